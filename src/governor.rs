//! The database-health governor (DESIGN §14 "Holds"): before work is claimed — a command or a
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
use serde::{Deserialize, Serialize};
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

/// One standby as `pg_stat_replication` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Standby {
    /// Its `application_name`.
    pub name: String,
    /// WAL bytes not yet replayed; `None`: unreadable.
    pub lag_bytes: Option<i64>,
    /// Seconds of replay lag; `None`: unreadable.
    pub lag_seconds: Option<f64>,
}

/// One reading of every signal.
#[derive(Debug, Clone, Serialize)]
pub struct Reading {
    /// When it was taken.
    pub at: DateTime<Utc>,
    /// Connected standbys.
    pub standbys: Vec<Standby>,
    /// xid age of the oldest snapshot of another session in this database (0: none open).
    pub xmin_age: i64,
    /// The session holding it, if any.
    pub xmin_pid: Option<i32>,
    /// Other sessions waiting on a lock, per target table.
    pub lock_waiters: HashMap<String, i64>,
}

/// Reads every signal in one query; `tables` are the governed targets as configured.
pub async fn read(pool: &PgPool, tables: &[String]) -> sqlx::Result<Reading> {
    type Row = (
        DateTime<Utc>,
        Option<serde_json::Value>,
        Option<i64>,
        Option<i32>,
        Vec<String>,
        Vec<i64>,
    );
    let (at, standbys, xmin_age, xmin_pid, names, waiters): Row = sqlx::query_as(
        "select sweeper.now(),
                (select json_agg(json_build_object(
                            'name', coalesce(application_name, ''),
                            'bytes', pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::int8,
                            'seconds', extract(epoch from replay_lag)::float8))
                   from pg_stat_replication),
                x.age, x.pid,
                coalesce((select array_agg(t.name order by t.name) from unnest($1::text[]) t(name)),
                         '{}'),
                coalesce((select array_agg((select count(distinct l.pid)
                                              from pg_locks l join pg_stat_activity a using (pid)
                                             where not l.granted
                                               and l.relation = to_regclass(t.name)
                                               and coalesce(a.application_name, '') <> 'sweeper')
                                           order by t.name)
                            from unnest($1::text[]) t(name)), '{}')
           from (select null) one
           left join lateral (
                select age(backend_xmin)::int8 as age, pid from pg_stat_activity
                 where backend_xmin is not null and pid <> pg_backend_pid()
                   and (datname = current_database() or backend_type = 'walsender')
                   and coalesce(application_name, '') <> 'sweeper'
                 order by age(backend_xmin) desc limit 1) x on true",
    )
    .bind(tables)
    .fetch_one(pool)
    .await?;
    let standbys = standbys
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .map(|s| {
            let bytes = s["bytes"].as_i64();
            Standby {
                name: s["name"].as_str().unwrap_or_default().to_string(),
                lag_bytes: bytes,
                // NULL replay_lag: caught up and idle when nothing is behind, else unknown.
                lag_seconds: s["seconds"].as_f64().or(if bytes == Some(0) {
                    Some(0.0)
                } else {
                    None
                }),
            }
        })
        .collect();
    Ok(Reading {
        at,
        standbys,
        xmin_age: xmin_age.unwrap_or(0),
        xmin_pid,
        lock_waiters: names.into_iter().zip(waiters).collect(),
    })
}

/// One signal's state against its marks.
#[derive(Debug, Clone, Serialize)]
pub struct Signal {
    /// `replay_lag_seconds`, `replay_lag_bytes`, `xmin_age` or `lock_waiters`.
    pub signal: &'static str,
    /// The reading (the worst standby's for replay lag); `None`: unreadable.
    pub reading: Option<f64>,
    /// The unit of the reading and marks.
    pub unit: &'static str,
    /// Hold above this.
    pub high: f64,
    /// Resume at or below this.
    pub low: f64,
    /// `ok`, `above_high`, `between_marks`, `unreadable` or `no_standby`.
    pub verdict: &'static str,
    /// What the reading covers or why it is unreadable.
    pub detail: String,
}

