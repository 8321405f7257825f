//! The database-health governor (docs/design.md §14 "Holds"): before work is claimed — a command or a
//! planning page — each replica compares cheap signals of the database's health with high and low
//! marks, and holds the policy's work (kind `governor`) while one is above its high mark, until
//! every signal is back at or below its low mark; then concurrency ramps up (1, 2, 4, … slots a
//! second) rather than jumping back to `max_concurrent_commands`.
//!
//! The signals, read at most once a second per replica in one query:
//! - replay lag of each connected standby (`pg_stat_replication`): bytes
//!   (`pg_current_wal_lsn() − replay_lsn`) and seconds (`replay_lag`, which PostgreSQL resets to
//!   NULL once an idle standby has caught up: NULL with 0 bytes behind reads as 0 s). A role
//!   without `pg_monitor` (or `pg_read_all_stats`) sees the rows with those columns NULL: the
//!   signal is `unreadable`, shown as such, never as 0;
//! - the xid age of the oldest snapshot in this database (`age(backend_xmin)` over
//!   `pg_stat_activity`, which any role can read), sweeper's own sessions excluded by
//!   `application_name = 'sweeper'`;
//! - sessions waiting on a lock of each governed policy's target table (`pg_locks` not granted),
//!   sweeper's own excluded.
//!
//! An unreadable signal does not hold work (the governor cannot tell), but `GET /governor` and
//! `check-config` say so.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use chrono::{DateTime, Utc};

mod signals;
use serde::{Deserialize, Serialize};
pub use signals::*;
use sqlx::PgPool;
use tracing::{info, warn};

/// `[governor]` (and a policy's `governor = { ... }`, which overrides any of the marks).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MarksConfig {
    /// `false` turns the governor off (default on).
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Standby replay lag that holds, seconds (default 30).
    #[serde(default)]
    pub replay_lag_seconds_high: Option<f64>,
    /// Replay lag at or under which work resumes, seconds (default 10).
    #[serde(default)]
    pub replay_lag_seconds_low: Option<f64>,
    /// Standby replay lag that holds, bytes of WAL (default 1 GiB).
    #[serde(default)]
    pub replay_lag_bytes_high: Option<i64>,
    /// Replay lag at or under which work resumes, bytes (default 256 MiB).
    #[serde(default)]
    pub replay_lag_bytes_low: Option<i64>,
    /// Oldest snapshot's xid age that holds, transactions (default 10,000,000).
    #[serde(default)]
    pub xmin_age_high: Option<i64>,
    /// xid age at or under which work resumes (default 5,000,000).
    #[serde(default)]
    pub xmin_age_low: Option<i64>,
    /// Other sessions waiting on a lock of the target table that hold, sessions (default 0: any
    /// waiter holds).
    #[serde(default)]
    pub lock_waiters_high: Option<i64>,
    /// Waiters at or under which work resumes (default 0).
    #[serde(default)]
    pub lock_waiters_low: Option<i64>,
}

/// Marks with every default applied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Marks {
    /// Whether the governor holds work at all.
    pub enabled: bool,
    /// (high, low), seconds.
    pub replay_lag_seconds: (f64, f64),
    /// (high, low), bytes.
    pub replay_lag_bytes: (i64, i64),
    /// (high, low), transactions.
    pub xmin_age: (i64, i64),
    /// (high, low), sessions.
    pub lock_waiters: (i64, i64),
}

impl Default for Marks {
    fn default() -> Self {
        Marks {
            enabled: true,
            replay_lag_seconds: (30.0, 10.0),
            replay_lag_bytes: (1 << 30, 256 << 20),
            xmin_age: (10_000_000, 5_000_000),
            lock_waiters: (0, 0),
        }
    }
}

impl Marks {
    /// `base` with what `c` sets; errors (a low mark above its high one) name `path`.
    pub fn with(base: Marks, c: &MarksConfig, path: &str, errors: &mut Vec<String>) -> Marks {
        let m = Marks {
            enabled: c.enabled.unwrap_or(base.enabled),
            replay_lag_seconds: (
                c.replay_lag_seconds_high
                    .unwrap_or(base.replay_lag_seconds.0),
                c.replay_lag_seconds_low
                    .unwrap_or(base.replay_lag_seconds.1),
            ),
            replay_lag_bytes: (
                c.replay_lag_bytes_high.unwrap_or(base.replay_lag_bytes.0),
                c.replay_lag_bytes_low.unwrap_or(base.replay_lag_bytes.1),
            ),
            xmin_age: (
                c.xmin_age_high.unwrap_or(base.xmin_age.0),
                c.xmin_age_low.unwrap_or(base.xmin_age.1),
            ),
            lock_waiters: (
                c.lock_waiters_high.unwrap_or(base.lock_waiters.0),
                c.lock_waiters_low.unwrap_or(base.lock_waiters.1),
            ),
        };
        let mut check = |name: &str, high: f64, low: f64| {
            if !(low >= 0.0 && low <= high) {
                errors.push(format!(
                    "{path}.{name}_low ({low}) must be at least 0 and not above {name}_high ({high})"
                ));
            }
        };
        check(
            "replay_lag_seconds",
            m.replay_lag_seconds.0,
            m.replay_lag_seconds.1,
        );
        check(
            "replay_lag_bytes",
            m.replay_lag_bytes.0 as f64,
            m.replay_lag_bytes.1 as f64,
        );
        check("xmin_age", m.xmin_age.0 as f64, m.xmin_age.1 as f64);
        check(
            "lock_waiters",
            m.lock_waiters.0 as f64,
            m.lock_waiters.1 as f64,
        );
        m
    }
}

