//! `GET /healthz`, `GET /readyz`, `GET /metrics` (no token) and `GET /policies`.

use super::*;

/// `GET /policies` (scope `ops:read`): loaded policies with their version, the ledger's
/// current version, `suspended` (null, or since when, by whom and why), `last_run` (its latest
/// live window's run: id, window, status, completed_at; null before the first), `next_window`
/// (the schedule's next tick after the ledger's now) and `planning` — the path a run triggered now would plan along, and why
/// ([`crate::policy::path::PathChoice`]). No secrets: policies hold none.
pub async fn policies(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    query?;
    let current = ledger::current_versions(&state.pool).await?;
    let mut conn = state.pool.acquire().await?;
    let now = ledger::now(&mut conn).await?;
    let mut planning = Vec::new();
    for p in &state.config.policies {
        planning.push(planning_path(&mut conn, p, now, state.config.planning.path).await);
    }
    drop(conn);
    let suspended = ledger::control::policy_states(&state.pool).await?;
    let last = ledger::attention::list_latest_runs(&state.pool).await?;
    let list: Vec<_> = state
        .config
        .policies
        .iter()
        .zip(planning)
        .map(|(p, planning)| {
            let ps = suspended.get(p.name.as_str()).filter(|s| s.suspended);
            let last = last.iter().find(|r| r.0 == p.name.as_str());
            json!({
                "name": p.name,
                "version": p.version,
                "current_version": current.get(p.name.as_str()),
                "suspended": ps.map(|s| json!({
                    "since": s.suspended_at, "by": s.changed_by, "reason": s.reason,
                })),
                "last_run": last.map(|(_, run_id, window, status, completed_at)| json!({
                    "run_id": run_id, "window": crate::window::format(*window),
                    "status": status, "completed_at": completed_at,
                })),
                "next_window": p.schedule.next_tick_after(now).map(crate::window::format),
                "schedule": { "cron": p.schedule.expr(), "timezone": p.schedule.zone_name() },
                "early_tolerance": p.early_tolerance,
                "retain_for": p.spec.select.is_empty()
                    .then(|| crate::config::DurationSpec::from_seconds(p.spec.retain_for_seconds)),
                "select": p.spec.select,
                "target": p.spec.target,
                "exclude": p.spec.exclude,
                "action": p.spec.action,
                "batch_size": p.batch_size,
                "transport": p.transport,
                "planning": planning,
            })
        })
        .collect();
    Ok(Json(json!({ "policies": list })).into_response())
}

/// The planning path a run triggered now would take (its cutoff `now − retain_for`), and why;
/// `{"path": null, "reason": …}` when the database cannot say (the table is missing).
async fn planning_path(
    conn: &mut sqlx::PgConnection,
    p: &crate::policy::Policy,
    now: chrono::DateTime<chrono::Utc>,
    path: crate::config::PathSetting,
) -> serde_json::Value {
    let cutoff = now - chrono::TimeDelta::seconds(p.spec.retain_for_seconds);
    let table = &p.spec.target.table;
    match sqlx::query_scalar::<_, bool>("select to_regclass($1) is not null")
        .bind(table.quoted())
        .fetch_one(&mut *conn)
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            return json!({"path": null, "reason": format!("table {table} does not exist")});
        }
        Err(e) => {
            return json!({"path": null, "reason": format!(
                "the planning path could not be estimated: {}",
                crate::retry::Setback::from_db(&e).message())});
        }
    }
    match crate::policy::path::choose(conn, &p.spec.target, cutoff, path).await {
        Ok(choice) => json!(choice),
        Err(e) => json!({
            "path": null,
            "reason": format!("the planning path could not be estimated: {}",
                              crate::retry::Setback::from_db(&e).message()),
        }),
    }
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
    let applied = ledger::migrations::applied_version(&state.pool).await;
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
    let mut figures = Vec::with_capacity(policies.len());
    for p in &state.config.policies {
        match crate::windows::missed_recently(&state, p).await {
            Ok(missed) => figures.push(crate::metrics::PolicyFigures {
                name: p.name.as_str(),
                missed,
                period_seconds: p.schedule.longest_period_seconds(),
            }),
            Err(e) => return Problem::unavailable(e, 5).into_response(),
        }
    }
    let dependencies: Vec<&str> = state
        .config
        .dependencies
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    let (mut hours, mut governor) = (Vec::new(), Vec::new());
    for p in &policies {
        match crate::holds::policy_hold(&state, p).map(|h| h.kind) {
            Some(crate::retry::HoldKind::ActiveHours) => hours.push(p.to_string()),
            Some(_) => governor.push(p.to_string()),
            None => {}
        }
    }
    match crate::metrics::render(
        &state.pool,
        &figures,
        &dependencies,
        state.config.ledger.hold_alert_after.seconds(),
        (&hours, &governor),
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
