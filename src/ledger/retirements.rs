//! Partition retirements (docs/design.md §14 "Partition sweep"): the partitions a run of a policy
//! with `partitions = "drop"` retires, each moved along `planned → detaching → detached →
//! dropped` — or, with held rows carved out, `planned → carved → dropped` — (through
//! `awaiting_drop` when the policy has a `drop_grace`; or `kept`, `gone`) by one leased step at a
//! time, and the manifests the drops wrote into the audit.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// The states of a retirement under way, as an SQL list: the retirer claims them, and a run
/// with one is not complete.
pub const UNDER_WAY: &str = "('planned', 'detaching', 'detached', 'carved')";

/// A partition planning chose to retire, or to keep with the reason.
#[derive(Debug, Clone)]
pub struct Chosen {
    /// The leaf (schema-qualified, quoted as needed).
    pub partition: String,
    /// Its parent.
    pub parent: String,
    /// Its bound as PostgreSQL printed it.
    pub bound: String,
    /// Its range on the policy's timestamp.
    pub timestamp_from: Option<DateTime<Utc>>,
    /// The end of its range (exclusive).
    pub timestamp_to: DateTime<Utc>,
    /// The rows it held at planning.
    pub rows: i64,
    /// Why it is kept (swept row by row); `None`: it retires.
    pub kept: Option<String>,
    /// The rows it retires with held rows carved out: how many are held (they stay, copied into
    /// a new partition of the same range); `None`: retired whole.
    pub held_rows: Option<i64>,
    /// A carve-out's held rows per reason at planning, added to the run's `held_at_planning`
    /// as the row path counts them.
    pub held: std::collections::BTreeMap<String, i64>,
}

/// Records the partitions `run_id`'s planning chose (in the first page's transaction): each
/// retiring one `planned` (`would_drop` for a dry run), each kept one `kept` with its reason,
/// and the retiring rows (a carve-out's held rows not among them) added to the run's planned
/// count (and, for a dry run, to `would_delete`: nothing executes). A partition another run is retiring now is left to it.
/// Returns the partitions this run retires.
pub async fn record_chosen(
    conn: &mut PgConnection,
    run_id: &str,
    dry_run: bool,
    chosen: &[Chosen],
) -> sqlx::Result<Vec<String>> {
    let mut retiring = Vec::new();
    let mut rows = 0i64;
    let mut held = std::collections::BTreeMap::<String, i64>::new();
    for c in chosen {
        let state = match (&c.kept, dry_run) {
            (Some(_), _) => "kept",
            (None, true) => "would_drop",
            (None, false) => "planned",
        };
        let inserted: Option<String> = sqlx::query_scalar(
            "insert into sweeper.partition_retirements
                 (run_id, partition, parent, bound, timestamp_from, timestamp_to, rows, state,
                  reason, finished_at, held_rows)
             values ($1, $2, $3, $4, $5, $6, $7, $8, $9,
                     case when $8 in ('kept', 'would_drop') then sweeper.now() end, $10)
             on conflict (partition) where state in ('planned', 'detaching', 'detached')
             do nothing
             returning partition",
        )
        .bind(run_id)
        .bind(&c.partition)
        .bind(&c.parent)
        .bind(&c.bound)
        .bind(c.timestamp_from)
        .bind(c.timestamp_to)
        .bind(c.rows)
        .bind(state)
        .bind(&c.kept)
        .bind(c.held_rows)
        .fetch_optional(&mut *conn)
        .await?;
        if c.kept.is_none() {
            // Retiring here, or by the run already retiring it: either way not walked.
            retiring.push(c.partition.clone());
            if inserted.is_some() {
                rows += c.rows;
                for (reason, n) in &c.held {
                    *held.entry(reason.clone()).or_default() += n;
                }
            }
        }
    }
    if !held.is_empty() {
        super::planning::add_held(&mut *conn, run_id, &held).await?;
    }
    if rows > 0 {
        sqlx::query(
            "update sweeper.runs
                set eligible_planned = eligible_planned + $2,
                    would_delete = would_delete + case when dry_run then $2 else 0 end
              where run_id = $1",
        )
        .bind(run_id)
        .bind(rows)
        .execute(&mut *conn)
        .await?;
    }
    Ok(retiring)
}

