//! On-call endpoints: runs, their audit trail, policies, health (DESIGN §4). Thin handlers over
//! [`crate::ledger`] and [`crate::audit`].

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::app::AppState;
use crate::audit;
use crate::http::{Caller, Problem};
use crate::ledger;

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

/// `GET /runs?policy=&status=&limit=` (scope `ops:read`): newest windows first, at most `limit`
/// (default 50, at most 500).
pub async fn list_runs(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Query<RunsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let Query(q) = query.map_err(|e| bad_query(e.body_text()))?;
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
    let mut body = serde_json::to_value(&run).map_err(Problem::internal)?;
    body["commands"] = json!(commands);
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
