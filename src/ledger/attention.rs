//! What on-call asks of a run beyond its counts: which runs need a look (`GET
//! /runs?status=attention`), which of a run's commands are retrying and why, and how far it has
//! got (`GET /runs/{id}`'s `progress`). Read-only; each answer is a fixed number of statements,
//! whatever the number of runs or commands.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::{RUN_COLUMNS, Run};

/// The facts `GET /runs?status=attention` turns into a run's one-line `reason`.
#[derive(Debug, Clone, Default, Serialize, sqlx::FromRow)]
pub struct Facts {
    /// The run.
    #[serde(skip)]
    pub run_id: String,
    /// Dead letters of the run waiting for an operator (`status = 'open'`).
    pub open_dead_letters: i64,
    /// Dead letters redriven and not yet done.
    pub redriven_dead_letters: i64,
    /// Dead letters an operator abandoned (they no longer keep the run in the list).
    pub abandoned_dead_letters: i64,
    /// Dead letters whose redrive succeeded.
    pub resolved_dead_letters: i64,
    /// The newest open dead letter's reason.
    #[serde(skip)]
    pub dead_letter_reason: Option<String>,
    /// Commands not terminal that failed or were snoozed at least once since they were last
    /// (re)queued: they are retrying by themselves. A command waiting on rows another
    /// transaction holds locked is not failing and is not counted here.
    pub retrying_commands: i64,
    /// Commands not terminal whose rows another transaction holds locked: their other rows are
    /// done; they try the locked ones again without spending attempts, until `max_age`.
    pub waiting_on_lock_commands: i64,
    /// The soonest-due retrying command's last error, class, attempts and next attempt.
    #[serde(skip)]
    pub retry_error: Option<String>,
    /// Its class.
    #[serde(skip)]
    pub retry_class: Option<String>,
    /// Its attempts.
    #[serde(skip)]
    pub retry_attempts: Option<i32>,
    /// Its next attempt.
    #[serde(skip)]
    pub retry_next_at: Option<DateTime<Utc>>,
    /// It is being tried now (leased), so its next attempt is this one.
    #[serde(skip)]
    pub retry_trying_now: bool,
    /// The oldest hold recorded on a command or the planning job: kind and detail.
    #[serde(skip)]
    pub held_kind: Option<String>,
    /// Why.
    #[serde(skip)]
    pub held_reason: Option<String>,
    /// Consecutive planning pages that failed, and the last one's error.
    #[serde(skip)]
    pub planning_failures: i32,
    /// The last failed page's error.
    #[serde(skip)]
    pub planning_error: Option<String>,
    /// `awaiting_plan`, `required`, ... (see [`super::runs::Approval`]).
    #[serde(skip)]
    pub approval: Option<String>,
    /// Commands of the run not yet terminal.
    #[serde(skip)]
    pub unfinished_commands: i64,
}

/// The runs that need a look, newest window first, at most `limit`: every run not terminal
/// (planning or running: held, retrying or just working) and every run with a dead letter open
/// or redriven. A run whose last such dead letter is resolved or abandoned leaves the list.
pub async fn attention_runs(
    pool: &PgPool,
    policy: Option<&str>,
    limit: i64,
) -> sqlx::Result<Vec<(Run, Facts)>> {
    // Both arms use a partial or leading index (runs_by_status, dead_letters_open).
    let sql = format!(
        "with a as (select run_id from sweeper.runs where status in ('planning', 'running')
                    union
                    select run_id from sweeper.dead_letters
                     where status in ('open', 'redriven') and run_id is not null)
         select {RUN_COLUMNS} from sweeper.run_totals
          where run_id in (select run_id from a) and ($1::text is null or policy = $1)
          order by window_at desc, created_at desc limit $2"
    );
    let runs: Vec<Run> = sqlx::query_as(&sql)
        .bind(policy)
        .bind(limit)
        .fetch_all(pool)
        .await?;
    let ids: Vec<&str> = runs.iter().map(|r| r.run_id.as_str()).collect();
    let mut facts = facts(pool, &ids).await?;
    Ok(runs
        .into_iter()
        .map(|r| {
            let f = facts.remove(&r.run_id).unwrap_or_default();
            (r, f)
        })
        .collect())
}

