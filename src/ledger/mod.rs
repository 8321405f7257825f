//! The run ledger: policy versions, runs and command states (docs/design.md §7).

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::{PgConnection, PgPool};

pub mod attention;
pub mod audit;
pub mod commands;
pub mod control;
pub mod dead_letter;
pub mod effects;
pub mod holds;
pub mod identity;
pub mod item_history;
pub mod migrations;
pub mod operator_log;
pub mod outbox;
pub mod outcome;

pub use outcome::{Counts, Outcome};
pub mod pauses;
pub mod planning;
pub mod queue;
pub mod retirements;
pub mod runs;
pub mod states;
pub mod supersede;
pub mod windows;

pub use holds::{HoldKind, first_hold, run_hold};
pub(crate) use holds::{recorded_kinds_sql, released};
pub use states::{Approval, CommandState, RunStatus};

/// The ledger's migrations, embedded in the binary (`migrations/`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The migrator a replica applies at start or with `sweeper migrate`: this binary's migrations,
/// ignoring any the database holds that the binary does not know. During a rolling upgrade a
/// newer replica may have migrated already; every migration is additive, so an older replica
/// keeps working against the newer schema instead of refusing to start.
pub fn migrator() -> sqlx::migrate::Migrator {
    let mut m = sqlx::migrate!("./migrations");
    m.set_ignore_missing(true);
    m
}

/// Registers each policy's version as this replica starts. The current version of a policy is
/// the newest registration by any replica (docs/design.md §2.10): a new version, or an old one
/// registered again after a revert.
///
/// `versions` are `(policy, version, spec)`; the spec is stored as JSON (the ledger does not
/// interpret it: [`crate::policy`] does).
pub async fn register_policy_versions<'a, S: Serialize + 'a>(
    pool: &PgPool,
    versions: impl IntoIterator<Item = (&'a str, &'a str, &'a S)>,
) -> sqlx::Result<()> {
    for (policy, version, spec) in versions {
        // A version registered again while another is current (a configuration change was
        // reverted) becomes current again: the newest registration wins.
        sqlx::query(
            "insert into sweeper.policy_versions (policy, version, spec, registered_at)
             values ($1, $2, $3, sweeper.now())
             on conflict (policy, version) do update
                set seq = nextval(pg_get_serial_sequence('sweeper.policy_versions', 'seq')),
                    registered_at = sweeper.now()
              where sweeper.policy_versions.seq
                    < (select max(seq) from sweeper.policy_versions where policy = $1)",
        )
        .bind(policy)
        .bind(version)
        .bind(sqlx::types::Json(spec))
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// The newest registered version of every policy: policy → version.
pub async fn current_versions(pool: &PgPool) -> sqlx::Result<HashMap<String, String>> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "select distinct on (policy) policy, version from sweeper.policy_versions
          order by policy, seq desc",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// The ledger's clock: `sweeper.now()` (the database clock; tests shift it by an offset).
pub async fn now(conn: &mut PgConnection) -> sqlx::Result<DateTime<Utc>> {
    sqlx::query_scalar("select sweeper.now()")
        .fetch_one(conn)
        .await
}

/// A run as stored, and as `GET /runs/{run_id}` shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Run {
    /// `{policy}:{window}` or `{policy}:{window}:dry-{n}`.
    pub run_id: String,
    /// Policy name.
    pub policy: String,
    /// The pinned policy version.
    pub policy_version: String,
    /// The window, an RFC 3339 UTC instant.
    #[serde(rename = "window", serialize_with = "ser_window")]
    pub window_at: DateTime<Utc>,
    /// Items are eligible when their timestamp is strictly before this.
    pub cutoff: DateTime<Utc>,
    /// Whether this is a dry run.
    pub dry_run: bool,
    /// `planning`, `running`, `completed`, `completed_with_dead_letters` or `cancelled`.
    pub status: String,
    /// Whether every command of the run has been planned.
    pub planning_done: bool,
    /// Commands not yet terminal.
    pub pending_commands: i32,
    /// Commands planned, plus one per item dead letter redriven (its one-item command).
    pub commands_total: i32,
    /// Commands quarantined.
    pub quarantined_commands: i32,
    /// Items put into commands by planning.
    pub eligible_planned: i64,
    /// Rows older than the cutoff held by an exclusion at planning time, per reason.
    pub held_at_planning: sqlx::types::Json<BTreeMap<String, i64>>,
    /// Item outcomes so far, one counter per [`Outcome`] (`deleted`, `already_absent`, ...),
    /// flattened into the run's JSON.
    #[sqlx(flatten)]
    #[serde(flatten)]
    pub counts: outcome::Counts,
    /// Closure check: rows still eligible when the run completed (expected 0), counted up to
    /// `remaining_eligible_cap`. Null until the run completes.
    pub remaining_eligible: Option<i64>,
    /// The cap of that count.
    pub remaining_eligible_cap: Option<i64>,
    /// The `sub` of the token that created the run.
    pub triggered_by: String,
    /// When the run was created.
    pub created_at: DateTime<Utc>,
    /// When planning finished.
    pub planned_at: Option<DateTime<Utc>>,
    /// When the last command finished.
    pub completed_at: Option<DateTime<Utc>>,
}

fn ser_window<S: serde::Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&crate::window::format(*t))
}

