#!/usr/bin/env bash
# The partition sweep (issue 35) against the row path and pg_partman's retention, on the same data:
# `demo.events` range partitioned by calendar month on `created_at`, keyed (id, created_at), rows of
# ~120 bytes; four whole months before the cutoff with ROWS_PER_MONTH rows each, and the month that
# straddles the cutoff with STRADDLE old rows (2 % of the expired ones) and as many young ones.
# Contenders, each on a fresh copy of the seeded database, right after a CHECKPOINT, interleaved,
# REPS repetitions:
#   drop     sweeper, partitions = "drop" (no default partition: DETACH ... CONCURRENTLY)
#   rows     sweeper, partitions = "rows" (the same policy deleting row by row)
#   partman  pg_partman 4.7's run_maintenance() with retention = '90 days' (drops the four months
#            whole; it has no holds, no evidence, and leaves the straddling month's old rows)
# Each prints: seconds (sweeper: trigger -> completed; pg_partman: run_maintenance), the retirement
# span (first retirement planned -> last drop), WAL bytes written, dead tuples left in demo.*, and
# the rows left older than the cutoff.
# Run from the repository root:
#   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres bash benches/partition_sweep.sh
# Options by environment: ROWS_PER_MONTH (250000), REPS (3), STRADDLE (old rows in the straddling
# month, and as many young ones; default 2 % of the expired ones; 0 isolates the retirement's own
# WAL), CONTENDERS ("drop rows partman"). Needs pg_partman (Debian's
# postgresql-15-partman) for the third contender; without it that contender is skipped.
set -euo pipefail
server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
admin="${server%/*}/postgres"
# sweeper reads DATABASE_URL before its configuration's database_url: each contender's
# configuration names its own database.
unset DATABASE_URL SWEEPER_DATABASE_URL
rows_per_month=${ROWS_PER_MONTH:-250000}
straddle=${STRADDLE:-$((rows_per_month * 4 / 50))}
reps=${REPS:-3}
port=${PORT:-18095}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
# BIN: a sweeper binary to measure instead of this tree's release build.
if [ -z "${BIN:-}" ]; then cargo build --release --locked -q; fi
bin=${BIN:-target/release/sweeper}

# The window: the latest 02:00 UTC tick; the cutoff 90 days before it.
window=$(psql -Atq "$admin" -c "select to_char(date_trunc('day', now() at time zone 'UTC' - interval '2 hours') + interval '2 hours', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')")
cutoff="(timestamptz '$window' - interval '90 days')"
has_partman=$(psql -Atq "$admin" -c "select count(*) from pg_available_extensions where name = 'pg_partman'")

# The table (by hand, or by pg_partman) and its rows; `$1`: "hand" or "partman".
seed() {
  local db=$1 how=$2
  psql -q "$admin" -c "drop database if exists $db" -c "create database $db"
  local url="${server%/*}/$db"
  psql -q -v ON_ERROR_STOP=1 "$url" <<SQL
create schema demo;
create table demo.events (id bigint not null, created_at timestamptz not null, payload text not null,
                          primary key (id, created_at)) partition by range (created_at);
create index on demo.events (created_at);
SQL
  local first="(date_trunc('month', $cutoff) - interval '4 months')"
  if [ "$how" = partman ]; then
    psql -q -v ON_ERROR_STOP=1 "$url" <<SQL
create schema partman;
create extension pg_partman schema partman;
select partman.create_parent(p_parent_table => 'demo.events', p_control => 'created_at',
       p_type => 'native', p_interval => 'monthly', p_premake => 4,
       p_start_partition => to_char($first, 'YYYY-MM-DD'));
SQL
  else
    psql -q -v ON_ERROR_STOP=1 "$url" <<SQL
do \$\$ declare m timestamptz := $first; begin
  for k in 0..8 loop
    execute format('create table demo.events_m%s partition of demo.events for values from (%L) to (%L)',
                   k, m, m + interval '1 month');
    m := m + interval '1 month';
  end loop;
end \$\$;
SQL
  fi
  psql -q -v ON_ERROR_STOP=1 "$url" <<SQL
insert into demo.events
select i, $first + make_interval(months => m)
          + (i::float8 / ($rows_per_month + 1)) * (($first + make_interval(months => m + 1))
                                                   - ($first + make_interval(months => m))),
       repeat('x', 80)
  from generate_series(0, 3) m, generate_series(1, $rows_per_month) i;
insert into demo.events
select i, date_trunc('month', $cutoff)
          + (i::float8 / ($straddle + 1)) * ($cutoff - interval '1 minute' - date_trunc('month', $cutoff)),
       repeat('x', 80)
  from generate_series(1, $straddle) i;
insert into demo.events
select i, $cutoff + interval '1 minute'
          + (i::float8 / ($straddle + 1)) * (date_trunc('month', $cutoff) + interval '1 month'
                                              - interval '2 minutes' - $cutoff),
       repeat('x', 80)
  from generate_series(1, $straddle) i;
vacuum analyze demo.events;
SQL
}

