#!/usr/bin/env bash
# WAL and bytes per audited item of the lean audit's own writes (issue 34), for three shapes of
# item key (a bigint, a uuid, a composite key's JSON text), with each of the items' indexes
# dropped in turn and with the item history index keyed by the key text instead of its hash:
# 400 commands of 250 items, each written with the statement sweeper uses (an execution row,
# then its items), on a freshly migrated database right after a CHECKPOINT.
# Run from the repository root: `bash benches/audit_wal.sh`.
# DATABASE_URL names the server (default postgres://postgres@127.0.0.1:5432/postgres); the script
# creates and drops the database `sweeper_bench_audit_wal`.
set -euo pipefail
server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
admin="${server%/*}/postgres"
db="${server%/*}/sweeper_bench_audit_wal"
# The item key of row g, per shape.
bigint='g::text'
uuid='md5(g::text)::uuid::text'
composite="format('[\"%s\",\"%s\"]', g, '2026-06-03 02:00:00.123456+00')"
run() {
  key=$1; shift
  psql -q "$admin" -c "drop database if exists sweeper_bench_audit_wal" \
       -c "create database sweeper_bench_audit_wal"
  for f in migrations/*.sql; do psql -q -v ON_ERROR_STOP=1 "$db" -f "$f" >/dev/null; done
  if [ -n "$1" ]; then psql -q "$db" -c "$1"; fi
  psql -q "$db" -c checkpoint
  from=$(psql -Atq "$db" -c "select pg_current_wal_insert_lsn()")
  psql -q "$db" <<SQL
do \$\$ begin for r in 1..400 loop
  with items as (select $key as item_key, 'deleted' as outcome, null::text as reason, g as ord
                   from generate_series(r * 250, r * 250 + 249) g),
  x as (insert into sweeper.audit_executions
            (policy, policy_version, run_id, window_at, pinned_cutoff, cutoff, command_id,
             attempt, actor, dry_run, recorded_at)
        select 'ticket-retention', 'b9e945b6b59af754', 'ticket-retention:2026-12-04T02:00:00Z',
               now(), now(), now(), 'ticket-retention:2026-12-04T02:00:00Z:' || r, 1, 'builtin',
               false, now()
        returning execution_id, recorded_at)
  insert into sweeper.audit_items (execution_id, recorded_at, item_key, outcome, reason)
  select x.execution_id, x.recorded_at, i.item_key, i.outcome, i.reason
    from x cross join items i order by i.ord;
end loop; end \$\$;
SQL
  to=$(psql -Atq "$db" -c "select pg_current_wal_insert_lsn()")
  wal=$(psql -Atq "$db" -c "select round(pg_wal_lsn_diff('$to', '$from') / 100000.0)")
  bytes=$(psql -Atq "$db" -c "select round(sum(pg_total_relation_size(inhrelid)) / 100000.0)
                                from pg_inherits
                               where inhparent in ('sweeper.audit_items'::regclass,
                                                   'sweeper.audit_executions'::regclass)")
  printf '%-10s %-52s %6s WAL B/item %6s audit B/item\n' "${key_name}" "$2" "$wal" "$bytes"
}
by_text='drop index sweeper.audit_items_by_item_hash;
         create index audit_items_by_item on sweeper.audit_items (item_key)'
for key_name in bigint uuid composite; do
  run "${!key_name}" "" "as built (item history and execution indexes)"
  run "${!key_name}" "$by_text" "the item history index on the key text instead"
done
key_name=bigint
run "$bigint" "drop index sweeper.audit_items_by_execution" "without the execution index"
run "$bigint" "drop index sweeper.audit_items_by_item_hash" "without the item history index"
run "$bigint" "drop index sweeper.audit_items_by_item_hash; drop index sweeper.audit_items_by_execution" \
    "items heap only"
psql -q "$admin" -c "drop database sweeper_bench_audit_wal"
