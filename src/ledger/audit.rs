//! Reading the audit trail (writing happens in the consume transaction, see [`crate::execute`]).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

/// One audit row: self-contained evidence of what happened to one item in one run (docs/design.md §2.9).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct AuditRow {
    /// Position in the append-only log.
    pub audit_id: i64,
    /// The execution that wrote it (for a row of the audit's first shape, its own id): a run's
    /// items are paged by `(execution_id, audit_id)`.
    #[serde(skip)]
    pub execution_id: i64,
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
    /// The fields of the call's answer the action records (`record`: each pointer and its
    /// value, in the action's order), as written; left out when it records none.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "ser_raw_json"
    )]
    pub recorded: Option<String>,
}

/// Writes JSON text kept by the ledger as the JSON it is (its fields in their order).
pub(crate) fn ser_raw_json<S: serde::Serializer>(
    v: &Option<String>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::Serialize;
    match v
        .as_deref()
        .map(|t| serde_json::value::RawValue::from_string(t.to_string()))
    {
        Some(Ok(raw)) => raw.serialize(s),
        Some(Err(_)) => v.serialize(s),
        None => s.serialize_none(),
    }
}

fn ser_window<S: serde::Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&crate::window::format(*t))
}

/// Bytes of every table of the audit (both shapes, every month still attached: heap, indexes,
/// TOAST): what the evidence costs in the database it shares with the data.
pub async fn size_bytes(conn: &mut sqlx::PgConnection) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "select coalesce(sum(pg_total_relation_size(i.inhrelid)), 0)::bigint
           from pg_inherits i
          where i.inhparent in ('sweeper.audit'::regclass, 'sweeper.audit_executions'::regclass,
                                'sweeper.audit_items'::regclass, 'sweeper.audit_manifests'::regclass)",
    )
    .fetch_one(conn)
    .await
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

/// The columns of an [`AuditRow`], as `sweeper.audit_trail` (the one reader of both shapes of
/// the audit, migration 20261204000022) names them.
pub(crate) const AUDIT_ROW: &str = "audit_id, execution_id, recorded_at, policy, policy_version, \
     run_id, window_at, cutoff, command_id, item_key, outcome, reason, actor, dry_run, \
     recorded::text as recorded";

/// A page of a run's audit rows, execution by execution in the order they were written and each
/// execution's items in order, after `after` (an `(execution_id, audit_id)`, exclusive), at most
/// `limit` rows, optionally only one outcome. The run's next executions are listed through the
/// run indexes of both shapes (a row of the first shape is its own execution), a few at first and
/// twice as many each round, and only their rows are read: unfiltered, a page costs its own rows
/// and at most one round's executions more, wherever it is in the run; filtered on an outcome, it
/// reads as many executions as it takes to find its rows, in a number of rounds that grows with
/// the logarithm of that.
pub async fn items_page(
    pool: &PgPool,
    run_id: &str,
    after: (i64, i64),
    limit: i64,
    outcome: Option<&str>,
) -> sqlx::Result<Vec<AuditRow>> {
    let mut rows: Vec<AuditRow> = Vec::new();
    let mut from = after;
    let mut step = 4i64;
    loop {
        let executions: Vec<i64> = sqlx::query_scalar(
            "(select execution_id from sweeper.audit_executions
               where run_id = $1 and execution_id >= $2 order by execution_id limit $3)
             union all
             (select audit_id from sweeper.audit
               where run_id = $1 and audit_id >= $2 order by audit_id limit $3)
             order by 1 limit $3",
        )
        .bind(run_id)
        .bind(from.0)
        .bind(step)
        .fetch_all(pool)
        .await?;
        let Some(&last) = executions.last() else {
            break;
        };
        let page: Vec<AuditRow> = sqlx::query_as(&format!(
            "select {AUDIT_ROW}
               from sweeper.audit_trail
              where run_id = $1 and execution_id = any($2) and (execution_id, audit_id) > ($3, $4)
                and ($6::text is null or outcome = $6)
              order by execution_id, audit_id
              limit $5"
        ))
        .bind(run_id)
        .bind(&executions)
        .bind(from.0)
        .bind(from.1)
        .bind(limit - rows.len() as i64)
        .bind(outcome)
        .fetch_all(pool)
        .await?;
        rows.extend(page);
        if rows.len() as i64 >= limit || (executions.len() as i64) < step {
            break;
        }
        from = (last + 1, 0);
        step *= 2;
    }
    Ok(rows)
}

