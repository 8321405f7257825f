-- Planning proportional to the eligible set (issue 13). A run is planned along one of two paths,
-- chosen on its first page and kept for the run: `key_order` walks every key of the table (the
-- right walk for a dense run), `timestamp_index` walks only `timestamp < cutoff` in
-- (timestamp, key) order through an index that leads with the timestamp. `path_reason` says why,
-- for operators.
alter table sweeper.planning_jobs
    add column path text check (path in ('key_order', 'timestamp_index')),
    add column path_reason text,
    -- The timestamp of the last row planned on the `timestamp_index` path; with `cursor_key` the
    -- keyset cursor (timestamp, key).
    add column cursor_timestamp timestamptz;

-- The keys a `timestamp_index` run's walk has met (eligible or held), each classified once, at the
-- first page that met it. A row's timestamp can move forward past the cursor after that; the walk
-- meets it again, and this table keeps it out of a second command (its second command would
-- otherwise audit `already_absent` after `deleted`) and out of a second held count. Written in
-- each page's transaction; emptied by the run's last page, or when the run is cancelled: once
-- planning is over no key can be met again.
create table sweeper.seen_keys (
    run_id   text not null references sweeper.runs (run_id),
    item_key text not null,
    primary key (run_id, item_key)
);
