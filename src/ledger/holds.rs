//! Holds the ledger records on planning jobs and commands, read back for a run's `held` object.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// Hold kinds each replica decides from its view of the present (the governor, active hours): a
/// command's or planning job's recorded marker of one tells when the hold reached it, not that it
/// still holds. Readers of the ledger's holds leave these out and take them from
/// [`crate::holds::policy_hold`], so a run's `held` and the gauges describe the present
/// within one governor tick. An SQL list, for `held_kind not in ...`.
pub(crate) const LIVE_HOLD_KINDS: &str = "('governor', 'active_hours')";

/// What holds a run's work, if anything: its oldest recorded hold (planning job or non-terminal
/// command) other than a [`LIVE_HOLD_KINDS`] one, as `{kind, detail, since, held_commands,
/// planning_held, overdue}`; `overdue` when it is older than `alert_after_seconds`.
pub async fn run_hold(
    pool: &PgPool,
    run_id: &str,
    alert_after_seconds: i64,
) -> sqlx::Result<Option<serde_json::Value>> {
    let sql = format!(
        "with h as (
             select held_kind, held_reason, held_since, false as planning
               from sweeper.commands
              where run_id = $1 and held_since is not null and state in ('pending', 'leased')
                and held_kind not in {LIVE_HOLD_KINDS}
             union all
             select held_kind, held_reason, held_since, true
               from sweeper.planning_jobs
              where run_id = $1 and held_since is not null and not done
                and held_kind not in {LIVE_HOLD_KINDS})
         select held_kind, held_reason, held_since,
                (select count(*) from h where not planning),
                (select bool_or(planning) from h),
                held_since < sweeper.now() - make_interval(secs => $2)
           from h order by held_since limit 1"
    );
    let row: Option<(String, String, DateTime<Utc>, i64, bool, bool)> = sqlx::query_as(&sql)
        .bind(run_id)
        .bind(alert_after_seconds as f64)
        .fetch_optional(pool)
        .await?;
    Ok(
        row.map(|(kind, detail, since, commands, planning, overdue)| {
            serde_json::json!({"kind": kind, "detail": detail, "since": since,
                           "held_commands": commands, "planning_held": planning,
                           "overdue": overdue})
        }),
    )
}
