//! One record's history under one policy (`GET /policies/{policy}/items/{key}`): its audit rows
//! across runs (both shapes of the audit, through `sweeper.audit_trail`: the lean one by
//! `audit_items_by_item_hash`, the first by its `(policy, item_key)` index), its effects and its
//! dead letters, each read through an index on the item key; and which exported audit months
//! were dropped, so an answer can say since when it is complete.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::audit::{AUDIT_ROW, AuditRow};
use super::dead_letter::DeadLetter;

/// The audit rows of item `$2` under policy `$1`, in `sweeper.audit_trail`. The lean audit's item
/// history index holds a 64-bit hash of the key (entries as short for a composite key as for a
/// bigint), so the hash is asked for too; the key itself settles a collision.
const THE_ITEM: &str =
    "policy = $1 and item_key = $2 and hashtextextended(item_key, 0) = hashtextextended($2, 0)";

/// The record's audit rows after `after` (an `audit_id`), oldest first, at most `limit`.
pub async fn audit_rows(
    pool: &PgPool,
    policy: &str,
    item_key: &str,
    after: i64,
    limit: i64,
) -> sqlx::Result<Vec<AuditRow>> {
    sqlx::query_as(&format!(
        "select {AUDIT_ROW}
           from sweeper.audit_trail
          where {THE_ITEM} and audit_id > $3
          order by audit_id limit $4"
    ))
    .bind(policy)
    .bind(item_key)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// An effect of the record (an external call decided for it), as the history shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Effect {
    /// `''` for an effect once per item, else the window it belongs to.
    pub scope: String,
    /// Its number: the idempotency key ends in it (once per item) or names the window.
    pub n: i32,
    /// `calling` (a call may have been made), `called` (it returned) or `closed`.
    pub state: String,
    /// The run and command that decided it.
    pub run_id: String,
    /// The command.
    pub command_id: String,
    /// What the call achieved (set once `called`).
    pub outcome: Option<String>,
    /// When it was opened, called and closed.
    pub started_at: DateTime<Utc>,
    /// When the call returned.
    pub called_at: Option<DateTime<Utc>>,
    /// When it was closed.
    pub closed_at: Option<DateTime<Utc>>,
}

/// The record's effects, open ones first, at most 100.
pub async fn effects(pool: &PgPool, policy: &str, item_key: &str) -> sqlx::Result<Vec<Effect>> {
    sqlx::query_as(
        "select scope, n, state, run_id, command_id, outcome, started_at, called_at, closed_at
           from sweeper.effects where policy = $1 and item_key = $2
          order by state = 'closed', started_at desc limit 100",
    )
    .bind(policy)
    .bind(item_key)
    .fetch_all(pool)
    .await
}

/// The record's item dead letters, newest first, at most 100.
pub async fn dead_letters(
    pool: &PgPool,
    policy: &str,
    item_key: &str,
) -> sqlx::Result<Vec<DeadLetter>> {
    let sql = format!(
        "select {} from sweeper.dead_letters
          where policy = $1 and item_key = $2 and kind = 'item'
          order by dead_letter_id desc limit 100",
        super::dead_letter::COLUMNS
    );
    sqlx::query_as(&sql)
        .bind(policy)
        .bind(item_key)
        .fetch_all(pool)
        .await
}

/// An audit month exported and dropped: its rows are no longer in the ledger.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DroppedExport {
    /// The partition's name.
    pub partition: String,
    /// Its range (`from_at` null for the first).
    pub from_at: Option<DateTime<Utc>>,
    /// Exclusive end.
    pub to_at: DateTime<Utc>,
    /// Rows exported.
    pub rows: i64,
    /// SHA-256 of the export file, hex.
    pub sha256: String,
    /// Where it went.
    pub location: String,
}

/// Every dropped audit month, oldest first.
pub async fn dropped_exports(pool: &PgPool) -> sqlx::Result<Vec<DroppedExport>> {
    sqlx::query_as(
        "select partition, from_at, to_at, rows, sha256, location from sweeper.audit_exports
          where state = 'dropped' order by to_at",
    )
    .fetch_all(pool)
    .await
}

/// A run of the policy that planned after the record's last audit row: it may have counted the
/// record among `held_at_planning` or not yet old enough without writing a row for it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct UnitemizedRun {
    /// The run.
    pub run_id: String,
    /// Its status.
    pub status: String,
    /// What it held at planning, per reason (counts over the whole table, not this record).
    pub held_at_planning: sqlx::types::Json<std::collections::BTreeMap<String, i64>>,
}

/// The live runs of `policy` created after `since` (every one when `None`), newest first, at
/// most `limit`, and how many there are.
pub async fn runs_since(
    pool: &PgPool,
    policy: &str,
    since: Option<DateTime<Utc>>,
    limit: i64,
) -> sqlx::Result<(Vec<UnitemizedRun>, i64)> {
    let runs = sqlx::query_as(
        "select run_id, status, held_at_planning from sweeper.runs
          where policy = $1 and not dry_run and ($2::timestamptz is null or created_at > $2)
          order by window_at desc limit $3",
    )
    .bind(policy)
    .bind(since)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    let total = sqlx::query_scalar(
        "select count(*) from sweeper.runs
          where policy = $1 and not dry_run and ($2::timestamptz is null or created_at > $2)",
    )
    .bind(policy)
    .bind(since)
    .fetch_one(pool)
    .await?;
    Ok((runs, total))
}

/// When the record's last audit row was written, if it has one.
pub async fn last_audited(
    pool: &PgPool,
    policy: &str,
    item_key: &str,
) -> sqlx::Result<Option<DateTime<Utc>>> {
    sqlx::query_scalar(&format!(
        "select max(recorded_at) from sweeper.audit_trail where {THE_ITEM}"
    ))
    .bind(policy)
    .bind(item_key)
    .fetch_one(pool)
    .await
}
