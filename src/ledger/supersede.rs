//! Superseding a run (docs/design.md §14): which runs a later completed window of their policy
//! covers, and the one transaction that supersedes one. `execute::supersede` decides which of
//! them a stage holds.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

/// An SQL condition over the run aliased `r`: no item of it executed (every outcome count zero)
/// and no effect of it was opened (no call was started).
fn executed_nothing(r: &str) -> String {
    format!(
        "{r}.deleted + {r}.already_absent + {r}.excluded + {r}.not_eligible + {r}.failed
            + {r}.reconciled + {r}.called + {r}.mismatched = 0
         and not exists (select 1 from sweeper.effects f where f.run_id = {r}.run_id)
         and not exists (select 1 from sweeper.partition_retirements p
                          where p.run_id = {r}.run_id
                            and p.state in ('detaching', 'detached', 'carved', 'awaiting_drop',
                                            'dropped'))"
    )
}

/// A run that may be superseded: not terminal, no item of it executed (every count zero, no
/// effect opened), and a later window of its policy has a `completed` run.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Supersedable {
    /// The run.
    pub run_id: String,
    /// Its policy.
    pub policy: String,
    /// Its window.
    pub window_at: DateTime<Utc>,
    /// The later completed run whose window covers it.
    pub by_run: String,
}

/// Runs of [`Supersedable`]'s kind: those `completed_run` (just completed) covers, or, when it is
/// `None`, any run a later completed run of its policy covers (housekeeping), at most `limit`.
pub async fn supersedable(
    conn: &mut PgConnection,
    completed_run: Option<&str>,
    limit: i64,
) -> sqlx::Result<Vec<Supersedable>> {
    let sql = format!(
        "select e.run_id, e.policy, e.window_at, l.run_id as by_run
           from sweeper.runs e
           join lateral (select l.run_id from sweeper.runs l
                          where l.policy = e.policy and not l.dry_run and l.status = 'completed'
                            and l.window_at > e.window_at
                            and ($1::text is null or l.run_id = $1)
                          order by l.window_at desc limit 1) l on true
          where not e.dry_run and e.status in ('planning', 'running') and {}
          order by e.window_at limit $2",
        executed_nothing("e")
    );
    sqlx::query_as(&sql)
        .bind(completed_run)
        .bind(limit)
        .fetch_all(conn)
        .await
}

/// Supersedes `run`: its planning stops, its commands not yet terminal are cancelled (so a
/// replica that reads `superseded` as unknown finds nothing to execute), and it becomes
/// `superseded` with `reason`, logged in the operator log as the act of `sweeper`. Done in a
/// savepoint of `tx`, and only if it still executed nothing once its commands are locked (the
/// lock order of cancel: planning job, commands, run); `false` when it did, and nothing changed.
pub async fn supersede(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    run: &Supersedable,
    reason: &str,
) -> sqlx::Result<bool> {
    let mut sp = sqlx::Connection::begin(&mut **tx).await?;
    sqlx::query(
        "update sweeper.planning_jobs set done = true, lease_until = null where run_id = $1",
    )
    .bind(&run.run_id)
    .execute(&mut *sp)
    .await?;
    sqlx::query("delete from sweeper.seen_keys where run_id = $1")
        .bind(&run.run_id)
        .execute(&mut *sp)
        .await?;
    let cancelled = sqlx::query(
        "update sweeper.commands
            set state = 'cancelled', finished_at = sweeper.now(), lease_until = null,
                lease_owner = null
          where run_id = $1 and state in ('pending', 'leased')",
    )
    .bind(&run.run_id)
    .execute(&mut *sp)
    .await?
    .rows_affected();
    let sql = format!(
        "update sweeper.runs r set status = 'superseded', completed_at = sweeper.now()
          where r.run_id = $1 and r.status in ('planning', 'running') and {}",
        executed_nothing("r")
    );
    let done = sqlx::query(&sql)
        .bind(&run.run_id)
        .execute(&mut *sp)
        .await?
        .rows_affected()
        == 1;
    if !done {
        sp.rollback().await?;
        return Ok(false);
    }
    // Its partitions not detached are not retired by it (the later run's planning met them).
    super::retirements::keep_not_begun(&mut sp, &run.run_id, "superseded").await?;
    super::dead_letter::log_operator_act(
        &mut sp,
        "sweeper",
        "supersede",
        &format!("run:{}", run.run_id),
        reason,
        true,
        serde_json::json!({ "superseded_by": run.by_run, "commands_cancelled": cancelled }),
    )
    .await?;
    sp.commit().await?;
    Ok(true)
}