/// The run whose carve-out of a partition of this name is still under way (`carved`: its old
/// table, renamed, not dropped yet), if any. The unique index that keeps two runs from retiring
/// one partition does not cover `carved` (the name then belongs to the new partition): planning
/// asks here instead, so the new partition is not retired while the old one's drop may still
/// carry rows over into it.
pub async fn carve_under_way(
    conn: &mut PgConnection,
    partition: &str,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "select run_id from sweeper.partition_retirements
          where partition = $1 and state = 'carved' limit 1",
    )
    .bind(partition)
    .fetch_optional(conn)
    .await
}

/// Keeps the retirements of `run_id` not begun (`planned`) when the run stops (`how`:
/// `cancelled`, `superseded`), their rows taken out of its planned count; one whose detach began is
/// left to the retirer, which finishes it, and so is a carve-out whose `CHECK` is on the default
/// partition (kept, it would stay there, refusing the partition's range once the partition is
/// gone). What a stopped run leaves is decided here, for both.
pub async fn keep_not_begun(conn: &mut PgConnection, run_id: &str, how: &str) -> sqlx::Result<()> {
    sqlx::query(
        "with k as (
             update sweeper.partition_retirements
                set state = 'kept',
                    reason = 'the run was ' || $2 || ' before the partition was detached',
                    finished_at = sweeper.now()
              where run_id = $1 and state = 'planned'
                and not (held_rows is not null
                         and exists (select 1 from pg_constraint k
                                      where k.conname = 'sweeper_carve_'
                                            || to_regclass(partition)::oid::bigint::text))
             returning rows)
         update sweeper.runs set eligible_planned = eligible_planned - (select sum(rows) from k)
          where run_id = $1 and exists (select 1 from k)",
    )
    .bind(run_id)
    .bind(how)
    .execute(conn)
    .await?;
    Ok(())
}

/// A retirement the retirer holds, with its run's fixed inputs.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Retirement {
    /// The run.
    pub run_id: String,
    /// The leaf (schema-qualified, quoted as needed).
    pub partition: String,
    /// Its parent at planning.
    pub parent: String,
    /// Its bound as PostgreSQL printed it.
    pub bound: String,
    /// Its range's start on the policy's timestamp.
    pub timestamp_from: Option<DateTime<Utc>>,
    /// Its range's end (exclusive).
    pub timestamp_to: DateTime<Utc>,
    /// Its rows at planning (a carve-out's held rows not among them).
    pub rows: i64,
    /// Where it stands.
    pub state: String,
    /// The rows planning found held: it retires with them carved out; `None`: whole.
    pub held_rows: Option<i64>,
    /// Once carved: the old table's name, detached (the partition's name is the new table's).
    pub detached_as: Option<String>,
    /// Once carved: the item keys of the rows carried over into the new partition.
    pub carried_keys: Option<Vec<String>>,
    /// Once carved: the rows carried over into the new partition, those without a key an item
    /// key names (copied by the swap, not among `carried_keys`) included.
    pub carried_rows: Option<i64>,
    /// Claims so far, this one included.
    pub attempts: i32,
    /// The run's policy.
    pub policy: String,
    /// The run's pinned version.
    pub policy_version: String,
    /// The run's window.
    pub window_at: DateTime<Utc>,
    /// The run's cutoff.
    pub cutoff: DateTime<Utc>,
}

/// Claims the oldest retirement not finished (unleased or its lease expired) of one of
/// `policies`, whose run is planned and released by every hold (`held`: the policies this
/// replica's active hours or governor hold), leasing it to `token` for `lease_seconds`; one
/// `awaiting_drop` only once its grace has passed. A cancel
/// or a supersession turns the run's `planned` retirements `kept` (what has not begun stops, as
/// for commands); one whose detach began is finished whatever the run's status since.
pub async fn claim(
    pool: &PgPool,
    token: Uuid,
    lease_seconds: f64,
    policies: &[String],
    held: &[String],
) -> sqlx::Result<Option<Retirement>> {
    let released = super::holds::released("$4");
    sqlx::query_as(&format!(
        "with c as (
             update sweeper.partition_retirements p
                set lease_token = $1,
                    lease_until = (select sweeper.now()) + make_interval(secs => $2),
                    attempts = attempts + 1
              where (p.run_id, p.partition) = (
                    select x.run_id, x.partition
                      from sweeper.partition_retirements x
                      join sweeper.runs r using (run_id)
                     where (x.state in {UNDER_WAY}
                            or x.state = 'awaiting_drop' and x.drop_after <= (select sweeper.now()))
                       and (x.lease_until is null or x.lease_until < (select sweeper.now()))
                       and r.policy = any($3) and r.planning_done and {released}
                     order by x.created_at
                     limit 1
                     for update of x skip locked)
          returning p.*)
         select c.run_id, c.partition, c.parent, c.bound, c.timestamp_from, c.timestamp_to,
                c.rows, c.state, c.held_rows, c.detached_as, c.carried_keys, c.carried_rows,
                c.attempts,
                r.policy, r.policy_version, r.window_at, r.cutoff
           from c join sweeper.runs r using (run_id)"
    ))
    .bind(token)
    .bind(lease_seconds)
    .bind(policies)
    .bind(held)
    .fetch_optional(pool)
    .await
}

