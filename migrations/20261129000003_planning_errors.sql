-- Planning failures are visible: the last error of a planning job and how many pages in a row
-- have failed, shown on the run (GET /runs/{run_id}) and counted in /metrics, instead of only in
-- the logs while the job is retried after each lease.
alter table sweeper.planning_jobs
    add column failures integer not null default 0,
    add column last_error text,
    add column last_error_at timestamptz;
