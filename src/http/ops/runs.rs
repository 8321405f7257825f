//! `GET /runs`, `GET /runs/{run_id}`, `GET /runs/{run_id}/items`: the runs and their audit
//! trail, for on-call.

use super::*;

/// Filters of `GET /runs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunsQuery {
    policy: Option<String>,
    status: Option<String>,
    limit: Option<i64>,
}

impl QueryParams for RunsQuery {
    const ACCEPTS: &'static [(&'static str, &'static str)] = &[
        ("policy", "a policy name"),
        ("status", "a run status or `attention`"),
        ("limit", "an integer from 1 to 500"),
    ];
}

pub(super) fn bad_query(e: impl std::fmt::Display) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, "bad-query", e.to_string())
}

/// A `?policy=` filter must be a possible policy name (400 otherwise, as `openapi.yaml`'s
/// pattern says): a name no policy can have would silently match nothing.
pub(super) fn policy_filter(policy: Option<&str>) -> Result<(), Problem> {
    match policy {
        Some(p) if crate::policy::PolicyName::parse(p).is_err() => Err(bad_query(
            "policy must be a policy name: 1-63 characters of a-z, 0-9, `-` and `_`, starting \
             with a letter or digit",
        )),
        _ => Ok(()),
    }
}

/// `?status=` that lists the runs needing a look rather than one status.
const ATTENTION: &str = "attention";

/// `GET /runs?policy=&status=&limit=` (scope `ops:read`): newest windows first, at most `limit`
/// (default 50, at most 500). `status=attention`: the runs that need a look, each with its
/// `reason` (see [`super::attention`]).
pub async fn list_runs(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<RunsQuery>, Problem>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let Params(q) = query?;
    policy_filter(q.policy.as_deref())?;
    if let Some(s) = &q.status
        && s != ATTENTION
        && ledger::RunStatus::parse(s).is_none()
    {
        return Err(bad_query(format!(
            "status `{s}` is not one of {}, {ATTENTION}",
            ledger::RunStatus::ALL
                .map(ledger::RunStatus::as_str)
                .join(", ")
        )));
    }
    let limit = q.limit.unwrap_or(50);
    if !(1..=500).contains(&limit) {
        return Err(bad_query("`limit` must be between 1 and 500"));
    }
    if q.status.as_deref() == Some(ATTENTION) {
        return super::attention::attention(&state, q.policy.as_deref(), limit).await;
    }
    let runs =
        ledger::list_runs(&state.pool, q.policy.as_deref(), q.status.as_deref(), limit).await?;
    Ok(Json(json!({ "runs": runs })).into_response())
}

/// A planning job as `GET /runs/{id}` shows it.
#[derive(sqlx::FromRow)]
pub(super) struct PlanningState {
    pages_done: i32,
    done: bool,
    failures: i32,
    last_error: Option<String>,
    last_error_at: Option<chrono::DateTime<chrono::Utc>>,
    /// `key_order` or `timestamp_index`; NULL until the first page chose it.
    path: Option<String>,
    path_reason: Option<String>,
    cursor_key: Option<String>,
    /// Epoch seconds (the cursor may be `-infinity`, which chrono cannot hold).
    cursor_epoch: Option<f64>,
}

pub(super) use ledger::StoppedCommand;

/// The current version's cutoff when it is stricter than the run's (a longer `retain_for` since
/// the run was pinned): the run acts under it, and says so. A finished run shows the one it
/// completed under, as recorded then.
async fn stricter_cutoff(
    state: &AppState,
    run: &ledger::Run,
) -> Result<Option<crate::policy::StricterCutoff>, Problem> {
    if run.is_terminal() {
        let recorded = ledger::runs::recorded_stricter_cutoff(&state.pool, &run.run_id).await?;
        return Ok(
            recorded.map(|(cutoff, version)| crate::policy::StricterCutoff { version, cutoff })
        );
    }
    let mut conn = state.pool.acquire().await?;
    let (_, version, current) =
        ledger::run_specs::<crate::policy::PolicySpec>(&mut conn, &run.policy, &run.policy_version)
            .await?;
    Ok(current
        .and_then(|c| crate::policy::StricterCutoff::of(&version, &c, run.cutoff, run.window_at)))
}