/// One monthly partition of the audit: `from_at` (None: unbounded below, the first one) to
/// `to_at` (exclusive), as `sweeper.audit_partitions` records it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Partition {
    /// The table's name in schema `sweeper` (`audit_before`, `audit_YYYY_MM`).
    pub partition: String,
    /// Its lower bound (inclusive), if any.
    pub from_at: Option<DateTime<Utc>>,
    /// Its upper bound (exclusive).
    pub to_at: DateTime<Utc>,
}

impl Partition {
    /// `sweeper."name"` of the month's table under `parent` (`audit`, `audit_executions`,
    /// `audit_items`, `audit_manifests`): `audit_2026_12` is the month whose lean tables are
    /// `audit_items_2026_12`, …, `audit_before` the one of `audit_items_before`, … The name comes
    /// from `sweeper.audit_partitions`, which only `ensure_audit_partitions` writes; quoted anyway.
    fn table(&self, parent: &str) -> String {
        let name = match parent {
            "audit" => self.partition.clone(),
            _ => format!(
                "{parent}_{}",
                self.partition
                    .strip_prefix("audit_")
                    .unwrap_or(&self.partition)
            ),
        };
        format!("sweeper.\"{}\"", name.replace('"', "\"\""))
    }
}

/// The parents of a month's tables: the audit's first shape and the lean one (migration
/// 20261204000022). A month is exported, detached and dropped as a whole.
const PARENTS: [&str; 4] = [
    "audit",
    "audit_executions",
    "audit_items",
    "audit_manifests",
];

/// An expired month's export as the ledger records it (`sweeper.audit_exports`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Export {
    /// The partition.
    pub partition: String,
    /// `exported`, `detach_pending` or `dropped`.
    pub state: String,
    /// Rows written.
    pub rows: i64,
    /// SHA-256 of the file, hex.
    pub sha256: String,
    /// The file's path.
    pub location: String,
}

/// The partitions whose month ended at least `retention_seconds` ago (ledger clock), oldest
/// first, with their export record if one was made.
pub async fn expired_partitions(
    pool: &PgPool,
    retention_seconds: i64,
) -> sqlx::Result<Vec<(Partition, Option<Export>)>> {
    let rows: Vec<(String, Option<DateTime<Utc>>, DateTime<Utc>)> = sqlx::query_as(
        "select partition, from_at, to_at from sweeper.audit_partitions
          where to_at <= (select sweeper.now()) - make_interval(secs => $1)
          order by to_at",
    )
    .bind(retention_seconds as f64)
    .fetch_all(pool)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for (partition, from_at, to_at) in rows {
        let export: Option<Export> = sqlx::query_as(
            "select partition, state, rows, sha256, location from sweeper.audit_exports
              where partition = $1",
        )
        .bind(&partition)
        .fetch_optional(pool)
        .await?;
        out.push((
            Partition {
                partition,
                from_at,
                to_at,
            },
            export,
        ));
    }
    Ok(out)
}

/// Whether the month holds a row of a run that is not terminal (such a month is never
/// dropped: the run may still be read, redriven or completed). Runs that are not terminal are
/// few; each is looked up through the run index of the month's audit and executions.
pub async fn holds_open_runs(pool: &PgPool, p: &Partition) -> sqlx::Result<bool> {
    sqlx::query_scalar(&format!(
        "with open as (select run_id from sweeper.runs where status in ('planning', 'running'))
         select exists (select 1 from {} a where a.run_id = any(array(select run_id from open)))
             or exists (select 1 from {} e where e.run_id = any(array(select run_id from open)))",
        p.table("audit"),
        p.table("audit_executions")
    ))
    .fetch_one(pool)
    .await
}

