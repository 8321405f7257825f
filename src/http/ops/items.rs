//! `GET /policies/{policy}/items/{key}`: what happened to one record under one policy — which
//! runs, windows, cutoffs and policy versions touched it and with what outcome, its effects and
//! its dead letters.

use super::*;

/// Longest key looked up, in bytes after percent-decoding (a request line over 64 KiB is refused
/// by the HTTP server before any handler, with a bare 414).
pub const MAX_KEY_BYTES: usize = 4_096;

/// Query of `GET /policies/{policy}/items/{key}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ItemQuery {
    cursor: Option<String>,
    limit: Option<i64>,
}

impl QueryParams for ItemQuery {
    const ACCEPTS: &'static [(&'static str, &'static str)] = &[
        ("cursor", "a value returned as `next_cursor`"),
        ("limit", "an integer from 1 to 1000"),
    ];
}

/// `GET /policies/{policy}/items/{key}?cursor=&limit=` (scope `ops:read`): the record's audit
/// rows across runs, oldest first, `limit` per page (default 100, at most 1000; `next_cursor`
/// pages on, null on the last page), with its `effects` and `dead_letters` (each at most 100,
/// on every page). The key is parsed per key column and written canonically before the lookup
/// (a bigint `007` is `7`, a uuid lower case, a key of several columns compact JSON); a text
/// key is taken as the path segment decodes (`%2F` is `/`). When audit months were exported and dropped,
/// `history_complete_since` is the end of the last one and `exports` says where they went;
/// otherwise it is null (the ledger holds the whole history).
// Over 80 lines: parse, canonicalize, three reads and the answer's assembly, in order.
pub async fn item_history(
    State(state): State<AppState>,
    caller: Caller,
    Segments((policy, key)): Segments<(String, String)>,
    query: Result<Params<ItemQuery>, Problem>,
) -> Result<Response, Problem> {
    caller.require("ops:read")?;
    if key.len() > MAX_KEY_BYTES {
        return Err(Problem::new(
            StatusCode::URI_TOO_LONG,
            "key-too-long",
            format!(
                "the key is {} bytes after percent-decoding; a key sweeper can look up is at \
                 most {MAX_KEY_BYTES}",
                key.len()
            ),
        ));
    }
    let Params(q) = query?;
    let p = require_policy(&state, &policy)?;
    let (after, limit) = audit_page(q.cursor.as_deref(), q.limit)?;
    let key_of = crate::policy::references::key(&state.pool, &p.spec.target)
        .await?
        .map_err(|why| {
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                format!(
                    "the policy's key {} cannot be read: {why}",
                    p.spec.target.key
                ),
            )
        })?;
    let canonical = canonical_key(&key_of, &key)?;
    let rows =
        ledger::item_history::audit_rows(&state.pool, &policy, &canonical, after, limit).await?;
    let effects = ledger::item_history::effects(&state.pool, &policy, &canonical).await?;
    let dead = ledger::item_history::dead_letters(&state.pool, &policy, &canonical).await?;
    let dead = with_verdicts(&state, &dead).await?;
    let dropped = ledger::item_history::dropped_exports(&state.pool).await?;
    let now = present(&state, &policy, &canonical).await?;
    let dropped_partitions = dropped_partitions(&state, p, &key_of, &canonical).await?;
    let next_cursor = (rows.len() as i64 == limit)
        .then(|| rows.last().map(|r| r.audit_id.to_string()))
        .flatten();
    let open_effect = effects.iter().find(|e| e.state != "closed");
    let earlier = earlier_key(&state, &policy, &key_of, &canonical, limit).await?;
    let (key_values, key_columns) = key_of.describe(&canonical);
    let key_type = match key_of.columns() {
        [(_, t)] => Some(t.as_str()),
        _ => None,
    };
    Ok(Json(json!({
        "policy": policy,
        "item_key": canonical,
        "key": key_values,
        "key_columns": key_columns,
        "key_type": key_type,
        "earlier_key": earlier,
        "audit": rows,
        "next_cursor": next_cursor,
        "open_effect": open_effect,
        "effects": effects,
        "dead_letters": dead,
        "history_complete_since": dropped.last().map(|d| d.to_at),
        "exports": dropped,
        "dropped_partitions": dropped_partitions,
        "present_state": now.0,
        "unitemized_runs": now.1,
    }))
    .into_response())
}

