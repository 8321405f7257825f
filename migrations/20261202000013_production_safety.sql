-- Production safety (DESIGN §14 "Holds"): the blast-radius guard's approval on a run, the pace's
-- reservations, and the database identity the restore/clone guard compares with.

-- The new kinds of hold a command or a planning job can record.
alter table sweeper.commands drop constraint commands_held_kind_check,
    add constraint commands_held_kind_check check (held_kind in
        ('schema', 'policy_changed', 'identity', 'approval', 'active_hours', 'governor', 'pace'));
alter table sweeper.planning_jobs drop constraint planning_jobs_held_kind_check,
    add constraint planning_jobs_held_kind_check check (held_kind in
        ('schema', 'policy_changed', 'identity', 'approval', 'active_hours', 'governor', 'pace'));

-- The blast-radius guard's decision on a run of a guarded policy. NULL: the policy has no guard
-- (or the run predates it). `awaiting_plan`: planning is not done, nothing executes yet.
-- `required`: the planned count crossed a limit; held until approved or cancelled. `approved`:
-- an operator released it. `not_required`: under every limit. `guard_verdict` says which limit
-- and the numbers compared (a dry run gets it too, and is never held).
alter table sweeper.runs
    add column approval text
        check (approval in ('awaiting_plan', 'required', 'approved', 'not_required')),
    add column guard_verdict jsonb,
    add column approval_changed_at timestamptz,
    add column approved_by text,
    add column approval_reason text;

-- The pace (`max_items_per_second`, across replicas): one row per policy and second, holding the
-- items reserved to start in that second. A command reserves its key count in the first second
-- with room and starts at that second plus the share already reserved in it, so starts spread
-- evenly. Each row takes at most `max_items_per_second / items` reservations and is then left
-- behind: no single row is updated by every command.
create table sweeper.pace_slots (
    policy    text        not null,
    slot      timestamptz not null,
    reserved  integer     not null check (reserved >= 0),
    primary key (policy, slot)
);

-- The start a command's reservation gave it (NULL: none). Reused while it is at most
-- 2 seconds old, so a command held for its start does not reserve twice.
alter table sweeper.commands add column pace_start timestamptz;

-- Reserves the key count of `p_command` (at most `p_rate`) of `p_policy`'s `p_rate` items per
-- second and returns the instant it may start; an unexpired reservation of the command is
-- returned as it is (NULL: no such command). Outside any effect transaction (the caller's
-- statement commits alone).
create function sweeper.reserve_pace(p_command text, p_policy text, p_rate integer)
returns timestamptz
language plpgsql as $$
declare
    kept  timestamptz;
    keys  integer;
    s     timestamptz := date_trunc('second', sweeper.now());
    n     integer;
    used  integer;
begin
    select pace_start, cardinality(item_keys) into kept, keys
      from sweeper.commands where command_id = p_command;
    if not found then
        return null;
    end if;
    if kept is not null and kept >= sweeper.now() - interval '2 seconds' then
        return kept;
    end if;
    n := least(greatest(keys, 0), p_rate);
    loop
        insert into sweeper.pace_slots as ps (policy, slot, reserved) values (p_policy, s, n)
        on conflict (policy, slot) do update set reserved = ps.reserved + n
            where ps.reserved + n <= p_rate
        returning ps.reserved - n into used;
        exit when found;
        s := s + interval '1 second';
    end loop;
    kept := s + make_interval(secs => used::float8 / p_rate);
    update sweeper.commands set pace_start = kept where command_id = p_command;
    return kept;
end $$;

-- The database sweeper serves, as recorded at its first `serve` (never by a migration, so a
-- template or a copy made from a migrated database is not taken for the original). A start or a
-- heartbeat that finds another identity, or a timeline change after a silence longer than
-- `guard.max_silence`, sets `held_since`: every policy is held (kind `identity`) until an
-- operator accepts (`POST /guard/accept`), which records the identity found.
create table sweeper.database_identity (
    singleton          boolean     primary key default true check (singleton),
    system_identifier  text        not null,
    database_oid       bigint      not null,
    timeline           integer     not null,
    recorded_at        timestamptz not null default sweeper.now(),
    recorded_by        text        not null,
    heartbeat_at       timestamptz not null default sweeper.now(),
    held_since         timestamptz,
    held_detail        text,
    check ((held_since is null) = (held_detail is null))
);
