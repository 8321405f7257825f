//! Holds that come from a policy's configuration and this replica's view of the database, not
//! from the ledger (docs/design.md §14 "Holds"): active hours and the governor. The built-in queue's
//! claim and the push relay skip the policies they hold; the gate re-checks them for a delivery
//! that arrives anyway. [`run_held`] composes a run's `held` object from every hold, in one
//! precedence, for each answer that shows it (the trigger's, `GET /runs/{id}`).

use chrono::{DateTime, Utc};
use serde_json::json;

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
                crate::metrics::hold_started(h.kind);
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

/// The run's `held` object (docs/design.md §14): its first hold in the one precedence
/// ([`crate::ledger::first_hold`]) among the identity guard, the policy's suspension, what its
/// commands or planning job recorded (schema, policy change, a stage, the pace), the
/// blast-radius guard's approval, a stage's upstream runs (`after`) and what this replica sees
/// now (active hours, the governor) — or null; and its `approval` object (null when its policy
/// has no guard).
pub async fn run_held(
    state: &AppState,
    run: &crate::ledger::Run,
) -> sqlx::Result<(Option<serde_json::Value>, serde_json::Value)> {
    use crate::ledger::{Approval, HoldKind};
    let (run_id, policy, status) = (
        run.run_id.as_str(),
        run.policy.as_str(),
        run.status.as_str(),
    );
    let a = crate::ledger::runs::approval(&state.pool, run_id).await?;
    let (approval, verdict, changed_at) =
        (a.approval.clone(), a.guard_verdict.clone(), a.changed_at);
    let approval_body = match (&approval, &verdict) {
        (None, None) => serde_json::Value::Null,
        _ => json!({"state": approval, "guard_verdict": verdict, "changed_at": changed_at,
                    "approved_by": a.approved_by, "reason": a.reason}),
    };
    if crate::ledger::is_terminal_run_status(status) {
        return Ok((None, approval_body));
    }
    // The same shape as a recorded hold's; a run-wide hold holds every unfinished command.
    let alert = chrono::TimeDelta::seconds(state.config.ledger.hold_alert_after.seconds());
    let (unfinished, now) = crate::ledger::runs::unfinished_commands(&state.pool, run_id).await?;
    let held = |kind: HoldKind, detail: String, since: Option<DateTime<Utc>>| {
        let overdue = !kind.is_expected() && since.is_some_and(|s| s < now - alert);
        // The governor holds planning pages too.
        let planning = kind == HoldKind::Governor && status == "planning";
        Some((
            kind,
            json!({"kind": kind.as_str(), "detail": detail, "since": since,
                   "held_commands": unfinished, "planning_held": planning, "overdue": overdue}),
        ))
    };
    let identity = crate::ledger::identity::held(&state.pool)
        .await?
        .and_then(|(since, why)| held(HoldKind::Identity, why, Some(since)));
    let suspended = crate::ledger::control::policy_state(&state.pool, policy)
        .await?
        .filter(|ps| ps.suspended)
        .and_then(|ps| {
            let detail = format!(
                "policy {policy} is suspended by {}: {}",
                ps.changed_by, ps.reason
            );
            held(HoldKind::Suspended, detail, ps.suspended_at)
        });
    let recorded = crate::ledger::run_hold(
        &state.pool,
        run_id,
        state.config.ledger.hold_alert_after.seconds(),
    )
    .await?
    .and_then(|r| r["kind"].as_str().and_then(HoldKind::parse).map(|k| (k, r)));
    let guard = match approval.as_deref().and_then(Approval::parse) {
        Some(Approval::AwaitingPlan) => {
            let detail = "the blast-radius guard decides when planning is done".to_string();
            held(HoldKind::Approval, detail, Some(a.created_at))
        }
        Some(Approval::Required) => {
            let why = verdict
                .as_ref()
                .and_then(|v| v["reason"].as_str())
                .unwrap_or("over the blast-radius guard");
            let detail = format!("{why}; approve with POST /runs/{{id}}/approve, or cancel");
            held(HoldKind::Approval, detail, changed_at)
        }
        _ => None,
    };
    let after = if run.dry_run {
        None
    } else {
        let mut conn = state.pool.acquire().await?;
        after_hold(state, &mut conn, policy, run.window_at)
            .await?
            .and_then(|why| held(HoldKind::After, why, Some(a.created_at)))
    };
    let live = policy_hold(state, policy).and_then(|h| {
        let (kind, mut v) = held(h.kind, h.detail, Some(h.since.max(a.created_at)))?;
        v["until"] = json!(h.until);
        Some((kind, v))
    });
    // What this replica reads now comes before a recorded marker of the same kind.
    let first = crate::ledger::first_hold([identity, suspended, guard, after, live, recorded]);
    Ok((first.map(|(_, v)| v), approval_body))
}