/// Retrying commands `GET /runs/{id}` lists (`retrying` counts them all).
const RETRYING_SHOWN: i64 = 20;

/// `GET /runs/{run_id}` (scope `ops:read`): the run with its commands per state, why it is not
/// done (`held`, `retrying_commands` with their last error, `waiting_on_lock_commands` whose
/// rows another transaction holds locked, `stopped_commands`, open dead letters with their
/// `replay_safe`) and its `progress`.
pub async fn get_run(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
    Segments(run_id): Segments<String>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    query?;
    let mut conn = state.pool.acquire().await?;
    let run = ledger::get_run(&mut conn, &run_id)
        .await?
        .ok_or_else(|| unknown_run(&run_id))?;
    drop(conn);
    let commands = ledger::command_states(&state.pool, &run_id).await?;
    let stopped = ledger::stopped_commands(&state.pool, &run_id).await?;
    let planning: Option<PlanningState> = sqlx::query_as(
        "select pages_done, done, failures, last_error, last_error_at, path, path_reason,
                cursor_key, extract(epoch from cursor_timestamp)::float8 as cursor_epoch
               from sweeper.planning_jobs where run_id = $1",
    )
    .bind(&run_id)
    .fetch_optional(&state.pool)
    .await?;
    let (held, approval) = crate::holds::run_held(&state, &run).await?;
    let stricter = stricter_cutoff(&state, &run).await?;
    let verdict = replay_verdict(&state, &run_id).await?;
    let retrying = ledger::attention::retrying(&state.pool, &run_id, RETRYING_SHOWN, false).await?;
    let waiting = ledger::attention::retrying(&state.pool, &run_id, RETRYING_SHOWN, true).await?;
    let facts = ledger::attention::facts(&state.pool, &[run_id.as_str()])
        .await?
        .remove(&run_id)
        .unwrap_or_default();
    let progress = progress(&state, &run, planning.as_ref()).await?;
    let open = crate::ledger::dead_letter::list(
        &state.pool,
        &crate::ledger::dead_letter::Filter {
            run_id: Some(&run_id),
            state: Some("open"),
            ..Default::default()
        },
        None,
        100,
    )
    .await?;
    let mut body = serde_json::to_value(&run).map_err(Problem::internal)?;
    body["commands"] = json!(commands);
    body["held"] = held.unwrap_or(serde_json::Value::Null);
    body["approval"] = approval;
    // A finished run says what it completed under (recorded with its closure check).
    body["effective_cutoff"] = json!(stricter.as_ref().map_or(run.cutoff, |s| s.cutoff));
    body["stricter_cutoff"] = json!(stricter);
    body["planning"] = match planning {
        Some(p) => json!({
            "pages_done": p.pages_done, "done": p.done, "consecutive_failures": p.failures,
            "last_error": p.last_error, "last_error_at": p.last_error_at,
            "path": p.path, "path_reason": p.path_reason,
        }),
        None => serde_json::Value::Null,
    };
    body["stopped_commands"] = json!(
        stopped
            .into_iter()
            .map(|(command_id, state, attempts, error, class)| json!({
                "command_id": command_id, "state": state, "attempts": attempts,
                "last_error": error, "last_error_class": class, "replay_safe": verdict,
            }))
            .collect::<Vec<_>>()
    );
    body["open_dead_letters"] = json!(with_verdicts(&state, &open).await?);
    body["dead_letters"] = json!({
        "open": facts.open_dead_letters, "redriven": facts.redriven_dead_letters,
        "abandoned": facts.abandoned_dead_letters, "resolved": facts.resolved_dead_letters,
    });
    body["retrying"] = json!(facts.retrying_commands);
    body["retrying_commands"] = json!(retrying);
    body["waiting_on_lock"] = json!(facts.waiting_on_lock_commands);
    body["waiting_on_lock_commands"] = json!(waiting);
    body["progress"] = json!(progress);
    // The partitions the run retires whole (partitions = "drop"), each with where it stands.
    body["partitions"] = json!(ledger::retirements::of_run(&state.pool, &run_id).await?);
    Ok(Json(body).into_response())
}

