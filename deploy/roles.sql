-- deploy/roles.sql: the two roles sweeper runs with, each with only what it needs.
--
--   sweeper_owner    owns schema `sweeper` and everything in it; `sweeper migrate` runs as it.
--   sweeper_runtime  what `sweeper serve` connects as: it reads and writes the ledger, reads
--                    and deletes in the target tables you grant it, and creates nothing.
--
-- Run it as the database owner or a superuser, in the database sweeper cleans, before the first
-- `sweeper migrate` and once more after it (it is safe to run any number of times):
--
--   psql "postgres://postgres@db.example.com/app" -v ON_ERROR_STOP=1 -f deploy/roles.sql
--
-- Then give each role a way to log in (a password with `\password sweeper_runtime`, or your
-- platform's IAM login), migrate as the owner and serve as the runtime role (`migrate_on_start`
-- may stay on: a schema that already holds every migration is left untouched, so the runtime
-- role, which may create nothing, starts once the owner has migrated):
--
--   SWEEPER_DATABASE_URL=postgres://sweeper_owner@db.example.com/app sweeper migrate
--   SWEEPER_DATABASE_URL=postgres://sweeper_runtime@db.example.com/app sweeper serve
--
-- What the runtime role does that needs ownership of the audit's tables (making the months
-- ahead at start and at every housekeeping round; detaching and dropping a month audit retention
-- has exported) goes through functions that run as sweeper_owner (SECURITY DEFINER, fixed
-- search_path; migration 20261205000025). The target tables are yours: grant each policy what
-- `sweeper check-config` says it lacks (see the end of this file).
--
-- An existing installation (tables made by another role, sqlx's table in `public`) is taken
-- over: everything in schema `sweeper` is given to sweeper_owner and `public._sqlx_migrations`
-- is moved into `sweeper`, leaving a view in its place for replicas of the previous release
-- (drop it once no replica of a release before this one runs). The role that owned the schema
-- becomes a member of sweeper_owner so its replicas keep working: `revoke sweeper_owner from
-- <that role>` once every replica uses the two roles. Giving objects away needs their owner's
-- rights: run it as a superuser, or as a member of the role that owns them today.

do $$
begin
    if not exists (select from pg_roles where rolname = 'sweeper_owner') then
        create role sweeper_owner login;
    end if;
    if not exists (select from pg_roles where rolname = 'sweeper_runtime') then
        create role sweeper_runtime login;
    end if;
    -- The first migration says `create schema if not exists sweeper`, which PostgreSQL allows
    -- only with CREATE on the database even when the schema exists.
    execute format('grant connect, create on database %I to sweeper_owner', current_database());
    execute format('grant connect on database %I to sweeper_runtime', current_database());
end
$$;

-- The role that owns schema `sweeper` today (an installation before this file: the one role
-- sweeper runs as) would lose its way into the schema when it is given away, stopping the
-- replicas that run as it. It becomes a member of sweeper_owner instead, until every replica
-- migrates as sweeper_owner and serves as sweeper_runtime; then revoke it, as the notice says.
do $$
declare
    previous name := (select pg_get_userbyid(nspowner) from pg_namespace
                       where nspname = 'sweeper');
begin
    if previous is not null and previous <> 'sweeper_owner'
       and not (select rolsuper from pg_roles where rolname = previous) then
        execute format('grant sweeper_owner to %I', previous);
        raise notice 'role % owned schema sweeper and is now a member of sweeper_owner, so the '
                     'replicas that connect as it keep working; once every replica migrates as '
                     'sweeper_owner and serves as sweeper_runtime, run: revoke sweeper_owner from %',
                     previous, quote_ident(previous);
    end if;
end
$$;

create schema if not exists sweeper authorization sweeper_owner;
alter schema sweeper owner to sweeper_owner;

-- Everything already in schema `sweeper` belongs to sweeper_owner. Every table, partitioned
-- table, partition, view and materialized view is altered (a partition depends on its parent and
-- a partitioned table on its own objects in pg_depend, which says nothing about their owner); only
-- a sequence that belongs to a column is left out, as it follows its table.
do $$
declare
    r record;
begin
    for r in
        select c.oid::regclass::text as name, c.relkind
          from pg_class c
         where c.relnamespace = 'sweeper'::regnamespace
           and c.relkind in ('r', 'p', 'v', 'm', 'S')
           and c.relowner <> 'sweeper_owner'::regrole
           and not (c.relkind = 'S'
                    and exists (select from pg_depend d
                                 where d.classid = 'pg_class'::regclass and d.objid = c.oid
                                   and d.refclassid = 'pg_class'::regclass
                                   and d.deptype in ('a', 'i')))
    loop
        execute format('alter %s %s owner to sweeper_owner',
                       case r.relkind when 'S' then 'sequence' when 'v' then 'view'
                                      when 'm' then 'materialized view' else 'table' end,
                       r.name);
    end loop;
    for r in
        select p.oid::regprocedure::text as name
          from pg_proc p
         where p.pronamespace = 'sweeper'::regnamespace
           and p.proowner <> 'sweeper_owner'::regrole
    loop
        execute format('alter function %s owner to sweeper_owner', r.name);
    end loop;
end
$$;

-- sqlx's migration table of a release before this one moves into schema `sweeper`; the view left
-- in `public` keeps an older replica reading the same table during a rolling upgrade (its
-- migrator's `create table if not exists` then skips).
do $$
begin
    if to_regclass('sweeper._sqlx_migrations') is null
       and exists (select from pg_class
                    where oid = to_regclass('public._sqlx_migrations') and relkind = 'r') then
        alter table public._sqlx_migrations set schema sweeper;
        alter table sweeper._sqlx_migrations owner to sweeper_owner;
        -- Owned by whoever runs this file: in PostgreSQL 15 only the database owner (schema
        -- public's owner) may create in public, and sweeper_owner may not.
        create view public._sqlx_migrations as select * from sweeper._sqlx_migrations;
        -- Read by the runtime role and by the previous release's replicas, whichever role they
        -- connect as (migration versions are not secret).
        grant select on public._sqlx_migrations to public;
    end if;
end
$$;

-- The runtime role: the ledger's tables and sequences, the owner's functions, nothing else in
-- the schema. Default privileges cover what later migrations (and the audit's new months) make.
grant usage on schema sweeper to sweeper_runtime;
grant select, insert, update, delete on all tables in schema sweeper to sweeper_runtime;
grant usage, select, update on all sequences in schema sweeper to sweeper_runtime;
grant execute on all functions in schema sweeper to sweeper_runtime;
alter default privileges for role sweeper_owner in schema sweeper
    grant select, insert, update, delete on tables to sweeper_runtime;
alter default privileges for role sweeper_owner in schema sweeper
    grant usage, select, update on sequences to sweeper_runtime;
alter default privileges for role sweeper_owner in schema sweeper
    grant execute on functions to sweeper_runtime;

-- sqlx's table is written by migrations only (readyz reads it). It exists from the first
-- `sweeper migrate` on, which is why this file is run once more after it.
do $$
begin
    if to_regclass('sweeper._sqlx_migrations') is not null then
        revoke insert, update, delete, truncate on sweeper._sqlx_migrations from sweeper_runtime;
    end if;
end
$$;

-- The governor reads standby replay lag (pg_stat_replication's lag columns need pg_monitor);
-- the restore and clone guard reads the system identifier with pg_control_system(), which every
-- role may execute unless the server revoked it.
grant pg_monitor to sweeper_runtime;
do $$
begin
    if not has_function_privilege('sweeper_runtime', 'pg_control_system()', 'execute') then
        grant execute on function pg_control_system() to sweeper_runtime;
    end if;
end
$$;

-- Per policy, on its target table (and any table an exclusion or selection reads): USAGE on the
-- table's schema, SELECT on the columns the policy reads, DELETE when rows are deleted, UPDATE
-- on the column an action stamps, and UPDATE on one column of any policy whose commands may take
-- row locks: a command that meets a row another transaction holds, or whose item fails alone,
-- deletes the others after `SELECT … FOR UPDATE SKIP LOCKED`, and PostgreSQL allows row locks
-- only to a role with UPDATE on at least one of the table's columns. `sweeper check-config`
-- prints each missing grant as a line. For deploy/sweeper.example.toml's ticket-retention:
--
--   grant usage on schema support to sweeper_runtime;
--   grant select (id, closed_at, legal_hold), delete on support.tickets to sweeper_runtime;
--   grant update (closed_at) on support.tickets to sweeper_runtime;
--
-- A policy with `partitions = "drop"` detaches and drops the target's partitions, which only the
-- table's owner may do: its role must be a member of that owner (`grant <owner> to
-- sweeper_runtime`), which is far more than the grants above. Keep such policies on a replica
-- whose role is allowed that, or leave them on the row path.