/// Moves a retirement `token` holds, not finished, to `state` (with `reason`); false when the
/// lease was lost or it was finished meanwhile (a cancel keeps what has not begun). The statement
/// reads the row as it was before (one snapshot for the whole statement). A
/// retirement that ends `kept` or `gone` after planning takes its rows back out of the run's
/// planned count (they were not retired by this run).
pub async fn set_state(
    conn: &mut PgConnection,
    r: &Retirement,
    token: Uuid,
    state: &str,
    reason: Option<&str>,
) -> sqlx::Result<bool> {
    let changed: Option<i64> = sqlx::query_scalar(&format!(
        "with old as (
             select state, rows from sweeper.partition_retirements
              where run_id = $1 and partition = $2 and lease_token = $3),
         s as (
             update sweeper.partition_retirements
                set state = $4, reason = coalesce($5, reason),
                    finished_at = case when $4 in ('kept', 'gone', 'dropped') then sweeper.now() end
              where run_id = $1 and partition = $2 and lease_token = $3
                and state in {UNDER_WAY}
             returning 1),
         counted as (
             update sweeper.runs
                set eligible_planned = eligible_planned - (select rows from old)
              where run_id = $1 and $4 in ('kept', 'gone') and exists (select 1 from s)
                and (select state from old) in {UNDER_WAY})
         select count(*) from s",
    ))
    .bind(&r.run_id)
    .bind(&r.partition)
    .bind(token)
    .bind(state)
    .bind(reason)
    .fetch_optional(conn)
    .await?;
    Ok(changed == Some(1))
}

/// Records, in the swap's transaction, that `r`'s held rows were carved out: the old table is
/// detached as `detached_as` and its `carried_rows` rows live on in the new partition: those of
/// `carried_keys`, and those without a key an item key names. False when the lease was lost
/// (the caller rolls the swap back).
pub async fn record_carve(
    tx: &mut PgConnection,
    r: &Retirement,
    token: Uuid,
    detached_as: &str,
    (carried_keys, carried_rows): (&[String], i64),
) -> sqlx::Result<bool> {
    Ok(sqlx::query(
        "update sweeper.partition_retirements
            set state = 'carved', detached_as = $4, carried_rows = $6, carried_keys = $5
          where run_id = $1 and partition = $2 and lease_token = $3 and state = 'planned'",
    )
    .bind(&r.run_id)
    .bind(&r.partition)
    .bind(token)
    .bind(detached_as)
    .bind(carried_keys)
    .bind(carried_rows)
    .execute(tx)
    .await?
    .rows_affected()
        == 1)
}

/// Adds `keys` to a carved retirement's carried rows: rows of the detached table held since the
/// swap, carried over in the drop's transaction. False when the lease was lost.
pub async fn add_carried(
    tx: &mut PgConnection,
    r: &Retirement,
    token: Uuid,
    keys: &[String],
) -> sqlx::Result<bool> {
    Ok(sqlx::query(
        "update sweeper.partition_retirements
            set carried_keys = carried_keys || $4::text[],
                carried_rows = carried_rows + cardinality($4::text[])
          where run_id = $1 and partition = $2 and lease_token = $3 and state = 'carved'",
    )
    .bind(&r.run_id)
    .bind(&r.partition)
    .bind(token)
    .bind(keys)
    .execute(tx)
    .await?
    .rows_affected()
        == 1)
}

