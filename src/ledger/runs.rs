//! Creating runs (docs/design.md §2.1): one run per window, and dry runs that repeat freely.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};

use super::{Run, get_run};

/// A run to create: its id is `{policy}:{window}` (a dry run's gets `:dry-{n}` appended).
#[derive(Debug)]
pub struct NewRun<'a> {
    /// `{policy}:{window}`.
    pub run_id: String,
    /// The policy.
    pub policy: &'a str,
    /// Its version, pinned on the run.
    pub policy_version: &'a str,
    /// The window.
    pub window: DateTime<Utc>,
    /// The cutoff, fixed now.
    pub cutoff: DateTime<Utc>,
    /// Who triggered it.
    pub triggered_by: &'a str,
    /// Whether its policy has a blast-radius guard: a live run then executes nothing before
    /// planning is done and the guard has decided (`approval = 'awaiting_plan'`).
    pub guarded: bool,
}

/// Whether [`create`] made the window's run or found it.
#[derive(Debug)]
pub enum Created {
    /// Created now, with its planning job.
    New(Run),
    /// The window's run already existed (another trigger, now or hours ago).
    Existing(Run),
}

/// Creates the window's run and its planning job in one transaction, or returns the run that
/// exists: any number of triggers for one window, concurrent or not, yield one run.
pub async fn create(pool: &PgPool, new: &NewRun<'_>) -> sqlx::Result<Created> {
    let mut tx = pool.begin().await?;
    let inserted = sqlx::query_scalar::<_, String>(
        "insert into sweeper.runs
             (run_id, policy, policy_version, window_at, cutoff, triggered_by, approval)
         values ($1, $2, $3, $4, $5, $6, case when $7 then 'awaiting_plan' end)
         on conflict do nothing
         returning run_id",
    )
    .bind(&new.run_id)
    .bind(new.policy)
    .bind(new.policy_version)
    .bind(new.window)
    .bind(new.cutoff)
    .bind(new.triggered_by)
    .bind(new.guarded)
    .fetch_optional(&mut *tx)
    .await?;
    if inserted.is_none() {
        // A concurrent trigger won the race; its run is the window's run.
        tx.rollback().await?;
        let mut conn = pool.acquire().await?;
        let run = get_run(&mut conn, &new.run_id)
            .await?
            .ok_or(sqlx::Error::RowNotFound)?;
        return Ok(Created::Existing(run));
    }
    sqlx::query("insert into sweeper.planning_jobs (run_id) values ($1)")
        .bind(&new.run_id)
        .execute(&mut *tx)
        .await?;
    let run = get_run(&mut tx, &new.run_id).await?.expect("inserted");
    tx.commit().await?;
    Ok(Created::New(run))
}

/// Creates a dry run `{run_id}:dry-{n}` (the next n of its window) and its planning job.
/// Concurrent dry runs for one window take turns choosing n (a transaction-scoped advisory lock
/// per policy and window); `None` when three tries all lost the race.
pub async fn create_dry(pool: &PgPool, new: &NewRun<'_>) -> sqlx::Result<Option<Run>> {
    for _ in 0..3 {
        let mut tx = pool.begin().await?;
        sqlx::query("select pg_advisory_xact_lock(hashtext('sweeper:dry-run:' || $1))")
            .bind(&new.run_id)
            .execute(&mut *tx)
            .await?;
        let n: i32 = sqlx::query_scalar(
            "select coalesce(max(dry_run_no), 0) + 1 from sweeper.runs
              where policy = $1 and window_at = $2 and dry_run",
        )
        .bind(new.policy)
        .bind(new.window)
        .fetch_one(&mut *tx)
        .await?;
        let run_id = format!("{}:dry-{n}", new.run_id);
        let inserted = sqlx::query_scalar::<_, String>(
            "insert into sweeper.runs
                 (run_id, policy, policy_version, window_at, cutoff, dry_run, dry_run_no, triggered_by)
             values ($1, $2, $3, $4, $5, true, $6, $7)
             on conflict do nothing
             returning run_id",
        )
        .bind(&run_id)
        .bind(new.policy)
        .bind(new.policy_version)
        .bind(new.window)
        .bind(new.cutoff)
        .bind(n)
        .bind(new.triggered_by)
        .fetch_optional(&mut *tx)
        .await?;
        if inserted.is_none() {
            tx.rollback().await?;
            continue;
        }
        sqlx::query("insert into sweeper.planning_jobs (run_id) values ($1)")
            .bind(&run_id)
            .execute(&mut *tx)
            .await?;
        let run = get_run(&mut tx, &run_id).await?.expect("inserted");
        tx.commit().await?;
        return Ok(Some(run));
    }
    Ok(None)
}

