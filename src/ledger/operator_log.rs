//! Reading the operator log (who redrove, abandoned, suspended, resumed, cancelled, approved,
//! backfilled or accepted what, and why) for `GET /operator-log`. Entries are written by the
//! acts themselves, in their transactions; this module only reads.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

/// Actions the log holds.
pub const ACTIONS: &[&str] = &[
    "redrive",
    "abandon",
    "suspend",
    "resume",
    "cancel",
    "approve",
    "backfill",
    "accept_identity",
    "supersede",
];

/// One entry.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Entry {
    /// Its id (entries are numbered in the order they were written).
    pub entry_id: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Who: the token's `sub`.
    pub subject: String,
    /// One of [`ACTIONS`].
    pub action: String,
    /// What it acted on: `dead_letter:{id}`, `policy:{name}`, `run:{id}`, ...
    pub target: String,
    /// The reason they gave.
    pub reason: String,
    /// Whether the act changed anything: a second approval of an approved run, a suspend of a
    /// suspended policy, a second accept of the same identity are logged with `false` (the log
    /// keeps every call; this tells the one that acted). Entries written before this field
    /// existed read `true`.
    pub changed: bool,
    /// What the act did (ids queued, effects closed, ...).
    pub detail: sqlx::types::Json<serde_json::Value>,
}

/// Filters of [`list`].
#[derive(Debug, Default)]
pub struct Filter<'a> {
    /// Only this action.
    pub action: Option<&'a str>,
    /// Only this subject.
    pub subject: Option<&'a str>,
    /// Only targets starting with this (`policy:orders`, `dead_letter:`, `run:orders:`).
    pub target_prefix: Option<&'a str>,
    /// Only entries at or after this time.
    pub since: Option<DateTime<Utc>>,
}

/// Entries newest first, before `before` (an `entry_id`), at most `limit`.
pub async fn list(
    pool: &PgPool,
    f: &Filter<'_>,
    before: Option<i64>,
    limit: i64,
) -> sqlx::Result<Vec<Entry>> {
    sqlx::query_as(
        "select entry_id, at, subject, action, target, reason,
                coalesce((detail->>'changed')::boolean, true) as changed, detail
           from sweeper.operator_log
          where ($1::text is null or action = $1) and ($2::text is null or subject = $2)
            and ($3::text is null or starts_with(target, $3))
            and ($4::timestamptz is null or at >= $4)
            and ($5::bigint is null or entry_id < $5)
          order by entry_id desc limit $6",
    )
    .bind(f.action)
    .bind(f.subject)
    .bind(f.target_prefix)
    .bind(f.since)
    .bind(before)
    .bind(limit)
    .fetch_all(pool)
    .await
}
