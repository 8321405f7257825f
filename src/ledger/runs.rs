//! Creating runs (DESIGN §2.1): one run per window, and dry runs that repeat freely.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

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
        "insert into sweeper.runs (run_id, policy, policy_version, window_at, cutoff, triggered_by)
         values ($1, $2, $3, $4, $5, $6)
         on conflict do nothing
         returning run_id",
    )
    .bind(&new.run_id)
    .bind(new.policy)
    .bind(new.policy_version)
    .bind(new.window)
    .bind(new.cutoff)
    .bind(new.triggered_by)
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
