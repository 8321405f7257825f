//! Superseding: a retention run that a stage (`after`) holds and that executed nothing is
//! covered once a later window's run of its policy completed — that run's later cutoff removed
//! everything this one would have — so it becomes `superseded` instead of waiting for ever for
//! an upstream run that will never come (a cancelled digest). Decided in the transaction that
//! completes the later run, or by the next housekeeping round. A selection policy's run is never
//! superseded: each window has its own effects; it stays held, on the attention list.

use tracing::{info, warn};

use super::*;

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
        let Some(why) = holds::after_hold(state, tx, &c.policy, c.window_at).await? else {
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
