//! `GET /policies/{policy}/windows` and `POST /policies/{policy}/backfill`: the ticks a policy's
//! schedule expected, and the runs created for the ones nobody triggered ([`crate::windows`]).

use chrono::{DateTime, Utc};

use super::*;
use crate::windows::{self, BackfillError, BackfillRequest};

/// Query of `GET /policies/{policy}/windows`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowsQuery {
    from: Option<String>,
    to: Option<String>,
    limit: Option<i64>,
}

impl QueryParams for WindowsQuery {
    const ACCEPTS: &'static [(&'static str, &'static str)] = &[
        ("from", "an RFC 3339 instant"),
        ("to", "an RFC 3339 instant"),
        ("limit", "an integer from 1 to 1000"),
    ];
}

/// The body of `POST /policies/{policy}/backfill`: a reason, and either `from` and `to` (their
/// missed windows) or `windows` (each named window that is missed or suspended).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct BackfillBody {
    reason: String,
    #[serde(default)]
    from: Option<String>,
    #[serde(default)]
    to: Option<String>,
    #[serde(default)]
    windows: Option<Vec<String>>,
}

impl HasReason for BackfillBody {
    fn reason(&self) -> &str {
        &self.reason
    }
}

fn instant(field: &str, s: &str) -> Result<DateTime<Utc>, String> {
    window::parse_rfc3339(s).ok_or_else(|| {
        format!("`{field}` must be an RFC 3339 instant like 2026-09-07T09:00:00Z, found `{s}`")
    })
}

use crate::window;

/// `GET /policies/{policy}/windows?from=&to=&limit=` (scope `ops:read`): each expected tick,
/// oldest first, at most `limit` (default and most 1,000); `next_from` continues.
pub async fn policy_windows(
    State(state): State<AppState>,
    caller: Caller,
    Segments(policy): Segments<String>,
    query: Result<Params<WindowsQuery>, Problem>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let p = require_policy(&state, &policy)?;
    let Params(q) = query?;
    let from = q.from.as_deref().map(|s| instant("from", s)).transpose();
    let to = q.to.as_deref().map(|s| instant("to", s)).transpose();
    let (from, to) = (from.map_err(bad_query)?, to.map_err(bad_query)?);
    let limit = q.limit.unwrap_or(windows::MAX_TICKS as i64);
    if !(1..=windows::MAX_TICKS as i64).contains(&limit) {
        return Err(bad_query(format!(
            "`limit` must be between 1 and {}",
            windows::MAX_TICKS
        )));
    }
    let page = windows::list(&state, p, from, to, limit as usize, true).await?;
    Ok(Json(page).into_response())
}

/// `POST /policies/{policy}/backfill` `{"reason", "from", "to"}` or `{"reason", "windows"}`
/// (scope `ops:write`): creates the runs of missed windows (at most 100), oldest first, each with
/// its own window's cutoff; suspended windows only when named in `windows`. 202 when it created
/// a run, 200 when there was nothing to create.
pub async fn backfill(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<NoQuery>, Problem>,
    Segments(policy): Segments<String>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.require("ops:write")?;
    query?;
    let p = require_policy(&state, &policy)?;
    let b: BackfillBody = reason_of(&body)?;
    let bad = |m: String| Problem::new(StatusCode::BAD_REQUEST, "bad-body", m);
    let request = match (&b.from, &b.to, &b.windows) {
        (Some(f), Some(t), None) => BackfillRequest::Range(
            instant("from", f).map_err(bad)?,
            instant("to", t).map_err(bad)?,
        ),
        (None, None, Some(ws)) => BackfillRequest::Named(
            ws.iter()
                .map(|w| instant("windows", w).map(window::normalize))
                .collect::<Result<_, _>>()
                .map_err(bad)?,
        ),
        _ => {
            return Err(bad(
                "give either `from` and `to` (backfills their missed windows) or `windows` (a list \
                 of windows to backfill, missed or suspended)"
                    .into(),
            ));
        }
    };
    let done = windows::backfill(&state, p, request, &caller.0, b.reason.trim())
        .await
        .map_err(|e| match e {
            BackfillError::Bad(m) => bad(m),
            e @ BackfillError::Suspended(_) => {
                Problem::new(StatusCode::CONFLICT, "conflict", e.to_string())
            }
            BackfillError::Db(e) => Problem::from(e),
        })?;
    let status = if done.created.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    Ok((status, Json(done)).into_response())
}
