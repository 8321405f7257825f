//! `GET /dead-letters`, `GET /dead-letters/{id}`, and the operator's acts on them: redrive
//! (one, or many by run and class) and abandon.

use super::*;

/// Query of `GET /dead-letters`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLettersQuery {
    run_id: Option<String>,
    policy: Option<String>,
    class: Option<String>,
    /// `open` (open or redriven), `resolved` (resolved or abandoned), or one exact status:
    /// `redriven`, `abandoned`.
    status: Option<String>,
    /// The older name of `status`, kept as an alias (both at once must agree).
    state: Option<String>,
    before: Option<i64>,
    limit: Option<i64>,
}

impl QueryParams for DeadLettersQuery {
    const ACCEPTS: &'static [(&'static str, &'static str)] = &[
        ("run_id", "a run id"),
        ("policy", "a policy name"),
        ("class", "transient, throttled, locked or permanent"),
        ("status", "open, resolved, redriven or abandoned"),
        (
            "state",
            "open, resolved, redriven or abandoned (the older name of `status`)",
        ),
        ("before", "a value returned as `next_before`, an integer"),
        ("limit", "an integer from 1 to 1000"),
    ];
}

pub(super) const CLASSES: &[&str] = &["transient", "throttled", "locked", "permanent"];

/// `GET /dead-letters?run_id=&policy=&class=&status=&before=&limit=` (scope `ops:read`): newest
/// first, each with its `replay_safe`; `next_before` pages on.
pub async fn list_dead_letters(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<DeadLettersQuery>, Problem>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let Params(q) = query?;
    policy_filter(q.policy.as_deref())?;
    if let Some(c) = &q.class
        && !CLASSES.contains(&c.as_str())
    {
        return Err(bad_query(format!(
            "`class` must be one of {}",
            CLASSES.join(", ")
        )));
    }
    let status = match (q.status, q.state) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad_query(
                "status and state (its older name) disagree: give one of them",
            ));
        }
        (a, b) => a.or(b),
    };
    if let Some(s) = &status
        && !matches!(s.as_str(), "open" | "resolved" | "redriven" | "abandoned")
    {
        return Err(bad_query(
            "`status` must be open (open or redriven), resolved (resolved or abandoned), \
             redriven or abandoned",
        ));
    }
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(bad_query("`limit` must be between 1 and 1000"));
    }
    let filter = crate::ledger::dead_letter::Filter {
        run_id: q.run_id.as_deref(),
        policy: q.policy.as_deref(),
        class: q.class.as_deref(),
        state: status.as_deref(),
    };
    let items = crate::ledger::dead_letter::list(&state.pool, &filter, q.before, limit).await?;
    let next_before = (items.len() as i64 == limit)
        .then(|| items.last().map(|d| d.dead_letter_id))
        .flatten();
    let items = with_verdicts(&state, &items).await?;
    Ok(Json(json!({ "dead_letters": items, "next_before": next_before })).into_response())
}

pub(super) fn unknown_dead_letter(id: i64) -> Problem {
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
    query: Result<Params<NoQuery>, Problem>,
    Segments(id): Segments<i64>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    query?;
    let dl = crate::ledger::dead_letter::get(&state.pool, id)
        .await?
        .ok_or_else(|| unknown_dead_letter(id))?;
    let body = with_verdicts(&state, std::slice::from_ref(&dl))
        .await?
        .pop()
        .unwrap_or_default();
    Ok(Json(body).into_response())
}

pub(super) fn act_problem(e: crate::ledger::dead_letter::ActError) -> Problem {
    use crate::ledger::dead_letter::ActError;
    match e {
        ActError::NotFound(id) => unknown_dead_letter(id),
        ActError::Conflict(m) => Problem::new(StatusCode::CONFLICT, "conflict", m),
        ActError::Db(e) => Problem::from(e),
    }
}

/// `POST /dead-letters/{id}/redrive` `{"reason": ...}` (scope `ops:write`): also answers
/// `will_fail_again` and `cause` as they were just before the redrive (see `replay_safe`).
pub async fn redrive_dead_letter(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
    Segments(id): Segments<i64>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    query?;
    let b: ReasonBody = reason_of(&body)?;
    // Asked before the redrive: whether its cause is still there (the redrive goes ahead
    // either way; the answer says it will fail again the same way).
    let before = match crate::ledger::dead_letter::get(&state.pool, id).await? {
        Some(dl) => with_verdicts(&state, std::slice::from_ref(&dl))
            .await?
            .pop(),
        None => None,
    };
    let r =
        crate::ledger::dead_letter::redrive(&state.pool, id, &caller.0.subject, b.reason.trim())
            .await
            .map_err(act_problem)?;
    state.wake_workers.notify_waiters();
    let verdict = before.map(|v| v["replay_safe"].clone()).unwrap_or_default();
    Ok(Json(json!({
        "dead_letter_id": id, "result": r,
        "will_fail_again": verdict["will_fail_again"], "cause": verdict["cause"],
    }))
    .into_response())
}

/// `POST /dead-letters/{id}/abandon` `{"reason": ...}` (scope `ops:write`).
pub async fn abandon_dead_letter(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
    Segments(id): Segments<i64>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    query?;
    let b: ReasonBody = reason_of(&body)?;
    let r =
        crate::ledger::dead_letter::abandon(&state.pool, id, &caller.0.subject, b.reason.trim())
            .await
            .map_err(act_problem)?;
    Ok(Json(json!({ "dead_letter_id": id, "result": r })).into_response())
}

/// `POST /dead-letters/redrive` `{"reason", "run_id"?, "class"?, "limit"?}` (scope `ops:write`):
/// redrives open dead letters of a run and/or a class, at most `limit` (default 100, at most
/// 1000) per call; the queue paces their execution. `will_fail_again` lists those redriven whose
/// cause was still there (a foreign key still referencing the item): they will fail the same way.
pub async fn redrive_dead_letters(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    query?;
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
            format!("`class` must be one of {}", CLASSES.join(", ")),
        ));
    }
    let limit = b.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-body",
            "`limit` must be between 1 and 1000",
        ));
    }
    // Which of the candidates will fail again the same way (asked before; redriven anyway).
    let candidates = crate::ledger::dead_letter::list(
        &state.pool,
        &crate::ledger::dead_letter::Filter {
            run_id: b.run_id.as_deref(),
            class: b.class.as_deref(),
            state: Some("open"),
            ..Default::default()
        },
        None,
        limit,
    )
    .await?;
    let still: Vec<i64> = with_verdicts(&state, &candidates)
        .await?
        .iter()
        .filter(|v| v["replay_safe"]["will_fail_again"] == json!(true))
        .filter_map(|v| v["dead_letter_id"].as_i64())
        .collect();
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
    let will_fail_again: Vec<i64> = still.into_iter().filter(|i| ids.contains(i)).collect();
    Ok(Json(json!({ "redriven": ids, "will_fail_again": will_fail_again })).into_response())
}