/// A command's terminal state (or a partial result) as its run counts it.
#[derive(Debug)]
pub struct CommandDone<'a> {
    /// The command.
    pub command_id: &'a str,
    /// It was quarantined.
    pub quarantined: bool,
    /// It re-executed one item whose earlier outcome (`failed` or `mismatched`) is superseded.
    pub redriven: Option<super::Outcome>,
    /// Its items' outcomes.
    pub counts: &'a super::Counts,
    /// Count the run's other pending commands up to this many (see [`Recorded`]).
    pub others_cap: i64,
}

/// What a command's result left for its run, as the recording transaction saw it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The run's status (not locked: the run row is not written per command).
    pub status: String,
    /// The run's other commands not yet terminal, counted up to the cap: below it, this command
    /// may be the run's last and [`complete_if_done`] is worth asking after the commit.
    pub others_pending: i64,
}

/// Adds a command's result to its own row (its contribution to the run's counts; the caller's
/// transaction holds the command row's lock) and reads what the run needs to decide next. The
/// run row is not touched: workers of one run do not queue on it (no command writes its run's
/// row, docs/design.md §7; the totals are summed when read, see `sweeper.run_totals`).
pub async fn record_command(
    conn: &mut PgConnection,
    d: &CommandDone<'_>,
) -> sqlx::Result<Recorded> {
    let (status, others_pending) = sqlx::query_as(
        "with c as (
             update sweeper.commands
                set quarantined_commands = quarantined_commands + $2,
                    deleted = deleted + $3, already_absent = already_absent + $4,
                    excluded = excluded + $5, not_eligible = not_eligible + $6,
                    failed = failed + $7 - $9, would_delete = would_delete + $8,
                    reconciled = reconciled + $10, called = called + $12,
                    would_call = would_call + $13, mismatched = mismatched + $14 - $15
              where command_id = $1
          returning run_id)
         select r.status,
                (select count(*) from (select 1 from sweeper.commands o
                                        where o.run_id = r.run_id and o.command_id <> $1
                                          and o.state in ('pending', 'leased')
                                        limit $11) x)
           from sweeper.runs r where r.run_id = (select run_id from c)",
    )
    .bind(d.command_id)
    .bind(d.quarantined as i32)
    .bind(d.counts.deleted)
    .bind(d.counts.already_absent)
    .bind(d.counts.excluded)
    .bind(d.counts.not_eligible)
    .bind(d.counts.failed)
    .bind(d.counts.would_delete)
    .bind((d.redriven == Some(super::Outcome::Failed)) as i64)
    .bind(d.counts.reconciled)
    .bind(d.others_cap)
    .bind(d.counts.called)
    .bind(d.counts.would_call)
    .bind(d.counts.mismatched)
    .bind((d.redriven == Some(super::Outcome::Mismatched)) as i64)
    .fetch_one(conn)
    .await?;
    Ok(Recorded {
        status,
        others_pending,
    })
}

