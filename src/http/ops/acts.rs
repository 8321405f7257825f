//! Operator acts on policies and runs: suspend, resume, cancel, approve; accepting the database's
//! identity; and the reason every act takes.

use super::*;

/// The body every operator act takes: why, in the operator's words (1-1000 characters).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReasonBody {
    pub(super) reason: String,
}

/// The body of a bulk redrive: a reason and what to redrive.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct BulkRedriveBody {
    pub(super) reason: String,
    #[serde(default)]
    pub(super) run_id: Option<String>,
    #[serde(default)]
    pub(super) class: Option<String>,
    #[serde(default, deserialize_with = "json_integer")]
    pub(super) limit: Option<i64>,
}

/// An optional JSON Schema `integer`: any number with a zero fractional part (`514` and
/// `514.0` alike; JSON Schema draft 2020-12 §6.1.1), within i64.
pub(super) fn json_integer<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<i64>, D::Error> {
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

pub(super) trait HasReason {
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

pub(super) fn reason_of<B: serde::de::DeserializeOwned + HasReason>(
    body: &[u8],
) -> Result<B, Problem> {
    let b: B = serde_json::from_slice(body).map_err(|e| {
        // Our words, not serde's: where the body went wrong, never its text.
        use serde_json::error::Category;
        let what = match e.classify() {
            Category::Eof if body.is_empty() => "the body is empty".to_string(),
            Category::Eof => "the body ends before its JSON does".to_string(),
            Category::Syntax | Category::Io => format!(
                "the body is not valid JSON (line {}, column {})",
                e.line(),
                e.column()
            ),
            // Our own messages (a field's checks, like `limit`'s) start with the field's name.
            Category::Data => match e.to_string().split(" at line ").next() {
                Some(ours) if ours.starts_with('`') => ours.to_string(),
                _ => "a field is unknown, missing or of the wrong type".to_string(),
            },
        };
        Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-body",
            format!("send a JSON body {{\"reason\": \"why you do this\"}}: {what}"),
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

pub(super) fn require_policy<'a>(
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
    query: Result<Params<NoQuery>, Problem>,
    Segments(policy): Segments<String>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    query?;
    require_policy(&state, &policy)?;
    let b: ReasonBody = reason_of(&body)?;
    let (ps, changed) =
        crate::ledger::control::suspend(&state.pool, &policy, &caller.0.subject, b.reason.trim())
            .await?;
    if changed {
        crate::metrics::hold_started(crate::ledger::HoldKind::Suspended);
    }
    Ok(Json(ps).into_response())
}

/// `POST /policies/{policy}/resume` `{"reason": ...}` (scope `ops:write`).
pub async fn resume_policy(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
    Segments(policy): Segments<String>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    query?;
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
    query: Result<Params<NoQuery>, Problem>,
    Segments(run_id): Segments<String>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    query?;
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

/// `POST /runs/{run_id}/approve` `{"reason": ...}` (scope `ops:write`): releases a run the
/// blast-radius guard holds. 409 when it is not waiting for approval.
pub async fn approve_run(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
    Segments(run_id): Segments<String>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    query?;
    let b: ReasonBody = reason_of(&body)?;
    let a =
        crate::ledger::control::approve(&state.pool, &run_id, &caller.0.subject, b.reason.trim())
            .await
            .map_err(|e| match e {
                crate::ledger::control::ApproveError::NotFound(_) => unknown_run(&run_id),
                e @ crate::ledger::control::ApproveError::NotHeld(..) => {
                    Problem::new(StatusCode::CONFLICT, "conflict", e.to_string())
                }
                crate::ledger::control::ApproveError::Db(e) => Problem::from(e),
            })?;
    state.wake_workers.notify_waiters();
    Ok(Json(a).into_response())
}

/// `POST /guard/accept` `{"reason": ...}` (scope `ops:write`): records the database's identity as
/// found now and releases the restore and clone guard's hold on every policy.
pub async fn accept_identity(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    query?;
    let b: ReasonBody = reason_of(&body)?;
    let g =
        crate::ledger::identity::accept(&state.pool, &caller.0.subject, b.reason.trim()).await?;
    state.wake_workers.notify_waiters();
    Ok(Json(g).into_response())
}
