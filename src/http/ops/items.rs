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
/// on every page). The key is parsed as the key column's type and written canonically before
/// the lookup (a bigint `007` is `7`, a uuid lower case); a text key is taken as the path
/// segment decodes (`%2F` is `/`). When audit months were exported and dropped,
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
    let key_type = crate::policy::references::key_type(&state.pool, &p.spec.target)
        .await?
        .ok_or_else(|| {
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                format!(
                    "the policy's key column {}.{} does not exist; its key type is unknown",
                    p.spec.target.table,
                    p.spec.target.key.as_str()
                ),
            )
        })?;
    let canonical = canonical_key(&state, &key, &key_type).await?;
    let rows =
        ledger::item_history::audit_rows(&state.pool, &policy, &canonical, after, limit).await?;
    let effects = ledger::item_history::effects(&state.pool, &policy, &canonical).await?;
    let dead = ledger::item_history::dead_letters(&state.pool, &policy, &canonical).await?;
    let dead = with_verdicts(&state, &dead).await?;
    let dropped = ledger::item_history::dropped_exports(&state.pool).await?;
    let now = present(&state, &policy, &canonical).await?;
    let next_cursor = (rows.len() as i64 == limit)
        .then(|| rows.last().map(|r| r.audit_id.to_string()))
        .flatten();
    let open_effect = effects.iter().find(|e| e.state != "closed");
    Ok(Json(json!({
        "policy": policy,
        "item_key": canonical,
        "key_type": key_type,
        "audit": rows,
        "next_cursor": next_cursor,
        "open_effect": open_effect,
        "effects": effects,
        "dead_letters": dead,
        "history_complete_since": dropped.last().map(|d| d.to_at),
        "exports": dropped,
        "present_state": now.0,
        "unitemized_runs": now.1,
    }))
    .into_response())
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
        Err(f) if f.class == crate::retry::FailureClass::Transient => {
            return Err(Problem::unavailable(f.message, 5));
        }
        Err(f) => json!({ "unavailable": f.message }),
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

/// The key as the ledger writes it: cast to the key column's type and back to text. A value the
/// type does not accept is a 400 naming the type.
async fn canonical_key(state: &AppState, key: &str, key_type: &str) -> Result<String, Problem> {
    if key.is_empty() {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-key",
            "the key is empty",
        ));
    }
    // key_type comes from the catalog's format_type (for example `bigint`, `uuid`,
    // `character varying(64)`); the key is bound.
    let sql = format!("select cast(cast($1 as text) as {key_type})::text");
    match sqlx::query_scalar::<_, String>(&sql)
        .bind(key)
        .fetch_one(&state.pool)
        .await
    {
        Ok(k) => Ok(k),
        // Class 22: data exception (invalid text representation, out of range, ...).
        Err(sqlx::Error::Database(db)) if db.code().is_some_and(|c| c.starts_with("22")) => {
            Err(Problem::new(
                StatusCode::BAD_REQUEST,
                "bad-key",
                format!(
                    "`{}` is not a {key_type}, the type of this policy's key",
                    ledger::printable(key, 64)
                ),
            ))
        }
        Err(e) => Err(e.into()),
    }
}
