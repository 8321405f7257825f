//! Leases on background jobs (`sweeper.job_leases`): housekeeping, audit retention and the push
//! relays are each done by one replica at a time. A lease lasts [`JOB_LEASE`]; its holder
//! renews it every [`JOB_LEASE_RENEWAL`] while it works, so a replica that dies (kill -9, a lost
//! node) is replaced within a minute. A replica has no identity that survives its restart (its
//! id is new per process), so recovery comes from expiry, never from recognising its own lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::ledger;
use crate::state::AppState;

/// How long a job lease lasts without renewal.
pub const JOB_LEASE: Duration = Duration::from_secs(60);
/// How often a held lease is renewed while its holder works.
pub const JOB_LEASE_RENEWAL: Duration = Duration::from_secs(20);

/// A job lease this replica holds, renewed in the background until dropped. When a renewal
/// finds another replica holding the job (ours expired while the ledger was out of reach),
/// [`HeldJob::held`] turns false, and the work checks it before every step it cannot undo.
pub struct HeldJob {
    lost: Arc<AtomicBool>,
    stop: CancellationToken,
}

impl HeldJob {
    /// Takes (or renews) the lease on `job`; `None` when another replica holds it.
    pub async fn take(state: &AppState, job: &str) -> sqlx::Result<Option<HeldJob>> {
        Self::take_for(state, job, JOB_LEASE, JOB_LEASE_RENEWAL).await
    }

    /// [`HeldJob::take`] with another lease and renewal interval (tests use seconds).
    pub async fn take_for(
        state: &AppState,
        job: &str,
        lease: Duration,
        renewal: Duration,
    ) -> sqlx::Result<Option<HeldJob>> {
        let (pool, owner) = (state.pool.clone(), state.replica_id);
        let seconds = lease.as_secs_f64();
        if !ledger::take_job_lease(&pool, job, owner, seconds).await? {
            return Ok(None);
        }
        let lost = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        let (job, l, s) = (job.to_string(), lost.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = s.cancelled() => return,
                    _ = tokio::time::sleep(renewal) => {}
                }
                match ledger::take_job_lease(&pool, &job, owner, seconds).await {
                    Ok(true) => {}
                    Ok(false) => {
                        warn!(job, "another replica took over this job; this one stops it");
                        l.store(true, Ordering::SeqCst);
                        return;
                    }
                    // Retried at the next renewal; the lease expires if none succeeds.
                    Err(e) => warn!(job, error = %e, "renewing the job lease failed"),
                }
            }
        });
        Ok(Some(HeldJob { lost, stop }))
    }

    /// Whether this replica still holds the job.
    pub fn held(&self) -> bool {
        !self.lost.load(Ordering::SeqCst)
    }
}

impl Drop for HeldJob {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
