-- The audit trail partitioned by month of `recorded_at` (declarative range partitioning), so a
-- month can later be exported and dropped as a whole instead of the log growing for ever.
--
-- The existing table becomes the first partition, `sweeper.audit_before`, covering everything
-- before the first day of the month after the newest row (or after now): it is attached, not
-- copied. A CHECK added NOT VALID, then validated (a scan under SHARE UPDATE EXCLUSIVE, writes
-- continue), lets ATTACH skip its own scan under a stronger lock. The primary key must include
-- the partition column, so it becomes (audit_id, recorded_at); that one index is rebuilt.

alter table sweeper.audit rename to audit_before;
alter index sweeper.audit_by_run rename to audit_before_by_run;
alter index sweeper.audit_by_command rename to audit_before_by_command;
alter table sweeper.audit_before drop constraint audit_pkey;
alter table sweeper.audit_before add constraint audit_before_pkey primary key (audit_id, recorded_at);
drop trigger audit_no_update_delete on sweeper.audit_before;
drop trigger audit_no_truncate on sweeper.audit_before;

create table sweeper.audit (like sweeper.audit_before including defaults including constraints)
    partition by range (recorded_at);
alter sequence sweeper.audit_audit_id_seq owned by sweeper.audit.audit_id;
alter table sweeper.audit add constraint audit_pkey primary key (audit_id, recorded_at);

-- Every partition of the audit, with its range: what `ensure_audit_partitions` extends.
create table sweeper.audit_partitions (
    partition   text primary key,
    from_at     timestamptz,  -- null: unbounded below (the first partition)
    to_at       timestamptz not null,
    created_at  timestamptz not null default sweeper.now()
);

do $$
declare
    bound timestamptz;
begin
    select (date_trunc('month', greatest(sweeper.now(), coalesce(max(recorded_at), sweeper.now()))
                                    at time zone 'UTC')
            + interval '1 month') at time zone 'UTC'
      into bound
      from sweeper.audit_before;
    execute format('alter table sweeper.audit_before add constraint audit_before_bound
                        check (recorded_at < %L) not valid', bound);
    alter table sweeper.audit_before validate constraint audit_before_bound;
    execute format('alter table sweeper.audit attach partition sweeper.audit_before
                        for values from (minvalue) to (%L)', bound);
    alter table sweeper.audit_before drop constraint audit_before_bound;
    insert into sweeper.audit_partitions (partition, from_at, to_at)
    values ('audit_before', null, bound);
end
$$;

-- Indexes on the parent: the first partition's matching indexes are attached, not rebuilt; every
-- later partition gets its own.
create index audit_by_run on sweeper.audit (run_id, audit_id);
create index audit_by_command on sweeper.audit (command_id);
-- One item's history under a policy, across runs and months.
create index audit_by_item on sweeper.audit (policy, item_key);

-- Append-only (DESIGN §2.9). The row trigger on the parent is cloned to every partition,
-- present and future. Statement triggers are not (a partition can be updated, deleted from or
-- truncated by name), so each partition gets its own when it is made: UPDATE, DELETE and
-- TRUNCATE fail on it even when no row matches.
create trigger audit_no_update_delete before update or delete on sweeper.audit
    for each row execute function sweeper.audit_is_append_only();
create trigger audit_no_change before update or delete or truncate on sweeper.audit
    for each statement execute function sweeper.audit_is_append_only();
create trigger audit_no_change before update or delete or truncate on sweeper.audit_before
    for each statement execute function sweeper.audit_is_append_only();

-- Creates the monthly partitions (UTC months) from the newest one's end until the month
-- `months_ahead` after the current one (ledger clock) is covered, and returns how many it made.
-- Each is created on its own and attached (SHARE UPDATE EXCLUSIVE on the parent, so audit
-- writes continue), with its statement guard. Replicas take turns (transaction-scoped advisory
-- lock).
create function sweeper.ensure_audit_partitions(months_ahead integer) returns integer
language plpgsql as $$
declare
    upto timestamp := date_trunc('month', sweeper.now() at time zone 'UTC')
                      + make_interval(months => months_ahead + 1);
    lo timestamp;
    name text;
    made integer := 0;
begin
    perform pg_advisory_xact_lock(hashtext('sweeper:audit_partitions'));
    select max(to_at) at time zone 'UTC' into lo from sweeper.audit_partitions;
    while lo < upto loop
        name := 'audit_' || to_char(lo, 'YYYY_MM');
        execute format('create table sweeper.%I
                            (like sweeper.audit including defaults including constraints)', name);
        execute format('alter table sweeper.audit attach partition sweeper.%I
                            for values from (%L) to (%L)',
                       name, lo at time zone 'UTC', (lo + interval '1 month') at time zone 'UTC');
        execute format('create trigger audit_no_change before update or delete or truncate
                            on sweeper.%I
                            for each statement execute function sweeper.audit_is_append_only()',
                       name);
        insert into sweeper.audit_partitions (partition, from_at, to_at)
        values (name, lo at time zone 'UTC', (lo + interval '1 month') at time zone 'UTC');
        lo := lo + interval '1 month';
        made := made + 1;
    end loop;
    return made;
end
$$;

select sweeper.ensure_audit_partitions(2);
