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