impl Run {
    /// Whether no more work will happen for the run.
    pub fn is_terminal(&self) -> bool {
        is_terminal_run_status(&self.status)
    }
}

/// Whether a run status is final. A status this release does not know (a later release's) is
/// final too: a replica never executes or completes a run it cannot read.
pub fn is_terminal_run_status(status: &str) -> bool {
    RunStatus::parse(status).is_none_or(RunStatus::is_terminal)
}

const RUN_COLUMNS: &str = "run_id, policy, policy_version, window_at, cutoff, dry_run, status,
    planning_done, pending_commands, commands_total, quarantined_commands, eligible_planned,
    held_at_planning, deleted, already_absent, excluded, not_eligible, failed, would_delete,
    reconciled, called, would_call, mismatched, remaining_eligible, remaining_eligible_cap,
    triggered_by, created_at, planned_at, completed_at";

/// Loads one run.
pub async fn get_run(conn: &mut PgConnection, run_id: &str) -> sqlx::Result<Option<Run>> {
    let sql = format!("select {RUN_COLUMNS} from sweeper.run_totals where run_id = $1");
    sqlx::query_as(&sql).bind(run_id).fetch_optional(conn).await
}

/// Lists runs, newest window first, optionally filtered; at most `limit`.
pub async fn list_runs(
    pool: &PgPool,
    policy: Option<&str>,
    status: Option<&str>,
    limit: i64,
) -> sqlx::Result<Vec<Run>> {
    let sql = format!(
        "select {RUN_COLUMNS} from sweeper.run_totals
          where ($1::text is null or policy = $1) and ($2::text is null or status = $2)
          order by window_at desc, created_at desc limit $3"
    );
    sqlx::query_as(&sql)
        .bind(policy)
        .bind(status)
        .bind(limit)
        .fetch_all(pool)
        .await
}

/// Deletes the reservations of paces and global dependency rate limits older than a minute
/// (they only ever mattered for the second they were in). Returns how many.
pub async fn purge_pace_slots(pool: &PgPool) -> sqlx::Result<u64> {
    Ok(sqlx::query_scalar::<_, i64>(
        "with p as (delete from sweeper.pace_slots
                     where slot < sweeper.now() - interval '1 minute' returning 1),
              d as (delete from sweeper.dependency_call_slots
                     where slot < sweeper.now() - interval '1 minute' returning 1)
         select (select count(*) from p) + (select count(*) from d)",
    )
    .fetch_one(pool)
    .await? as u64)
}

/// (command_id, state, attempts, last_error, last_error_class) of a stopped command.
pub type StoppedCommand = (String, String, i32, Option<String>, Option<String>);

/// The first 100 stopped (quarantined or cancelled) commands of a run, in batch order.
pub async fn stopped_commands(pool: &PgPool, run_id: &str) -> sqlx::Result<Vec<StoppedCommand>> {
    sqlx::query_as(
        "select command_id, state, attempts, last_error, last_error_class from sweeper.commands
          where run_id = $1 and state in ('quarantined', 'cancelled')
          order by batch_no limit 100",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
}

/// The state of `command_id` if it is terminal (succeeded, quarantined, cancelled): one indexed
/// read, no lock, for answering a duplicate delivery at once.
pub async fn terminal_state(pool: &PgPool, command_id: &str) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "select state from sweeper.commands where command_id = $1
           and state in ('succeeded', 'quarantined', 'cancelled')",
    )
    .bind(command_id)
    .fetch_optional(pool)
    .await
}

