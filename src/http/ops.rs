//! On-call endpoints: runs, their audit trail, policies, health (DESIGN §4). Thin handlers over
//! [`crate::ledger`] and [`crate::audit`].

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::http::{Caller, Problem};
use crate::ledger;
use crate::ledger::audit;
use crate::state::AppState;

/// Filters of `GET /runs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunsQuery {
    policy: Option<String>,
    status: Option<String>,
    limit: Option<i64>,
}

const RUN_STATUSES: &[&str] = &[
    "planning",
    "running",
    "completed",
    "completed_with_dead_letters",
    "cancelled",
];

fn bad_query(e: impl std::fmt::Display) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, "bad-query", e.to_string())
}

/// A `?policy=` filter must be a possible policy name (400 otherwise, as `openapi.yaml`'s
/// pattern says): a name no policy can have would silently match nothing.
fn policy_filter(policy: Option<&str>) -> Result<(), Problem> {
    match policy {
        Some(p) if crate::policy::PolicyName::parse(p).is_err() => Err(bad_query(
            "policy must be a policy name: 1-63 characters of a-z, 0-9, `-` and `_`, starting \
             with a letter or digit",
        )),
        _ => Ok(()),
    }
}

/// `GET /runs?policy=&status=&limit=` (scope `ops:read`): newest windows first, at most `limit`
/// (default 50, at most 500).
pub async fn list_runs(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Query<RunsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let Query(q) = query.map_err(|e| bad_query(e.body_text()))?;
    policy_filter(q.policy.as_deref())?;
    if let Some(s) = &q.status
        && !RUN_STATUSES.contains(&s.as_str())
    {
        return Err(bad_query(format!(
            "status `{s}` is not one of {}",
            RUN_STATUSES.join(", ")
        )));
    }
    let limit = q.limit.unwrap_or(50);
    if !(1..=500).contains(&limit) {
        return Err(bad_query("limit must be between 1 and 500"));
    }
    let runs =
        ledger::list_runs(&state.pool, q.policy.as_deref(), q.status.as_deref(), limit).await?;
    Ok(Json(json!({ "runs": runs })).into_response())
}

/// (pages_done, done, consecutive failures, last_error, last_error_at) of a planning job.
type PlanningState = (
    i32,
    bool,
    i32,
    Option<String>,
    Option<chrono::DateTime<chrono::Utc>>,
);

/// (command_id, state, attempts, last_error, last_error_class) of a stopped command.
type StoppedCommand = (String, String, i32, Option<String>, Option<String>);

/// `GET /runs/{run_id}` (scope `ops:read`): the run with its commands per state.
pub async fn get_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(run_id): Path<String>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let mut conn = state.pool.acquire().await?;
    let run = ledger::get_run(&mut conn, &run_id)
        .await?
        .ok_or_else(|| unknown_run(&run_id))?;
    drop(conn);
    let commands = ledger::command_states(&state.pool, &run_id).await?;
    let stopped: Vec<StoppedCommand> = sqlx::query_as(
        "select command_id, state, attempts, last_error, last_error_class from sweeper.commands
          where run_id = $1 and state in ('quarantined', 'cancelled')
          order by batch_no limit 100",
    )
    .bind(&run_id)
    .fetch_all(&state.pool)
    .await?;
    let planning: Option<PlanningState> = sqlx::query_as(
        "select pages_done, done, failures, last_error, last_error_at
               from sweeper.planning_jobs where run_id = $1",
    )
    .bind(&run_id)
    .fetch_optional(&state.pool)
    .await?;
    let held = ledger::run_hold(
        &state.pool,
        &run_id,
        state.config.ledger.hold_alert_after.seconds(),
    )
    .await?;
    let verdict = replay_verdict(&state, &run_id).await?;
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
    body["planning"] = match planning {
        Some((pages_done, done, failures, last_error, last_error_at)) => json!({
            "pages_done": pages_done, "done": done, "consecutive_failures": failures,
            "last_error": last_error, "last_error_at": last_error_at,
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
    body["open_dead_letters"] = json!(
        open.into_iter()
            .map(|d| {
                let mut v = serde_json::to_value(&d).unwrap_or_default();
                v["replay_safe"] = verdict.clone();
                v
            })
            .collect::<Vec<_>>()
    );
    Ok(Json(body).into_response())
}

fn unknown_run(run_id: &str) -> Problem {
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

/// `GET /runs/{run_id}/items?cursor=&limit=&outcome=` (scope `ops:read`): the run's audit rows in
/// log order, `limit` per page (default 100, at most 1000). `next_cursor` is null on the last page.
pub async fn run_items(
    State(state): State<AppState>,
    caller: Caller,
    Path(run_id): Path<String>,
    query: Result<Query<ItemsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let Query(q) = query.map_err(|e| bad_query(e.body_text()))?;
    let after = match &q.cursor {
        None => 0,
        Some(c) => c
            .parse::<i64>()
            .ok()
            .filter(|v| *v >= 0)
            .ok_or_else(|| bad_query("cursor must be a value returned as next_cursor"))?,
    };
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(bad_query("limit must be between 1 and 1000"));
    }
    let mut conn = state.pool.acquire().await?;
    if ledger::get_run(&mut conn, &run_id).await?.is_none() {
        return Err(unknown_run(&run_id));
    }
    drop(conn);
    let items = audit::items_page(&state.pool, &run_id, after, limit, q.outcome.as_deref()).await?;
    let next_cursor = (items.len() as i64 == limit)
        .then(|| items.last().map(|i| i.audit_id.to_string()))
        .flatten();
    Ok(Json(json!({ "items": items, "next_cursor": next_cursor })).into_response())
}

/// `GET /policies` (scope `ops:read`): loaded policies with their version and the ledger's
/// current version. No secrets: policies hold none.
pub async fn policies(State(state): State<AppState>, caller: Caller) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let current = ledger::current_versions(&state.pool).await?;
    let list: Vec<_> = state
        .config
        .policies
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "version": p.version,
                "current_version": current.get(p.name.as_str()),
                "schedule": { "cron": p.schedule.expr(), "timezone": p.schedule.zone_name() },
                "early_tolerance": p.early_tolerance,
                "retain_for": crate::config::DurationSpec::from_seconds(p.spec.retain_for_seconds),
                "target": p.spec.target,
                "exclude": p.spec.exclude,
                "action": p.spec.action,
                "batch_size": p.batch_size,
                "transport": p.transport,
            })
        })
        .collect();
    Ok(Json(json!({ "policies": list })).into_response())
}

