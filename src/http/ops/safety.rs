//! Reads of the production-safety controls (docs/design.md §14 "Holds"): the governor's signals on this
//! replica and the restore and clone guard's recorded identity.

use super::*;

/// `GET /governor` (scope `ops:read`): this replica's latest reading, and per policy each
/// signal's reading, marks and verdict (`unreadable` when the role cannot read it, never 0) and
/// whether the governor holds its work.
pub async fn governor(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    query?;
    let reading = state.governor.reading();
    let policies: Vec<serde_json::Value> = state
        .config
        .policies
        .iter()
        .map(|p| {
            let table = p.spec.target.table.quoted();
            let signals = match &reading {
                Some(Ok(r)) => json!(crate::governor::signals(r, &p.safety.governor, &table)),
                _ => serde_json::Value::Null,
            };
            let held = state.governor.held(p.name.as_str());
            json!({
                "policy": p.name.as_str(), "enabled": p.safety.governor.enabled,
                "held": held.map(|(since, why)| json!({"since": since, "detail": why})),
                "slots": state.governor.slots(p.name.as_str(), p.max_concurrent_commands),
                "max_concurrent_commands": p.max_concurrent_commands,
                "signals": signals,
            })
        })
        .collect();
    let (at, error) = match &reading {
        Some(Ok(r)) => (Some(r.at), None),
        Some(Err(e)) => (None, Some(e.clone())),
        None => (None, Some("no reading yet".to_string())),
    };
    Ok(Json(json!({
        "replica": state.replica_id, "read_at": at, "error": error,
        "standbys": reading.and_then(|r| r.ok()).map(|r| r.standbys),
        "policies": policies,
    }))
    .into_response())
}

/// `GET /guard` (scope `ops:read`): the recorded identity, its heartbeat and any hold, beside
/// the identity PostgreSQL reports now.
pub async fn guard(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    query?;
    let recorded = crate::ledger::identity::state(&state.pool).await?;
    let now = crate::ledger::identity::observe(&state.pool).await?;
    Ok(Json(json!({
        "recorded": recorded, "observed": now,
        "max_silence": state.config.guard.max_silence,
    }))
    .into_response())
}