/// A policy's governor state on this replica.
#[derive(Debug, Clone, Default)]
struct PolicyState {
    /// Held: since when, and why.
    held: Option<(DateTime<Utc>, String)>,
    /// When it last resumed (ramps concurrency from then).
    resumed: Option<Instant>,
}

/// The governor of one replica: the latest reading and each policy's verdict. Cheap to clone.
#[derive(Clone, Default)]
pub struct Governor {
    inner: Arc<RwLock<Inner>>,
}

#[derive(Default)]
struct Inner {
    reading: Option<Result<Reading, String>>,
    policies: HashMap<String, PolicyState>,
}

/// A governed policy: its name, target table and effective marks.
#[derive(Debug, Clone)]
pub struct Governed {
    /// The policy.
    pub policy: String,
    /// Its target table as configured.
    pub table: String,
    /// Its marks.
    pub marks: Marks,
}

impl Governor {
    /// Why `policy`'s work is held now, with since when (`None`: not held).
    pub fn held(&self, policy: &str) -> Option<(DateTime<Utc>, String)> {
        let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
        inner.policies.get(policy).and_then(|p| p.held.clone())
    }

    /// Policies held now.
    pub fn held_policies(&self) -> Vec<String> {
        let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
        inner
            .policies
            .iter()
            .filter(|(_, p)| p.held.is_some())
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Slots `policy` may use of its `max`: ramps 1, 2, 4, … per second since it last resumed.
    pub fn slots(&self, policy: &str, max: u32) -> u32 {
        let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
        match inner.policies.get(policy).and_then(|p| p.resumed) {
            Some(at) => {
                let seconds = at.elapsed().as_secs().min(16) as u32;
                max.min(1u32 << seconds)
            }
            None => max,
        }
    }

    /// The latest reading (`Err`: the query failed), if one was taken.
    pub fn reading(&self) -> Option<Result<Reading, String>> {
        let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
        inner.reading.clone()
    }

    /// Takes a reading and updates every governed policy's verdict, logging and counting each
    /// hold and resume.
    pub async fn refresh(&self, pool: &PgPool, governed: &[Governed]) {
        let tables: Vec<String> = governed.iter().map(|g| g.table.clone()).collect();
        let reading = read(pool, &tables).await.map_err(|e| e.to_string());
        let mut inner = self.inner.write().unwrap_or_else(|e| e.into_inner());
        if let Ok(r) = &reading {
            for g in governed.iter().filter(|g| g.marks.enabled) {
                let signals = signals(r, &g.marks, &g.table);
                let state = inner.policies.entry(g.policy.clone()).or_default();
                let above: Vec<String> = signals
                    .iter()
                    .filter(|s| s.verdict == "above_high")
                    .map(|s| {
                        format!(
                            "{} {} {} > high mark {}",
                            s.signal,
                            s.reading.unwrap_or_default(),
                            s.unit,
                            s.high
                        )
                    })
                    .collect();
                match &state.held {
                    None if !above.is_empty() => {
                        let why = above.join("; ");
                        warn!(policy = %g.policy, reason = %why, "governor holds the policy's work");
                        state.held = Some((r.at, why));
                    }
                    Some(_)
                        if signals
                            .iter()
                            .all(|s| s.verdict != "above_high" && s.verdict != "between_marks") =>
                    {
                        info!(policy = %g.policy, "governor resumes the policy's work");
                        state.held = None;
                        state.resumed = Some(Instant::now());
                    }
                    Some(_) if !above.is_empty() => {
                        if let Some(h) = state.held.as_mut() {
                            h.1 = above.join("; ");
                        }
                    }
                    _ => {}
                }
            }
        }
        inner.reading = Some(reading);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrency_ramps_up_after_a_resume() {
        let g = Governor::default();
        assert_eq!(g.slots("p", 8), 8, "never held: every slot");
        let resumed = |ago: u64| {
            let mut inner = g.inner.write().unwrap();
            inner.policies.insert(
                "p".into(),
                PolicyState {
                    held: None,
                    resumed: Instant::now().checked_sub(std::time::Duration::from_secs(ago)),
                },
            );
        };
        resumed(0);
        assert_eq!(g.slots("p", 8), 1, "one slot at the resume");
        resumed(2);
        assert_eq!(g.slots("p", 8), 4);
        resumed(10);
        assert_eq!(g.slots("p", 8), 8, "capped at max_concurrent_commands");
    }

    #[test]
    fn a_low_mark_above_its_high_mark_is_refused_by_name() {
        let mut errors = Vec::new();
        let c = MarksConfig {
            xmin_age_high: Some(10),
            xmin_age_low: Some(20),
            ..Default::default()
        };
        Marks::with(Marks::default(), &c, "governor", &mut errors);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("governor.xmin_age_low (20)"),
            "{errors:?}"
        );
    }
}
