-- Hardening from black-box testing (issue 11).

-- The size of a quarantined envelope's whole body, in bytes: raw_body keeps only its first
-- 8 KiB, raw_sha256 covers every byte, and a push body over the envelope limit is quarantined
-- rather than refused (DESIGN §5), so its size is evidence of its own.
alter table sweeper.dead_letters add column raw_size bigint;

-- Held work (DESIGN §14): a command or planning job that cannot run as configured right now
-- (the target's schema does not match, or the policy's current version changes the target)
-- waits without spending attempts or budget. held_since is when the hold began (kept while it
-- lasts), held_seen_at the last time it was found held: the time between two checks is
-- credited to the command's max_age (age_credit_seconds), since held time counts against no
-- budget. A command that runs (or fails for another reason) is no longer held.
alter table sweeper.commands
    add column held_kind text check (held_kind in ('schema', 'policy_changed')),
    add column held_reason text,
    add column held_since timestamptz,
    add column held_seen_at timestamptz;
alter table sweeper.planning_jobs
    add column held_kind text check (held_kind in ('schema', 'policy_changed')),
    add column held_reason text,
    add column held_since timestamptz;
-- Held commands are few and looked up per run and for the metric.
create index commands_held on sweeper.commands (run_id) where held_since is not null;
