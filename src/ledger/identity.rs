//! The restore and clone guard's ledger (docs/design.md §14 "Holds"): the identity of the database sweeper
//! serves, recorded at its first `serve` (never by a migration, so templates and copies of a
//! migrated database are not taken for the original), and a heartbeat.
//!
//! Compared at every start and housekeeping round: another system identifier or database oid (a
//! `pg_dump | pg_restore` into another cluster, a `CREATE DATABASE … TEMPLATE` clone, pg_upgrade)
//! holds every policy (kind `identity`); so does a timeline change whose last heartbeat is older
//! than `guard.max_silence` (a point-in-time recovery or a restored physical backup: restored old
//! rows would be wiped at once, which is why TiDB turns TTL off after a restore). A timeline
//! change within it is a failover: logged, recorded, not held. `POST /guard/accept` records the
//! identity found and releases the hold.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::config::DurationSpec;
use crate::ledger::dead_letter::log_operator_act;

/// `[guard]`: the restore and clone guard.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityGuardConfig {
    /// A timeline change after a heartbeat older than this holds every policy (default 10m; a
    /// failover loses seconds). Must be longer than `ledger.housekeeping_interval`, which
    /// writes the heartbeat.
    #[serde(default = "default_max_silence")]
    pub max_silence: DurationSpec,
}

impl Default for IdentityGuardConfig {
    fn default() -> Self {
        IdentityGuardConfig {
            max_silence: default_max_silence(),
        }
    }
}

impl IdentityGuardConfig {
    /// Pushes a problem onto `errors` unless `max_silence` is longer than the heartbeat's
    /// interval (`ledger.housekeeping_interval`).
    pub fn validate(&self, housekeeping_interval: &DurationSpec, errors: &mut Vec<String>) {
        if self.max_silence <= *housekeeping_interval {
            errors.push(format!(
                "guard.max_silence ({}) must be longer than ledger.housekeeping_interval ({}), \
                 which writes the heartbeat",
                self.max_silence, housekeeping_interval
            ));
        }
    }
}

fn default_max_silence() -> DurationSpec {
    DurationSpec::from_seconds(600)
}

/// The database as PostgreSQL describes it now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Identity {
    /// `pg_control_system().system_identifier`, as text (a u64).
    pub system_identifier: String,
    /// The database's oid.
    pub database_oid: i64,
    /// The current WAL timeline (from `pg_walfile_name(pg_current_wal_lsn())`).
    pub timeline: i32,
}

/// Reads the identity of the database the pool serves.
pub async fn observe(pool: &PgPool) -> sqlx::Result<Identity> {
    sqlx::query_as(
        "select (select system_identifier::text from pg_control_system()) as system_identifier,
                (select oid::int8 from pg_database where datname = current_database())
                    as database_oid,
                ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int4
                    as timeline",
    )
    .fetch_one(pool)
    .await
}

/// What a comparison found.
#[derive(Debug, Clone, PartialEq)]
pub enum Found {
    /// First serve: recorded.
    Recorded,
    /// The recorded identity; heartbeat written.
    Same,
    /// A timeline change within `max_silence` (a failover): recorded, not held.
    Failover {
        /// Timeline before.
        from: i32,
        /// Timeline now.
        to: i32,
        /// Seconds since the last heartbeat.
        silence_seconds: f64,
    },
    /// Held now, by this check: why.
    Held(String),
    /// Held already (an earlier check found it): why.
    StillHeld(String),
}

/// Compares the database's identity with the recorded one (recording it on the first serve),
/// holds every policy on a mismatch, and writes the heartbeat. `subject` records who recorded it.
// Over 80 lines: one transaction under the identity row's lock, the three outcomes in order.
pub async fn check(
    pool: &PgPool,
    max_silence: &DurationSpec,
    subject: &str,
) -> sqlx::Result<Found> {
    let now = observe(pool).await?;
    let mut tx = pool.begin().await?;
    type Recorded = (String, i64, i32, f64, Option<String>);
    let recorded: Option<Recorded> = sqlx::query_as(
        "select system_identifier, database_oid, timeline,
                extract(epoch from sweeper.now() - heartbeat_at)::float8, held_detail
           from sweeper.database_identity for update",
    )
    .fetch_optional(&mut *tx)
    .await?;
    let found = match recorded {
        None => {
            sqlx::query(
                "insert into sweeper.database_identity
                        (system_identifier, database_oid, timeline, recorded_by)
                 values ($1, $2, $3, $4) on conflict do nothing",
            )
            .bind(&now.system_identifier)
            .bind(now.database_oid)
            .bind(now.timeline)
            .bind(subject)
            .execute(&mut *tx)
            .await?;
            Found::Recorded
        }
        Some((_, _, _, _, Some(detail))) => Found::StillHeld(detail),
        Some((sysid, oid, timeline, silence, None)) => {
            let why = if sysid != now.system_identifier || oid != now.database_oid {
                let mut changed = Vec::new();
                if sysid != now.system_identifier {
                    changed.push(format!(
                        "system identifier {sysid} → {}",
                        now.system_identifier
                    ));
                }
                if oid != now.database_oid {
                    changed.push(format!("database oid {oid} → {}", now.database_oid));
                }
                Some(format!(
                    "the database is not the one sweeper served: {} (a restore into another \
                     cluster, a CREATE DATABASE … TEMPLATE clone or pg_upgrade); accept it with \
                     POST /guard/accept",
                    changed.join(", ")
                ))
            } else if timeline != now.timeline && silence > max_silence.seconds() as f64 {
                Some(format!(
                    "timeline {timeline} → {} after {silence:.0} s without a heartbeat, longer than \
                     guard.max_silence {max_silence} (a point-in-time recovery or a restored \
                     backup); accept it with POST /guard/accept",
                    now.timeline
                ))
            } else {
                None
            };
            match why {
                Some(why) => {
                    sqlx::query(
                        "update sweeper.database_identity
                            set held_since = sweeper.now(), held_detail = $1",
                    )
                    .bind(&why)
                    .execute(&mut *tx)
                    .await?;
                    Found::Held(why)
                }
                None if timeline != now.timeline => {
                    sqlx::query("update sweeper.database_identity set timeline = $1")
                        .bind(now.timeline)
                        .execute(&mut *tx)
                        .await?;
                    Found::Failover {
                        from: timeline,
                        to: now.timeline,
                        silence_seconds: silence,
                    }
                }
                None => Found::Same,
            }
        }
    };
    sqlx::query("update sweeper.database_identity set heartbeat_at = sweeper.now()")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(found)
}

