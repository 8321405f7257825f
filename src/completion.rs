//! Completing a run (docs/design.md §2.5): once its last command ended, or planning ended with
//! none, the run completes once, in one transaction with its closure check and the runs its later
//! cutoff covers ([`supersede_covered`]). Execution, planning and housekeeping all complete runs
//! here.
//!
//! Superseding: a retention run that a stage (`after`) holds and that executed nothing is
//! covered once a later window's run of its policy completed — that run's later cutoff removed
//! everything this one would have — so it becomes `superseded` instead of waiting for ever for
//! an upstream run that will never come (a cancelled digest). Decided in the transaction that
//! completes the later run, or by the next housekeeping round. A selection policy's run is never
//! superseded: each window has its own effects; it stays held, on the attention list.

use sqlx::{PgConnection, Postgres, Transaction};
use tracing::{info, warn};

use crate::ledger;
use crate::policy::RuleSet;
use crate::state::AppState;

/// Completes `run_id` if it is done, with the closure check when `rules` are given, in one
/// transaction. `Some(status)` when this call completed it.
pub(crate) async fn complete_run(
    state: &AppState,
    run_id: &str,
    rules: Option<&RuleSet>,
) -> sqlx::Result<Option<String>> {
    let mut tx = state.pool.begin().await?;
    // A session holding the run row (an operator's psql) must not hold up the answer of the
    // command that asks: past a second, housekeeping completes the run instead.
    sqlx::query("set local lock_timeout = '1s'")
        .execute(&mut *tx)
        .await?;
    let Some((status, seconds)) = ledger::runs::complete_if_done(&mut tx, run_id).await? else {
        tx.rollback().await?;
        return Ok(None);
    };
    if status == ledger::RunStatus::Completed.as_str() {
        supersede_covered(state, &mut tx, Some(run_id)).await;
    }
    if let Some(rules) = rules {
        // The count must never keep the run from completing: on a table where it outlasts the
        // statement timeout, the run completes without it (`remaining_eligible` stays null).
        let mut check = sqlx::Connection::begin(&mut *tx).await?;
        let cap = state.config.planning.closure_check_cap;
        match record_closure_check(&mut check, run_id, rules, cap).await {
            Ok(()) => check.commit().await?,
            Err(e) => {
                check.rollback().await?;
                warn!(run_id, error = %e, "the closure check failed; the run completes without it");
            }
        }
    }
    tx.commit().await?;
    info!(run_id, status, "run completed");
    if let (false, Some(t)) = (run_id.contains(":dry-"), seconds) {
        let policy = policy_of(run_id);
        let backfill = state
            .config
            .policy(policy)
            .is_some_and(|p| p.is_backfill(t.window, t.created));
        crate::metrics::run_completed(policy, t.since_window, t.since_created, backfill);
    }
    Ok(Some(status))
}

/// The closure check: how many rows are still eligible under the run's rules, counted up to
/// `cap` so the statement stays bounded on huge tables. Expected 0 for a completed real run;
/// dry runs skip it (`remaining_eligible` stays null: they change nothing to check).
pub async fn record_closure_check(
    conn: &mut PgConnection,
    run_id: &str,
    rules: &RuleSet,
    cap: i64,
) -> sqlx::Result<()> {
    // Rows without a key are held (`null_key`, counted at planning), not remaining. The bare
    // `timestamp < cutoff` lets an index on the timestamp find the few rows left (the eligibility
    // predicate's `coalesce` cannot use it, and a completed run expects none).
    let remaining: i64 = rules
        .capped_count(cap, |q| {
            rules.push_has_key(q);
            q.push(" and ");
            rules.push_timestamp(q);
            q.push(" < ");
            q.push_bind(rules.cutoff);
            q.push(" and ");
            rules.push_eligible(q);
            rules.push_not_done_in_window(q);
        })
        .build_query_scalar()
        .fetch_one(&mut *conn)
        .await?;
    let stricter = rules
        .stricter_cutoff
        .as_ref()
        .map(|s| (s.cutoff, s.version.as_str()));
    ledger::runs::set_remaining_eligible(conn, run_id, remaining, cap, stricter).await
}

/// Supersedes the runs `completed_run` covers (or, when `None`, any run a later completed run
/// covers), each in a savepoint of `tx`; a failure leaves them for the next round. Returns the
/// runs superseded.
pub(crate) async fn supersede_covered(
    state: &AppState,
    tx: &mut Transaction<'_, Postgres>,
    completed_run: Option<&str>,
) -> Vec<String> {
    let mut sp = match sqlx::Connection::begin(&mut **tx).await {
        Ok(sp) => sp,
        Err(e) => {
            warn!(error = %e, "superseding covered runs failed; housekeeping retries");
            return Vec::new();
        }
    };
    match supersede_in(state, &mut sp, completed_run).await {
        Ok(done) => match sp.commit().await {
            Ok(()) => done,
            Err(e) => {
                warn!(error = %e, "superseding covered runs failed; housekeeping retries");
                Vec::new()
            }
        },
        Err(e) => {
            let _ = sp.rollback().await;
            warn!(error = %e, "superseding covered runs failed; housekeeping retries");
            Vec::new()
        }
    }
}

async fn supersede_in(
    state: &AppState,
    tx: &mut Transaction<'_, Postgres>,
    completed_run: Option<&str>,
) -> sqlx::Result<Vec<String>> {
    let mut done = Vec::new();
    for c in ledger::supersede::supersedable(tx, completed_run, 100).await? {
        // A policy this replica does not know, or a selection policy, is left alone.
        let Some(p) = state.config.policy(&c.policy) else {
            continue;
        };
        if !p.spec.select.is_empty() {
            continue;
        }
        let Some(why) = crate::holds::after_hold(state, tx, &c.policy, c.window_at).await? else {
            continue;
        };
        let reason = format!(
            "superseded by {}, a later window's completed run whose later cutoff covers this \
             window; this run executed nothing while held: {why}",
            c.by_run
        );
        if ledger::supersede::supersede(tx, &c, &reason).await? {
            info!(run_id = c.run_id, by = c.by_run, "run superseded");
            done.push(c.run_id);
        }
    }
    Ok(done)
}

/// The policy of a run id `{policy}:{window}[:dry-{n}]`.
fn policy_of(run_id: &str) -> &str {
    run_id.split(':').next().unwrap_or(run_id)
}
