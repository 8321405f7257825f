-- Failure handling and operator control (DESIGN §2.7, §2.13, §7): attempt history, dead
-- letters, an append-only operator log, policy suspension, and the columns retries need.

-- `due_since` starts a command's max_age clock: when it first became due (its window), or when a
-- redrive gave it a fresh budget. `age_credit_seconds` is time that must not count against
-- max_age (the policy was suspended). `lease_owner` lets a replica release its own leases on
-- shutdown. `redrive_of` links a command created to re-execute one item to its dead letter.
alter table sweeper.commands
    add column due_since timestamptz,
    add column age_credit_seconds double precision not null default 0,
    add column lease_owner uuid,
    add column redrive_of bigint;
update sweeper.commands set due_since = next_attempt_at where due_since is null;
alter table sweeper.commands alter column due_since set not null;

-- One row per attempt (a claimed execution) and per snooze, kept with its command and purged
-- with it. No foreign key: a purge deletes both in one statement each, in bounded batches.
create table sweeper.attempts (
    attempt_id    bigserial primary key,
    command_id    text not null,
    attempt_no    integer not null,
    started_at    timestamptz not null,
    ended_at      timestamptz not null,
    outcome       text not null check (outcome in ('succeeded', 'failed', 'snoozed', 'quarantined')),
    class         text check (class in ('transient', 'throttled', 'permanent')),
    error         text,
    delay_seconds double precision
);
create index attempts_by_command on sweeper.attempts (command_id, attempt_id);

-- Dead letters: quarantined commands and items, and unparseable envelopes, for an operator.
-- Never purged automatically (an open one also keeps its command from being purged).
create table sweeper.dead_letters (
    dead_letter_id   bigserial primary key,
    kind             text not null check (kind in ('command', 'item', 'envelope')),
    run_id           text,
    policy           text,
    command_id       text,
    item_key         text,
    reason           text not null,
    class            text not null check (class in ('transient', 'throttled', 'permanent')),
    attempts         jsonb not null default '[]'::jsonb,
    raw_body         text,
    raw_sha256       text,
    first_failure_at timestamptz not null,
    last_failure_at  timestamptz not null,
    failures         integer not null default 1,
    status           text not null default 'open'
                     check (status in ('open', 'redriven', 'resolved', 'abandoned')),
    resolved_at      timestamptz,
    resolved_by      text,
    resolution_reason text,
    created_at       timestamptz not null default sweeper.now()
);
-- At most one live dead letter per command, per item of a command, and per envelope body.
create unique index dead_letters_one_per_command on sweeper.dead_letters (command_id)
    where kind = 'command' and status in ('open', 'redriven');
create unique index dead_letters_one_per_item on sweeper.dead_letters (command_id, item_key)
    where kind = 'item' and status in ('open', 'redriven');
create unique index dead_letters_one_per_envelope on sweeper.dead_letters (raw_sha256)
    where kind = 'envelope' and status = 'open';
create index dead_letters_open on sweeper.dead_letters (status, created_at);
create index dead_letters_by_run on sweeper.dead_letters (run_id);

-- The append-only guard names the table it protects.
create or replace function sweeper.audit_is_append_only() returns trigger
language plpgsql as $$
begin
    raise exception '%.% is append-only: % is not allowed', tg_table_schema, tg_table_name, tg_op
        using errcode = 'insufficient_privilege';
end
$$;

-- Who did what and why: redrives, abandons, suspends, resumes, cancels. Append-only.
create table sweeper.operator_log (
    entry_id  bigserial primary key,
    at        timestamptz not null default sweeper.now(),
    subject   text not null,
    action    text not null,
    target    text not null,
    reason    text not null,
    detail    jsonb not null default '{}'::jsonb
);
create trigger operator_log_no_update_delete before update or delete on sweeper.operator_log
    for each row execute function sweeper.audit_is_append_only();
create trigger operator_log_no_truncate before truncate on sweeper.operator_log
    for each statement execute function sweeper.audit_is_append_only();

-- Suspended policies: no new runs, no commands claimed.
create table sweeper.policy_state (
    policy       text primary key,
    suspended    boolean not null,
    suspended_at timestamptz,
    changed_at   timestamptz not null default sweeper.now(),
    changed_by   text not null,
    reason       text not null
);