/// An audit row as an export writes it: the row as the API shows it and what else its
/// execution recorded (none of it for a row of the first shape), so each line is self-contained.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ExportRow {
    /// The row.
    #[serde(flatten)]
    #[sqlx(flatten)]
    pub row: AuditRow,
    /// The execution that wrote it (a first-shape row: its own id).
    pub execution_id: i64,
    /// The try of the command.
    pub attempt: Option<i32>,
    /// The run's own cutoff (`cutoff` is the one the item was judged by).
    pub pinned_cutoff: Option<DateTime<Utc>>,
    /// The current version, when its stricter cutoff applied.
    pub current_version: Option<String>,
}

/// A page of the month's rows of the audit's first shape in `audit_id` order after `after`
/// (keyset on its primary key), at most `limit`.
pub async fn first_shape_page(
    pool: &PgPool,
    p: &Partition,
    after: i64,
    limit: i64,
) -> sqlx::Result<Vec<ExportRow>> {
    sqlx::query_as(&format!(
        "select audit_id, audit_id as execution_id, recorded_at, policy, policy_version, run_id,
                window_at, cutoff, command_id, item_key, outcome, reason, actor, dry_run,
                recorded::text as recorded, null::integer as attempt,
                null::timestamptz as pinned_cutoff, null::text as current_version
           from {} where audit_id > $1 order by audit_id limit $2",
        p.table("audit")
    ))
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// The month's next `n` executions after `after` (an `execution_id`), in order.
pub async fn lean_executions(
    pool: &PgPool,
    p: &Partition,
    after: i64,
    n: i64,
) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar(&format!(
        "select execution_id from {} where execution_id > $1 order by execution_id limit $2",
        p.table("audit_executions")
    ))
    .bind(after)
    .bind(n)
    .fetch_all(pool)
    .await
}

/// The month's item rows of `executions`, each with its execution's fields, in execution order
/// and each execution's items in order (`audit_items_by_execution`, within the month).
pub async fn lean_rows(
    pool: &PgPool,
    p: &Partition,
    executions: &[i64],
) -> sqlx::Result<Vec<ExportRow>> {
    let (e, i) = (p.table("audit_executions"), p.table("audit_items"));
    sqlx::query_as(&format!(
        "select i.audit_id, i.execution_id, i.recorded_at, e.policy, e.policy_version, e.run_id,
                e.window_at, e.cutoff, e.command_id, i.item_key, i.outcome, i.reason, e.actor,
                e.dry_run, i.recorded::text as recorded, e.attempt, e.pinned_cutoff,
                e.current_version
           from {e} e join {i} i on i.execution_id = e.execution_id and i.recorded_at = e.recorded_at
          where e.execution_id = any($1)
          order by i.execution_id, i.audit_id"
    ))
    .bind(executions)
    .fetch_all(pool)
    .await
}

/// The month's manifests (the partition sweep's evidence), each as one JSON object with its
/// execution.
pub async fn manifest_lines(pool: &PgPool, p: &Partition) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(&format!(
        "select jsonb_build_object('manifest', to_jsonb(m), 'execution', to_jsonb(e))::text
           from {} m left join {} e using (execution_id, recorded_at)
          order by m.manifest_id",
        p.table("audit_manifests"),
        p.table("audit_executions")
    ))
    .fetch_all(pool)
    .await
}

/// How many rows the month holds: audit rows of both shapes and manifests (what its export
/// writes, a line each).
pub async fn partition_rows(pool: &PgPool, p: &Partition) -> sqlx::Result<i64> {
    sqlx::query_scalar(&format!(
        "select (select count(*) from {}) + (select count(*) from {}) + (select count(*) from {})",
        p.table("audit"),
        p.table("audit_items"),
        p.table("audit_manifests")
    ))
    .fetch_one(pool)
    .await
}