/// How many commands of `policy` other than `command_id` are leased for their external calls
/// and calling now (a live lease).
pub async fn calling_commands(
    conn: &mut sqlx::PgConnection,
    policy: &str,
    command_id: &str,
) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "select count(*) from sweeper.commands c join sweeper.runs r using (run_id)
          where r.policy = $2 and c.command_id <> $1 and c.state = 'leased'
            and c.calling_since is not null and c.lease_until > sweeper.now()",
    )
    .bind(command_id)
    .bind(policy)
    .fetch_one(conn)
    .await
}

/// Commands of a run per state (`pending`, `leased`, `succeeded`, `quarantined`, `cancelled`).
pub async fn command_states(pool: &PgPool, run_id: &str) -> sqlx::Result<BTreeMap<String, i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "select state, count(*) from sweeper.commands where run_id = $1 group by state",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?;
    let mut out: BTreeMap<String, i64> = CommandState::ALL
        .into_iter()
        .map(|s| (s.as_str().to_string(), 0))
        .collect();
    out.extend(rows);
    Ok(out)
}

/// The pinned spec of a run, the policy's current version, and its spec if it differs, from the
/// ledger (`S` is the spec type the policy layer stored).
pub async fn run_specs<S: DeserializeOwned + Send + Unpin + 'static>(
    conn: &mut PgConnection,
    policy: &str,
    pinned_version: &str,
) -> sqlx::Result<(S, String, Option<S>)> {
    let (pinned, current_version, current): (sqlx::types::Json<S>, String, sqlx::types::Json<S>) =
        sqlx::query_as(
            "select pv.spec, cur.version, cur.spec
           from sweeper.policy_versions pv,
                lateral (select version, spec from sweeper.policy_versions
                          where policy = $1 order by seq desc limit 1) cur
          where pv.policy = $1 and pv.version = $2",
        )
        .bind(policy)
        .bind(pinned_version)
        .fetch_one(conn)
        .await?;
    let current = (current_version != pinned_version).then_some(current.0);
    Ok((pinned.0, current_version, current))
}

/// Purges terminal commands that finished more than `retention_seconds` ago and have no live dead
/// letter, with their attempts, at most `batch` per call (docs/design.md §7); their contributions to
/// their runs' counts are settled into the run rows. Runs, audit, dead letters and the operator
/// log are never purged. Returns how many commands were purged.
pub async fn purge_terminal_commands(
    pool: &PgPool,
    retention_seconds: i64,
    batch: i64,
) -> sqlx::Result<u64> {
    let mut tx = pool.begin().await?;
    let ids: Vec<String> = sqlx::query_scalar(
        "select c.command_id from sweeper.commands c
          where c.state in ('succeeded', 'quarantined', 'cancelled')
            and c.finished_at < (select sweeper.now()) - make_interval(secs => $1)
            and not exists (select 1 from sweeper.dead_letters d
                             where d.status in ('open', 'redriven')
                               and (d.command_id = c.command_id or d.dead_letter_id = c.redrive_of))
          order by c.finished_at
          limit $2
          for update skip locked",
    )
    .bind(retention_seconds as f64)
    .bind(batch)
    .fetch_all(&mut *tx)
    .await?;
    if ids.is_empty() {
        return Ok(0);
    }
    sqlx::query("delete from sweeper.attempts where command_id = any($1)")
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
    // A purged command's contribution to its run's counts is settled into the run row.
    let n: i64 = sqlx::query_scalar(
        "with d as (delete from sweeper.commands where command_id = any($1)
                    returning run_id, quarantined_commands, deleted, already_absent, excluded,
                              not_eligible, failed, would_delete, reconciled, called,
                              would_call, mismatched),
              s as (select run_id, count(*) as n, sum(quarantined_commands) as q,
                           sum(deleted) as de, sum(already_absent) as aa, sum(excluded) as ex,
                           sum(not_eligible) as ne, sum(failed) as fa, sum(would_delete) as wd,
                           sum(reconciled) as re, sum(called) as ca, sum(would_call) as wc,
                           sum(mismatched) as mi
                      from d group by run_id),
              u as (update sweeper.runs r
                       set quarantined_commands = r.quarantined_commands + s.q,
                           deleted = r.deleted + s.de, already_absent = r.already_absent + s.aa,
                           excluded = r.excluded + s.ex, not_eligible = r.not_eligible + s.ne,
                           failed = r.failed + s.fa, would_delete = r.would_delete + s.wd,
                           reconciled = r.reconciled + s.re, called = r.called + s.ca,
                           would_call = r.would_call + s.wc, mismatched = r.mismatched + s.mi
                      from s where r.run_id = s.run_id)
         select coalesce(sum(n), 0)::int8 from s",
    )
    .bind(&ids)
    .fetch_one(&mut *tx)
    .await?;
    let n = n as u64;
    tx.commit().await?;
    Ok(n)
}