/// Completes `run_id` if planning is done, no command is pending and no partition is still
/// retiring: `completed`, or
/// `completed_with_dead_letters` while a dead letter of the run is open or redriven (an
/// abandoned one no longer counts: the operator decided). Decided once:
/// the UPDATE is guarded by the run's status, so of two concurrent callers one changes it and the
/// other finds it completed. Callers run it after their own commit (a snapshot that sees their
/// command terminal): the last command to commit always sees every other one terminal. Returns
/// the status when this call completed the run, with its timing — None when a redrive reopened
/// it (that completion measures the operator, not the run).
pub async fn complete_if_done(
    conn: &mut PgConnection,
    run_id: &str,
) -> sqlx::Result<Option<(String, Option<Completion>)>> {
    sqlx::query_as(
        "update sweeper.runs r
            set status = case when exists (select 1 from sweeper.dead_letters d
                                            where d.run_id = r.run_id
                                              and d.status in ('open', 'redriven'))
                              then 'completed_with_dead_letters' else 'completed' end,
                completed_at = sweeper.now()
          where r.run_id = $1 and r.status in ('planning', 'running') and r.planning_done
            and not exists (select 1 from sweeper.commands c
                             where c.run_id = r.run_id and c.state in ('pending', 'leased'))
            and not exists (select 1 from sweeper.partition_retirements p
                             where p.run_id = r.run_id
                               and p.state in ('planned', 'detaching', 'detached', 'carved'))
          returning r.status,
                    not exists (select 1 from sweeper.dead_letters d
                                 where d.run_id = r.run_id
                                   and d.status in ('redriven', 'resolved')) as unreopened,
                    r.window_at, r.created_at,
                    extract(epoch from r.completed_at - r.window_at)::float8,
                    extract(epoch from r.completed_at - r.created_at)::float8",
    )
    .bind(run_id)
    .fetch_optional(conn)
    .await
    .map(|row: Option<CompletedRow>| {
        row.map(
            |(status, unreopened, window, created, since_window, since_created)| {
                let timing = unreopened.then_some(Completion {
                    window,
                    created,
                    since_window,
                    since_created,
                });
                (status, timing)
            },
        )
    })
}

/// A completed run's row as [`complete_if_done`] returns it.
type CompletedRow = (String, bool, DateTime<Utc>, DateTime<Utc>, f64, f64);

/// When a run completed, against its window and its creation.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    /// Its window.
    pub window: DateTime<Utc>,
    /// When it was created.
    pub created: DateTime<Utc>,
    /// Seconds from its window to its completion.
    pub since_window: f64,
    /// Seconds from its creation to its completion.
    pub since_created: f64,
}

/// Runs that are done but not completed: planning done, nothing pending, status still
/// `running` — what a crash between a command's commit and [`complete_if_done`] leaves.
pub async fn done_but_open(pool: &PgPool, limit: i64) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "select r.run_id from sweeper.runs r
          where r.status in ('planning', 'running') and r.planning_done
            and not exists (select 1 from sweeper.commands c
                             where c.run_id = r.run_id and c.state in ('pending', 'leased'))
          order by r.created_at limit $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Records the closure check's count: rows still eligible when the run completed, counted up
/// to `cap`.
pub async fn set_remaining_eligible(
    conn: &mut PgConnection,
    run_id: &str,
    remaining: i64,
    cap: i64,
    stricter: Option<(DateTime<Utc>, &str)>,
) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.runs
            set remaining_eligible = $2, remaining_eligible_cap = $3,
                stricter_cutoff = $4, stricter_version = $5
          where run_id = $1",
    )
    .bind(run_id)
    .bind(remaining)
    .bind(cap)
    .bind(stricter.map(|s| s.0))
    .bind(stricter.map(|s| s.1))
    .execute(conn)
    .await?;
    Ok(())
}

/// The stricter cutoff and version a completed run was checked under, if one was recorded
/// (see [`set_remaining_eligible`]).
pub async fn recorded_stricter_cutoff(
    pool: &PgPool,
    run_id: &str,
) -> sqlx::Result<Option<(DateTime<Utc>, String)>> {
    let row: Option<(Option<DateTime<Utc>>, Option<String>)> = sqlx::query_as(
        "select stricter_cutoff, stricter_version from sweeper.runs where run_id = $1",
    )
    .bind(run_id)
    .fetch_optional(pool)
    .await?;
    Ok(row.and_then(|(c, v)| Some((c?, v?))))
}

