//! Holds that come from a policy's configuration and this replica's view of the database, not
//! from the ledger (DESIGN §14 "Holds"): active hours and the governor. The built-in queue's
//! claim and the push relay skip the policies they hold; the gate re-checks them for a delivery
//! that arrives anyway.

use chrono::{DateTime, Utc};

use crate::policy::safety::Hours;
use crate::retry::HoldKind;
use crate::state::AppState;

/// A configuration or governor hold on a policy's work now.
#[derive(Debug, Clone)]
pub struct PolicyHold {
    /// `active_hours` or `governor`.
    pub kind: HoldKind,
    /// Why, for the `held` object and logs.
    pub detail: String,
    /// Since when.
    pub since: DateTime<Utc>,
    /// When it is released, if known (active hours open).
    pub until: Option<DateTime<Utc>>,
}

/// The hold on `policy`'s work now, in precedence order (active hours, then the governor), or
/// `None`. Active hours follow the machine's clock, as the schedule's triggers do.
pub fn policy_hold(state: &AppState, policy: &str) -> Option<PolicyHold> {
    let p = state.config.policy(policy)?;
    if let Some(active) = &p.safety.active
        && let Hours::Closed { since, opens_at } = active.at(Utc::now())
    {
        return Some(PolicyHold {
            kind: HoldKind::ActiveHours,
            detail: format!(
                "outside the policy's active hours {}; they open at {}",
                active.describe(),
                opens_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
            since,
            until: Some(opens_at),
        });
    }
    state.governor.held(policy).map(|(since, why)| PolicyHold {
        kind: HoldKind::Governor,
        detail: format!("the database-health governor: {why}"),
        since,
        until: None,
    })
}

/// The configured policies whose work is held now by their active hours or the governor (the
/// claim and the relay skip them).
pub fn held_policies(state: &AppState) -> Vec<String> {
    state
        .config
        .policies
        .iter()
        .filter(|p| policy_hold(state, p.name.as_str()).is_some())
        .map(|p| p.name.to_string())
        .collect()
}

/// Logs and counts each policy-level hold that began or ended since the last call (`seen`
/// keeps the previous state); called once a second by the application.
pub fn watch(state: &AppState, seen: &mut std::collections::HashMap<String, HoldKind>) {
    for p in &state.config.policies {
        let name = p.name.as_str();
        match (policy_hold(state, name), seen.get(name).copied()) {
            (Some(h), before) if before != Some(h.kind) => {
                tracing::info!(policy = name, kind = h.kind.as_str(), reason = %h.detail, "policy's work held");
                crate::metrics::hold_started(h.kind.as_str());
                seen.insert(name.to_string(), h.kind);
            }
            (None, Some(kind)) => {
                tracing::info!(
                    policy = name,
                    kind = kind.as_str(),
                    "policy's work released"
                );
                seen.remove(name);
            }
            _ => {}
        }
    }
}

/// The stage hold on `policy`'s command of window `window` (`after`, see
/// [`crate::policy::stages`]): why it waits for its upstream runs, or `None`. One query, in the
/// gate's transaction, only for a policy with `after`.
pub async fn after_hold(
    state: &AppState,
    tx: &mut sqlx::PgConnection,
    policy: &str,
    window: DateTime<Utc>,
) -> sqlx::Result<Option<String>> {
    let Some(p) = state.config.policy(policy).filter(|p| !p.after.is_empty()) else {
        return Ok(None);
    };
    let upstream = crate::policy::stages::upstream_runs(p, &state.config.policies, window);
    let ids: Vec<String> = upstream.iter().filter_map(|(_, r)| r.clone()).collect();
    let status = crate::ledger::runs::statuses(tx, &ids).await?;
    Ok(crate::policy::stages::waits_for(p, &upstream, &status))
}