/// The guard's state as `GET /guard` shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct GuardState {
    /// Recorded system identifier.
    pub system_identifier: String,
    /// Recorded database oid.
    pub database_oid: i64,
    /// Recorded timeline.
    pub timeline: i32,
    /// When it was recorded.
    pub recorded_at: DateTime<Utc>,
    /// Who recorded it.
    pub recorded_by: String,
    /// Last heartbeat.
    pub heartbeat_at: DateTime<Utc>,
    /// Held since (null: not held).
    pub held_since: Option<DateTime<Utc>>,
    /// Why it is held.
    pub held_detail: Option<String>,
}

/// The recorded identity, if any serve recorded one.
pub async fn state(pool: &PgPool) -> sqlx::Result<Option<GuardState>> {
    sqlx::query_as(
        "select system_identifier, database_oid, timeline, recorded_at, recorded_by, heartbeat_at,
                held_since, held_detail
           from sweeper.database_identity",
    )
    .fetch_optional(pool)
    .await
}

/// Records the identity found now as the database's, releases the hold, and logs the act.
pub async fn accept(pool: &PgPool, subject: &str, reason: &str) -> sqlx::Result<GuardState> {
    let now = observe(pool).await?;
    let mut tx = pool.begin().await?;
    let before: Option<(String, i64, i32, Option<String>)> = sqlx::query_as(
        "select system_identifier, database_oid, timeline, held_detail
           from sweeper.database_identity for update",
    )
    .fetch_optional(&mut *tx)
    .await?;
    let state: GuardState = sqlx::query_as(
        "insert into sweeper.database_identity
                (system_identifier, database_oid, timeline, recorded_by)
         values ($1, $2, $3, $4)
         on conflict (singleton) do update
            set system_identifier = excluded.system_identifier,
                database_oid = excluded.database_oid, timeline = excluded.timeline,
                recorded_at = sweeper.now(), recorded_by = excluded.recorded_by,
                heartbeat_at = sweeper.now(), held_since = null, held_detail = null
         returning system_identifier, database_oid, timeline, recorded_at, recorded_by,
                   heartbeat_at, held_since, held_detail",
    )
    .bind(&now.system_identifier)
    .bind(now.database_oid)
    .bind(now.timeline)
    .bind(subject)
    .fetch_one(&mut *tx)
    .await?;
    // Held push commands were kept from the relay; they are due for publishing now.
    sqlx::query(
        "update sweeper.commands set next_attempt_at = least(next_attempt_at, sweeper.now())
          where held_kind = 'identity' and state = 'pending'",
    )
    .execute(&mut *tx)
    .await?;
    log_operator_act(
        &mut tx,
        subject,
        "accept_identity",
        "guard",
        reason,
        // A second accept of the same identity (two operators at once) changes nothing.
        before.as_ref().is_none_or(|(s, o, t, d)| {
            d.is_some()
                || *s != now.system_identifier
                || *o != now.database_oid
                || *t != now.timeline
        }),
        serde_json::json!({
            "before": before.as_ref().map(|(s, o, t, d)| serde_json::json!({
                "system_identifier": s, "database_oid": o, "timeline": t, "held_detail": d})),
            "accepted": now,
        }),
    )
    .await?;
    tx.commit().await?;
    Ok(state)
}

/// Whether every policy is held by the guard: `(since, why)`.
pub async fn held(pool: &PgPool) -> sqlx::Result<Option<(DateTime<Utc>, String)>> {
    sqlx::query_as(
        "select held_since, held_detail from sweeper.database_identity
          where held_since is not null",
    )
    .fetch_optional(pool)
    .await
}