/// The [`Facts`] of `run_ids`, in one statement.
pub async fn facts(
    pool: &PgPool,
    run_ids: &[&str],
) -> sqlx::Result<std::collections::HashMap<String, Facts>> {
    let sql = format!(
        "select r.run_id,
                coalesce(d.open, 0) as open_dead_letters,
                coalesce(d.redriven, 0) as redriven_dead_letters,
                coalesce(d.abandoned, 0) as abandoned_dead_letters,
                coalesce(d.resolved, 0) as resolved_dead_letters,
                (select dl.reason from sweeper.dead_letters dl
                  where dl.run_id = r.run_id and dl.status = 'open'
                  order by dl.dead_letter_id desc limit 1) as dead_letter_reason,
                (select count(*) from sweeper.commands c
                  where c.run_id = r.run_id and c.state in ('pending', 'leased')
                    and c.attempts > 0 and c.last_error is not null
                    and c.last_error_class is distinct from '{locked}') as retrying_commands,
                (select count(*) from sweeper.commands c
                  where c.run_id = r.run_id and c.state in ('pending', 'leased')
                    and c.last_error_class = '{locked}') as waiting_on_lock_commands,
                rc.last_error as retry_error, rc.last_error_class as retry_class,
                rc.attempts as retry_attempts, rc.next_attempt_at as retry_next_at,
                coalesce(rc.state = 'leased', false) as retry_trying_now,
                coalesce(hc.held_kind, case when not p.done and p.held_kind in {recorded}
                                            then p.held_kind end) as held_kind,
                coalesce(hc.held_reason, case when not p.done and p.held_kind in {recorded}
                                              then p.held_reason end) as held_reason,
                coalesce(case when not p.done then p.failures end, 0) as planning_failures,
                case when not p.done then p.last_error end as planning_error,
                r.approval,
                (select count(*) from sweeper.commands c
                  where c.run_id = r.run_id and c.state in ('pending', 'leased'))
                    as unfinished_commands
           from sweeper.runs r
           left join lateral (
               select count(*) filter (where status = 'open') as open,
                      count(*) filter (where status = 'redriven') as redriven,
                      count(*) filter (where status = 'abandoned') as abandoned,
                      count(*) filter (where status = 'resolved') as resolved
                 from sweeper.dead_letters dl where dl.run_id = r.run_id) d on true
           left join lateral (
               select c.last_error, c.last_error_class, c.attempts, c.next_attempt_at, c.state
                 from sweeper.commands c
                where c.run_id = r.run_id and c.state in ('pending', 'leased')
                  and c.attempts > 0 and c.last_error is not null
                  and c.last_error_class is distinct from '{locked}'
                order by c.next_attempt_at limit 1) rc on true
           left join lateral (
               select c.held_kind, c.held_reason from sweeper.commands c
                where c.run_id = r.run_id and c.held_since is not null
                  and c.state in ('pending', 'leased') and c.held_kind in {recorded}
                order by c.held_since limit 1) hc on true
           left join sweeper.planning_jobs p on p.run_id = r.run_id
          where r.run_id = any($1)",
        recorded = super::recorded_kinds_sql(),
        locked = crate::retry::FailureClass::LOCKED,
    );
    let rows: Vec<Facts> = sqlx::query_as(&sql).bind(run_ids).fetch_all(pool).await?;
    Ok(rows.into_iter().map(|f| (f.run_id.clone(), f)).collect())
}

/// A command that is retrying by itself, as `GET /runs/{id}` lists it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Retrying {
    /// The command.
    pub command_id: String,
    /// `pending` (waiting for its next attempt) or `leased` (being tried now).
    pub state: String,
    /// Attempts spent since it was last queued (a snooze spends none).
    pub attempts: i32,
    /// The last failure's message (SQLSTATE included for a database error).
    pub last_error: Option<String>,
    /// Its class: `transient`, `throttled`, `locked` (waiting on a row lock) or `permanent`.
    pub last_error_class: Option<String>,
    /// When it is tried next (RFC 3339); for a leased command, when this try began to be due.
    pub next_attempt_at: DateTime<Utc>,
    /// It is being tried now (`leased`): attempt `attempts + 1` is running.
    pub trying_now: bool,
    /// Items in it.
    pub items: i32,
}

