#!/usr/bin/env bash
# The delete of one 250-key command with a hold kept in another table, as sweeper writes it
# (related.sql: src/policy/related.rs), beside the same hold as a column of the row (own.sql) and
# PostgreSQL's own form of the same test, an anti-join (floor.sql); each rolled back, so every
# transaction deletes. Interleaved, 3 repetitions of 10 s. (pgbench reads `:name` as a variable,
# so the scripts spell the `unknown:` reasons `unknown_`.)
#   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres bash benches/related_holds/run.sh
set -euo pipefail
cd "$(dirname "$0")"
base="${DATABASE_URL%/*}"
psql -q "$DATABASE_URL" -c "drop database if exists sweeper_related_bench" \
     -c "create database sweeper_related_bench"
db="$base/sweeper_related_bench"
psql -q "$db" -f setup.sql
for rep in 1 2 3; do
  for f in own related floor; do
    tps=$(pgbench -n -M prepared -T 10 -c 1 -f "$f.sql" "$db" | grep -oP 'tps = \K[0-9.]+')
    echo "$rep $f $tps"
  done
done
psql -q "$DATABASE_URL" -c "drop database sweeper_related_bench"
