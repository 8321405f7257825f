//! Housekeeping: periodic ledger work done by one replica at a time (it holds the
//! `housekeeping` job lease): republishing push commands no queue delivered, and purging old
//! terminal commands in bounded batches.

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::ledger;
use crate::state::AppState;

/// Periodic ledger work, done by the replica holding the `housekeeping` job lease (renewed every
/// round, twice the interval long): republishing stale push commands and purging old terminal
/// commands in bounded batches.
pub async fn housekeeping_loop(state: AppState, shutdown: CancellationToken) {
    let interval = state.config.ledger.housekeeping_interval;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval.std()) => {}
        }
        let lease = (interval.seconds() * 2 + 10) as f64;
        match crate::ledger::take_job_lease(&state.pool, "housekeeping", state.replica_id, lease)
            .await
        {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                warn!(error = %e, "housekeeping could not take its lease; retrying next round");
                continue;
            }
        }
        if let Err(e) = housekeeping_once(&state).await {
            warn!(error = %e, "housekeeping failed; retrying next round");
        }
    }
}

/// One round of housekeeping: purges until a batch comes back short. Returns commands purged.
pub async fn housekeeping_once(state: &AppState) -> sqlx::Result<u64> {
    let republish = crate::relay::mark_stale_for_republish(state).await?;
    if republish > 0 {
        info!(
            commands = republish,
            "push commands not delivered within republish_after are published again"
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