/// Where `r` stands now (`None` when its row is gone).
pub async fn state_of(conn: &mut PgConnection, r: &Retirement) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "select state from sweeper.partition_retirements where run_id = $1 and partition = $2",
    )
    .bind(&r.run_id)
    .bind(&r.partition)
    .fetch_optional(conn)
    .await
}

/// Renews the lease `token` holds on a retirement for `lease_seconds` from now; false when it was
/// lost.
pub async fn renew(
    pool: &PgPool,
    r: &Retirement,
    token: Uuid,
    lease_seconds: f64,
) -> sqlx::Result<bool> {
    Ok(sqlx::query(
        "update sweeper.partition_retirements
            set lease_until = (select sweeper.now()) + make_interval(secs => $4)
          where run_id = $1 and partition = $2 and lease_token = $3",
    )
    .bind(&r.run_id)
    .bind(&r.partition)
    .bind(token)
    .bind(lease_seconds)
    .execute(pool)
    .await?
    .rows_affected()
        == 1)
}

/// Records a failed step on the retirement and gives its lease back after `retry_seconds`.
pub async fn record_failure(
    pool: &PgPool,
    r: &Retirement,
    token: Uuid,
    error: &str,
    retry_seconds: f64,
) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.partition_retirements
            set last_error = $4,
                lease_until = (select sweeper.now()) + make_interval(secs => $5)
          where run_id = $1 and partition = $2 and lease_token = $3",
    )
    .bind(&r.run_id)
    .bind(&r.partition)
    .bind(token)
    .bind(error)
    .bind(retry_seconds)
    .execute(pool)
    .await?;
    Ok(())
}

/// What a drop proves: the manifest's fields.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Manifest {
    /// The policy.
    pub policy: String,
    /// The run.
    pub run_id: String,
    /// The partition dropped.
    pub partition: String,
    /// Its parent.
    pub parent: String,
    /// Its bound.
    pub bound: String,
    /// Its range's start on the policy's timestamp.
    pub timestamp_from: Option<DateTime<Utc>>,
    /// Its range's end (exclusive).
    pub timestamp_to: DateTime<Utc>,
    /// The rows it held when dropped.
    pub rows: i64,
    /// Its first item key, bytewise.
    pub first_key: Option<String>,
    /// Its last item key, bytewise.
    pub last_key: Option<String>,
    /// SHA-256 of the item key texts sorted bytewise, each followed by `\n`.
    pub digest: String,
    /// The key export's file.
    pub export_location: String,
    /// The key export's SHA-256.
    pub export_sha256: String,
    /// With held rows carved out: the rows carried over into the new partition of the same
    /// range (live, not in the export), and the name the old table was dropped under.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub carried_rows: Option<i64>,
    /// With held rows carved out: the old table's name once detached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detached_as: Option<String>,
}

/// Records a retirement's evidence in `tx`, which holds the detached table's lock: one
/// execution row and one manifest row in the audit, the rows added to the run's `deleted` (its
/// planned count corrected to what the manifest names: they left the target with the detach),
/// and the retirement `dropped` with its evidence (the caller drops the table in `tx`) or, with
/// a grace of `grace_seconds` > 0, `awaiting_drop` until then. False when the lease was lost
/// (nothing is written; the caller rolls back).
pub async fn record_drop(
    tx: &mut PgConnection,
    r: &Retirement,
    token: Uuid,
    m: &Manifest,
    grace_seconds: i64,
) -> sqlx::Result<bool> {
    let detail = serde_json::to_value(m).expect("a manifest serializes");
    let manifest_id: Option<i64> = sqlx::query_scalar(
        "with mine as (
             select 1 from sweeper.partition_retirements
              where run_id = $1 and partition = $2 and lease_token = $3
                and state in ('detached', 'carved')
              for update),
         ex as (
             insert into sweeper.audit_executions
                 (policy, policy_version, current_version, run_id, window_at, pinned_cutoff,
                  cutoff, command_id, attempt, actor, dry_run, recorded_at)
             select r.policy, r.policy_version, null, r.run_id, r.window_at, r.cutoff, r.cutoff,
                    r.run_id || ':drop:' || $2, $4, 'sweeper', false, (select sweeper.now())
               from sweeper.runs r
              where r.run_id = $1 and exists (select 1 from mine)
             returning execution_id, recorded_at),
         man as (
             insert into sweeper.audit_manifests (execution_id, recorded_at, partition, rows, detail)
             select execution_id, recorded_at, $2, $5, $6 from ex
             returning manifest_id),
         counted as (
             update sweeper.runs
                set deleted = deleted + $5, eligible_planned = eligible_planned + $5 - $7
              where run_id = $1 and exists (select 1 from man))
         update sweeper.partition_retirements
            set state = case when $11 > 0 then 'awaiting_drop' else 'dropped' end,
                rows = $5, manifest_id = (select manifest_id from man),
                export_location = $8, export_sha256 = $9, digest = $10,
                drop_after = case when $11 > 0
                                  then sweeper.now() + make_interval(secs => $11) end,
                relid = to_regclass(coalesce(detached_as, $2))::oid::bigint,
                finished_at = case when $11 > 0 then null else sweeper.now() end,
                lease_until = case when $11 > 0 then null else lease_until end
          where run_id = $1 and partition = $2 and exists (select 1 from man)
          returning manifest_id",
    )
    .bind(&r.run_id)
    .bind(&r.partition)
    .bind(token)
    .bind(r.attempts)
    .bind(m.rows)
    .bind(detail)
    .bind(r.rows)
    .bind(&m.export_location)
    .bind(&m.export_sha256)
    .bind(&m.digest)
    .bind(grace_seconds as f64)
    .fetch_optional(tx)
    .await?;
    Ok(manifest_id.is_some())
}

