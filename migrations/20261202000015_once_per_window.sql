-- Effects once per window (`once_per = "window"` on an external action): one effect per
-- (policy, window, item), idempotency key `{policy}:{window}:{item}`. `scope` is '' for an
-- effect once per item (every effect written before this migration, and the default) and the
-- window as run ids write it (`2026-09-07T09:00:00Z`) for one once per window, so an open effect
-- of one window never blocks the next.
alter table sweeper.effects add column scope text not null default '';
alter table sweeper.effects drop constraint effects_pkey;
alter table sweeper.effects add primary key (policy, scope, item_key);

-- `called`: an external call succeeded and the row was kept (`then = "nothing"` on a
-- POST/PUT/PATCH, once per window); `would_call` is its dry run. NOT VALID: every existing row
-- passed the narrower check, and a partitioned audit is not scanned under this lock.
alter table sweeper.audit drop constraint audit_outcome_check;
alter table sweeper.audit add constraint audit_outcome_check
    check (outcome in ('deleted', 'already_absent', 'excluded', 'not_eligible', 'failed',
                       'would_delete', 'reconciled', 'called', 'would_call')) not valid;

alter table sweeper.commands
    add column called     bigint not null default 0,
    add column would_call bigint not null default 0;
alter table sweeper.runs
    add column called     bigint not null default 0,
    add column would_call bigint not null default 0;

-- The run totals with the two new counts (appended: `create or replace view` keeps the others).
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
       (r.would_call + coalesce(t.would_call, 0))::bigint as would_call
  from sweeper.runs r
  left join lateral (
      select count(*) filter (where c.state in ('pending', 'leased')) as pending_commands,
             sum(c.quarantined_commands) as quarantined_commands,
             sum(c.deleted) as deleted, sum(c.already_absent) as already_absent,
             sum(c.excluded) as excluded, sum(c.not_eligible) as not_eligible,
             sum(c.failed) as failed, sum(c.would_delete) as would_delete,
             sum(c.reconciled) as reconciled, sum(c.called) as called,
             sum(c.would_call) as would_call
        from sweeper.commands c
       where c.run_id = r.run_id) t on true;