/// The manifests of the policy's dropped partitions whose range holds the key (docs/design.md §14
/// "Partition sweep"): every key of a partitioned target includes its timestamp, which says
/// which partition held it. Empty when the key has no timestamp column.
async fn dropped_partitions(
    state: &AppState,
    p: &crate::policy::Policy,
    key_of: &crate::policy::Key,
    canonical: &str,
) -> Result<Vec<serde_json::Value>, Problem> {
    let ts = p.spec.target.timestamp.as_str();
    let Some(at) = key_of
        .columns()
        .iter()
        .position(|(name, _)| name.as_str() == ts)
    else {
        return Ok(Vec::new());
    };
    let Some(value) = key_of
        .values(canonical)
        .ok()
        .and_then(|v| v.get(at).cloned())
    else {
        return Ok(Vec::new());
    };
    let zone = p.spec.target.timestamp_zone.as_deref();
    Ok(ledger::retirements::manifests_holding(&state.pool, p.name.as_str(), &value, zone).await?)
}

/// Runs listed in `unitemized_runs` at most.
const UNITEMIZED_SHOWN: i64 = 20;

/// The record's present state under the current version, evaluated now (or why it cannot be),
/// and the runs since its last audit row: planning counts the rows it holds or finds not old
/// enough (`held_at_planning`) without writing a row per record, so such a run kept this record
/// without itemizing it.
async fn present(
    state: &AppState,
    policy: &str,
    key: &str,
) -> Result<(serde_json::Value, serde_json::Value), Problem> {
    let now = match crate::execute::present::present_state(state, policy, key).await {
        Ok(s) => json!(s),
        Err(f) if f.class() == Some(crate::retry::FailureClass::Transient) => {
            return Err(Problem::unavailable(f.message(), 5));
        }
        Err(f) => json!({ "unavailable": f.message() }),
    };
    let since = ledger::item_history::last_audited(&state.pool, policy, key).await?;
    let (runs, total) =
        ledger::item_history::runs_since(&state.pool, policy, since, UNITEMIZED_SHOWN).await?;
    let detail = format!(
        "{total} run(s) of this policy since {} counted the rows they held or found not old \
         enough at planning (held_at_planning) without writing a row per record: a run kept this \
         record without a row when it was held or not old enough as that run planned; \
         present_state says how it stands now",
        since.map_or("the first run".to_string(), |s| format!(
            "this record's last audit row ({})",
            s.to_rfc3339()
        ))
    );
    Ok((
        now,
        json!({ "count": total, "runs": runs, "detail": detail }),
    ))
}

/// The key as the ledger writes it, parsed here (a PostgreSQL cast would also take `now` or
/// `epoch`): a bigint `007` is `7`, a uuid lower case, a timestamptz at UTC with `Z`, a
/// composite key compact JSON. A value the key does not accept is a 400 saying why.
fn canonical_key(key_of: &crate::policy::Key, key: &str) -> Result<String, Problem> {
    if key.is_empty() {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-key",
            "the key is empty",
        ));
    }
    key_of.canonical(key).map_err(|why| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-key",
            format!("{why}: not a key of this policy ({})", key_of.names()),
        )
    })
}

/// For a key of several columns: the history of the one-column key that preceded it, whose
/// value is the first column's (a table keyed `id` that was partitioned and is now keyed
/// `(id, created_at)`), when there is any; null otherwise. Marked `earlier_key` in the answer.
async fn earlier_key(
    state: &AppState,
    policy: &str,
    key_of: &crate::policy::Key,
    canonical: &str,
    limit: i64,
) -> Result<serde_json::Value, Problem> {
    if !key_of.is_composite() {
        return Ok(serde_json::Value::Null);
    }
    let Some(first) = key_of
        .values(canonical)
        .ok()
        .and_then(|v| v.into_iter().next())
    else {
        return Ok(serde_json::Value::Null);
    };
    let rows = ledger::item_history::audit_rows(&state.pool, policy, &first, 0, limit).await?;
    let effects = ledger::item_history::effects(&state.pool, policy, &first).await?;
    let dead = ledger::item_history::dead_letters(&state.pool, policy, &first).await?;
    if rows.is_empty() && effects.is_empty() && dead.is_empty() {
        return Ok(serde_json::Value::Null);
    }
    let dead = with_verdicts(state, &dead).await?;
    Ok(json!({
        "item_key": first,
        "key_columns": [key_of.columns()[0].0.as_str()],
        "audit": rows,
        "effects": effects,
        "dead_letters": dead,
        "detail": format!(
            "this policy's key was {} before it became {}: the history of {} under the earlier key",
            key_of.columns()[0].0.as_str(),
            key_of.names(),
            first
        ),
    }))
}
