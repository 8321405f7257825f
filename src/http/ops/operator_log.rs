//! `GET /operator-log`: who did what to which run, policy or dead letter, and why.

use super::*;
use crate::ledger::operator_log;

/// Query of `GET /operator-log`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorLogQuery {
    action: Option<String>,
    subject: Option<String>,
    target: Option<String>,
    since: Option<String>,
    before: Option<i64>,
    limit: Option<i64>,
}

impl QueryParams for OperatorLogQuery {
    const ACCEPTS: &'static [(&'static str, &'static str)] = &[
        ("action", "an operator action"),
        ("subject", "a caller's subject"),
        ("target", "a target prefix such as `policy:orders`"),
        ("since", "an RFC 3339 instant"),
        ("before", "a value returned as `next_before`, an integer"),
        ("limit", "an integer from 1 to 1000"),
    ];
}

/// `GET /operator-log?action=&subject=&target=&since=&before=&limit=` (scope `ops:read`):
/// entries newest first, `limit` per page (default 100, at most 1000); `next_before` pages on.
/// `target` matches a prefix (`policy:orders`, `run:orders:2026-`, `dead_letter:12`); `since`
/// is an RFC 3339 instant.
pub async fn list_operator_log(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Params<OperatorLogQuery>, Problem>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    let Params(q) = query?;
    if let Some(a) = &q.action
        && !operator_log::ACTIONS.contains(&a.as_str())
    {
        return Err(bad_query(format!(
            "`action` must be one of {}",
            operator_log::ACTIONS.join(", ")
        )));
    }
    let since = q
        .since
        .as_deref()
        .map(|s| {
            chrono::DateTime::parse_from_rfc3339(s)
                .map(|t| t.with_timezone(&chrono::Utc))
                .map_err(|_| bad_query("since must be an RFC 3339 instant"))
        })
        .transpose()?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(bad_query("`limit` must be between 1 and 1000"));
    }
    if q.before.is_some_and(|b| b < 1) {
        return Err(bad_query("before must be a value returned as next_before"));
    }
    let filter = operator_log::Filter {
        action: q.action.as_deref(),
        subject: q.subject.as_deref(),
        target_prefix: q.target.as_deref(),
        since,
    };
    let entries = operator_log::list(&state.pool, &filter, q.before, limit).await?;
    let next_before = (entries.len() as i64 == limit)
        .then(|| entries.last().map(|e| e.entry_id))
        .flatten();
    Ok(Json(json!({ "entries": entries, "next_before": next_before })).into_response())
}
