//! The relay of the push transports (docs/design.md §8): commands of a push policy are written with
//! `publish_due` in the run's transaction (the outbox); one replica per transport (the holder of
//! its job lease) publishes the due ones through the transport's [`Publisher`], then marks them
//! published. A crash between the two publishes again with the same generation, and the
//! consumer absorbs the duplicate. A push answered "not now" and housekeeping's republish
//! horizon make commands due again ([`crate::ledger::outbox`]).

use std::time::Duration;

use tracing::{info, warn};

use super::job_lease::HeldJob;
use crate::ledger;
use crate::retry::Setback;
use crate::state::AppState;
use crate::transport::{Outbound, PublishError, Publisher};

/// Most commands one relay round reads and publishes.
pub const RELAY_BATCH: i64 = 100;

/// What one relay round did.
#[derive(Debug, PartialEq, Eq)]
pub enum Round {
    /// Another replica holds the relay's lease; nothing was read.
    Standby,
    /// This replica holds the lease: commands read, and how many of them were published.
    Published {
        /// Commands read (at most [`RELAY_BATCH`]).
        read: usize,
        /// Commands the queue accepted.
        published: usize,
    },
}

/// One relay round: takes or renews the relay's job lease, then publishes if it holds it (the
/// lease is renewed in the background while a slow publish lasts).
pub async fn relay_round(state: &AppState, publisher: &Publisher) -> Result<Round, PublishError> {
    let lease = HeldJob::take(state, &publisher.job())
        .await
        .map_err(|e| PublishError {
            message: Setback::from_db(&e).message().to_string(),
            retry_after: None,
        })?;
    let Some(_lease) = lease else {
        return Ok(Round::Standby);
    };
    let (read, published) = relay_once(state, publisher).await?;
    Ok(Round::Published { read, published })
}

/// Publishes the due commands of the publisher's transport once, whoever holds the lease;
/// returns how many were read and how many published.
pub async fn relay_once(
    state: &AppState,
    publisher: &Publisher,
) -> Result<(usize, usize), PublishError> {
    let db = |e: sqlx::Error| PublishError {
        message: Setback::from_db(&e).message().to_string(),
        retry_after: None,
    };
    let due = ledger::outbox::due(
        &state.pool,
        publisher.transport().as_str(),
        RELAY_BATCH,
        publisher.horizon_seconds(),
        &crate::holds::held_policies(state),
    )
    .await
    .map_err(db)?;
    if due.is_empty() {
        return Ok((0, 0));
    }
    let messages: Vec<Outbound> = due.iter().cloned().map(Outbound::from).collect();
    let (published, error) = publisher.publish(&messages).await;
    crate::crash_point!("relay_after_publish");
    if !published.is_empty() {
        let accepted: Vec<&ledger::outbox::Due> = published.iter().map(|&i| &due[i]).collect();
        ledger::outbox::mark_published(&state.pool, &accepted)
            .await
            .map_err(db)?;
    }
    match error {
        Some(e) => Err(e),
        None => Ok((due.len(), published.len())),
    }
}

/// The relay: every `relay_interval` until `shutdown`, a round of [`relay_round`] (publishing
/// when this replica holds the relay's lease), backing off when the publish API throttles or
/// fails.
pub async fn relay_loop(
    state: AppState,
    publisher: Publisher,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let interval = publisher.relay_interval();
    let transport = publisher.transport().as_str();
    let mut failures = 0u32;
    loop {
        let wait = match relay_round(&state, &publisher).await {
            Ok(Round::Standby) => interval,
            Ok(Round::Published { read, .. }) if read as i64 == RELAY_BATCH => Duration::ZERO,
            Ok(Round::Published { published, .. }) => {
                if published > 0 {
                    info!(transport, published, "relay published commands");
                }
                failures = 0;
                interval
            }
            Err(e) => {
                failures += 1;
                let backoff = crate::retry::Backoff {
                    base_seconds: 1.0,
                    cap_seconds: 60.0,
                }
                .delay_seconds(failures, &mut rand::rng());
                let wait = e
                    .retry_after
                    .unwrap_or(Duration::from_secs_f64(backoff.max(0.5)));
                warn!(transport, error = %e.message, retry_in = ?wait, "relay could not publish");
                wait
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
