//! The built-in queue's workers (DESIGN §8): how commands of the `builtin` transport reach the
//! consume pipeline. (Push transports publish from the same ledger rows and arrive through
//! `/consume`.)
//!
//! The built-in queue claims one due command at a time in a short transaction
//! (`FOR UPDATE SKIP LOCKED`, lease, attempt number), then runs the same pipeline as `/consume`
//! with that attempt number fencing every write, so a worker whose lease expired cannot overwrite
//! a newer attempt's result.

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::execute::{self, ConsumeOutcome, Executor};
use crate::retry::Failure;
use crate::state::AppState;

/// The actor recorded in audit rows written by built-in workers.
pub const BUILTIN_ACTOR: &str = "sweeper:builtin-queue";

/// What one worker step did.
#[derive(Debug)]
pub enum WorkerStep {
    /// Nothing was due.
    Idle,
    /// A command was claimed and driven to this outcome.
    Ran(ConsumeOutcome),
}

/// Claims up to `limit` due built-in commands (pending and due, or leased with an expired
/// lease) in one short transaction: each gets a lease owned by this replica and its attempt
/// number, which fences everything its execution writes.
pub async fn claim(state: &AppState, limit: i64) -> Result<Vec<(String, i32)>, Failure> {
    sqlx::query_as(
        "update sweeper.commands c
            set state = 'leased', attempts = c.attempts + 1, lease_owner = $2, calling_since = null,
                lease_until = (select sweeper.now()) + make_interval(secs => $1)
          where c.command_id in (
                select q.command_id from sweeper.commands q
                 where q.transport = 'builtin'
                   and ((q.state = 'pending' and q.next_attempt_at <= (select sweeper.now()))
                     or (q.state = 'leased' and q.lease_until < (select sweeper.now())))
                   and not exists (
                        select 1 from sweeper.runs r join sweeper.policy_state ps using (policy)
                         where r.run_id = q.run_id and ps.suspended)
                 order by q.next_attempt_at
                 limit $3
                 for update of q skip locked)
          returning c.command_id, c.attempts",
    )
    .bind(state.config.queue.lease.seconds() as f64)
    .bind(state.replica_id)
    .bind(limit)
    .fetch_all(&state.pool)
    .await
    .map_err(|e| Failure::from_db(&e))
}

/// Executes one claimed command; a "not now" gives it back without spending its attempt.
async fn run_claimed(
    state: &AppState,
    command_id: &str,
    attempt: i32,
) -> Result<ConsumeOutcome, Failure> {
    crate::crash_point!("worker_after_claim");
    let outcome =
        execute::execute(state, command_id, Executor::Claimed(attempt), BUILTIN_ACTOR).await?;
    if let ConsumeOutcome::NotNow {
        retry_after_seconds,
        reason,
    } = &outcome
    {
        release(state, command_id, attempt, *retry_after_seconds, reason).await?;
    }
    Ok(outcome)
}

/// Claims one due built-in command and executes it. Tests drive the queue deterministically
/// through this.
pub async fn run_one_command(state: &AppState) -> Result<WorkerStep, Failure> {
    match claim(state, 1).await?.pop() {
        None => Ok(WorkerStep::Idle),
        Some((command_id, attempt)) => Ok(WorkerStep::Ran(
            run_claimed(state, &command_id, attempt).await?,
        )),
    }
}

/// Gives a claimed command back without spending its attempt (suspended, held, or this
/// replica's configuration is behind): it is due again after `retry_after_seconds`, and its
/// `last_error` says why.
async fn release(
    state: &AppState,
    command_id: &str,
    attempt: i32,
    retry_after_seconds: u64,
    reason: &str,
) -> Result<(), Failure> {
    // Not a failure, but visible: `last_error` says why the command waits (class stays null).
    sqlx::query(
        "update sweeper.commands
            set state = 'pending', lease_until = null, lease_owner = null, attempts = attempts - 1,
                next_attempt_at = greatest(next_attempt_at,
                                           sweeper.now() + make_interval(secs => $3)),
                last_error = $4
          where command_id = $1 and state = 'leased' and attempts = $2",
    )
    .bind(command_id)
    .bind(attempt)
    .bind(retry_after_seconds as f64)
    .bind(reason)
    .execute(&state.pool)
    .await
    .map_err(|e| Failure::from_db(&e))?;
    Ok(())
}

/// After a try that could not record its result (the ledger was unreachable), puts the command
/// back for a retry in a second, keeping its spent attempt. Best effort, a few times: if the
/// ledger stays away, the lease's expiry gives the command back instead.
async fn give_back(state: &AppState, command_id: &str, attempt: i32) {
    for pause_ms in [100, 500, 2_000] {
        tokio::time::sleep(std::time::Duration::from_millis(pause_ms)).await;
        let done = sqlx::query(
            "update sweeper.commands
                set state = 'pending', lease_until = null, lease_owner = null,
                    next_attempt_at = sweeper.now() + interval '1 second'
              where command_id = $1 and state = 'leased' and attempts = $2",
        )
        .bind(command_id)
        .bind(attempt)
        .execute(&state.pool)
        .await;
        if done.is_ok() {
            return;
        }
    }
}

/// Gives back every command this replica still holds a lease on (after its workers stopped),
/// without spending their attempts, so another replica picks them up at once. Returns how many.
pub async fn release_own_leases(state: &AppState) -> Result<u64, Failure> {
    let n = sqlx::query(
        "update sweeper.commands
            set state = 'pending', lease_until = null, lease_owner = null, attempts = attempts - 1
          where lease_owner = $1 and state = 'leased'",
    )
    .bind(state.replica_id)
    .execute(&state.pool)
    .await
    .map_err(|e| Failure::from_db(&e))?
    .rows_affected();
    Ok(n)
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
                for (command_id, attempt) in claimed {
                    // On shutdown the rest stay leased to this replica and are released.
                    if shutdown.is_cancelled() {
                        return;
                    }
                    match run_claimed(&state, &command_id, attempt).await {
                        Ok(outcome) => debug!(worker_no, ?outcome, "command done"),
                        Err(f) => {
                            warn!(worker_no, command_id, error = %f.message, "command step failed");
                            give_back(&state, &command_id, attempt).await;
                        }
                    }
                }
                continue;
            }
            Ok(_) => {}
            Err(f) => warn!(worker_no, error = %f.message, "claim failed"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = notified => {}
            _ = tokio::time::sleep(state.config.queue.poll_interval.std()) => {}
        }
    }
}