wal_now() { psql -Atq "$1" -c "select pg_current_wal_insert_lsn()"; }
dead() {
  sleep 1.5 # the servers' table statistics reach the stats system within a second
  psql -Atq "$1" -c "select coalesce(sum(n_dead_tup), 0) from pg_stat_user_tables where schemaname = 'demo'"
}
old_left() { psql -Atq "$1" -c "select count(*) from demo.events where created_at < $cutoff"; }

config() {
  local url=$1 mode=$2
  cat <<TOML
database_url = "$url"
listen = "127.0.0.1:$port"
migrate_on_start = true
[queue]
workers = 2
poll_interval = "1s"
[ledger]
audit_export_dir = "$work/exports"
[[auth.issuer]]
iss = "bench"
audience = "sweeper"
keys = [ { kid = "k1", secret = "bench-secret-bench-secret-bench-secret-0123456789" } ]
[[policy]]
name = "events"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "demo.events", key = ["id", "created_at"], timestamp = "created_at" }
retain_for = "90d"
batch_size = 250
partitions = "$mode"
TOML
}

run_sweeper() {
  local url=$1 mode=$2
  mkdir -p "$work/exports"
  config "$url" "$mode" >"$work/sweeper.toml"
  "$bin" migrate --config "$work/sweeper.toml" >/dev/null
  local token
  token=$("$bin" token --config "$work/sweeper.toml" --scope 'trigger:*' --scope ops:read)
  psql -q "$url" -c checkpoint
  local from
  from=$(wal_now "$url")
  "$bin" serve --config "$work/sweeper.toml" >"$work/serve.log" 2>&1 &
  local pid=$!
  local waited=0
  until curl -sf "http://127.0.0.1:$port/readyz" >/dev/null; do
    sleep 0.05
    waited=$((waited + 1))
    if [ "$waited" -gt 1200 ]; then echo "sweeper did not become ready:" >&2; tail -20 "$work/serve.log" >&2; exit 1; fi
  done
  local started run status
  started=$(date +%s.%N)
  run=$(curl -sf -X POST -H "authorization: Bearer $token" \
          "http://127.0.0.1:$port/trigger/events?window=$window" | sed -E 's/.*"run_id":"([^"]+)".*/\1/')
  while :; do
    status=$(psql -Atq "$url" -c "select status from sweeper.runs where run_id = '$run'")
    case $status in completed*) break ;; esac
    sleep 0.02
  done
  local seconds
  seconds=$(echo "$(date +%s.%N) - $started" | bc)
  local wal span
  wal=$(psql -Atq "$url" -c "select pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '$from')")
  span=$(psql -Atq "$url" -c "select coalesce(round(extract(epoch from max(finished_at) - min(created_at))::numeric, 3)::text, '-')
                                from sweeper.partition_retirements where run_id = '$run' and state = 'dropped'")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$seconds $span $wal $(dead "$url") $(old_left "$url")"
  rm -rf "$work/exports"
}

run_partman() {
  local url=$1
  psql -q "$url" -c "update partman.part_config set retention = '90 days', retention_keep_table = false
                      where parent_table = 'demo.events'" -c checkpoint
  local from started seconds wal
  from=$(wal_now "$url")
  started=$(date +%s.%N)
  psql -q "$url" -c "select partman.run_maintenance('demo.events')" >/dev/null
  seconds=$(echo "$(date +%s.%N) - $started" | bc)
  wal=$(psql -Atq "$url" -c "select pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '$from')")
  echo "$seconds - $wal $(dead "$url") $(old_left "$url")"
}

seed sweeper_bench_partitions_seed hand >/dev/null
if [ "$has_partman" = 1 ]; then seed sweeper_bench_partitions_seed_partman partman >/dev/null; fi
echo "window $window; $((rows_per_month * 4)) rows in four expired months, $straddle old and $straddle young in the straddling month"
echo "rep contender seconds retirement_span_s wal_bytes dead_tuples old_rows_left"
for rep in $(seq 1 "$reps"); do
  for c in ${CONTENDERS:-drop rows partman}; do
    db=sweeper_bench_partitions_run
    template=sweeper_bench_partitions_seed
    if [ "$c" = partman ]; then
      [ "$has_partman" = 1 ] || continue
      template=sweeper_bench_partitions_seed_partman
    fi
    psql -q "$admin" -c "drop database if exists $db" \
         -c "create database $db template $template strategy file_copy"
    url="${server%/*}/$db"
    if [ "$c" = partman ]; then
      echo "$rep $c $(run_partman "$url")"
    else
      echo "$rep $c $(run_sweeper "$url" "$c")"
    fi
  done
done
psql -q "$admin" -c "drop database if exists sweeper_bench_partitions_run" \
     -c "drop database if exists sweeper_bench_partitions_seed" \
     -c "drop database if exists sweeper_bench_partitions_seed_partman"
