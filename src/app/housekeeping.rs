//! Housekeeping: periodic ledger work done by one replica at a time (it holds the
//! `housekeeping` job lease): republishing push commands no queue delivered, creating the audit's
//! partitions ahead of the clock, completing runs a crash left done but open, and purging old
//! terminal commands in bounded batches.

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::job_lease::HeldJob;
use crate::ledger;
use crate::state::AppState;

/// Periodic ledger work, done by the replica holding the `housekeeping` job lease (see
/// [`HeldJob`]: held between rounds and renewed every 20 s): republishing stale push commands
/// and purging old terminal commands in bounded batches.
pub async fn housekeeping_loop(state: AppState, shutdown: CancellationToken) {
    let interval = state.config.ledger.housekeeping_interval;
    let mut lease: Option<HeldJob> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval.std()) => {}
        }
        if !lease.as_ref().is_some_and(HeldJob::held) {
            lease = match HeldJob::take(&state, "housekeeping").await {
                Ok(l) => l,
                Err(e) => {
                    warn!(error = %e, "housekeeping could not take its lease; retrying next round");
                    None
                }
            };
        }
        if lease.is_none() {
            continue;
        }
        if let Err(e) = housekeeping_once(&state).await {
            warn!(error = %e, "housekeeping failed; retrying next round");
        }
    }
}

/// One round of housekeeping: purges until a batch comes back short. Returns commands purged.
pub async fn housekeeping_once(state: &AppState) -> sqlx::Result<u64> {
    // The restore and clone guard's heartbeat and timeline check.
    if let Err(e) = super::check_identity(&state.pool, &state.config).await {
        warn!(error = %format!("{e:#}"), "the identity check failed; retrying next round");
    }
    ledger::purge_pace_slots(&state.pool).await?;
    let republish = mark_stale_for_republish(state).await?;
    if republish > 0 {
        info!(
            commands = republish,
            "push commands not delivered within republish_after are published again"
        );
    }
    let partitions = ledger::audit::ensure_partitions(&state.pool).await?;
    if partitions > 0 {
        info!(partitions, "created audit partitions ahead of the clock");
    }
    // Its own lease, renewed while a month is exported: two replicas must not export the same
    // month at once, and a replica killed mid-export is replaced within a minute.
    let retention_lease = match state.config.ledger.audit_retention {
        Some(_) => HeldJob::take(state, "audit_retention").await?,
        None => None,
    };
    if let Some(lease) = retention_lease {
        match super::audit_retention::audit_retention_pass(state, &lease).await {
            Ok(0) => {}
            Ok(n) => info!(months = n, "audit months exported and dropped"),
            Err(e) => {
                warn!(error = %format!("{e:#}"), "audit retention failed; retrying next round")
            }
        }
    }
    // Runs a stage holds that a later completed window covers (normally superseded when that
    // run completed; a failure there, or a run planned later, is caught here).
    let mut tx = state.pool.begin().await?;
    let superseded = crate::completion::supersede_covered(state, &mut tx, None).await;
    tx.commit().await?;
    if !superseded.is_empty() {
        info!(
            runs = superseded.len(),
            "superseded held runs a later completed window covers"
        );
    }
    let completed = complete_done_runs(state).await?;
    if completed > 0 {
        info!(
            runs = completed,
            "completed runs whose last command ended without completing them"
        );
    }
    // A closed effect once per window outlives every command that could deliver it again (a
    // day past the command retention).
    let horizon = state.config.ledger.command_retention.seconds() as f64 + 86_400.0;
    let effects = ledger::effects::purge_closed_window_effects(&state.pool, horizon).await?;
    if effects > 0 {
        info!(
            effects,
            "purged closed effects once per window past their horizon"
        );
    }
    let mut total = 0;
    loop {
        let n = ledger::purge_terminal_commands(
            &state.pool,
            state.config.ledger.command_retention.seconds(),
            state.config.ledger.purge_batch,
        )
        .await?;
        total += n;
        if n < state.config.ledger.purge_batch as u64 {
            if total > 0 {
                info!(
                    purged = total,
                    "purged terminal commands past their retention"
                );
            }
            return Ok(total);
        }
    }
}

/// Completes the runs that are done but still open: what a crash between a command's commit
/// and its completion check leaves (`execute::complete_after`). The closure check runs as it
/// would have; a run whose rules cannot be built now (its table changed) completes without it
/// (`remaining_eligible` stays null). Returns how many runs were completed.
pub async fn complete_done_runs(state: &AppState) -> sqlx::Result<u64> {
    let mut n = 0;
    for run_id in ledger::runs::done_but_open(&state.pool, 100).await? {
        let mut conn = state.pool.acquire().await?;
        let Some(run) = ledger::get_run(&mut conn, &run_id).await? else {
            continue;
        };
        let rules = if run.dry_run {
            None
        } else {
            let named = crate::plan::RunRef {
                run_id: &run.run_id,
                policy: &run.policy,
                pinned_version: &run.policy_version,
                cutoff: run.cutoff,
                window: run.window_at,
            };
            match crate::plan::run_rules(state, &mut conn, &named).await {
                Ok(r) => Some(r),
                Err(e) => {
                    warn!(run_id, error = %e.message(), "no closure check for this run: its rules cannot be built");
                    None
                }
            }
        };
        drop(conn);
        // One run that cannot complete now (its row locked) must not stop the others, nor the
        // rest of housekeeping.
        match crate::completion::complete_run(state, &run_id, rules.as_ref()).await {
            Ok(Some(_)) => n += 1,
            Ok(None) => {}
            Err(e) => {
                warn!(run_id, error = %e, "completing a done run failed; retrying next round")
            }
        }
    }
    Ok(n)
}

/// Makes due again every push command no queue delivered within its transport's
/// `republish_after` (docs/design.md §8). Returns how many were marked.
pub async fn mark_stale_for_republish(state: &AppState) -> sqlx::Result<u64> {
    let horizons = [
        (
            crate::policy::Transport::Pubsub,
            state.config.pubsub.as_ref().map(|p| p.republish_after),
        ),
        (
            crate::policy::Transport::Qstash,
            state
                .config
                .qstash
                .as_ref()
                .map(|q| q.config.republish_after),
        ),
    ];
    let mut total = 0;
    for (transport, after) in horizons {
        if let Some(after) = after {
            total += ledger::outbox::mark_stale_for_republish(
                &state.pool,
                transport.as_str(),
                after.seconds(),
            )
            .await?;
        }
    }
    Ok(total)
}
