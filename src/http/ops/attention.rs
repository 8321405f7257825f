//! `GET /runs?status=attention`: every run that needs a look, each with a one-line `reason`
//! built from facts read for all of them at once (a fixed number of statements).

use super::*;
use crate::ledger::attention::Facts;

/// The runs that need a look, newest window first: not terminal (held, retrying, planning or
/// working), or with dead letters open or redriven. Each is the run as `GET /runs` shows it,
/// plus `reason` (one line: what holds it, what is retrying and why, what waits for an
/// operator), `held_kind` (null when nothing holds it) and the facts behind the reason.
pub(super) async fn attention(
    state: &AppState,
    policy: Option<&str>,
    limit: i64,
) -> Result<Response, Problem> {
    let runs = ledger::attention::attention_runs(&state.pool, policy, limit).await?;
    let identity = ledger::identity::held(&state.pool).await?;
    let suspended = ledger::control::policy_states(&state.pool).await?;
    let list = runs
        .into_iter()
        .map(|(run, facts)| {
            let ps = suspended.get(&run.policy).filter(|s| s.suspended);
            let (held_kind, reason) = reason(state, &run, &facts, identity.as_ref(), ps);
            let mut v = serde_json::to_value(&run).unwrap_or_default();
            v["reason"] = json!(reason);
            v["held_kind"] = json!(held_kind);
            v["open_dead_letters"] = json!(facts.open_dead_letters);
            v["redriven_dead_letters"] = json!(facts.redriven_dead_letters);
            v["abandoned_dead_letters"] = json!(facts.abandoned_dead_letters);
            v["retrying_commands"] = json!(facts.retrying_commands);
            v["waiting_on_lock_commands"] = json!(facts.waiting_on_lock_commands);
            v
        })
        .collect::<Vec<_>>();
    Ok(Json(json!({ "runs": list })).into_response())
}

/// The run's hold kind (if held) and its one-line reason: every part that applies, most
/// urgent first, joined by `; `.
// Over 80 lines: one short block per part of the reason, in the order they are shown.
fn reason(
    state: &AppState,
    run: &ledger::Run,
    f: &Facts,
    identity: Option<&(chrono::DateTime<chrono::Utc>, String)>,
    suspended: Option<&ledger::control::PolicyState>,
) -> (Option<String>, String) {
    let mut parts = Vec::new();
    let mut kind: Option<&'static str> = None;
    let live = !run.is_terminal();
    if live {
        if let Some((k, part)) = hold_part(state, run, f, identity, suspended) {
            kind = Some(k.as_str());
            parts.push(part);
        }
        if f.planning_failures > 0 {
            parts.push(format!(
                "planning failing ({} pages in a row): {}",
                f.planning_failures,
                f.planning_error.as_deref().unwrap_or("")
            ));
        }
        if f.retrying_commands > 0 {
            let attempts = f.retry_attempts.unwrap_or(0);
            let when = if f.retry_trying_now {
                format!("attempt {} running now", attempts + 1)
            } else {
                format!(
                    "attempt {} at {}",
                    attempts + 1,
                    f.retry_next_at
                        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
                        .unwrap_or_default()
                )
            };
            parts.push(format!(
                "{} command(s) retrying; {when}, after {attempts} failed ({}): {}",
                f.retrying_commands,
                f.retry_class.as_deref().unwrap_or("unknown"),
                f.retry_error.as_deref().unwrap_or("")
            ));
        }
        if f.waiting_on_lock_commands > 0 {
            parts.push(format!(
                "{} command(s) waiting on a lock: rows another transaction holds locked wait, \
                 the others are done; no attempt is spent (a dead letter only past max_age)",
                f.waiting_on_lock_commands
            ));
        }
    }
    if f.open_dead_letters > 0 {
        parts.push(format!(
            "{} dead letter(s) open (redrive or abandon: GET /dead-letters?run_id={}): {}",
            f.open_dead_letters,
            run.run_id,
            f.dead_letter_reason.as_deref().unwrap_or("")
        ));
    }
    if f.redriven_dead_letters > 0 {
        parts.push(format!(
            "{} dead letter(s) redriven, not yet done",
            f.redriven_dead_letters
        ));
    }
    if parts.is_empty() {
        parts.push(if run.status == "planning" {
            format!(
                "planning: {} items in commands so far",
                run.eligible_planned
            )
        } else {
            format!(
                "running: {} of its commands not yet done",
                f.unfinished_commands
            )
        });
    }
    (kind.map(str::to_string), parts.join("; "))
}

/// The run's first hold in the one precedence ([`ledger::first_hold`]) and its part of the
/// reason, from the facts read for the list.
fn hold_part(
    state: &AppState,
    run: &ledger::Run,
    f: &Facts,
    identity: Option<&(chrono::DateTime<chrono::Utc>, String)>,
    suspended: Option<&ledger::control::PolicyState>,
) -> Option<(ledger::HoldKind, String)> {
    use ledger::{Approval, HoldKind};
    let approval = f.approval.as_deref().and_then(Approval::parse);
    ledger::first_hold([
        identity.map(|(_, why)| (HoldKind::Identity, format!("held (identity): {why}"))),
        suspended.map(|s| {
            let why = format!(
                "held (suspended): policy {} suspended by {}: {}",
                run.policy, s.changed_by, s.reason
            );
            (HoldKind::Suspended, why)
        }),
        match approval {
            Some(Approval::Required) => Some(format!(
                "held (approval): over the blast-radius guard; approve with POST /runs/{}/approve, or cancel",
                run.run_id
            )),
            Some(Approval::AwaitingPlan) => Some(
                "held (approval): the blast-radius guard decides when planning is done; nothing executes before"
                    .to_string(),
            ),
            _ => None,
        }
        .map(|why| (HoldKind::Approval, why)),
        crate::holds::policy_hold(state, &run.policy)
            .map(|h| (h.kind, format!("held ({}): {}", h.kind.as_str(), h.detail))),
        f.held_kind.as_deref().and_then(HoldKind::parse).map(|k| {
            let why = f.held_reason.as_deref().unwrap_or("");
            (k, format!("held ({}): {why}", k.as_str()))
        }),
    ])
}
