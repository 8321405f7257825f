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
# the rows left older than the cutoff; then the held rows per expired month (the HELD in force),
# the held rows left after the run, and for sweeper's drop path, per month (from the server's log
# and the run's partitions, GET /runs/{id}): the carved month's retirement seconds (the swap plus
# its export and drop), the swap alone, a whole month's (its detach plus its export and drop;
# median of the whole months), the carved month's wall seconds (its finish minus the previous
# retirement's, or the planning for the first) and a whole month's (median), and the carved
# month's rows carried over. The last lines give the medians per contender and HELD, and the drop
# path against the row path (time ratio, WAL in % of the row path's, seconds per million rows).
# With HELD=n > 0 the table has a column `legal_hold boolean not null default false`, n rows of
# one expired month (HELD_MONTH, evenly spread) have it true, and the policy holds them with
# `exclude = [ { column = "legal_hold", equals = true } ]`: the drop path carves that month (its
# held rows copied into a new partition of the same range, the old one retired whole; above
# 10,000 held rows it sweeps that month row by row instead) and the row path keeps them row by
# row; pg_partman has no holds and drops them with the month.
# Run from the repository root:
#   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres bash benches/partition_sweep.sh
# Options by environment: ROWS_PER_MONTH (250000), REPS (3), STRADDLE (old rows in the straddling
# month, and as many young ones; default 2 % of the expired ones; 0 isolates the retirement's own
# WAL), CONTENDERS ("drop rows partman"), HELD (held rows in one expired month, default 0: no
# hold column and no exclusion, as before; a list such as "0 40" seeds one database per value and
# interleaves them within each repetition), HELD_MONTH (which expired month holds them, 0 the
# oldest .. 3; default 1), BIN (a sweeper binary instead of this tree's release build). Needs
# pg_partman (Debian's postgresql-15-partman) for the third contender; without it that contender
# is skipped; jq for the per-month figures (without it they print "-").
set -euo pipefail
server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
admin="${server%/*}/postgres"
# sweeper reads DATABASE_URL before its configuration's database_url: each contender's
# configuration names its own database.
unset DATABASE_URL SWEEPER_DATABASE_URL
rows_per_month=${ROWS_PER_MONTH:-250000}
straddle=${STRADDLE:-$((rows_per_month * 4 / 50))}
reps=${REPS:-3}
held_list=${HELD:-0}
held_month=${HELD_MONTH:-1}
for h in $held_list; do
  case $h in *[!0-9]*|'') echo "HELD: whole numbers, e.g. HELD=40 or HELD=\"0 40\"" >&2; exit 2 ;; esac
  if [ "$h" -gt "$rows_per_month" ]; then echo "HELD=$h is more than ROWS_PER_MONTH" >&2; exit 2; fi
done
case $held_month in [0-3]) ;; *) echo "HELD_MONTH: 0..3" >&2; exit 2 ;; esac
has_jq=$(command -v jq >/dev/null && echo 1 || echo 0)
port=${PORT:-18095}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
# BIN: a sweeper binary to measure instead of this tree's release build.
if [ -z "${BIN:-}" ]; then cargo build --release --locked -q; fi
bin=${BIN:-${CARGO_TARGET_DIR:-target}/release/sweeper}

# The window: the latest 02:00 UTC tick; the cutoff 90 days before it.
window=$(psql -Atq "$admin" -c "select to_char(date_trunc('day', now() at time zone 'UTC' - interval '2 hours') + interval '2 hours', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')")
cutoff="(timestamptz '$window' - interval '90 days')"
has_partman=$(psql -Atq "$admin" -c "select count(*) from pg_available_extensions where name = 'pg_partman'")

