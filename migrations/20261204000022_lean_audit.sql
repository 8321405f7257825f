-- Lean evidence (docs/design.md §2.9): one row per command execution and one narrow row per item,
-- beside the audit as it was. `sweeper.audit` is neither rewritten nor dropped: a replica of the
-- previous release keeps writing it during a rollout, and its months age out through audit
-- retention with the new ones. Every reader reads both shapes through `sweeper.audit_trail`.
--
-- All three tables are partitioned by month of `recorded_at` like the audit, and their months
-- are made, exported, detached and dropped together (a month is one row of
-- `sweeper.audit_partitions`). Ids come from the audit's sequence, so a cursor over ids never
-- goes backwards across the two shapes. An item row carries its execution's `recorded_at`: an
-- item and its execution always fall in the same month.

-- One execution of a command: who judged which items, under which rules. Written in the same
-- statement as its items (and only with items).
create table sweeper.audit_executions (
    execution_id     bigint not null default nextval('sweeper.audit_audit_id_seq'),
    recorded_at      timestamptz not null default sweeper.now(),
    policy           text not null,
    policy_version   text not null,   -- the run's pinned version
    current_version  text,            -- the current version, when its stricter cutoff applied
    run_id           text not null,
    window_at        timestamptz not null,
    pinned_cutoff    timestamptz not null,  -- the run's cutoff
    cutoff           timestamptz not null,  -- the cutoff the items were judged by
    command_id       text not null,
    attempt          integer not null,
    actor            text not null,
    dry_run          boolean not null
) partition by range (recorded_at);

-- One item's outcome in one execution. Narrow on purpose (fixed-width columns first): the
-- execution's fields are joined in by readers.
create table sweeper.audit_items (
    audit_id      bigint not null default nextval('sweeper.audit_audit_id_seq'),
    execution_id  bigint not null,
    recorded_at   timestamptz not null,
    item_key      text not null,
    outcome       text not null
                  check (outcome in ('deleted', 'already_absent', 'excluded', 'not_eligible',
                                     'failed', 'would_delete', 'reconciled', 'called',
                                     'would_call')),
    reason        text   -- the exclusion that held it, the predicate it failed, or the error
) partition by range (recorded_at);

-- Reserved for the partition sweep: what a retired partition of a target held, as one row per
-- partition (the sweep's evidence instead of one row per item).
create table sweeper.audit_manifests (
    manifest_id   bigint not null default nextval('sweeper.audit_audit_id_seq'),
    execution_id  bigint not null,
    recorded_at   timestamptz not null,
    partition     text not null,
    rows          bigint not null,
    detail        jsonb not null default '{}'
) partition by range (recorded_at);

-- Only the indexes a reader needs, each named by what it serves (no unique index on an id that
-- only ever grows).
-- GET /policies/{policy}/items/{key}: one item's history (the policy is the execution's).
create index audit_items_by_item on sweeper.audit_items (item_key);
-- An execution's items: a run's items page, a command's finished keys (deduplicated: a few bytes
-- per item).
create index audit_items_by_execution on sweeper.audit_items (execution_id);
-- A run's executions in order (its items page, whether a month holds an open run).
create index audit_executions_by_run on sweeper.audit_executions (run_id, execution_id);
-- A command's executions (its finished keys).
create index audit_executions_by_command on sweeper.audit_executions (command_id);
-- An item's execution (the history's join). Executions are one per command try: few.
create index audit_executions_by_id on sweeper.audit_executions (execution_id);
create index audit_manifests_by_execution on sweeper.audit_manifests (execution_id);

-- Append-only, like the audit: the row trigger on each parent is cloned to every partition; each
-- partition gets its statement trigger when it is made.
create trigger audit_no_update_delete before update or delete on sweeper.audit_executions
    for each row execute function sweeper.audit_is_append_only();
create trigger audit_no_change before update or delete or truncate on sweeper.audit_executions
    for each statement execute function sweeper.audit_is_append_only();
create trigger audit_no_update_delete before update or delete on sweeper.audit_items
    for each row execute function sweeper.audit_is_append_only();
create trigger audit_no_change before update or delete or truncate on sweeper.audit_items
    for each statement execute function sweeper.audit_is_append_only();
create trigger audit_no_update_delete before update or delete on sweeper.audit_manifests
    for each row execute function sweeper.audit_is_append_only();
create trigger audit_no_change before update or delete or truncate on sweeper.audit_manifests
    for each statement execute function sweeper.audit_is_append_only();

-- Makes the month `suffix` (`YYYY_MM`, or `before`) of each parent in `parents` that lacks it:
-- `{parent}_{suffix}`, attached for [from_at, to_at) (null from_at: unbounded below), with its
-- statement guard.
create function sweeper.make_audit_month(parents text[], suffix text, from_at timestamptz,
                                         to_at timestamptz) returns void
language plpgsql as $$
declare
    parent text;
    name text;