/// What the blast-radius guard compares a run's planned count with: `(planned, median of the
/// policy's last `history` completed live runs' planned counts (None: no such run), the
/// target's estimated rows (`pg_class.reltuples`; None: unknown))`.
pub async fn guard_inputs(
    conn: &mut PgConnection,
    run_id: &str,
    table: &str,
    history: i64,
) -> sqlx::Result<(i64, Option<f64>, Option<f64>)> {
    sqlx::query_as(
        "select r.eligible_planned,
                (select percentile_cont(0.5) within group (order by h.eligible_planned)
                   from (select eligible_planned from sweeper.runs h
                          where h.policy = r.policy and not h.dry_run and h.run_id <> r.run_id
                            and h.status in ('completed', 'completed_with_dead_letters')
                          order by h.window_at desc limit $3) h),
                (select c.reltuples::float8 from pg_class c where c.oid = to_regclass($2))
           from sweeper.runs r where r.run_id = $1",
    )
    .bind(run_id)
    .bind(table)
    .bind(history)
    .fetch_one(conn)
    .await
}

/// Records the blast-radius guard's verdict on a run whose planning is done: a live run waiting
/// on it becomes `required` (held until approved or cancelled) or `not_required`; a dry run only
/// records what its live run would get (`verdict.would_be_held`).
pub async fn record_guard_verdict(
    conn: &mut PgConnection,
    run_id: &str,
    verdict: &serde_json::Value,
    held: bool,
) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.runs
            set guard_verdict = $2,
                approval = case when approval = 'awaiting_plan'
                                then case when $3 then 'required' else 'not_required' end
                                else approval end,
                approval_changed_at = case when approval = 'awaiting_plan' then sweeper.now()
                                           else approval_changed_at end
          where run_id = $1",
    )
    .bind(run_id)
    .bind(verdict)
    .bind(held)
    .execute(conn)
    .await?;
    Ok(())
}

/// A run's blast-radius guard state, as `GET /runs/{id}` shows it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Approval {
    /// `awaiting_plan`, `required`, `approved`, `not_required`, or NULL (no guard, or a dry run).
    pub approval: Option<String>,
    /// The guard's verdict at the end of planning.
    pub guard_verdict: Option<serde_json::Value>,
    /// When `approval` last changed.
    pub changed_at: Option<DateTime<Utc>>,
    /// Who approved it.
    pub approved_by: Option<String>,
    /// Why.
    pub reason: Option<String>,
    /// When the run was created (a run awaiting its plan is held since then).
    pub created_at: DateTime<Utc>,
}

/// The guard state of `run_id` (which must exist).
pub async fn approval(pool: &sqlx::PgPool, run_id: &str) -> sqlx::Result<Approval> {
    sqlx::query_as(
        "select approval, guard_verdict, approval_changed_at as changed_at, approved_by,
                approval_reason as reason, created_at
           from sweeper.runs where run_id = $1",
    )
    .bind(run_id)
    .fetch_one(pool)
    .await
}

/// How many of `run_id`'s commands are not terminal (pending or leased), and the ledger's clock.
pub async fn unfinished_commands(
    pool: &sqlx::PgPool,
    run_id: &str,
) -> sqlx::Result<(i64, DateTime<Utc>)> {
    sqlx::query_as(
        "select count(*), sweeper.now() from sweeper.commands
          where run_id = $1 and state in ('pending', 'leased')",
    )
    .bind(run_id)
    .fetch_one(pool)
    .await
}

/// The statuses of the runs `run_ids` that exist: run id → status.
pub async fn statuses(
    conn: &mut PgConnection,
    run_ids: &[String],
) -> sqlx::Result<std::collections::HashMap<String, String>> {
    Ok(
        sqlx::query_as("select run_id, status from sweeper.runs where run_id = any($1)")
            .bind(run_ids)
            .fetch_all(conn)
            .await?
            .into_iter()
            .collect(),
    )
}