/// The first `limit` retrying commands of `run_id` (`waiting_on_lock`: instead, those
/// waiting on rows another transaction holds locked), soonest next attempt first.
pub async fn retrying(
    pool: &PgPool,
    run_id: &str,
    limit: i64,
    waiting_on_lock: bool,
) -> sqlx::Result<Vec<Retrying>> {
    sqlx::query_as(&format!(
        "select command_id, state, attempts, last_error, last_error_class, next_attempt_at,
                state = 'leased' as trying_now, cardinality(item_keys) as items
           from sweeper.commands
          where run_id = $1 and state in ('pending', 'leased')
            and case when $3 then last_error_class = '{locked}'
                     else attempts > 0 and last_error is not null
                          and last_error_class is distinct from '{locked}' end
          order by next_attempt_at, batch_no limit $2",
        locked = crate::retry::FailureClass::LOCKED,
    ))
    .bind(run_id)
    .bind(limit)
    .bind(waiting_on_lock)
    .fetch_all(pool)
    .await
}

/// How far a run has got, as `GET /runs/{id}`'s `progress` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    /// 1 once planning is done; while planning, the walk's estimated fraction (set by the
    /// caller from the cursor, `crate::plan::estimate`), or null when it cannot be told.
    pub planned_fraction: Option<f64>,
    /// Items with an outcome over items planned (0-1; 1 when nothing was planned and the run is
    /// done).
    pub executed_fraction: f64,
    /// Items with an outcome so far.
    pub items_done: i64,
    /// Items planned so far.
    pub items_planned: i64,
    /// Commands terminal (succeeded, quarantined, cancelled) of all commands the run has.
    pub commands_done: i64,
    /// All commands the run has (planned and redrive commands).
    pub commands: i64,
    /// Items of commands that finished in the last 60 s (or since the run was created, when
    /// that is less), per second.
    pub items_per_second: f64,
    /// Seconds to finish the planned items at that rate; null when planning is not done or the
    /// rate is 0.
    pub eta_seconds: Option<f64>,
}

/// The run's progress (`run` as loaded; one statement for the last minute's rate).
pub async fn progress(pool: &PgPool, run: &Run) -> sqlx::Result<Progress> {
    // The rate's span: the last 60 s, or less for a run younger than that.
    let (recent, span, commands, commands_done): (i64, f64, i64, i64) = sqlx::query_as(
        "select coalesce(sum(cardinality(item_keys))
                         filter (where finished_at > sweeper.now() - interval '60 seconds'
                                   and state in ('succeeded', 'quarantined')), 0)::bigint,
                extract(epoch from least(interval '60 seconds', sweeper.now() - $2))::float8,
                count(*),
                count(*) filter (where state not in ('pending', 'leased'))
           from sweeper.commands where run_id = $1",
    )
    .bind(&run.run_id)
    .bind(run.created_at)
    .fetch_one(pool)
    .await?;
    let items_done: i64 = super::Outcome::ALL
        .into_iter()
        .map(|o| run.counts.get(o))
        .sum();
    let planned = run.eligible_planned;
    let executed_fraction = if planned > 0 {
        (items_done as f64 / planned as f64).min(1.0)
    } else if run.is_terminal() {
        1.0
    } else {
        0.0
    };
    let rate = if span > 0.0 {
        recent as f64 / span
    } else {
        0.0
    };
    let left = (planned - items_done).max(0) as f64;
    let eta_seconds = (run.planning_done && !run.is_terminal() && rate > 0.0).then(|| left / rate);
    Ok(Progress {
        planned_fraction: run.planning_done.then_some(1.0),
        executed_fraction,
        items_done,
        items_planned: planned,
        commands_done,
        commands,
        items_per_second: rate,
        eta_seconds,
    })
}

/// `(policy, run_id, window, status, completed_at)` of each policy's latest live run (by
/// window), one per policy that has one (runs_by_policy serves it).
pub type LatestRun = (String, String, DateTime<Utc>, String, Option<DateTime<Utc>>);

/// See [`LatestRun`].
pub async fn list_latest_runs(pool: &PgPool) -> sqlx::Result<Vec<LatestRun>> {
    sqlx::query_as(
        "select distinct on (policy) policy, run_id, window_at, status, completed_at
           from sweeper.runs where not dry_run order by policy, window_at desc",
    )
    .fetch_all(pool)
    .await
}
