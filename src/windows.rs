//! Missed windows (docs/design.md §14): every tick a policy's schedule expected, what became of it, and
//! the backfill that creates the runs the scheduler never asked for.
//!
//! The schedule expects ticks from the policy's first registration (`policy_versions`) to the
//! ledger's now; the current version's schedule defines them. A backfill may name a window
//! before the registration: such a window is listed too, as what it is (its run's status), but
//! it never makes the ticks before the registration expected, so they are never `missed`. Each
//! tick is, in this order of precedence:
//! - its run's status, when it has a live run (dry runs do not count);
//! - `not_expected`: before the first registration (only a backfill that names it sees it, and
//!   may create it);
//! - `suspended`: the policy was suspended at the tick (the trigger created nothing);
//! - `superseded`: a retention policy whose later window has a `completed` run (that run's later
//!   cutoff removed everything the tick's run would have; a selection policy is never superseded:
//!   each window has its own effects);
//! - `missed`: no run once `early_tolerance` plus [`GRACE`] has passed since the tick;
//! - `due`: not yet missed.

use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;

use crate::auth::Principal;
use crate::ledger::windows::{Bounds, WindowRun};
use crate::policy::Policy;
use crate::state::AppState;
use crate::trigger::{self, TriggerOutcome};
use crate::window;

/// How long after its tick (past `early_tolerance`) a window without a run counts as missed:
/// one hour, so a trigger that Cloud Scheduler or QStash retries late is not reported missed.
pub const GRACE: TimeDelta = TimeDelta::hours(1);

/// The most ticks one listing returns (and one backfill range may span).
pub const MAX_TICKS: usize = 1_000;

/// The most windows one backfill creates.
pub const MAX_BACKFILL: usize = 100;

/// One expected tick and what became of it.
#[derive(Debug, Clone, Serialize)]
pub struct Tick {
    /// The window, `2026-09-07T09:00:00Z`.
    pub window: String,
    /// Its run's status, or `suspended`, `superseded`, `missed`, `due`.
    pub status: String,
    /// Its run, when it has one.
    pub run_id: Option<String>,
    /// Its run's cutoff (RFC 3339), when it has one.
    pub cutoff: Option<String>,
    /// In a backfill's `skipped`: why it was left alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    #[serde(skip)]
    at: DateTime<Utc>,
}

impl Tick {
    /// The window as an instant.
    pub fn at(&self) -> DateTime<Utc> {
        self.at
    }
}

/// A page of ticks, oldest first.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    /// The policy.
    pub policy: String,
    /// The ticks.
    pub windows: Vec<Tick>,
    /// How many of them are `missed`.
    pub missed: usize,
    /// Where the expected ticks begin: the policy's first registration (earlier windows are
    /// listed only when they have a run).
    pub expected_from: Option<String>,
    /// Pass as `from` for the next page; `null` on the last.
    pub next_from: Option<String>,
}