# The table (by hand, or by pg_partman) and its rows; `$2`: "hand" or "partman"; `$3`: the held
# rows (0: no hold column at all, the table as it always was).
seed() {
  local db=$1 how=$2 held=${3:-0}
  local hold_column="" hold_insert="" hold_value=""
  if [ "$held" -gt 0 ]; then
    hold_column=", legal_hold boolean not null default false"
    hold_insert=", legal_hold"
    # Every step-th row of the month, n of them, spread over the month.
    hold_value=", (m = $held_month and i % $((rows_per_month / held)) = 0 and i <= $(((rows_per_month / held) * held)))"
  fi
  psql -q "$admin" -c "drop database if exists $db" -c "create database $db"
  local url="${server%/*}/$db"
  psql -q -v ON_ERROR_STOP=1 "$url" <<SQL
create schema demo;
create table demo.events (id bigint not null, created_at timestamptz not null, payload text not null$hold_column,
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
insert into demo.events (id, created_at, payload$hold_insert)
select i, $first + make_interval(months => m)
          + (i::float8 / ($rows_per_month + 1)) * (($first + make_interval(months => m + 1))
                                                   - ($first + make_interval(months => m))),
       repeat('x', 80)$hold_value
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
# The held rows left after the run ("-" without a hold column).
held_left() {
  if [ "$2" -gt 0 ]; then psql -Atq "$1" -c "select count(*) from demo.events where legal_hold"; else echo -; fi
}
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "-"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

config() {
  local url=$1 mode=$2 held=$3
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
  if [ "$held" -gt 0 ]; then
    echo 'exclude = [ { column = "legal_hold", equals = true } ]'
  fi
}

# The drop path's months, from the server's log ($1) and the run's partitions (GET /runs/{id},
# $2) and their ledger rows ($3: the database, $4: the run): the carved month's seconds (swap +
# export and drop), the swap's, a whole month's (detach + export and drop; median), the carved
# month's wall seconds and a whole month's (median), the rows carried over.
months() {
  local log=$1 json=$2 url=$3 run=$4
  if [ "$has_jq" != 1 ] || ! jq -e '.partitions | length > 0' "$json" >/dev/null 2>&1; then
    echo "- - - - - -"; return
  fi
  local carved carried
  carved=$(jq -r '[.partitions[] | select(.held_rows != null)][0].partition // ""' "$json")
  carried=$(jq -r '[.partitions[] | select(.held_rows != null)][0].carried_rows // "-"' "$json")
  # partition, step, seconds
  jq -r 'select(.fields.partition? != null and .fields.seconds? != null)
         | [.fields.partition,
            (.fields.message | if startswith("held rows carved out") then "carve"
                               elif startswith("partition detached") then "detach"
                               elif startswith("partition exported and recorded") then "drop"
                               else "other" end),
            .fields.seconds] | @tsv' "$log" >"$work/steps.tsv"
  local carve_s carved_s whole_s
  carve_s=$(awk -F'\t' -v p="$carved" '$1 == p && $2 == "carve" { print $3 }' "$work/steps.tsv" | median)
  carved_s=$(awk -F'\t' -v p="$carved" '$1 == p && ($2 == "carve" || $2 == "drop") { s += $3; n++ }
                                        END { if (n == 2) printf "%.3f\n", s; else print "-" }' "$work/steps.tsv")
  whole_s=$(awk -F'\t' -v p="$carved" '$1 != p && ($2 == "detach" || $2 == "drop") { s[$1] += $3; n[$1]++ }
                                       END { for (k in s) if (n[k] == 2) printf "%.3f\n", s[k] }' "$work/steps.tsv" | median)
  # Wall seconds per month: its finish minus the previous retirement's (the planning for the
  # first); the retirer takes one partition after another.
  psql -Atq -F' ' "$url" -c "select partition, round(extract(epoch from finished_at - coalesce(lag(finished_at) over (order by finished_at), created_at))::numeric, 3)
                               from sweeper.partition_retirements where run_id = '$run' and state = 'dropped'" >"$work/wall.txt"
  local carved_wall whole_wall
  carved_wall=$(awk -v p="$carved" '$1 == p { print $2 }' "$work/wall.txt" | median)
  whole_wall=$(awk -v p="$carved" '$1 != p { print $2 }' "$work/wall.txt" | median)
  [ -n "$carved" ] || { carve_s=-; carved_s=-; carved_wall=-; }
  echo "$carved_s $carve_s $whole_s $carved_wall $whole_wall $carried"
}

run_sweeper() {
  local url=$1 mode=$2 held=$3
  mkdir -p "$work/exports"
  config "$url" "$mode" "$held" >"$work/sweeper.toml"
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
  curl -sf -H "authorization: Bearer $token" "http://127.0.0.1:$port/runs/$run" >"$work/run.json" || echo '{}' >"$work/run.json"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  local per_month="- - - - - -"
  if [ "$mode" = drop ]; then per_month=$(months "$work/serve.log" "$work/run.json" "$url" "$run"); fi
  echo "$seconds $span $wal $(dead "$url") $(old_left "$url") $held $(held_left "$url" "$held") $per_month"
  rm -rf "$work/exports"
}

run_partman() {
  local url=$1 held=$2
  psql -q "$url" -c "update partman.part_config set retention = '90 days', retention_keep_table = false
                      where parent_table = 'demo.events'" -c checkpoint
  local from started seconds wal
  from=$(wal_now "$url")
  started=$(date +%s.%N)
  psql -q "$url" -c "select partman.run_maintenance('demo.events')" >/dev/null
  seconds=$(echo "$(date +%s.%N) - $started" | bc)
  wal=$(psql -Atq "$url" -c "select pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '$from')")
  echo "$seconds - $wal $(dead "$url") $(old_left "$url") $held $(held_left "$url" "$held") - - - - - -"
}

for h in $held_list; do
  seed "sweeper_bench_partitions_seed_h$h" hand "$h" >/dev/null
  case " ${CONTENDERS:-drop rows partman} " in
    *" partman "*) if [ "$has_partman" = 1 ]; then seed "sweeper_bench_partitions_seed_partman_h$h" partman "$h" >/dev/null; fi ;;
  esac
done
echo "window $window; $((rows_per_month * 4)) rows in four expired months, $straddle old and $straddle young in the straddling month; held rows in expired month $held_month: $held_list"
echo "rep contender seconds retirement_span_s wal_bytes dead_tuples old_rows_left held held_rows_left carved_month_s carve_swap_s whole_month_s carved_month_wall_s whole_month_wall_s carried_rows"
: >"$work/results"
for rep in $(seq 1 "$reps"); do
  for h in $held_list; do
    for c in ${CONTENDERS:-drop rows partman}; do
      db=sweeper_bench_partitions_run
      template=sweeper_bench_partitions_seed_h$h
      if [ "$c" = partman ]; then
        [ "$has_partman" = 1 ] || continue
        template=sweeper_bench_partitions_seed_partman_h$h
      fi
      psql -q "$admin" -c "drop database if exists $db" \
           -c "create database $db template $template strategy file_copy"
      url="${server%/*}/$db"
      if [ "$c" = partman ]; then
        line="$rep $c $(run_partman "$url" "$h")"
      else
        line="$rep $c $(run_sweeper "$url" "$c" "$h")"
      fi
      echo "$line"
      echo "$line" >>"$work/results"
    done
  done
done
# Medians per contender and HELD; then the drop path against the row path of the same HELD.
echo "medians: held contender seconds retirement_span_s wal_bytes carved_month_s carve_swap_s whole_month_s carved_month_wall_s whole_month_wall_s"
col() { awk -v c="$1" -v h="$2" -v k="$3" '$2 == c && $8 == h && $k != "-" { print $k }' "$work/results" | median; }
for h in $held_list; do
  for c in ${CONTENDERS:-drop rows partman}; do
    [ -n "$(col "$c" "$h" 3)" ] && [ "$(col "$c" "$h" 3)" != - ] || continue
    echo "medians: $h $c $(col "$c" "$h" 3) $(col "$c" "$h" 4) $(col "$c" "$h" 5) $(col "$c" "$h" 10) $(col "$c" "$h" 11) $(col "$c" "$h" 12) $(col "$c" "$h" 13) $(col "$c" "$h" 14)"
  done
  d_s=$(col drop "$h" 3) r_s=$(col rows "$h" 3) d_w=$(col drop "$h" 5) r_w=$(col rows "$h" 5)
  d_span=$(col drop "$h" 4) d_carved=$(col drop "$h" 10) d_whole=$(col drop "$h" 12)
  if [ "$d_s" != - ] && [ "$r_s" != - ]; then
    awk -v h="$h" -v ds="$d_s" -v rs="$r_s" -v dw="$d_w" -v rw="$r_w" -v span="$d_span" \
        -v carved="$d_carved" -v whole="$d_whole" -v rpm="$rows_per_month" 'BEGIN {
      printf "held %s: drop/rows time %.3f; drop WAL %.2f %% of the row path'"'"'s", h, ds / rs, 100 * dw / rw
      if (span != "-") printf "; retirement span %.2f s per million rows", span / (4 * rpm) * 1e6
      if (carved != "-") printf "; carved month %.2f s per million rows", carved / rpm * 1e6
      if (whole != "-") printf "; whole month %.2f s per million rows", whole / rpm * 1e6
      printf "\n" }'
  fi
done
psql -q "$admin" -c "drop database if exists sweeper_bench_partitions_run"
for h in $held_list; do
  psql -q "$admin" -c "drop database if exists sweeper_bench_partitions_seed_h$h" \
       -c "drop database if exists sweeper_bench_partitions_seed_partman_h$h"
done
