//! `POST /trigger/{policy}`: find the window, create its run (or return the existing one), fix
//! the cutoff once, and leave planning to a ledger job (docs/design.md §1, §2.1, §2.2).
//!
//! The answer comes in bounded time whatever the backlog: this module only writes the run row and
//! its planning job; [`crate::plan`] does the scan in bounded pages afterwards.

use chrono::{DateTime, NaiveDate, Utc};
use tracing::info;

use crate::auth::Principal;
use crate::ledger::{self, Run};
use crate::policy::Policy;
use crate::state::AppState;
use crate::window;

/// Where the caller said which window it means, in order of precedence.
#[derive(Debug, Default)]
pub struct WindowHints {
    /// The `X-CloudScheduler-ScheduleTime` header (RFC 3339), sent by Cloud Scheduler for
    /// unix-cron jobs.
    pub schedule_time_header: Option<String>,
    /// `?window=`: RFC 3339, or a date `YYYY-MM-DD` naming the single tick on that local date.
    pub window_param: Option<String>,
}

/// What a trigger did.
#[derive(Debug)]
pub enum TriggerOutcome {
    /// A new run was created (202).
    Created(Run),
    /// The window's run already existed (200).
    Existing(Run),
    /// The policy is suspended: no run was created (200, so the cron does not retry).
    Suspended(crate::ledger::control::PolicyState),
}