/// Lists `policy`'s ticks in `[from, to]` (defaults: its first window, now; clamped to them),
/// at most `limit` (≤ [`MAX_TICKS`]). `clamp = false` lists from `from` even before the first
/// window (a backfill that names windows).
pub async fn list(
    state: &AppState,
    policy: &Policy,
    from: Option<DateTime<Utc>>,
    to: Option<DateTime<Utc>>,
    limit: usize,
    clamp: bool,
) -> sqlx::Result<Page> {
    let bounds = crate::ledger::windows::bounds(&state.pool, policy.name.as_str()).await?;
    let first = first_window(&bounds);
    let begin = match (from, first) {
        (Some(f), Some(s)) if clamp => f.max(s),
        (Some(f), _) => f,
        (None, Some(s)) => s,
        (None, None) => bounds.now,
    };
    let end = to.map_or(bounds.now, |t| t.min(bounds.now));
    let expected_from = bounds.first_registered.unwrap_or(bounds.now);
    let mut ats = if clamp {
        let mut ats = Vec::new();
        let before =
            expected_from.min(end + TimeDelta::microseconds(1)) - TimeDelta::microseconds(1);
        if begin <= before {
            // Before the registration only the windows that have runs (a backfill's) are listed.
            let (runs, _) = crate::ledger::windows::runs_and_suspensions(
                &state.pool,
                policy.name.as_str(),
                begin,
                before,
            )
            .await?;
            ats.extend(runs.iter().map(|r| r.window_at).take(limit + 1));
        }
        let room = limit + 1 - ats.len();
        ats.extend(ticks_between(policy, begin.max(expected_from), end, room));
        ats
    } else {
        // A backfill that names windows walks every tick from the first it names.
        ticks_between(policy, begin, end, limit + 1)
    };
    let next_from = (ats.len() > limit).then(|| window::format(ats[limit]));
    ats.truncate(limit);
    let (runs, suspensions) = match (ats.first(), ats.last()) {
        (Some(a), Some(b)) => {
            crate::ledger::windows::runs_and_suspensions(&state.pool, policy.name.as_str(), *a, *b)
                .await?
        }
        _ => Default::default(),
    };
    let windows: Vec<Tick> = ats
        .into_iter()
        .map(|at| classify(policy, &bounds, &runs, &suspensions, at))
        .collect();
    Ok(Page {
        policy: policy.name.as_str().to_string(),
        missed: windows.iter().filter(|t| t.status == "missed").count(),
        expected_from: bounds.first_registered.map(window::format),
        windows,
        next_from,
    })
}

/// How many of `policy`'s latest [`MAX_TICKS`] ticks are missed (`sweeper_missed_windows`).
pub async fn missed_recently(state: &AppState, policy: &Policy) -> sqlx::Result<usize> {
    let mut conn = state.pool.acquire().await?;
    let now = crate::ledger::now(&mut conn).await?;
    drop(conn);
    let mut from = now;
    for _ in 0..MAX_TICKS {
        match policy
            .schedule
            .latest_tick_at_or_before(from - TimeDelta::seconds(1))
        {
            Some(t) => from = t,
            None => break,
        }
    }
    Ok(list(state, policy, Some(from), None, MAX_TICKS, true)
        .await?
        .missed)
}

/// The first window listed: the earlier of the first registration and the first run's window.
fn first_window(b: &Bounds) -> Option<DateTime<Utc>> {
    match (b.first_registered, b.first_run) {
        (Some(a), Some(r)) => Some(a.min(r)),
        (a, r) => a.or(r),
    }
}

/// Ticks in `[begin, end]`, oldest first, at most `limit`.
fn ticks_between(
    policy: &Policy,
    begin: DateTime<Utc>,
    end: DateTime<Utc>,
    limit: usize,
) -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    let mut next = policy
        .schedule
        .next_tick_after(window::normalize(begin) - TimeDelta::seconds(1));
    while let Some(t) = next {
        if t > end || out.len() >= limit {
            break;
        }
        out.push(t);
        next = policy.schedule.next_tick_after(t);
    }
    out
}

fn classify(
    policy: &Policy,
    bounds: &Bounds,
    runs: &[WindowRun],
    suspensions: &[(DateTime<Utc>, bool)],
    at: DateTime<Utc>,
) -> Tick {
    let tick = |status: &str, run: Option<&WindowRun>| Tick {
        window: window::format(at),
        status: status.to_string(),
        run_id: run.map(|r| r.run_id.clone()),
        cutoff: run.map(|r| window::format(r.cutoff)),
        why: None,
        at,
    };
    if let Some(run) = runs.iter().find(|r| r.window_at == at) {
        return tick(&run.status, Some(run));
    }
    if bounds.first_registered.is_some_and(|r| at < r) {
        return tick("not_expected", None);
    }
    let suspended = suspensions
        .iter()
        .take_while(|(t, _)| *t <= at)
        .last()
        .is_some_and(|(_, s)| *s);
    let retention = policy.spec.select.is_empty();
    if suspended {
        tick("suspended", None)
    } else if retention && bounds.latest_completed.is_some_and(|w| w > at) {
        tick("superseded", None)
    } else if at + policy.early_tolerance.delta() + GRACE < bounds.now {
        tick("missed", None)
    } else {
        tick("due", None)
    }
}

