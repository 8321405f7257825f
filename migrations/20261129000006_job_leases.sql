-- Background work done by one replica at a time (DESIGN §8: background work is ledger jobs):
-- the push relays (`relay:pubsub`, `relay:qstash`) and housekeeping. The holder renews its lease
-- every round; another replica takes the job over when the lease has expired, or at once when
-- the holder released it on shutdown.
create table sweeper.job_leases (
    job          text primary key,
    lease_owner  uuid not null,
    lease_until  timestamptz not null,
    taken_at     timestamptz not null default sweeper.now()
);