/// Why a trigger was refused.
#[derive(Debug, thiserror::Error)]
pub enum TriggerError {
    /// The window is malformed, not a tick, or in the future (400).
    #[error("{0}")]
    BadWindow(String),
    /// The window is a backfill and the caller lacks `ops:write` (403).
    #[error("{0}")]
    Forbidden(String),
    /// Concurrent triggers kept taking the same dry-run number (503, retry).
    #[error("{0}")]
    Busy(String),
    /// The ledger failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Resolves the window and creates or finds its run.
///
/// The window is the schedule-time header when present, else `?window=`, else the latest tick at
/// or before arrival + the early tolerance. It must be a tick; it must not be later than arrival +
/// the early tolerance; one older than the latest tick minus the tolerance is a backfill and needs
/// `ops:write` to create (an existing run is returned to anyone allowed to trigger). The caller
/// wakes the planner for a created run once its answer is ready (`state.wake_planner`).
pub async fn trigger(
    state: &AppState,
    policy: &Policy,
    hints: WindowHints,
    dry_run: bool,
    principal: &Principal,
) -> Result<TriggerOutcome, TriggerError> {
    let suspended = crate::ledger::control::policy_state(&state.pool, policy.name.as_str())
        .await?
        .filter(|ps| ps.suspended);
    let mut conn = state.pool.acquire().await?;
    let arrival = ledger::now(&mut conn).await?;
    let tolerance = policy.early_tolerance.delta();
    let horizon = arrival + tolerance;
    let resolved = resolve_window(policy, &hints, horizon);
    if let Some(ps) = suspended {
        // A repeat of a trigger whose run exists is answered with that run (held: suspended);
        // otherwise nothing is created, whatever the window.
        if let (false, Ok(window)) = (dry_run, &resolved)
            && let Some(run) = existing_run(&mut conn, policy, *window).await?
        {
            return Ok(TriggerOutcome::Existing(run));
        }
        return Ok(TriggerOutcome::Suspended(ps));
    }
    let window = resolved?;
    if !policy.schedule.is_tick(window) {
        return Err(TriggerError::BadWindow(format!(
            "window {} is not a tick of the schedule `{}` ({})",
            window::format(window),
            policy.schedule.expr(),
            policy.schedule.zone_name()
        )));
    }
    if window > horizon {
        return Err(TriggerError::BadWindow(format!(
            "window {} is in the future: a trigger may arrive at most {} before its tick",
            window::format(window),
            policy.early_tolerance
        )));
    }
    let latest = policy.latest_tick(window, arrival);
    let backfill = policy.is_backfill(window, arrival);

    if !dry_run && let Some(run) = existing_run(&mut conn, policy, window).await? {
        return Ok(TriggerOutcome::Existing(run));
    }
    if backfill && !principal.has("ops:write") {
        return Err(TriggerError::Forbidden(format!(
            "window {} is older than the latest tick {}: creating a run for it is a backfill and needs scope ops:write",
            window::format(window),
            window::format(latest)
        )));
    }
    drop(conn);

    let cutoff = policy.cutoff(window);
    let outcome = if dry_run {
        create_dry_run(state, policy, window, cutoff, principal).await?
    } else {
        create_run(state, policy, window, cutoff, principal).await?
    };
    if let TriggerOutcome::Created(run) = &outcome {
        if !dry_run && !backfill {
            crate::metrics::trigger_lag((arrival - window).as_seconds_f64());
        }
        info!(run_id = %run.run_id, policy = %policy.name, window = %window::format(window),
              cutoff = %run.cutoff.to_rfc3339(), dry_run, backfill, "run created");
    }
    Ok(outcome)
}

/// The live run of `policy` for `window`, if it has one.
async fn existing_run(
    conn: &mut sqlx::PgConnection,
    policy: &Policy,
    window: chrono::DateTime<chrono::Utc>,
) -> Result<Option<ledger::Run>, TriggerError> {
    let existing = sqlx::query_scalar::<_, String>(
        "select run_id from sweeper.runs where policy = $1 and window_at = $2 and not dry_run",
    )
    .bind(policy.name.as_str())
    .bind(window)
    .fetch_optional(&mut *conn)
    .await?;
    match existing {
        Some(run_id) => Ok(ledger::get_run(conn, &run_id).await?),
        None => Ok(None),
    }
}

fn resolve_window(
    policy: &Policy,
    hints: &WindowHints,
    horizon: DateTime<Utc>,
) -> Result<DateTime<Utc>, TriggerError> {
    if let Some(h) = &hints.schedule_time_header {
        return window::parse_rfc3339(h)
            .map(window::normalize)
            .ok_or_else(|| {
                TriggerError::BadWindow(format!(
                    "X-CloudScheduler-ScheduleTime `{h}` is not an RFC 3339 instant"
                ))
            });
    }
    if let Some(w) = &hints.window_param {
        if let Some(t) = window::parse_rfc3339(w) {
            return Ok(window::normalize(t));
        }
        if let Ok(date) = NaiveDate::parse_from_str(w.trim(), "%Y-%m-%d") {
            let ticks = policy.schedule.ticks_on_local_date(date);
            return match ticks.as_slice() {
                [one] => Ok(*one),
                [] => Err(TriggerError::BadWindow(format!(
                    "the schedule has no tick on {date} ({})",
                    policy.schedule.zone_name()
                ))),
                _ => Err(TriggerError::BadWindow(format!(
                    "the schedule has {} ticks on {date}; give the window as an RFC 3339 instant",
                    ticks.len()
                ))),
            };
        }
        return Err(TriggerError::BadWindow(format!(
            "window `{w}` is neither an RFC 3339 instant nor a date YYYY-MM-DD"
        )));
    }
    policy
        .schedule
        .latest_tick_at_or_before(horizon)
        .ok_or_else(|| TriggerError::BadWindow("the schedule has no tick yet".into()))
}

/// Creates the run of `window` with `cutoff` (or finds the one that exists): the trigger's
/// path and a backfill's.
pub async fn create_run(
    state: &AppState,
    policy: &Policy,
    window: DateTime<Utc>,
    cutoff: DateTime<Utc>,
    principal: &Principal,
) -> Result<TriggerOutcome, TriggerError> {
    let run = ledger::runs::NewRun {
        run_id: format!("{}:{}", policy.name, window::format(window)),
        policy: policy.name.as_str(),
        policy_version: &policy.version,
        window,
        cutoff,
        triggered_by: &principal.subject,
        guarded: policy.safety.guard.is_some(),
    };
    Ok(match ledger::runs::create(&state.pool, &run).await? {
        ledger::runs::Created::New(run) => TriggerOutcome::Created(run),
        ledger::runs::Created::Existing(run) => TriggerOutcome::Existing(run),
    })
}

async fn create_dry_run(
    state: &AppState,
    policy: &Policy,
    window: DateTime<Utc>,
    cutoff: DateTime<Utc>,
    principal: &Principal,
) -> Result<TriggerOutcome, TriggerError> {
    let run = ledger::runs::NewRun {
        run_id: format!("{}:{}", policy.name, window::format(window)),
        policy: policy.name.as_str(),
        policy_version: &policy.version,
        window,
        cutoff,
        triggered_by: &principal.subject,
        guarded: policy.safety.guard.is_some(),
    };
    match ledger::runs::create_dry(&state.pool, &run).await? {
        Some(run) => Ok(TriggerOutcome::Created(run)),
        None => Err(TriggerError::Busy(
            "too many concurrent dry runs for one window; retry".into(),
        )),
    }
}
