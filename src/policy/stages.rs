//! Stages (`after = ["support-digest"]`): a policy whose runs execute only once the named
//! policies' runs of the same window completed. The run is created by its own trigger as any
//! other (its cutoff fixed then) and planned, but every command is held (kind `after`) until
//! each upstream's run for the window is `completed` — or `completed_with_dead_letters` with
//! `after_allows_dead_letters = true`. An upstream run that is missing, still running, reopened
//! by a redrive or cancelled keeps it held, with that reason: a cleanup never runs early.
//!
//! Window W of the downstream maps to the upstream's latest tick at or before W (the same tick
//! when both share a schedule; a daily cleanup after a weekly digest waits for that week's).

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use super::Policy;

/// `(upstream policy, its run id for downstream window `window`)`, for each of `p.after`
/// (an upstream without a tick at or before the window has no run to wait for: `None`).
pub fn upstream_runs(
    p: &Policy,
    policies: &[Policy],
    window: DateTime<Utc>,
) -> Vec<(String, Option<String>)> {
    p.after
        .iter()
        .map(|u| {
            let run = policies
                .iter()
                .find(|x| x.name.as_str() == u)
                .and_then(|x| x.schedule.latest_tick_at_or_before(window))
                .map(|t| format!("{u}:{}", crate::window::format(t)));
            (u.clone(), run)
        })
        .collect()
}

/// Why `p`'s work for its window waits, given the upstream runs' statuses (run id → status), or
/// `None` when every upstream run is done.
pub fn waits_for(
    p: &Policy,
    upstream: &[(String, Option<String>)],
    status: &HashMap<String, String>,
) -> Option<String> {
    for (u, run) in upstream {
        let Some(run) = run else {
            return Some(format!("policy {u} has no tick at or before this window"));
        };
        match status.get(run).map(String::as_str) {
            Some("completed") => {}
            Some("completed_with_dead_letters") if p.after_allows_dead_letters => {}
            Some("completed_with_dead_letters") => {
                return Some(format!(
                    "waits for {u}'s run {run}, completed with dead letters (resolve them, or \
                     set after_allows_dead_letters = true)"
                ));
            }
            Some(s) => return Some(format!("waits for {u}'s run {run}, which is {s}")),
            None => return Some(format!("waits for {u}'s run {run}, not created yet")),
        }
    }
    None
}

/// Configuration errors of `after` across all policies (each `policy[name].after: ...`): a
/// name no policy has, the policy itself, and cycles.
pub fn check(policies: &[Policy]) -> Vec<String> {
    let by_name: HashMap<&str, &Policy> = policies.iter().map(|p| (p.name.as_str(), p)).collect();
    let mut errors = Vec::new();
    for p in policies {
        for u in &p.after {
            if u == p.name.as_str() {
                errors.push(format!(
                    "policy[{}].after: a policy cannot wait for itself",
                    p.name
                ));
            } else if !by_name.contains_key(u.as_str()) {
                errors.push(format!(
                    "policy[{}].after: no policy is named `{u}`",
                    p.name
                ));
            }
        }
    }
    // Cycles: a depth-first walk from each policy; a path that comes back to its start is
    // reported once, by its lexically smallest member.
    for p in policies {
        let start = p.name.as_str();
        let mut stack: Vec<(&str, Vec<&str>)> = vec![(start, vec![start])];
        while let Some((at, path)) = stack.pop() {
            for u in by_name.get(at).map(|x| x.after.as_slice()).unwrap_or(&[]) {
                if u == start && path.len() > 1 {
                    if path.iter().all(|n| *n >= start) {
                        errors.push(format!(
                            "policy[{start}].after: a cycle: {} -> {start}",
                            path.join(" -> ")
                        ));
                    }
                } else if !path.contains(&u.as_str()) && by_name.contains_key(u.as_str()) {
                    let mut next = path.clone();
                    next.push(u);
                    stack.push((u, next));
                }
            }
        }
    }
    errors
}
