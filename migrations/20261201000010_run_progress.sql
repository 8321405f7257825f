-- A run's progress is derived from its commands instead of a counter on the run row.
--
-- Before: every command decremented `runs.pending_commands` and added its counts under the run
-- row's lock, held until the command's transaction committed, so every worker of a run queued on
-- one hot row (DESIGN §7's pending counter). Now a command writes its counts on its own row (which
-- its transaction has locked anyway); the run row keeps only the counts of commands that were
-- purged ("settled" into it by the purge), and `sweeper.run_totals` adds the two on read.
-- Pending commands are counted, not kept. Completion is decided once, by a guarded UPDATE after
-- the deciding command's commit (see `ledger::runs::complete_if_done`).

-- A command's contribution to its run's counts. They can go below zero: a redrive gives back the
-- quarantine it lifts (`quarantined_commands - 1`) and an item redrive the `failed` outcome it
-- supersedes, whether or not the original contribution was already settled into the run row.
alter table sweeper.commands
    add column quarantined_commands integer not null default 0,
    add column deleted              bigint  not null default 0,
    add column already_absent       bigint  not null default 0,
    add column excluded             bigint  not null default 0,
    add column not_eligible         bigint  not null default 0,
    add column failed               bigint  not null default 0,
    add column would_delete         bigint  not null default 0,
    add column reconciled           bigint  not null default 0;

-- Counted from the commands now (a run being planned has its commands indexed by run and state).
alter table sweeper.runs drop column pending_commands;

comment on column sweeper.runs.deleted is
    'Settled count: deletions of this run''s purged commands. The run''s total is in sweeper.run_totals.';

-- A run with its totals: the run row's settled counts plus its commands' contributions.
create view sweeper.run_totals as
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
       r.planned_at, r.completed_at
  from sweeper.runs r
  left join lateral (
      select count(*) filter (where c.state in ('pending', 'leased')) as pending_commands,
             sum(c.quarantined_commands) as quarantined_commands,
             sum(c.deleted) as deleted, sum(c.already_absent) as already_absent,
             sum(c.excluded) as excluded, sum(c.not_eligible) as not_eligible,
             sum(c.failed) as failed, sum(c.would_delete) as would_delete,
             sum(c.reconciled) as reconciled
        from sweeper.commands c
       where c.run_id = r.run_id) t on true;
