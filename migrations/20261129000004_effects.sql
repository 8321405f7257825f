-- Actions with external calls (DESIGN §2.4, §9).
--
-- One effect row per (policy, item), not per run: committed as `calling` before the call,
-- `called` when it returns, and `closed` in the transaction that changes the row and writes the
-- audit. `n` numbers the item's effects (the idempotency key is `{policy}:{item}:{n}`); it grows
-- only when a closed effect is opened again. Effects are never purged with commands.
create table sweeper.effects (
    policy       text not null,
    item_key     text not null,
    n            integer not null default 1,
    state        text not null check (state in ('calling', 'called', 'closed')),
    run_id       text not null,
    command_id   text not null,
    -- md5 of the row as it was when the call was decided: a different row at close means it
    -- changed during the call.
    row_digest   text,
    -- What the call achieved: deleted, already_absent or reconciled (set when `called`).
    outcome      text,
    started_at   timestamptz not null default sweeper.now(),
    called_at    timestamptz,
    closed_at    timestamptz,
    primary key (policy, item_key)
);
create index effects_open on sweeper.effects (run_id) where state <> 'closed';

-- A dependency's pause: no call starts before `paused_until`, on any replica.
create table sweeper.dependency_pauses (
    dependency   text primary key,
    paused_until timestamptz not null,
    reason       text,
    paused_at    timestamptz not null default sweeper.now(),
    pauses       bigint not null default 1
);

-- `reconciled`: an external call was made and the row stamped (not deleted).
alter table sweeper.audit drop constraint audit_outcome_check;
alter table sweeper.audit add constraint audit_outcome_check
    check (outcome in ('deleted', 'already_absent', 'excluded', 'not_eligible', 'failed',
                       'would_delete', 'reconciled'));
alter table sweeper.runs add column reconciled bigint not null default 0;

-- A command with external calls finishes its items over several attempts; the items an earlier
-- attempt already audited are found by command.
create index audit_by_command on sweeper.audit (command_id);

-- A command of an external action while its calls run (its lease is live): counted against the
-- policy's max_concurrent_commands, since no transaction (and so no transaction-scoped slot lock)
-- can span the calls.
alter table sweeper.commands add column calling_since timestamptz;