/// The run's progress; while it plans, `planned_fraction` estimated from its cursor.
async fn progress(
    state: &AppState,
    run: &ledger::Run,
    planning: Option<&PlanningState>,
) -> Result<ledger::attention::Progress, Problem> {
    let mut progress = ledger::attention::progress(&state.pool, run).await?;
    if let (false, Some(p), Some(policy)) = (
        run.planning_done,
        planning,
        state.config.policy(&run.policy),
    ) {
        let cursor = crate::plan::estimate::Cursor {
            path: p.path.as_deref(),
            key: p.cursor_key.as_deref(),
            timestamp: p.cursor_epoch,
        };
        progress.planned_fraction = crate::plan::estimate::planned_fraction(
            &state.pool,
            &policy.spec.target,
            &cursor,
            run.cutoff,
        )
        .await;
    }
    Ok(progress)
}

/// A page of audit rows: `(after, limit)` from `?cursor=` (an `audit_id` returned as
/// `next_cursor`; 0 when absent) and `?limit=` (default 100, 1-1000).
pub(super) fn audit_page(cursor: Option<&str>, limit: Option<i64>) -> Result<(i64, i64), Problem> {
    let after = match cursor {
        None => 0,
        Some(c) => cursor_id(c)
            .ok_or_else(|| bad_query("`cursor` must be a value returned as `next_cursor`"))?,
    };
    let limit = limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(bad_query("`limit` must be between 1 and 1000"));
    }
    Ok((after, limit))
}

/// An id in a cursor: ASCII digits only (no sign), at most an `i64`.
fn cursor_id(v: &str) -> Option<i64> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// A page of a run's items: `((execution_id, audit_id), limit)` from `?cursor=` (`E.A` as
/// returned in `next_cursor`; a bare id, as cursors were before the audit's execution rows, is
/// the row of the first shape with that id) and `?limit=`.
fn run_items_page(cursor: Option<&str>, limit: Option<i64>) -> Result<((i64, i64), i64), Problem> {
    let bad = || bad_query("`cursor` must be a value returned as `next_cursor`");
    let id = |v: &str| cursor_id(v).ok_or_else(bad);
    let after = match cursor.map(|c| c.split_once('.').ok_or(c)) {
        None => (0, 0),
        Some(Ok((e, a))) => (id(e)?, id(a)?),
        Some(Err(a)) => (id(a)?, id(a)?),
    };
    let (_, limit) = audit_page(None, limit)?;
    Ok((after, limit))
}

pub(super) fn unknown_run(run_id: &str) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-run",
        format!("no run `{run_id}`"),
    )
}

/// Query of `GET /runs/{run_id}/items`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ItemsQuery {
    cursor: Option<String>,
    limit: Option<i64>,
    outcome: Option<String>,
}

impl QueryParams for ItemsQuery {
    const ACCEPTS: &'static [(&'static str, &'static str)] = &[
        ("cursor", "a value returned as `next_cursor`"),
        ("limit", "an integer from 1 to 1000"),
        ("outcome", "an audit outcome"),
    ];
}

/// `GET /runs/{run_id}/items?cursor=&limit=&outcome=` (scope `ops:read`): the run's audit rows in
/// log order, `limit` per page (default 100, at most 1000). `next_cursor` is null on the last page.
pub async fn run_items(
    State(state): State<AppState>,
    caller: Caller,
    Segments(run_id): Segments<String>,
    query: Result<Params<ItemsQuery>, Problem>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let Params(q) = query?;
    let (after, limit) = run_items_page(q.cursor.as_deref(), q.limit)?;
    if let Some(o) = &q.outcome
        && !ledger::Outcome::ALL.iter().any(|k| k.as_str() == o)
    {
        return Err(bad_query(format!(
            "outcome must be one of {}",
            ledger::Outcome::ALL.map(ledger::Outcome::as_str).join(", ")
        )));
    }
    let mut conn = state.pool.acquire().await?;
    if ledger::get_run(&mut conn, &run_id).await?.is_none() {
        return Err(unknown_run(&run_id));
    }
    drop(conn);
    let items = audit::items_page(&state.pool, &run_id, after, limit, q.outcome.as_deref()).await?;
    let next_cursor = (items.len() as i64 == limit)
        .then(|| {
            items
                .last()
                .map(|i| format!("{}.{}", i.execution_id, i.audit_id))
        })
        .flatten();
    Ok(Json(json!({ "items": items, "next_cursor": next_cursor })).into_response())
}