/// A per-process cache of policy specs (of type `S`) by (policy, version). Versions are
/// immutable rows, so a cached spec is never stale; only "which version is current" must be
/// read from the ledger.
#[derive(Debug)]
pub struct SpecCache<S> {
    specs: std::sync::Mutex<HashMap<(String, String), std::sync::Arc<S>>>,
}

impl<S> Default for SpecCache<S> {
    fn default() -> Self {
        Self {
            specs: Default::default(),
        }
    }
}

impl<S: DeserializeOwned + Send + Unpin + 'static> SpecCache<S> {
    /// The spec of `policy` at `version`.
    pub async fn get(
        &self,
        conn: &mut PgConnection,
        policy: &str,
        version: &str,
    ) -> sqlx::Result<std::sync::Arc<S>> {
        let key = (policy.to_string(), version.to_string());
        if let Some(s) = self.specs.lock().expect("spec cache").get(&key) {
            return Ok(s.clone());
        }
        let spec: sqlx::types::Json<S> = sqlx::query_scalar(
            "select spec from sweeper.policy_versions where policy = $1 and version = $2",
        )
        .bind(policy)
        .bind(version)
        .fetch_one(conn)
        .await?;
        let spec = std::sync::Arc::new(spec.0);
        self.specs
            .lock()
            .expect("spec cache")
            .insert(key, spec.clone());
        Ok(spec)
    }
}

/// Takes or renews the lease on background job `job` for `owner` for `seconds`. Returns whether
/// `owner` holds it now: it did already, or the lease was free or expired. One statement, so two
/// replicas cannot both win.
pub async fn take_job_lease(
    pool: &PgPool,
    job: &str,
    owner: uuid::Uuid,
    seconds: f64,
) -> sqlx::Result<bool> {
    let held: Option<bool> = sqlx::query_scalar(
        "insert into sweeper.job_leases as l (job, lease_owner, lease_until)
         values ($1, $2, sweeper.now() + make_interval(secs => $3))
         on conflict (job) do update
            set lease_until = excluded.lease_until, lease_owner = excluded.lease_owner,
                taken_at = case when l.lease_owner = excluded.lease_owner then l.taken_at
                                 else sweeper.now() end
          where l.lease_owner = excluded.lease_owner or l.lease_until < sweeper.now()
         returning true",
    )
    .bind(job)
    .bind(owner)
    .bind(seconds)
    .fetch_optional(pool)
    .await?;
    Ok(held.is_some())
}

/// Releases every job lease `owner` holds (on shutdown), so another replica takes over at once.
pub async fn release_job_leases(pool: &PgPool, owner: uuid::Uuid) -> sqlx::Result<u64> {
    Ok(
        sqlx::query("delete from sweeper.job_leases where lease_owner = $1")
            .bind(owner)
            .execute(pool)
            .await?
            .rows_affected(),
    )
}

/// `text` safe to store as PostgreSQL text and to show: control characters (NUL included)
/// replaced by U+FFFD, cut to `max` characters with a trailing `…`.
pub fn printable(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max)
        .map(|c| if c.is_control() { '\u{FFFD}' } else { c })
        .collect();
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}
