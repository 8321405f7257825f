//! The built-in queue's workers (docs/design.md §8): how commands of the `builtin` transport reach the
//! consume pipeline. (Push transports publish from the same ledger rows and arrive through
//! `/consume`.)
//!
//! The built-in queue claims one due command at a time in a short transaction
//! (`FOR UPDATE SKIP LOCKED`, lease, attempt number), then runs the same pipeline as `/consume`
//! with that attempt number fencing every write, so a worker whose lease expired cannot overwrite
//! a newer attempt's result.

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::execute::{self, Ended, Executor};
use crate::ledger;
use crate::ledger::commands::CommandTry;
use crate::retry::Setback;
use crate::state::AppState;

/// The actor recorded in audit rows written by built-in workers.
pub const BUILTIN_ACTOR: &str = "sweeper:builtin-queue";

/// What one worker step did.
#[derive(Debug)]
pub enum WorkerStep {
    /// Nothing was due.
    Idle,
    /// A command was claimed and driven to this outcome.
    Ran(Ended),
}

/// Claims up to `limit` due built-in commands (pending and due, or leased with an expired
/// lease) in one short transaction: each gets a lease owned by this replica and its attempt
/// number, which fences everything its execution writes.
pub async fn claim(state: &AppState, limit: i64) -> Result<Vec<CommandTry>, Setback> {
    ledger::queue::claim(
        &state.pool,
        state.replica_id,
        state.config.queue.lease.seconds() as f64,
        limit,
        &crate::holds::held_policies(state),
    )
    .await
    .map_err(|e| Setback::from_db(&e))
}

/// Executes one claimed command (a "not now" is given back by the execution, without spending
/// its attempt).
async fn run_claimed(state: &AppState, claim: CommandTry) -> Result<Ended, Setback> {
    crate::crash_point!("worker_after_claim");
    let command_id = claim.command_id().to_string();
    execute::execute(state, &command_id, Executor::Claimed(claim), BUILTIN_ACTOR).await
}

/// Claims one due built-in command and executes it. Tests drive the queue deterministically
/// through this.
pub async fn run_one_command(state: &AppState) -> Result<WorkerStep, Setback> {
    match claim(state, 1).await?.pop() {
        None => Ok(WorkerStep::Idle),
        Some(claim) => Ok(WorkerStep::Ran(run_claimed(state, claim).await?)),
    }
}

/// After a try that could not record its result (the ledger was unreachable), puts the command
/// back for a retry in a second, keeping its spent attempt. Best effort, a few times: if the
/// ledger stays away, the lease's expiry gives the command back instead.
async fn give_back(state: &AppState, claim: &CommandTry) {
    for pause_ms in [100, 500, 2_000] {
        tokio::time::sleep(std::time::Duration::from_millis(pause_ms)).await;
        if claim.give_back(&state.pool).await.is_ok() {
            return;
        }
    }
}

/// Gives back every command this replica still holds a lease on (after its workers stopped),
/// without spending their attempts, so another replica picks them up at once. Returns how many.
pub async fn release_own_leases(state: &AppState) -> Result<u64, Setback> {
    ledger::queue::release_all(&state.pool, state.replica_id)
        .await
        .map_err(|e| Setback::from_db(&e))
}

/// One built-in worker: runs due commands until `shutdown`, then returns after its current
/// command (each try is bounded by `consume.command_deadline`; the application also bounds the
/// whole drain by `queue.drain`).
pub async fn worker_loop(state: AppState, worker_no: usize, shutdown: CancellationToken) {
    let batch = state.config.queue.claim_batch as i64;
    loop {
        if shutdown.is_cancelled() {
            return;
        }
        let notified = state.wake_workers.notified();
        match claim(&state, batch).await {
            Ok(claimed) if !claimed.is_empty() => {
                for claim in claimed {
                    // On shutdown the rest stay leased to this replica and are released.
                    if shutdown.is_cancelled() {
                        return;
                    }
                    let command_id = claim.command_id().to_string();
                    match run_claimed(&state, claim.clone()).await {
                        Ok(outcome) => debug!(worker_no, ?outcome, "command done"),
                        Err(f) => {
                            warn!(worker_no, command_id, error = %f.message(), "command step failed");
                            give_back(&state, &claim).await;
                        }
                    }
                }
                continue;
            }
            Ok(_) => {}
            Err(f) => warn!(worker_no, error = %f.message(), "claim failed"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = notified => {}
            _ = tokio::time::sleep(state.config.queue.poll_interval.std()) => {}
        }
    }
}