/// `GET /healthz`: the process is alive.
pub async fn healthz() -> Response {
    (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
}

/// `GET /readyz`: the database answers and every migration this binary knows is applied.
pub async fn readyz(State(state): State<AppState>) -> Response {
    let latest = ledger::MIGRATOR
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap_or(0);
    let applied: Result<Option<i64>, _> =
        sqlx::query_scalar("select max(version) from _sqlx_migrations where success")
            .fetch_one(&state.pool)
            .await;
    match applied {
        Ok(Some(v)) if v >= latest => {
            (StatusCode::OK, Json(json!({"status": "ready"}))).into_response()
        }
        Ok(_) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-ready",
            "migrations are not current; run `sweeper migrate`",
        )
        .retry_after(5)
        .into_response(),
        // A database that was never migrated has no migrations table: reachable, not ready.
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42P01") => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-ready",
            "the ledger is not migrated; run `sweeper migrate`",
        )
        .retry_after(5)
        .into_response(),
        Err(e) => Problem::unavailable(e, 5).into_response(),
    }
}

/// `GET /metrics`: Prometheus text (no token: scrape it from inside the cluster).
pub async fn metrics(State(state): State<AppState>) -> Response {
    let policies: Vec<&str> = state
        .config
        .policies
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    match crate::metrics::render(
        &state.pool,
        &policies,
        state.config.ledger.hold_alert_after.seconds(),
    )
    .await
    {
        Ok(text) => (
            StatusCode::OK,
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => Problem::unavailable(e, 5).into_response(),
    }
}

/// The body every operator act takes: why, in the operator's words (1-1000 characters).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReasonBody {
    reason: String,
}

/// The body of a bulk redrive: a reason and what to redrive.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkRedriveBody {
    reason: String,
    #[serde(default)]
    run_id: Option<String>,
    #[serde(default)]
    class: Option<String>,
    #[serde(default, deserialize_with = "json_integer")]
    limit: Option<i64>,
}

/// An optional JSON Schema `integer`: any number with a zero fractional part (`514` and
/// `514.0` alike; JSON Schema draft 2020-12 §6.1.1), within i64.
fn json_integer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    use serde::de::Error;
    match Option::<serde_json::Number>::deserialize(d)? {
        None => Ok(None),
        Some(n) => n
            .as_i64()
            .or_else(|| {
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9.2e18)
                    .map(|f| f as i64)
            })
            .map(Some)
            .ok_or_else(|| D::Error::custom(format!("`limit`: {n} is not an integer"))),
    }
}

