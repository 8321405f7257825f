//! `POST /trigger/{policy}`: extract, call [`crate::trigger`], map the result.

use super::*;

/// `?window=` and `?dry_run=` of a trigger.
#[derive(Debug, Deserialize)]
pub struct TriggerQuery {
    window: Option<String>,
    #[serde(default)]
    dry_run: bool,
}

impl QueryParams for TriggerQuery {
    const ACCEPTS: &'static [(&'static str, &'static str)] = &[
        ("window", "the tick as an RFC 3339 instant"),
        ("dry_run", "`true` or `false`"),
    ];
}

pub(super) async fn trigger_handler(
    State(state): State<AppState>,
    Segments(policy): Segments<String>,
    caller: Caller,
    query: Result<Params<TriggerQuery>, Problem>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.verify_body(&body)?;
    caller.require(&format!("trigger:{policy}"))?;
    let Params(query) = query?;
    let policy = state.config.policy(&policy).ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-policy",
            format!("no policy named `{policy}` is configured"),
        )
    })?;
    let hints = WindowHints {
        schedule_time_header: headers
            .get("x-cloudscheduler-scheduletime")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        window_param: query.window,
    };
    let outcome = crate::trigger::trigger(&state, policy, hints, query.dry_run, &caller.0)
        .await
        .map_err(|e| match e {
            TriggerError::BadWindow(m) => Problem::new(StatusCode::BAD_REQUEST, "bad-window", m),
            TriggerError::Forbidden(m) => {
                Problem::new(StatusCode::FORBIDDEN, "backfill-forbidden", m)
            }
            TriggerError::Busy(m) => {
                Problem::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", m).retry_after(1)
            }
            TriggerError::Db(e) => Problem::from(e),
        })?;
    let created = matches!(outcome, TriggerOutcome::Created(_));
    let (status, run) = match outcome {
        TriggerOutcome::Created(run) => (StatusCode::ACCEPTED, run),
        TriggerOutcome::Existing(run) => (StatusCode::OK, run),
        TriggerOutcome::Suspended(ps) => {
            return Ok((
                StatusCode::OK,
                Json(json!({"policy": ps.policy, "state": "suspended", "suspended_at": ps.suspended_at,
                            "suspended_by": ps.changed_by, "reason": ps.reason,
                            "detail": "the policy is suspended: no run was created"})),
            )
                .into_response());
        }
    };
    let location = format!("/runs/{}", run.run_id);
    // What holds the run already (a restored database, a suspension, an approval, a stage, the
    // governor): a cron's log only ever sees this answer.
    let held = crate::holds::run_held(&state, &run).await;
    // The answer is ready before planning starts (a held object failing to read does not lose
    // the run: planning is woken either way).
    if created {
        state.wake_planner.notify_waiters();
    }
    let (held, _) = held?;
    let mut body = serde_json::to_value(&run).map_err(Problem::internal)?;
    body["held"] = held.unwrap_or(serde_json::Value::Null);
    let mut resp = (status, Json(body)).into_response();
    if let Ok(v) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    Ok(resp)
}
