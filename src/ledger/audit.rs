//! Reading the audit trail (writing happens in the consume transaction, see [`crate::execute`]).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

/// One audit row: self-contained evidence of what happened to one item in one run (DESIGN §2.9).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct AuditRow {
    /// Position in the append-only log; also the pagination cursor.
    pub audit_id: i64,
    /// When the row was written (ledger clock).
    pub recorded_at: DateTime<Utc>,
    /// Policy name.
    pub policy: String,
    /// The run's pinned policy version.
    pub policy_version: String,
    /// The run.
    pub run_id: String,
    /// The run's window.
    #[serde(rename = "window", serialize_with = "ser_window")]
    pub window_at: DateTime<Utc>,
    /// The cutoff the item was judged against.
    pub cutoff: DateTime<Utc>,
    /// The command.
    pub command_id: String,
    /// The item's key, as text.
    pub item_key: String,
    /// `deleted`, `already_absent`, `excluded`, `not_eligible`, `failed` or `would_delete`.
    pub outcome: String,
    /// The exclusion that held the item, or the error that failed it.
    pub reason: Option<String>,
    /// Who executed the command (a token's `sub`, or the built-in queue).
    pub actor: String,
    /// Whether the run was a dry run.
    pub dry_run: bool,
}

fn ser_window<S: serde::Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&crate::window::format(*t))
}

/// Months of audit partitions kept ready after the current one (UTC months, ledger clock).
pub const PARTITION_MONTHS_AHEAD: i32 = 2;

/// Creates the audit's monthly partitions up to [`PARTITION_MONTHS_AHEAD`] months after the
/// current one (`sweeper.ensure_audit_partitions`, migration 20261201000011). Run at every start
/// and every housekeeping round, so an audit row never lacks its month. Returns how many it made.
pub async fn ensure_partitions(pool: &PgPool) -> sqlx::Result<i32> {
    sqlx::query_scalar("select sweeper.ensure_audit_partitions($1)")
        .bind(PARTITION_MONTHS_AHEAD)
        .fetch_one(pool)
        .await
}

/// A page of a run's audit rows in log order, after `after` (exclusive), at most `limit` rows,
/// optionally only one outcome. Keyset pagination on `audit_id`.
pub async fn items_page(
    pool: &PgPool,
    run_id: &str,
    after: i64,
    limit: i64,
    outcome: Option<&str>,
) -> sqlx::Result<Vec<AuditRow>> {
    sqlx::query_as(
        "select audit_id, recorded_at, policy, policy_version, run_id, window_at, cutoff,
                command_id, item_key, outcome, reason, actor, dry_run
           from sweeper.audit
          where run_id = $1 and audit_id > $2 and ($4::text is null or outcome = $4)
          order by audit_id
          limit $3",
    )
    .bind(run_id)
    .bind(after)
    .bind(limit)
    .bind(outcome)
    .fetch_all(pool)
    .await
}
