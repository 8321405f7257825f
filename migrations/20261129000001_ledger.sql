-- sweeper's ledger: policy versions, runs, planning jobs, commands and the audit trail.
-- It lives in schema `sweeper`, in the same database as the rows it cleans, so a row deletion,
-- its audit rows and the command's terminal state commit in one transaction (DESIGN §7).

create schema if not exists sweeper;

-- The single clock (DESIGN §12): the database clock, plus an offset that only tests set.
-- Production never writes this table; it stays empty and the offset is zero.
create table sweeper.clock_offset (
    singleton boolean primary key default true check (singleton),
    offset_seconds double precision not null
);

create function sweeper.now() returns timestamptz
language sql volatile as $$
    select clock_timestamp()
         + make_interval(secs => coalesce((select offset_seconds from sweeper.clock_offset), 0))
$$;

-- One row per distinct policy version any replica has registered. `seq` orders registrations:
-- the current version of a policy is its row with the highest seq (DESIGN §2.10).
create table sweeper.policy_versions (
    policy        text not null,
    version       text not null,
    seq           bigserial not null unique,
    spec          jsonb not null,
    registered_at timestamptz not null default clock_timestamp(),
    primary key (policy, version)
);

-- Runs are kept forever as window tombstones: a purged run could be recreated and act twice.
create table sweeper.runs (
    run_id            text primary key,
    policy            text not null,
    policy_version    text not null,
    -- "window" is an SQL keyword, hence window_at; JSON and docs say `window`.
    window_at         timestamptz not null,
    cutoff            timestamptz not null,
    dry_run           boolean not null default false,
    dry_run_no        integer,
    status            text not null default 'planning'
                      check (status in ('planning', 'running', 'completed',
                                        'completed_with_dead_letters', 'cancelled')),
    planning_done     boolean not null default false,
    -- commands not yet terminal; decremented under the run-row lock so the last two commands
    -- cannot both miss completion (DESIGN §7)
    pending_commands  integer not null default 0 check (pending_commands >= 0),
    commands_total    integer not null default 0,
    quarantined_commands integer not null default 0,
    eligible_planned  bigint not null default 0,
    held_at_planning  jsonb not null default '{}'::jsonb,
    -- final outcome counts per item (one audit row per item and run on the healthy path)
    deleted           bigint not null default 0,
    already_absent    bigint not null default 0,
    excluded          bigint not null default 0,
    not_eligible      bigint not null default 0,
    failed            bigint not null default 0,
    would_delete      bigint not null default 0,
    -- closure check: rows still eligible under the cutoff when the run completed, counted up to
    -- remaining_eligible_cap so it stays bounded on huge tables (expected 0)
    remaining_eligible bigint,
    remaining_eligible_cap bigint,
    triggered_by      text not null,
    created_at        timestamptz not null default sweeper.now(),
    planned_at        timestamptz,
    completed_at      timestamptz,
    check (dry_run = (dry_run_no is not null))
);
create unique index runs_one_per_window on sweeper.runs (policy, window_at) where not dry_run;
create unique index runs_dry_run_no on sweeper.runs (policy, window_at, dry_run_no) where dry_run;
create index runs_by_policy on sweeper.runs (policy, window_at desc);
create index runs_by_status on sweeper.runs (status) where status in ('planning', 'running');

-- Planning is background work done as a leased ledger job, one keyset page per transaction,
-- resumable from `cursor_key` after a crash (DESIGN §8).
create table sweeper.planning_jobs (
    run_id        text primary key references sweeper.runs (run_id),
    cursor_key    text,
    next_batch_no integer not null default 0,
    pages_done    integer not null default 0,
    done          boolean not null default false,
    lease_token   uuid,
    lease_until   timestamptz,
    created_at    timestamptz not null default sweeper.now()
);
create index planning_jobs_open on sweeper.planning_jobs (created_at) where not done;

-- A command is one bounded batch of item keys of a run. Keys are stored as text and cast to the
-- target key's type when used; the ledger's keys are authoritative (messages carry identity only).
create table sweeper.commands (
    command_id         text primary key,
    run_id             text not null references sweeper.runs (run_id),
    batch_no           integer not null,
    item_keys          text[] not null,
    transport          text not null default 'builtin',
    state              text not null default 'pending'
                       check (state in ('pending', 'leased', 'succeeded', 'quarantined', 'cancelled')),
    attempts           integer not null default 0,
    next_attempt_at    timestamptz not null,
    lease_until        timestamptz,
    publish_generation integer not null default 1,
    last_error         text,
    last_error_class   text check (last_error_class in ('transient', 'throttled', 'permanent')),
    created_at         timestamptz not null default sweeper.now(),
    finished_at        timestamptz,
    unique (run_id, batch_no)
);
create index commands_due on sweeper.commands (next_attempt_at)
    where state in ('pending', 'leased');
create index commands_by_run on sweeper.commands (run_id, state);

-- The audit trail: an append-only event log, self-contained evidence (DESIGN §2.9). No foreign
-- keys from it, so nothing in the ledger can cascade into it; UPDATE, DELETE and TRUNCATE fail.
create table sweeper.audit (
    audit_id       bigserial primary key,
    recorded_at    timestamptz not null default sweeper.now(),
    policy         text not null,
    policy_version text not null,
    run_id         text not null,
    window_at      timestamptz not null,
    cutoff         timestamptz not null,
    command_id     text not null,
    item_key       text not null,
    outcome        text not null
                   check (outcome in ('deleted', 'already_absent', 'excluded', 'not_eligible',
                                      'failed', 'would_delete')),
    reason         text,
    actor          text not null,
    dry_run        boolean not null
);
create index audit_by_run on sweeper.audit (run_id, audit_id);

create function sweeper.audit_is_append_only() returns trigger
language plpgsql as $$
begin
    raise exception 'sweeper.audit is append-only: % is not allowed', tg_op
        using errcode = 'insufficient_privilege';
end
$$;
create trigger audit_no_update_delete before update or delete on sweeper.audit
    for each row execute function sweeper.audit_is_append_only();
create trigger audit_no_truncate before truncate on sweeper.audit
    for each statement execute function sweeper.audit_is_append_only();
