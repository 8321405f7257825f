-- Least privilege (docs/design.md §7): the runtime role need not own the audit's tables.
--
-- What the runtime does that needs ownership of them goes through functions that run as their
-- owner (the role that applies this migration, deploy/roles.sql's migration owner): making the
-- months ahead at start and every housekeeping round, and detaching and dropping a month audit
-- retention has exported. Each has a fixed search_path and names every object with its schema.
-- EXECUTE is taken from PUBLIC; roles.sql grants it to the runtime role. A runtime role that owns
-- the tables (every deployment before this release) keeps working: an owner may always execute.

-- As migration 20261204000022 made it, now running as its owner and refusing more than 24 months
-- ahead (sweeper asks for 2; a caller with EXECUTE must not make the owner create tables without
-- bound).
create or replace function sweeper.ensure_audit_partitions(months_ahead integer) returns integer
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    upto timestamp;
    lo timestamp;
    made integer := 0;
begin
    if months_ahead is null or months_ahead > 24 then
        raise exception 'ensure_audit_partitions makes at most 24 months ahead, not %', months_ahead
            using errcode = 'invalid_parameter_value';
    end if;
    upto := date_trunc('month', sweeper.now() at time zone 'UTC')
            + make_interval(months => months_ahead + 1);
    perform pg_advisory_xact_lock(hashtext('sweeper:audit_partitions'));
    -- Any month that lacks one of its tables gets it (a no-op once each has all four).
    perform sweeper.make_audit_month(
                array['audit_executions', 'audit_items', 'audit_manifests'],
                substr(partition, length('audit_') + 1), from_at, to_at)
       from sweeper.audit_partitions;
    select max(to_at) at time zone 'UTC' into lo from sweeper.audit_partitions;
    while lo < upto loop
        perform sweeper.make_audit_month(
            array['audit', 'audit_executions', 'audit_items', 'audit_manifests'],
            to_char(lo, 'YYYY_MM'), lo at time zone 'UTC', (lo + interval '1 month') at time zone 'UTC');
        insert into sweeper.audit_partitions (partition, from_at, to_at)
        values ('audit_' || to_char(lo, 'YYYY_MM'), lo at time zone 'UTC',
                (lo + interval '1 month') at time zone 'UTC');
        lo := lo + interval '1 month';
        made := made + 1;
    end loop;
    return made;
end
$$;
alter function sweeper.make_audit_month(text[], text, timestamptz, timestamptz)
    set search_path = pg_catalog, pg_temp;
revoke execute on function sweeper.ensure_audit_partitions(integer) from public;
revoke execute on function sweeper.make_audit_month(text[], text, timestamptz, timestamptz)
    from public;

-- The month's four tables (`audit_2026_03`, `audit_executions_2026_03`, …), for a name that is one.
create function sweeper.audit_month_tables(month text) returns text[]
language sql immutable set search_path = pg_catalog, pg_temp as $$
    select case when month ~ '^audit_([0-9]{4}_[0-9]{2}|before)$' then
        array[month,
              'audit_executions_' || substr(month, length('audit_') + 1),
              'audit_items_' || substr(month, length('audit_') + 1),
              'audit_manifests_' || substr(month, length('audit_') + 1)]
    end
$$;

-- Detaches a month that has ended and whose export is recorded, for a runtime role that does not own the audit.
-- Plain DETACH (not CONCURRENTLY, which cannot run in a function): it takes ACCESS EXCLUSIVE on
-- each parent for a moment, waiting at most lock_timeout; the next retention pass tries again.
create function sweeper.detach_audit_month(month text) returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp set lock_timeout = '5s'
as $$
declare
    parents text[] := array['audit', 'audit_executions', 'audit_items', 'audit_manifests'];
    tables text[] := sweeper.audit_month_tables(month);
begin
    if tables is null then
        raise exception '% is not the name of an audit month', month
            using errcode = 'invalid_parameter_value';
    end if;
    if not exists (select from sweeper.audit_exports e
                    where e.partition = month and e.state in ('exported', 'detach_pending')) then
        raise exception 'audit month % has no recorded export: it is not detached', month
            using errcode = 'object_not_in_prerequisite_state';
    end if;
    if exists (select from sweeper.audit_partitions p
                where p.partition = month and p.to_at > sweeper.now()) then
        raise exception 'audit month % has not ended: it is not detached', month
            using errcode = 'object_not_in_prerequisite_state';
    end if;
    for i in 1 .. 4 loop
        if exists (select from pg_inherits
                    where inhparent = format('sweeper.%I', parents[i])::regclass
                      and inhrelid = to_regclass(format('sweeper.%I', tables[i]))) then
            execute format('alter table sweeper.%I detach partition sweeper.%I',
                           parents[i], tables[i]);
        end if;
    end loop;
end
$$;

-- Drops a detached month that has ended and whose export is recorded (the caller deletes its audit_partitions row
-- and records the drop in the same transaction). A table still attached is refused.
create function sweeper.drop_audit_month(month text) returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    tables text[] := sweeper.audit_month_tables(month);
    t text;
begin
    if tables is null then
        raise exception '% is not the name of an audit month', month
            using errcode = 'invalid_parameter_value';
    end if;
    if not exists (select from sweeper.audit_exports e
                    where e.partition = month and e.state in ('exported', 'detach_pending')) then
        raise exception 'audit month % has no recorded export: it is not dropped', month
            using errcode = 'object_not_in_prerequisite_state';
    end if;
    if exists (select from sweeper.audit_partitions p
                where p.partition = month and p.to_at > sweeper.now()) then
        raise exception 'audit month % has not ended: it is not dropped', month
            using errcode = 'object_not_in_prerequisite_state';
    end if;
    foreach t in array tables loop
        if exists (select from pg_inherits
                    where inhrelid = to_regclass(format('sweeper.%I', t))) then
            raise exception 'audit table sweeper.% is still attached: detach it first', t
                using errcode = 'object_not_in_prerequisite_state';
        end if;
        execute format('drop table if exists sweeper.%I', t);
    end loop;
end
$$;
revoke execute on function sweeper.detach_audit_month(text) from public;
revoke execute on function sweeper.drop_audit_month(text) from public;

-- SECURITY DEFINER runs as the function's owner, which is whoever applied this migration: a
-- superuser who migrates by hand would otherwise own them (and be what they run as), and a
-- runtime role that owns the audit (every deployment before this release) would lack EXECUTE,
-- taken from PUBLIC above. They belong to the owner of the audit's tables, as their statements
-- need (deploy/roles.sql's migration owner, when it has run).
do $$
declare
    owner text := (select pg_get_userbyid(relowner) from pg_class
                    where oid = 'sweeper.audit'::regclass);
    f text;
begin
    foreach f in array array['sweeper.ensure_audit_partitions(integer)',
                             'sweeper.make_audit_month(text[], text, timestamptz, timestamptz)',
                             'sweeper.audit_month_tables(text)',
                             'sweeper.detach_audit_month(text)',
                             'sweeper.drop_audit_month(text)'] loop
        execute format('alter function %s owner to %I', f, owner);
    end loop;
end
$$;
