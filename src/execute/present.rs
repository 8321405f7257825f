//! A record's present state under its policy's current version, evaluated live for
//! `GET /policies/{policy}/items/{key}`: whether the row is there, old enough now (its timestamp
//! before `now − retain_for`; a selection policy's `select` at now), and held now — by which
//! exclusion. Read without a lock, in one statement, with the same rules an execution applies.

use serde::Serialize;

use super::*;

/// The record as the current version would judge it if a run started now.
#[derive(Debug, Clone, Serialize)]
pub struct PresentState {
    /// When it was evaluated (the ledger's clock).
    pub evaluated_at: chrono::DateTime<chrono::Utc>,
    /// The policy version whose rules were applied (the newest registered).
    pub policy_version: String,
    /// The cutoff of a run starting now: `now − retain_for`.
    pub cutoff: chrono::DateTime<chrono::Utc>,
    /// Whether the row exists.
    pub present: bool,
    /// Old enough (and selected, for a selection policy) now; null when the row is absent.
    pub old_enough: Option<bool>,
    /// The exclusion that holds it now, if any (`legal_hold`, `unknown:{column}`, ...).
    pub held_by: Option<String>,
    /// Why it is not eligible now (`younger_than_cutoff: ...`, `null_timestamp`,
    /// `not_selected:{column}`), if it is not.
    pub not_eligible_reason: Option<String>,
    /// Eligible now: present, old enough and held by nothing (a run starting now would plan it).
    pub eligible: bool,
}

/// Evaluates `item_key` (canonical text) of `policy` now. `Err` carries why the rules cannot be
/// built (the table's schema no longer matches, ...), for the answer to say instead.
pub async fn present_state(
    state: &AppState,
    policy: &str,
    item_key: &str,
) -> Result<PresentState, Setback> {
    let db = |e: sqlx::Error| Setback::from_db(&e);
    let mut conn = state.pool.acquire().await.map_err(db)?;
    let now = ledger::now(&mut conn).await.map_err(db)?;
    let version = ledger::current_versions(&state.pool)
        .await
        .map_err(db)?
        .remove(policy)
        .ok_or_else(|| Failure::permanent(format!("policy {policy} was never registered")))?;
    let spec = state
        .specs
        .get(&mut conn, policy, &version)
        .await
        .map_err(db)?;
    let table = state.catalog.tables(&state.pool, &[spec.as_ref()]).await?;
    let cutoff = now - chrono::TimeDelta::seconds(spec.retain_for_seconds);
    let rules = RuleSet::effective(
        &spec,
        None,
        cutoff,
        now,
        &table,
        state.checked_types.get(policy),
    )
    .map_err(Setback::from)?
    .with_effects(policy, "")
    .evaluated_now();
    let mut q = rules.classify_select();
    q.push(" where ");
    rules.push_key_in(&mut q, vec![item_key.to_string()]);
    let row = q.build().fetch_optional(&mut *conn).await.map_err(db)?;
    let (old_enough, held_by, not_eligible_reason) = match &row {
        Some(r) => (
            Some(r.get::<bool, _>("old_enough")),
            r.get::<Option<String>, _>("reason"),
            r.get::<Option<String>, _>("not_eligible_reason"),
        ),
        None => (None, None, None),
    };
    Ok(PresentState {
        evaluated_at: now,
        policy_version: version,
        cutoff,
        present: row.is_some(),
        eligible: old_enough == Some(true) && held_by.is_none(),
        old_enough,
        held_by,
        not_eligible_reason,
    })
}