begin
    foreach parent in array parents loop
        name := parent || '_' || suffix;
        if to_regclass(format('sweeper.%I', name)) is not null then
            continue;
        end if;
        execute format('create table sweeper.%I
                            (like sweeper.%I including defaults including constraints)',
                       name, parent);
        execute format('alter table sweeper.%I attach partition sweeper.%I
                            for values from (%s) to (%L)',
                       parent, name,
                       coalesce(quote_literal(from_at), 'minvalue'), to_at);
        execute format('create trigger audit_no_change before update or delete or truncate
                            on sweeper.%I
                            for each statement execute function sweeper.audit_is_append_only()',
                       name);
    end loop;
end
$$;

-- Every month already made gets its lean tables (`audit_before` → `audit_items_before`, …), under
-- the lock `ensure_audit_partitions` takes, so a month a previous-release replica makes meanwhile
-- is either seen here or made after this commits (by the new function, with all four tables).
select pg_advisory_xact_lock(hashtext('sweeper:audit_partitions'));
select sweeper.make_audit_month(array['audit_executions', 'audit_items', 'audit_manifests'],
                                substr(partition, length('audit_') + 1), from_at, to_at)
  from sweeper.audit_partitions
 order by to_at;

-- Months ahead, as before, now with all four tables (the previous release calls this function
-- too, so a month it makes during a rollout has them as well).
create or replace function sweeper.ensure_audit_partitions(months_ahead integer) returns integer
language plpgsql as $$
declare
    upto timestamp := date_trunc('month', sweeper.now() at time zone 'UTC')
                      + make_interval(months => months_ahead + 1);
    lo timestamp;
    made integer := 0;
begin
    perform pg_advisory_xact_lock(hashtext('sweeper:audit_partitions'));
    -- Any month that lacks one of its tables gets it (a no-op once each has all four).
    perform sweeper.make_audit_month(
                array['audit_executions', 'audit_items', 'audit_manifests'],
                substr(partition, length('audit_') + 1), from_at, to_at)
       from sweeper.audit_partitions;
    select max(to_at) at time zone 'UTC' into lo from sweeper.audit_partitions;
    while lo < upto loop
        perform sweeper.make_audit_month(
            array['audit', 'audit_executions', 'audit_items', 'audit_manifests'],
            to_char(lo, 'YYYY_MM'), lo at time zone 'UTC', (lo + interval '1 month') at time zone 'UTC');
        insert into sweeper.audit_partitions (partition, from_at, to_at)
        values ('audit_' || to_char(lo, 'YYYY_MM'), lo at time zone 'UTC',
                (lo + interval '1 month') at time zone 'UTC');
        lo := lo + interval '1 month';
        made := made + 1;
    end loop;
    return made;
end
$$;

-- A month is dropped whole. The previous release's audit retention drops only a month's
-- first-shape table and then deletes its row here, which would leave the month's lean tables
-- attached and unexported: that delete fails (and rolls back the drop made in its transaction)
-- while any of them exists. This release drops all four before deleting the row.
create function sweeper.audit_month_dropped_whole() returns trigger
language plpgsql as $$
declare
    suffix text := substr(old.partition, length('audit_') + 1);
begin
    if to_regclass(format('sweeper.%I', 'audit_executions_' || suffix)) is not null
       or to_regclass(format('sweeper.%I', 'audit_items_' || suffix)) is not null
       or to_regclass(format('sweeper.%I', 'audit_manifests_' || suffix)) is not null then
        raise exception 'audit month % still has its lean tables (audit_items_%, …): a release '
                        'before the lean audit cannot drop it; let a newer replica run audit '
                        'retention', old.partition, suffix;
    end if;
    return old;
end
$$;
create trigger audit_month_dropped_whole before delete on sweeper.audit_partitions
    for each row execute function sweeper.audit_month_dropped_whole();

-- The one reader: both shapes as one row per item with its execution's fields, as the audit
-- always read. `execution_id` of a row of the old shape is its own id (it was its own execution);
-- its `pinned_cutoff`, `current_version` and `attempt` were not recorded. The lean branch names
-- the execution's own `execution_id`, so a range on it reaches `audit_executions_by_run`.
create view sweeper.audit_trail as
select a.audit_id, a.audit_id as execution_id, a.recorded_at, a.policy, a.policy_version,
       null::text as current_version, a.run_id, a.window_at, null::timestamptz as pinned_cutoff,
       a.cutoff, a.command_id, null::integer as attempt, a.item_key, a.outcome, a.reason,
       a.actor, a.dry_run
  from sweeper.audit a
union all
select i.audit_id, e.execution_id, i.recorded_at, e.policy, e.policy_version,
       e.current_version, e.run_id, e.window_at, e.pinned_cutoff, e.cutoff, e.command_id,
       e.attempt, i.item_key, i.outcome, i.reason, e.actor, e.dry_run
  from sweeper.audit_items i
  join sweeper.audit_executions e
    on e.execution_id = i.execution_id and e.recorded_at = i.recorded_at;