/// Each signal of `r` against `m`, for the policy whose target is `table`.
// Over 80 lines: the four signals in `GET /governor`'s order, each with its unit and the reason
// it may be unreadable.
pub fn signals(r: &Reading, m: &Marks, table: &str) -> Vec<Signal> {
    let verdict = |v: f64, (high, low): (f64, f64)| {
        if v > high {
            "above_high"
        } else if v > low {
            "between_marks"
        } else {
            "ok"
        }
    };
    let mut out = Vec::new();
    let lag = |f: &dyn Fn(&Standby) -> Option<f64>| -> (Option<f64>, String) {
        if r.standbys.is_empty() {
            return (Some(0.0), "no standby connected".into());
        }
        let hidden: Vec<&str> = r
            .standbys
            .iter()
            .filter(|s| f(s).is_none())
            .map(|s| s.name.as_str())
            .collect();
        if !hidden.is_empty() {
            return (
                None,
                format!(
                    "{} of {} standbys unreadable ({}): grant the role pg_monitor",
                    hidden.len(),
                    r.standbys.len(),
                    hidden.join(", ")
                ),
            );
        }
        let worst = r.standbys.iter().filter_map(f).fold(0.0, f64::max);
        (
            Some(worst),
            format!("worst of {} standbys", r.standbys.len()),
        )
    };
    for (name, unit, marks, f) in [
        (
            "replay_lag_seconds",
            "seconds",
            m.replay_lag_seconds,
            &(|s: &Standby| s.lag_seconds) as &dyn Fn(&Standby) -> Option<f64>,
        ),
        (
            "replay_lag_bytes",
            "bytes",
            (m.replay_lag_bytes.0 as f64, m.replay_lag_bytes.1 as f64),
            &|s: &Standby| s.lag_bytes.map(|b| b as f64),
        ),
    ] {
        let (reading, detail) = lag(f);
        out.push(Signal {
            signal: name,
            reading,
            unit,
            high: marks.0,
            low: marks.1,
            verdict: match reading {
                None => "unreadable",
                Some(_) if r.standbys.is_empty() => "no_standby",
                Some(v) => verdict(v, marks),
            },
            detail,
        });
    }
    let xmin = (m.xmin_age.0 as f64, m.xmin_age.1 as f64);
    out.push(Signal {
        signal: "xmin_age",
        reading: Some(r.xmin_age as f64),
        unit: "transactions",
        high: xmin.0,
        low: xmin.1,
        verdict: verdict(r.xmin_age as f64, xmin),
        detail: match r.xmin_pid {
            Some(pid) => format!("oldest snapshot held by pid {pid}"),
            None => "no other session holds a snapshot".into(),
        },
    });
    let waits = (m.lock_waiters.0 as f64, m.lock_waiters.1 as f64);
    match r.lock_waiters.get(table) {
        Some(n) => out.push(Signal {
            signal: "lock_waiters",
            reading: Some(*n as f64),
            unit: "sessions",
            high: waits.0,
            low: waits.1,
            verdict: verdict(*n as f64, waits),
            detail: format!("other sessions waiting on a lock of {table}"),
        }),
        None => out.push(Signal {
            signal: "lock_waiters",
            reading: None,
            unit: "sessions",
            high: waits.0,
            low: waits.1,
            verdict: "unreadable",
            detail: format!("{table} was not read"),
        }),
    }
    out
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

/// What `check-config` says about the signals the configured role can read: `(warning, line)`
/// pairs. Replay lag needs `pg_monitor` (or `pg_read_all_stats`, or a superuser); the xid age and
/// lock waits are readable by any role; the restore and clone guard needs `pg_control_system()`.
pub async fn readability(pool: &PgPool) -> sqlx::Result<Vec<(bool, String)>> {
    let (role, stats, control, standbys): (String, bool, bool, i64) = sqlx::query_as(
        "select current_user::text,
                pg_has_role(current_user, 'pg_read_all_stats', 'member')
                    or (select rolsuper from pg_roles where rolname = current_user),
                has_function_privilege('pg_control_system()', 'execute'),
                (select count(*) from pg_stat_replication)",
    )
    .fetch_one(pool)
    .await?;
    let mut lines = vec![(
        false,
        format!(
            "governor: role {role} reads the oldest snapshot's xid age and lock waits (any role can)"
        ),
    )];
    lines.push(if stats {
        (
            false,
            format!(
                "governor: role {role} reads standby replay lag ({standbys} standbys connected now)"
            ),
        )
    } else {
        (
            true,
            format!(
                "governor: role {role} is not a member of pg_monitor or pg_read_all_stats: standby \
                 replay lag will read `unreadable` (it holds nothing); grant pg_monitor to {role}"
            ),
        )
    });
    if !control {
        lines.push((
            true,
            format!(
                "guard: role {role} cannot execute pg_control_system(): the restore and clone \
                 guard cannot read the system identifier, and serve will fail at start"
            ),
        ));
    }
    Ok(lines)
}
