-- A dependency's `rate_limit` with `scope = "global"` (DESIGN §9, §14): the same reservation
-- as a policy's pace, per dependency and second, so every replica together stays within
-- `per_second`. One row per (dependency, second) that saw a call; housekeeping deletes rows
-- older than a minute.
create table sweeper.dependency_call_slots (
    dependency  text        not null,
    slot        timestamptz not null,
    reserved    integer     not null check (reserved >= 0),
    primary key (dependency, slot)
);

-- Reserves one call of `p_dependency` at `p_rate` calls a second with `p_burst` calls allowed
-- at once, and returns the seconds until it may start (≤ 0: now). Calls are spaced 1/`p_rate`
-- apart through each second; the part of the current second already gone counts as used, so
-- no reservation starts in the past and a one-second interval carries at most
-- `p_rate + p_burst` calls. Its own statement, outside any effect transaction (the slot row is
-- locked only for the upsert).
create function sweeper.reserve_dependency_call(p_dependency text, p_rate integer, p_burst integer)
returns float8
language plpgsql as $$
declare
    now_  timestamptz := sweeper.now();
    s     timestamptz := date_trunc('second', now_);
    gone  integer := floor(extract(epoch from now_ - date_trunc('second', now_)) * p_rate);
    used  integer;
begin
    loop
        insert into sweeper.dependency_call_slots as d (dependency, slot, reserved)
        values (p_dependency, s, gone + 1)
        on conflict (dependency, slot) do update set reserved = greatest(d.reserved, gone) + 1
            where greatest(d.reserved, gone) < p_rate
        returning d.reserved - 1 into used;
        exit when found;
        s := s + interval '1 second';
        gone := 0;
    end loop;
    return extract(epoch from
        s + make_interval(secs => greatest(used - p_burst + 1, 0)::float8 / p_rate) - now_);
end $$;

-- The pace's reservation, corrected the same way: the part of the current second already gone
-- counts as used, so a command claimed late in a second is not given a start in its past (which
-- let a second's whole budget start at once at its end).
create or replace function sweeper.reserve_pace(p_command text, p_policy text, p_rate integer)
returns timestamptz
language plpgsql as $$
declare
    kept  timestamptz;
    keys  integer;
    now_  timestamptz := sweeper.now();
    s     timestamptz := date_trunc('second', now_);
    gone  integer := floor(extract(epoch from now_ - date_trunc('second', now_)) * p_rate);
    n     integer;
    used  integer;
begin
    select pace_start, cardinality(item_keys) into kept, keys
      from sweeper.commands where command_id = p_command;
    if not found then
        return null;
    end if;
    if kept is not null and kept >= now_ - interval '2 seconds' then
        return kept;
    end if;
    n := least(greatest(keys, 0), p_rate);
    if gone + n > p_rate then
        s := s + interval '1 second';
        gone := 0;
    end if;
    loop
        insert into sweeper.pace_slots as ps (policy, slot, reserved)
        values (p_policy, s, gone + n)
        on conflict (policy, slot) do update set reserved = greatest(ps.reserved, gone) + n
            where greatest(ps.reserved, gone) + n <= p_rate
        returning ps.reserved - n into used;
        exit when found;
        s := s + interval '1 second';
        gone := 0;
    end loop;
    kept := s + make_interval(secs => used::float8 / p_rate);
    update sweeper.commands set pace_start = kept where command_id = p_command;
    return kept;
end $$;
