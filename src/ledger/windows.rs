//! What the ledger knows about a policy's windows (`GET /policies/{policy}/windows`): when the
//! policy was first registered, its runs in a range, when it was suspended and resumed, and
//! its latest completed run. Three statements, whatever the range; the walk over the schedule's
//! ticks is [`crate::windows`]'.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// A policy's run as the window listing shows it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct WindowRun {
    /// The window (`runs.window_at`).
    pub window_at: DateTime<Utc>,
    /// `{policy}:{window}`.
    pub run_id: String,
    /// Its status (`RunStatus` as text).
    pub status: String,
    /// Its cutoff.
    pub cutoff: DateTime<Utc>,
}

/// Where a policy's windows begin and end, as the ledger knows it.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// The ledger's clock (`sweeper.now()`).
    pub now: DateTime<Utc>,
    /// When any version of the policy was first registered; `None` if never.
    pub first_registered: Option<DateTime<Utc>>,
    /// The earliest window any live run of the policy has (a backfill can precede the first
    /// registration).
    pub first_run: Option<DateTime<Utc>>,
    /// The latest window whose live run is `completed`.
    pub latest_completed: Option<DateTime<Utc>>,
}

/// Reads the [`Bounds`] of `policy`'s windows (one statement).
pub async fn bounds(pool: &PgPool, policy: &str) -> sqlx::Result<Bounds> {
    let (now, first_registered, first_run, latest_completed) = sqlx::query_as(
        "select sweeper.now(),
                (select min(registered_at) from sweeper.policy_versions where policy = $1),
                (select min(window_at) from sweeper.runs where policy = $1 and not dry_run),
                (select max(window_at) from sweeper.runs
                  where policy = $1 and not dry_run and status = 'completed')",
    )
    .bind(policy)
    .fetch_one(pool)
    .await?;
    Ok(Bounds {
        now,
        first_registered,
        first_run,
        latest_completed,
    })
}

/// Live runs of `policy` with windows in `[from, to]`, in window order, and the policy's
/// suspends and resumes, in order: (when, `true` for a suspend). Two statements.
pub async fn runs_and_suspensions(
    pool: &PgPool,
    policy: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> sqlx::Result<(Vec<WindowRun>, Vec<(DateTime<Utc>, bool)>)> {
    let runs: Vec<WindowRun> = sqlx::query_as(
        "select window_at, run_id, status, cutoff from sweeper.runs
          where policy = $1 and not dry_run and window_at between $2 and $3
          order by window_at",
    )
    .bind(policy)
    .bind(from)
    .bind(to)
    .fetch_all(pool)
    .await?;
    let suspensions: Vec<(DateTime<Utc>, bool)> = sqlx::query_as(
        "select at, action = 'suspend' from sweeper.operator_log
          where target = 'policy:' || $1 and action in ('suspend', 'resume')
          order by at, entry_id",
    )
    .bind(policy)
    .fetch_all(pool)
    .await?;
    Ok((runs, suspensions))
}

/// Records a backfill in the operator log before its runs are created: who asked, why, and the
/// windows it will create.
pub async fn log_backfill(
    pool: &PgPool,
    policy: &str,
    subject: &str,
    reason: &str,
    windows: &[String],
) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
    super::dead_letter::log_operator_act(
        &mut tx,
        subject,
        "backfill",
        &format!("policy:{policy}"),
        reason,
        !windows.is_empty(),
        serde_json::json!({ "windows": windows }),
    )
    .await?;
    tx.commit().await
}
