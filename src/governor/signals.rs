//! The governor's signals (see [`super`]): one query that reads them all, and each reading
//! against its marks with its unit and the reason it may be unreadable.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::Marks;

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
    /// Other sessions waiting on a lock, per target table (quoted, as configured): a lock of the
    /// table itself, or any lock (a row's, a transaction's) held up by a session that holds a
    /// lock on the table — sweeper's own deletes included. -1: the table does not exist.
    pub lock_waiters: HashMap<String, i64>,
}

/// Reads every signal in one query; `tables` are the governed targets, quoted
/// ([`crate::policy::TableName::quoted`]).
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
                coalesce((select array_agg(
                                     case when to_regclass(t.name) is null then -1 else
                                     (select count(distinct w.pid)
                                        from pg_locks w join pg_stat_activity a on a.pid = w.pid
                                       where not w.granted and w.pid <> pg_backend_pid()
                                         and coalesce(a.application_name, '') <> 'sweeper'
                                         and (w.relation = to_regclass(t.name)
                                              or exists (select 1 from pg_locks h
                                                          where h.pid = any(pg_blocking_pids(w.pid))
                                                            and h.granted
                                                            and h.relation = to_regclass(t.name))))
                                     end order by t.name)
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
            return (None, "no standby connected".into());
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
                _ if r.standbys.is_empty() => "no_standby",
                None => "unreadable",
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
    match r.lock_waiters.get(table).filter(|n| **n >= 0) {
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
            detail: format!("{table} was not found (dropped or renamed?)"),
        }),
    }
    out
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
