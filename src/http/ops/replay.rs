//! `replay_safe`: whether replaying a run's commands or a dead letter causes no double effect,
//! and — a separate question — whether the cause of an item's failure is gone, so a redrive
//! can succeed.

use std::collections::HashMap;

use super::*;
use crate::ledger::dead_letter::DeadLetter;
use crate::policy::references::{Found, Reference};

/// Whether replaying the run's commands is safe, and why: the effect is idempotent (one
/// transaction per command for `delete_rows`), the cutoff is fixed on the run, and the pinned
/// policy version is still the one that would apply.
pub(super) async fn replay_verdict(
    state: &AppState,
    run_id: &str,
) -> Result<serde_json::Value, Problem> {
    let mut all = replay_verdicts(state, &[run_id]).await?;
    Ok(all.remove(run_id).unwrap_or_default())
}

/// [`replay_verdict`] of each of `run_ids`, in one statement.
async fn replay_verdicts(
    state: &AppState,
    run_ids: &[&str],
) -> Result<HashMap<String, serde_json::Value>, Problem> {
    let rows: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "select r.run_id, r.policy_version,
                (select version from sweeper.policy_versions v where v.policy = r.policy
                  order by seq desc limit 1)
           from sweeper.runs r where r.run_id = any($1)",
    )
    .bind(run_ids)
    .fetch_all(&state.pool)
    .await?;
    let mut out: HashMap<String, serde_json::Value> = run_ids
        .iter()
        .map(|r| {
            let gone = json!({"safe": false, "reasons": ["the run no longer exists"]});
            (r.to_string(), gone)
        })
        .collect();
    for (run_id, pinned, current) in rows {
        let version_current = current.as_deref() == Some(pinned.as_str());
        let mut reasons = vec![
            "effect idempotent: a command's deletes, audit rows and state commit in one \
             transaction"
                .to_string(),
            "cutoff fixed: stored on the run and bound into every query".to_string(),
        ];
        if version_current {
            reasons.push(format!("pinned policy version {pinned} is still current"));
        } else {
            reasons.push(format!(
                "pinned policy version {pinned} is no longer current ({}): a replay applies the stricter of both",
                current.as_deref().unwrap_or("none")
            ));
        }
        out.insert(
            run_id,
            json!({ "safe": version_current, "reasons": reasons }),
        );
    }
    Ok(out)
}

/// SQLSTATE of a foreign-key violation (PostgreSQL, Appendix A): the item is still referenced.
const FOREIGN_KEY_VIOLATION: &str = "SQLSTATE 23503";

/// Each dead letter as JSON with its `replay_safe`: the run's verdict (no double effect) and
/// `will_fail_again` — for an item that failed on a foreign key, `true` with the constraints
/// and referencing tables (`references`) while a referencing row still exists, `false` once
/// none does; `"unknown"` for any other failure, or when the check itself could not run (a
/// lock held longer than its `lock_timeout`, a table gone). One statement for the runs'
/// verdicts and one check per policy, whatever the number of dead letters.
pub(super) async fn with_verdicts(
    state: &AppState,
    dead_letters: &[DeadLetter],
) -> Result<Vec<serde_json::Value>, Problem> {
    let mut ids: Vec<&str> = dead_letters
        .iter()
        .filter_map(|d| d.run_id.as_deref())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    let runs = replay_verdicts(state, &ids).await?;
    // Foreign-key failures per policy: their keys, checked in one call per policy.
    let mut fk: HashMap<&str, Vec<String>> = HashMap::new();
    for d in dead_letters.iter().filter(|d| is_foreign_key_failure(d)) {
        if let (Some(p), Some(k)) = (d.policy.as_deref(), d.item_key.as_ref()) {
            fk.entry(p).or_default().push(k.clone());
        }
    }
    let mut referenced: HashMap<&str, Option<Found>> = HashMap::new();
    for (policy, keys) in &fk {
        let found = match state.config.policy(policy) {
            Some(p) => {
                match crate::policy::references::still_referenced(&state.pool, &p.spec.target, keys)
                    .await
                {
                    Ok(m) => Some(m),
                    Err(e) => {
                        tracing::info!(policy, error = %e, "foreign-key re-check did not finish");
                        None
                    }
                }
            }
            None => None,
        };
        referenced.insert(policy, found);
    }
    dead_letters
        .iter()
        .map(|d| {
            let mut v = serde_json::to_value(d).map_err(Problem::internal)?;
            let Some(run_id) = d.run_id.as_deref() else {
                return Ok(v);
            };
            let mut verdict = runs.get(run_id).cloned().unwrap_or_default();
            let checked = d
                .policy
                .as_deref()
                .and_then(|p| referenced.get(p))
                .filter(|_| is_foreign_key_failure(d));
            let (again, refs, cause) = cause_of(d, checked);
            verdict["will_fail_again"] = again;
            if let Some(refs) = refs {
                verdict["references"] = json!(refs);
            }
            verdict["cause"] = json!(cause);
            v["replay_safe"] = verdict;
            Ok(v)
        })
        .collect()
}

/// `(will_fail_again, references, cause)` of one dead letter, given its policy's re-check
/// (`None`: not a foreign-key failure; `Some(None)`: the check did not finish).
fn cause_of(
    d: &DeadLetter,
    checked: Option<&Option<Found>>,
) -> (serde_json::Value, Option<Vec<Reference>>, String) {
    let unknown = |why: String| (json!("unknown"), None, why);
    if d.outcome.as_deref() == Some("mismatched") {
        return unknown(
            "the provider's answer said its record differs from ours (see recorded): correct \
             the data, then redrive (the call is made again with the next idempotency key), or \
             abandon it with a reason"
                .into(),
        );
    }
    let found = match checked {
        None => {
            return unknown(
                "only a foreign-key failure is re-checked; read the reason and attempts".into(),
            );
        }
        Some(None) => {
            return unknown(
                "the foreign-key re-check did not finish (a lock held, or the table changed): \
                 ask again"
                    .into(),
            );
        }
        Some(Some(f)) => f,
    };
    // Only the refusing references of the target itself were checked.
    if let Some(n) = constraint_named(&d.reason)
        && !found.checked.iter().any(|c| c == n)
    {
        return unknown(format!(
            "the failure names constraint {n}, which does not reference the target directly (a \
             cascade further down, or ON DELETE SET DEFAULT): not re-checked; look at its table"
        ));
    }
    match d.item_key.as_ref().and_then(|k| found.referenced.get(k)) {
        Some(refs) => {
            let by = refs
                .iter()
                .map(|r| format!("{} ({})", r.table, r.constraint))
                .collect::<Vec<_>>()
                .join(", ");
            (
                json!(true),
                Some(refs.clone()),
                format!(
                    "still referenced by {by}: remove or re-point those rows before redriving, \
                     or abandon"
                ),
            )
        }
        None => (
            json!(false),
            Some(Vec::new()),
            "no row references the item any more: a redrive can succeed".into(),
        ),
    }
}

/// The constraint a foreign-key violation names (`... violates foreign key constraint "x" ...`).
fn constraint_named(reason: &str) -> Option<&str> {
    let rest = reason.split_once("violates foreign key constraint \"")?.1;
    Some(rest.split_once('"')?.0)
}

fn is_foreign_key_failure(d: &DeadLetter) -> bool {
    d.kind == "item" && d.reason.contains(FOREIGN_KEY_VIOLATION)
}