trait HasReason {
    fn reason(&self) -> &str;
}
impl HasReason for ReasonBody {
    fn reason(&self) -> &str {
        &self.reason
    }
}
impl HasReason for BulkRedriveBody {
    fn reason(&self) -> &str {
        &self.reason
    }
}

fn reason_of<B: serde::de::DeserializeOwned + HasReason>(body: &[u8]) -> Result<B, Problem> {
    let b: B = serde_json::from_slice(body).map_err(|e| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-body",
            format!("send a JSON body {{\"reason\": \"why you do this\"}}: {e}"),
        )
    })?;
    let len = b.reason().trim().chars().count();
    if !(1..=1000).contains(&len) {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-body",
            "`reason` must be 1-1000 characters",
        ));
    }
    Ok(b)
}

/// Query of `GET /dead-letters`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLettersQuery {
    run_id: Option<String>,
    policy: Option<String>,
    class: Option<String>,
    state: Option<String>,
    before: Option<i64>,
    limit: Option<i64>,
}

const CLASSES: &[&str] = &["transient", "throttled", "permanent"];

/// `GET /dead-letters?run_id=&policy=&class=&state=open|resolved&before=&limit=` (scope
/// `ops:read`): newest first; `next_before` pages on.
pub async fn list_dead_letters(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Query<DeadLettersQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let Query(q) = query.map_err(|e| bad_query(e.body_text()))?;
    policy_filter(q.policy.as_deref())?;
    if let Some(c) = &q.class
        && !CLASSES.contains(&c.as_str())
    {
        return Err(bad_query(format!(
            "class must be one of {}",
            CLASSES.join(", ")
        )));
    }
    if let Some(s) = &q.state
        && !matches!(s.as_str(), "open" | "resolved")
    {
        return Err(bad_query("state must be open or resolved"));
    }
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(bad_query("limit must be between 1 and 1000"));
    }
    let filter = crate::ledger::dead_letter::Filter {
        run_id: q.run_id.as_deref(),
        policy: q.policy.as_deref(),
        class: q.class.as_deref(),
        state: q.state.as_deref(),
    };
    let items = crate::ledger::dead_letter::list(&state.pool, &filter, q.before, limit).await?;
    let next_before = (items.len() as i64 == limit)
        .then(|| items.last().map(|d| d.dead_letter_id))
        .flatten();
    Ok(Json(json!({ "dead_letters": items, "next_before": next_before })).into_response())
}

fn unknown_dead_letter(id: i64) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-dead-letter",
        format!("no dead letter {id}"),
    )
}

/// `GET /dead-letters/{id}` (scope `ops:read`).
pub async fn get_dead_letter(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<i64>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let dl = crate::ledger::dead_letter::get(&state.pool, id)
        .await?
        .ok_or_else(|| unknown_dead_letter(id))?;
    let mut body = serde_json::to_value(&dl).map_err(Problem::internal)?;
    if let Some(run_id) = &dl.run_id {
        body["replay_safe"] = replay_verdict(&state, run_id).await?;
    }
    Ok(Json(body).into_response())
}

fn act_problem(e: crate::ledger::dead_letter::ActError) -> Problem {
    use crate::ledger::dead_letter::ActError;
    match e {
        ActError::NotFound(id) => unknown_dead_letter(id),
        ActError::Conflict(m) => Problem::new(StatusCode::CONFLICT, "conflict", m),
        ActError::Db(e) => Problem::from(e),
    }
}

/// `POST /dead-letters/{id}/redrive` `{"reason": ...}` (scope `ops:write`).
pub async fn redrive_dead_letter(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<i64>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    let b: ReasonBody = reason_of(&body)?;
    let r =
        crate::ledger::dead_letter::redrive(&state.pool, id, &caller.0.subject, b.reason.trim())
            .await
            .map_err(act_problem)?;
    state.wake_workers.notify_waiters();
    Ok(Json(json!({ "dead_letter_id": id, "result": r })).into_response())
}

/// `POST /dead-letters/{id}/abandon` `{"reason": ...}` (scope `ops:write`).
pub async fn abandon_dead_letter(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<i64>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    let b: ReasonBody = reason_of(&body)?;
    let r =
        crate::ledger::dead_letter::abandon(&state.pool, id, &caller.0.subject, b.reason.trim())
            .await
            .map_err(act_problem)?;
    Ok(Json(json!({ "dead_letter_id": id, "result": r })).into_response())
}