/// Records the verified export of `p`.
pub async fn record_export(
    pool: &PgPool,
    p: &Partition,
    rows: i64,
    sha256: &str,
    location: &str,
) -> sqlx::Result<()> {
    sqlx::query(
        "insert into sweeper.audit_exports (partition, from_at, to_at, state, rows, sha256, location)
         values ($1, $2, $3, 'exported', $4, $5, $6)",
    )
    .bind(&p.partition)
    .bind(p.from_at)
    .bind(p.to_at)
    .bind(rows)
    .bind(sha256)
    .bind(location)
    .execute(pool)
    .await?;
    Ok(())
}

/// Detaches the month's tables from their parents. A role that owns the audit's tables uses
/// `DETACH PARTITION … CONCURRENTLY` (audit writes and reads go on; it cannot run in a
/// transaction block, so each runs on its own). The record says `detach_pending` first: a crash
/// in the middle leaves PostgreSQL's own "detach pending" state, which the next pass finishes
/// with `FINALIZE`. A table already detached (or never made) is skipped. A runtime role that does
/// not own them (deploy/roles.sql) calls `sweeper.detach_audit_month`, which runs as their owner
/// and detaches without CONCURRENTLY (a function runs in a transaction): a moment of ACCESS
/// EXCLUSIVE on each parent, waiting at most its lock_timeout (migration 20261205000025).
pub async fn detach(pool: &PgPool, p: &Partition) -> sqlx::Result<()> {
    sqlx::query("update sweeper.audit_exports set state = 'detach_pending' where partition = $1")
        .bind(&p.partition)
        .execute(pool)
        .await?;
    if !owns_audit(pool).await? {
        sqlx::query("select sweeper.detach_audit_month($1)")
            .bind(&p.partition)
            .execute(pool)
            .await?;
        return Ok(());
    }
    for parent in PARENTS {
        let pending: Option<bool> = sqlx::query_scalar(
            "select i.inhdetachpending from pg_inherits i
              where i.inhparent = to_regclass($1) and i.inhrelid = to_regclass($2)",
        )
        .bind(format!("sweeper.{parent}"))
        .bind(p.table(parent))
        .fetch_optional(pool)
        .await?;
        let how = match pending {
            None => continue,
            Some(true) => "finalize",
            Some(false) => "concurrently",
        };
        sqlx::query(&format!(
            "alter table sweeper.{parent} detach partition {} {how}",
            p.table(parent)
        ))
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// Whether the connecting role may alter the audit's tables (it owns them, or is a member of
/// their owner), or goes through the owner's functions.
async fn owns_audit(pool: &PgPool) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "select pg_has_role(c.relowner, 'USAGE') from pg_class c where c.oid = 'sweeper.audit'::regclass",
    )
    .fetch_one(pool)
    .await
}

/// Drops the month's detached tables and records the month dropped, in one transaction: itself
/// when the role owns the audit (as [`detach`] does), through `sweeper.drop_audit_month` when not.
pub async fn drop_partition(pool: &PgPool, p: &Partition) -> sqlx::Result<()> {
    let owner = owns_audit(pool).await?;
    let mut tx = pool.begin().await?;
    if owner {
        // A role that owns the audit (every deployment before deploy/roles.sql) drops them
        // itself: the owner's functions are for a runtime role that does not.
        for parent in PARENTS {
            sqlx::query(&format!("drop table if exists {}", p.table(parent)))
                .execute(&mut *tx)
                .await?;
        }
    } else {
        // As the tables' owner (migration 20261205000025): the runtime role need not own them.
        sqlx::query("select sweeper.drop_audit_month($1)")
            .bind(&p.partition)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query("delete from sweeper.audit_partitions where partition = $1")
        .bind(&p.partition)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "update sweeper.audit_exports set state = 'dropped', dropped_at = sweeper.now()
          where partition = $1",
    )
    .bind(&p.partition)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}