/// Where an `awaiting_drop` retirement's table stands, read with the catalog as of now.
#[derive(Debug, sqlx::FromRow)]
pub struct GraceTarget {
    /// A table of its name exists.
    pub exists: bool,
    /// It is the table the evidence describes (same oid).
    pub same_table: bool,
    /// It is attached as a partition again.
    pub attached: bool,
    /// A later run retiring a table of its name (it was attached again since): a dry run's
    /// report or a partition a later run kept at planning does not count.
    pub later_run: Option<String>,
}

/// Reads where `r`'s table stands (in `conn`'s transaction; after its lock, the committed state).
pub async fn grace_target(conn: &mut PgConnection, r: &Retirement) -> sqlx::Result<GraceTarget> {
    sqlx::query_as(
        "select c.oid is not null as exists,
                coalesce(c.oid::bigint = p.relid, false) as same_table,
                coalesce(c.relispartition, false) as attached,
                (select q.run_id from sweeper.partition_retirements q
                  where q.partition = p.partition and q.run_id <> p.run_id
                    and p.detached_as is null
                    and q.created_at > p.created_at
                    and q.state in ('planned', 'detaching', 'detached', 'awaiting_drop',
                                    'dropped')
                  order by q.created_at desc limit 1) as later_run
           from sweeper.partition_retirements p
           left join pg_class c on c.oid = to_regclass(coalesce(p.detached_as, p.partition))
          where p.run_id = $1 and p.partition = $2",
    )
    .bind(&r.run_id)
    .bind(&r.partition)
    .fetch_one(conn)
    .await
}

/// Ends a retirement `token` holds in `awaiting_drop`: `dropped` (the caller dropped the table in
/// `conn`'s transaction), or `kept` or `gone` with `reason` (it was attached again, changed or
/// dropped during its grace). Its manifest and the run's counts stand either way: they record
/// the rows that left the target with the detach. False when the lease was lost.
pub async fn end_grace(
    conn: &mut PgConnection,
    r: &Retirement,
    token: Uuid,
    state: &str,
    reason: Option<&str>,
) -> sqlx::Result<bool> {
    Ok(sqlx::query(
        "update sweeper.partition_retirements
            set state = $4, reason = $5, finished_at = sweeper.now()
          where run_id = $1 and partition = $2 and lease_token = $3
            and state = 'awaiting_drop'",
    )
    .bind(&r.run_id)
    .bind(&r.partition)
    .bind(token)
    .bind(state)
    .bind(reason)
    .execute(conn)
    .await?
    .rows_affected()
        == 1)
}