/// `POST /dead-letters/redrive` `{"reason", "run_id"?, "class"?, "limit"?}` (scope `ops:write`):
/// redrives open dead letters of a run and/or a class, at most `limit` (default 100, at most
/// 1000) per call; the queue paces their execution.
pub async fn redrive_dead_letters(
    State(state): State<AppState>,
    caller: Caller,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    let b: BulkRedriveBody = reason_of(&body)?;
    if b.run_id.is_none() && b.class.is_none() {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-body",
            "name `run_id`, `class` or both: a bulk redrive never takes everything",
        ));
    }
    if let Some(c) = &b.class
        && !CLASSES.contains(&c.as_str())
    {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-body",
            format!("class must be one of {}", CLASSES.join(", ")),
        ));
    }
    let limit = b.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-body",
            "limit must be between 1 and 1000",
        ));
    }
    let ids = crate::ledger::dead_letter::redrive_many(
        &state.pool,
        b.run_id.as_deref(),
        b.class.as_deref(),
        limit,
        &caller.0.subject,
        b.reason.trim(),
    )
    .await
    .map_err(act_problem)?;
    state.wake_workers.notify_waiters();
    Ok(Json(json!({ "redriven": ids })).into_response())
}

fn require_policy<'a>(
    state: &'a AppState,
    policy: &str,
) -> Result<&'a crate::policy::Policy, Problem> {
    state.config.policy(policy).ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-policy",
            format!("no policy named `{policy}` is configured"),
        )
    })
}

/// `POST /policies/{policy}/suspend` `{"reason": ...}` (scope `ops:write`).
pub async fn suspend_policy(
    State(state): State<AppState>,
    caller: Caller,
    Path(policy): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    require_policy(&state, &policy)?;
    let b: ReasonBody = reason_of(&body)?;
    let ps =
        crate::ledger::control::suspend(&state.pool, &policy, &caller.0.subject, b.reason.trim())
            .await?;
    Ok(Json(ps).into_response())
}

/// `POST /policies/{policy}/resume` `{"reason": ...}` (scope `ops:write`).
pub async fn resume_policy(
    State(state): State<AppState>,
    caller: Caller,
    Path(policy): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    require_policy(&state, &policy)?;
    let b: ReasonBody = reason_of(&body)?;
    let ps =
        crate::ledger::control::resume(&state.pool, &policy, &caller.0.subject, b.reason.trim())
            .await?;
    state.wake_workers.notify_waiters();
    Ok(Json(ps).into_response())
}

/// `POST /runs/{run_id}/cancel` `{"reason": ...}` (scope `ops:write`).
pub async fn cancel_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(run_id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    let b: ReasonBody = reason_of(&body)?;
    let c =
        crate::ledger::control::cancel(&state.pool, &run_id, &caller.0.subject, b.reason.trim())
            .await
            .map_err(|e| match e {
                crate::ledger::control::CancelError::NotFound(_) => unknown_run(&run_id),
                e @ crate::ledger::control::CancelError::Completed(..) => {
                    Problem::new(StatusCode::CONFLICT, "conflict", e.to_string())
                }
                crate::ledger::control::CancelError::Db(e) => Problem::from(e),
            })?;
    Ok(Json(c).into_response())
}

/// Whether replaying the run's commands is safe, and why: the effect is idempotent (one
/// transaction per command for `delete_rows`), the cutoff is fixed on the run, and the pinned
/// policy version is still the one that would apply.
async fn replay_verdict(state: &AppState, run_id: &str) -> Result<serde_json::Value, Problem> {
    let row: Option<(String, String, Option<String>)> = sqlx::query_as(
        "select r.policy, r.policy_version,
                (select version from sweeper.policy_versions v where v.policy = r.policy
                  order by seq desc limit 1)
           from sweeper.runs r where r.run_id = $1",
    )
    .bind(run_id)
    .fetch_optional(&state.pool)
    .await?;
    let Some((_policy, pinned, current)) = row else {
        return Ok(json!({"safe": false, "reasons": ["the run no longer exists"]}));
    };
    let version_current = current.as_deref() == Some(pinned.as_str());
    let mut reasons = vec![
        "effect idempotent: a command's deletes, audit rows and state commit in one transaction"
            .to_string(),
        "cutoff fixed: stored on the run and bound into every query".to_string(),
    ];
    if version_current {
        reasons.push(format!("pinned policy version {pinned} is still current"));
    } else {
        reasons.push(format!(
            "pinned policy version {pinned} is no longer current ({}): a replay applies the stricter of both",
            current.as_deref().unwrap_or("none")
        ));
    }
    Ok(json!({ "safe": version_current, "reasons": reasons }))
}
