-- Push transports (DESIGN §8): commands of a Pub/Sub policy are written in the run's transaction
-- (the outbox) and published by a relay. `publish_due` asks the relay to publish the command when
-- it is next due (set at planning, after every "not now" decision, at redrive, and by
-- housekeeping for a command whose last publish is older than the horizon); `published_at` and
-- `published_generation` record the last publish the relay confirmed.
alter table sweeper.commands
    add column publish_due boolean not null default false,
    add column published_at timestamptz,
    add column published_generation integer;
create index commands_publish_due on sweeper.commands (next_attempt_at)
    where publish_due and transport <> 'builtin';
