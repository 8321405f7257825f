-- Responses as evidence (docs/design.md §2.9): an `http` action may name up to 8 fields of its
-- JSON response (`record = ["/status", ...]`); their values are kept with the item's effect from
-- the moment its call returns, and written into the item's audit row. `json`, not `jsonb`: the
-- text is kept as written, fields in the action's order. Nullable columns only: a previous release
-- writes NULL and reads past them.
alter table sweeper.effects add column recorded json;
alter table sweeper.audit add column recorded json;
alter table sweeper.audit_items add column recorded json;

-- The one reader, with the recorded fields appended (`create or replace view` keeps the others).
create or replace view sweeper.audit_trail as
select a.audit_id, a.audit_id as execution_id, a.recorded_at, a.policy, a.policy_version,
       null::text as current_version, a.run_id, a.window_at, null::timestamptz as pinned_cutoff,
       a.cutoff, a.command_id, null::integer as attempt, a.item_key, a.outcome, a.reason,
       a.actor, a.dry_run, a.recorded
  from sweeper.audit a
union all
select i.audit_id, e.execution_id, i.recorded_at, e.policy, e.policy_version,
       e.current_version, e.run_id, e.window_at, e.pinned_cutoff, e.cutoff, e.command_id,
       e.attempt, i.item_key, i.outcome, i.reason, e.actor, e.dry_run, i.recorded
  from sweeper.audit_items i
  join sweeper.audit_executions e
    on e.execution_id = i.execution_id and e.recorded_at = i.recorded_at;

-- `mismatched` (`mismatch = { pointer, in }` on an `http` action): the answer's field said the
-- provider's record differs from ours. The item's row is kept as it is, its effect closed, and
-- an item dead letter opened with the recorded fields; while that dead letter is open, planning
-- and execution hold the item (reason `dead_letter_open`). NOT VALID: every existing row passed
-- the narrower check (the partitions' copies are inherited, so they are replaced with it).
alter table sweeper.audit drop constraint audit_outcome_check;
alter table sweeper.audit add constraint audit_outcome_check
    check (outcome in ('deleted', 'already_absent', 'excluded', 'not_eligible', 'failed',
                       'would_delete', 'reconciled', 'called', 'would_call', 'mismatched'))
    not valid;
alter table sweeper.audit_items drop constraint audit_items_outcome_check;
alter table sweeper.audit_items add constraint audit_items_outcome_check
    check (outcome in ('deleted', 'already_absent', 'excluded', 'not_eligible', 'failed',
                       'would_delete', 'reconciled', 'called', 'would_call', 'mismatched'))
    not valid;

alter table sweeper.commands add column mismatched bigint not null default 0;
alter table sweeper.runs add column mismatched bigint not null default 0;

-- An item dead letter says which outcome opened it (NULL: `failed`, as every earlier one) and
-- carries the answer's recorded fields.
alter table sweeper.dead_letters
    add column outcome text check (outcome in ('failed', 'mismatched')),
    add column recorded json;
create index dead_letters_open_mismatches on sweeper.dead_letters (policy, item_key)
    where kind = 'item' and status = 'open' and outcome = 'mismatched';

-- The run totals with `mismatched` appended (`create or replace view` keeps the others).
create or replace view sweeper.run_totals as
select r.run_id, r.policy, r.policy_version, r.window_at, r.cutoff, r.dry_run, r.dry_run_no,
       r.status, r.planning_done,
       coalesce(t.pending_commands, 0)::integer as pending_commands,
       r.commands_total,
       (r.quarantined_commands + coalesce(t.quarantined_commands, 0))::integer
           as quarantined_commands,
       r.eligible_planned, r.held_at_planning,
       (r.deleted + coalesce(t.deleted, 0))::bigint as deleted,
       (r.already_absent + coalesce(t.already_absent, 0))::bigint as already_absent,
       (r.excluded + coalesce(t.excluded, 0))::bigint as excluded,
       (r.not_eligible + coalesce(t.not_eligible, 0))::bigint as not_eligible,
       greatest(0, r.failed + coalesce(t.failed, 0))::bigint as failed,
       (r.would_delete + coalesce(t.would_delete, 0))::bigint as would_delete,
       (r.reconciled + coalesce(t.reconciled, 0))::bigint as reconciled,
       r.remaining_eligible, r.remaining_eligible_cap, r.triggered_by, r.created_at,
       r.planned_at, r.completed_at,
       (r.called + coalesce(t.called, 0))::bigint as called,
       (r.would_call + coalesce(t.would_call, 0))::bigint as would_call,
       (r.mismatched + coalesce(t.mismatched, 0))::bigint as mismatched
  from sweeper.runs r
  left join lateral (
      select count(*) filter (where c.state in ('pending', 'leased')) as pending_commands,
             sum(c.quarantined_commands) as quarantined_commands,
             sum(c.deleted) as deleted, sum(c.already_absent) as already_absent,
             sum(c.excluded) as excluded, sum(c.not_eligible) as not_eligible,
             sum(c.failed) as failed, sum(c.would_delete) as would_delete,
             sum(c.reconciled) as reconciled, sum(c.called) as called,
             sum(c.would_call) as would_call, sum(c.mismatched) as mismatched
        from sweeper.commands c
       where c.run_id = r.run_id) t on true;