/// What a backfill asks for: a range (its `missed` windows) or windows named one by one (their
/// `missed` or `suspended` ones).
#[derive(Debug)]
pub enum BackfillRequest {
    /// `from` / `to`, both inclusive.
    Range(DateTime<Utc>, DateTime<Utc>),
    /// Windows named explicitly.
    Named(Vec<DateTime<Utc>>),
}

/// What a backfill did.
#[derive(Debug, Serialize)]
pub struct Backfilled {
    /// The policy.
    pub policy: String,
    /// Runs created, in window order, each with its own window's cutoff.
    pub created: Vec<Tick>,
    /// Windows of the request left alone, each with the status that kept it and `why`.
    pub skipped: Vec<Tick>,
    /// When nothing was created: why, for the whole request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Why a backfill leaves a window of status `status` alone (`named`: the window was named).
fn left_alone(status: &str, named: bool) -> String {
    match status {
        "suspended" if !named => {
            "the policy was suspended at this tick; name it in `windows` to create its run".into()
        }
        "superseded" => "a later window's completed run covers it (its later cutoff)".into(),
        "due" => "not missed yet: its trigger may still come (early_tolerance plus an hour)".into(),
        "not_expected" => "before the policy's first registration; name it to create it".into(),
        s => format!("it has a run ({s})"),
    }
}

/// Why a backfill was refused; nothing was created.
#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    /// The request is malformed or too large (400).
    #[error("{0}")]
    Bad(String),
    /// The policy is suspended (409).
    #[error("policy `{0}` is suspended: resume it before backfilling its windows")]
    Suspended(String),
    /// The ledger failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Why a backfill created nothing, for the request as a whole: it held no expected tick
/// (`nothing_listed`), or every window had a run or was not missed; a range that starts before
/// the first registration (`expected_from`) says its earlier ticks were not expected.
fn nothing_created(
    request: &BackfillRequest,
    expected_from: Option<&str>,
    nothing_listed: bool,
) -> String {
    // A range that starts before the registration: its earlier ticks were not expected.
    let unexpected = match (request, expected_from.and_then(window::parse_rfc3339)) {
        (BackfillRequest::Range(from, _), Some(reg)) if *from < reg => format!(
            "; ticks before the policy's first registration ({}) were not expected and are not \
             listed: name one in `windows` to create its run",
            window::format(reg)
        ),
        _ => String::new(),
    };
    if nothing_listed {
        format!(
            "nothing to create: the request holds no tick the schedule expected (ticks are \
                 expected from the policy's first registration, {}); name an earlier window in \
                 `windows` to create its run",
            expected_from.unwrap_or("not yet")
        )
    } else {
        format!(
            "nothing to create: every window of the request has a run or is not missed; each \
                 skipped window says why{unexpected}"
        )
    }
}

/// Creates the runs of the windows `request` selects, oldest first, after recording the act in
/// the operator log. A window whose run appears meanwhile (a late trigger) is skipped.
pub async fn backfill(
    state: &AppState,
    policy: &Policy,
    request: BackfillRequest,
    principal: &Principal,
    reason: &str,
) -> Result<Backfilled, BackfillError> {
    let name = policy.name.as_str();
    if crate::ledger::control::policy_state(&state.pool, name)
        .await?
        .is_some_and(|s| s.suspended)
    {
        return Err(BackfillError::Suspended(name.to_string()));
    }
    let (wanted, skipped, expected_from) = choose(state, policy, &request).await?;
    let named = matches!(request, BackfillRequest::Named(_));
    let skipped: Vec<Tick> = skipped
        .into_iter()
        .map(|t| Tick {
            why: Some(left_alone(&t.status, named)),
            ..t
        })
        .collect();
    let mut out = Backfilled {
        policy: name.to_string(),
        created: Vec::new(),
        detail: None,
        skipped,
    };
    if wanted.is_empty() {
        out.detail = Some(nothing_created(
            &request,
            expected_from.as_deref(),
            out.skipped.is_empty(),
        ));
        return Ok(out);
    }
    let windows: Vec<String> = wanted.iter().map(|t| t.window.clone()).collect();
    crate::ledger::windows::log_backfill(&state.pool, name, &principal.subject, reason, &windows)
        .await?;
    for t in wanted {
        let cutoff = policy.cutoff(t.at);
        let made = match trigger::create_run(state, policy, t.at, cutoff, principal).await {
            Ok(o) => o,
            Err(trigger::TriggerError::Db(e)) => return Err(e.into()),
            Err(e) => return Err(BackfillError::Bad(e.to_string())),
        };
        match made {
            TriggerOutcome::Created(run) => {
                tracing::info!(run_id = %run.run_id, policy = name, window = %t.window,
                               cutoff = %run.cutoff.to_rfc3339(), "run created by backfill");
                out.created.push(Tick {
                    status: run.status.clone(),
                    run_id: Some(run.run_id.clone()),
                    cutoff: Some(window::format(run.cutoff)),
                    ..t
                });
            }
            TriggerOutcome::Existing(run) => out.skipped.push(Tick {
                status: run.status.clone(),
                run_id: Some(run.run_id.clone()),
                cutoff: Some(window::format(run.cutoff)),
                ..t
            }),
            TriggerOutcome::Suspended(_) => out.skipped.push(t),
        }
    }
    state.wake_planner.notify_waiters();
    Ok(out)
}

/// Splits the windows `request` covers into those to create and those to leave alone.
async fn choose(
    state: &AppState,
    policy: &Policy,
    request: &BackfillRequest,
) -> Result<(Vec<Tick>, Vec<Tick>, Option<String>), BackfillError> {
    let (page, named) = match request {
        BackfillRequest::Range(from, to) => {
            if from > to {
                return Err(BackfillError::Bad("`from` is later than `to`".into()));
            }
            let page = list(state, policy, Some(*from), Some(*to), MAX_TICKS, true).await?;
            (page, None)
        }
        BackfillRequest::Named(ws) => {
            if ws.is_empty() || ws.len() > MAX_BACKFILL {
                return Err(BackfillError::Bad(format!(
                    "`windows` must name 1-{MAX_BACKFILL} windows"
                )));
            }
            if let Some(w) = ws.iter().find(|w| !policy.schedule.is_tick(**w)) {
                return Err(BackfillError::Bad(format!(
                    "window {} is not a tick of the schedule `{}` ({})",
                    window::format(*w),
                    policy.schedule.expr(),
                    policy.schedule.zone_name()
                )));
            }
            let (lo, hi) = (*ws.iter().min().unwrap(), *ws.iter().max().unwrap());
            let page = list(state, policy, Some(lo), Some(hi), MAX_TICKS, false).await?;
            (page, Some(ws.clone()))
        }
    };
    if page.next_from.is_some() {
        return Err(BackfillError::Bad(format!(
            "the request spans more than {MAX_TICKS} ticks; narrow it"
        )));
    }
    if let Some(w) = named
        .iter()
        .flatten()
        .find(|w| !page.windows.iter().any(|t| t.at == **w))
    {
        return Err(BackfillError::Bad(format!(
            "window {} is in the future",
            window::format(*w)
        )));
    }
    let (wanted, skipped): (Vec<Tick>, Vec<Tick>) = page
        .windows
        .into_iter()
        .filter(|t| named.as_ref().is_none_or(|ws| ws.contains(&t.at)))
        .partition(|t| {
            t.status == "missed"
                || (named.is_some() && matches!(t.status.as_str(), "suspended" | "not_expected"))
        });
    if wanted.len() > MAX_BACKFILL {
        return Err(BackfillError::Bad(format!(
            "the range holds {} missed windows; a backfill creates at most {MAX_BACKFILL}: narrow `to`",
            wanted.len()
        )));
    }
    Ok((wanted, skipped, page.expected_from))
}