/// A partition a run retires (or keeps), as `GET /runs/{id}` lists it.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct PartitionState {
    /// The leaf.
    pub partition: String,
    /// Its bound.
    pub bound: String,
    /// Its range on the policy's timestamp.
    pub timestamp_from: Option<DateTime<Utc>>,
    /// The end of its range (exclusive).
    pub timestamp_to: DateTime<Utc>,
    /// Rows counted at planning; once dropped, the rows its manifest names.
    pub rows: i64,
    /// `would_drop`, `planned`, `detaching`, `detached`, `awaiting_drop`, `dropped`, `kept` or
    /// `gone`.
    pub state: String,
    /// Why it was kept or gone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The manifest of its drop in the audit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifest_id: Option<i64>,
    /// Its key export.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub export_location: Option<String>,
    /// The export's SHA-256.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub export_sha256: Option<String>,
    /// SHA-256 of its item keys sorted bytewise, each followed by a newline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The rows planning found held in it: it retires with them carved out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_rows: Option<i64>,
    /// Once carved: the rows carried over into the new partition of its range (they stay).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub carried_rows: Option<i64>,
    /// Once carved: the old table's name, detached, until it is dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detached_as: Option<String>,
    /// The last failed step's error, while it is retried.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// With a grace period: when its grace ends (or ended) and it is dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drop_after: Option<DateTime<Utc>>,
    /// When it was dropped, kept or found gone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
}

/// A run's partitions as planning chose them and where each stands, for `GET /runs/{id}`.
pub async fn of_run(pool: &PgPool, run_id: &str) -> sqlx::Result<Vec<PartitionState>> {
    sqlx::query_as(
        "select partition, bound, timestamp_from, timestamp_to, rows, state, reason, manifest_id,
                export_location, export_sha256, digest, held_rows, carried_rows, detached_as,
                last_error, drop_after, finished_at
           from sweeper.partition_retirements
          where run_id = $1
          order by timestamp_to, partition",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
}

/// The manifests of `policy`'s dropped partitions whose range holds `value` (the key's value of
/// the policy's timestamp as its canonical text; read in `zone` for a `timestamp` column): each
/// as the evidence it records, with its execution's run fields. Reads only the policy's
/// manifests (one per retired partition), never the audit's items.
pub async fn manifests_holding(
    pool: &PgPool,
    policy: &str,
    value: &str,
    zone: Option<&str>,
) -> sqlx::Result<Vec<serde_json::Value>> {
    let rows: Vec<ManifestRow> = sqlx::query_as(
        "with k as (select case when $3::text is null then $2::timestamptz
                                else $2::timestamp at time zone $3 end as at)
         select m.detail, m.manifest_id, m.recorded_at, e.window_at, e.cutoff, e.policy_version,
                p.state
           from sweeper.audit_manifests m
           join sweeper.audit_executions e
             on e.execution_id = m.execution_id and e.recorded_at = m.recorded_at
           left join sweeper.partition_retirements p on p.manifest_id = m.manifest_id
          cross join k
          where m.detail ->> 'policy' = $1
            and (m.detail ->> 'timestamp_from' is null
                 or (m.detail ->> 'timestamp_from')::timestamptz <= k.at)
            and k.at < (m.detail ->> 'timestamp_to')::timestamptz
          order by m.manifest_id",
    )
    .bind(policy)
    .bind(value)
    .bind(zone)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(mut detail, manifest_id, recorded_at, window, cutoff, version, state)| {
                let carried = detail["carried_rows"].as_i64().unwrap_or(0) > 0;
                let membership = match state.as_deref() {
                    Some("awaiting_drop") => {
                        "in the range of a partition detached and awaiting its drop (drop_grace); \
                         verify with the export"
                    }
                    Some("kept" | "gone") => {
                        "in the range of a partition detached and recorded, then not dropped by \
                         sweeper (see the run's partitions for why): the row may be live"
                    }
                    _ if carried => {
                        "in the range of a dropped partition whose held rows were carried over \
                         into a new partition of the same range; verify with the export (a \
                         carried row is not in it, and is live)"
                    }
                    _ => "in the range of a dropped partition; verify with the export",
                };
                let fields = serde_json::json!({
                    "manifest_id": manifest_id, "recorded_at": recorded_at,
                    "window": window, "cutoff": cutoff, "policy_version": version,
                    "state": state, "membership": membership,
                });
                if let (Some(d), serde_json::Value::Object(f)) = (detail.as_object_mut(), fields) {
                    d.extend(f);
                }
                detail
            },
        )
        .collect())
}

/// A manifest with its execution's fields, as [`manifests_holding`] reads it.
type ManifestRow = (
    serde_json::Value,
    i64,
    DateTime<Utc>,
    DateTime<Utc>,
    DateTime<Utc>,
    String,
    Option<String>,
);
