//! The outbox relay shared by the push transports (DESIGN §8): Pub/Sub and QStash.
//!
//! Commands of a push policy are written with `publish_due` in the run's transaction (the
//! outbox). Each replica runs one relay per configured push transport; it publishes the due
//! commands, then marks them published. A crash between the two publishes again with the same
//! generation and the consumer absorbs the duplicate. Every "not now" answered to a push is a
//! committed decision plus an acknowledgement ([`request_republish`]): the command is marked
//! `publish_due` and republished with the next generation. Housekeeping marks commands whose last
//! publish is older than the transport's `republish_after` ([`mark_stale_for_republish`]), so a
//! message lost or dead-lettered by the queue still completes.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tracing::{info, warn};

use crate::policy::Transport;
use crate::retry::Failure;
use crate::state::AppState;

/// Most commands one relay round reads and publishes.
pub const RELAY_BATCH: i64 = 100;
/// The relay's job lease, in seconds: one replica publishes per transport; another takes over
/// this long after the holder stopped renewing (a crash), or at once after a clean shutdown.
pub const RELAY_LEASE_SECONDS: f64 = 60.0;

/// One command to publish.
#[derive(Debug, Clone)]
pub struct Outbound {
    /// The command.
    pub command_id: String,
    /// Its run.
    pub run_id: String,
    /// The publish generation this message carries; the dedup id is `{command_id}:{generation}`.
    pub generation: i32,
    /// The command's `next_attempt_at` when it was read (ledger clock).
    pub next_attempt_at: DateTime<Utc>,
    /// Seconds until it is due (0 when due); a transport that can hold a message (QStash's
    /// `Upstash-Not-Before`) delivers it no earlier.
    pub due_in_seconds: f64,
}

impl Outbound {
    /// The dedup id sent to the queue: `{command_id}:{generation}` (DESIGN §8).
    pub fn dedup_id(&self) -> String {
        format!("{}:{}", self.command_id, self.generation)
    }

    /// The message body: the built-in envelope, identity only (DESIGN §2.12).
    pub fn envelope(&self) -> serde_json::Value {
        serde_json::json!({"command_id": self.command_id, "run_id": self.run_id,
                           "schema_version": 1, "publish_generation": self.generation})
    }
}

/// Why a publish did not go through.
#[derive(Debug)]
pub struct PublishError {
    /// What happened.
    pub message: String,
    /// How long the API asked us to wait (429/503 with `Retry-After`, a rate-limit reset,
    /// or Pub/Sub's `RetryInfo`).
    pub retry_after: Option<Duration>,
}

/// A push transport's publisher.
pub enum Publisher {
    /// Google Cloud Pub/Sub.
    Pubsub(crate::pubsub::Publisher),
    /// Upstash QStash.
    Qstash(crate::qstash::Publisher),
}

impl Publisher {
    /// The name of this relay's job lease: `relay:{transport}`.
    pub fn job(&self) -> String {
        format!("relay:{}", self.transport().as_str())
    }

    fn transport(&self) -> Transport {
        match self {
            Publisher::Pubsub(_) => Transport::Pubsub,
            Publisher::Qstash(_) => Transport::Qstash,
        }
    }

    /// How far ahead of due a command may be published: QStash holds a message until its
    /// `Upstash-Not-Before`; Pub/Sub delivers at once, so only due commands are published.
    fn horizon_seconds(&self, state: &AppState) -> f64 {
        match self {
            Publisher::Pubsub(_) => 0.0,
            Publisher::Qstash(_) => state
                .config
                .qstash
                .as_ref()
                .map_or(0.0, |q| q.config.max_delay.seconds() as f64),
        }
    }

    fn relay_interval(&self, state: &AppState) -> Duration {
        match self {
            Publisher::Pubsub(_) => state.config.pubsub.as_ref().map(|p| p.relay_interval.std()),
            Publisher::Qstash(_) => state
                .config
                .qstash
                .as_ref()
                .map(|q| q.config.relay_interval.std()),
        }
        .unwrap_or(Duration::from_secs(1))
    }

    /// Publishes `messages`; returns which of them went through (by index) and the first
    /// failure, if any. Pub/Sub publishes all or none; QStash one request per message.
    async fn publish(&self, messages: &[Outbound]) -> (Vec<usize>, Option<PublishError>) {
        match self {
            Publisher::Pubsub(p) => match p.publish(messages).await {
                Ok(()) => ((0..messages.len()).collect(), None),
                Err(e) => (Vec::new(), Some(e)),
            },
            Publisher::Qstash(q) => q.publish(messages).await,
        }
    }
}

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

/// One relay round: takes or renews the relay's job lease, then publishes if it holds it.
pub async fn relay_round(state: &AppState, publisher: &Publisher) -> Result<Round, PublishError> {
    let held = crate::ledger::take_job_lease(
        &state.pool,
        &publisher.job(),
        state.replica_id,
        RELAY_LEASE_SECONDS,
    )
    .await
    .map_err(|e| PublishError {
        message: Failure::from_db(&e).message,
        retry_after: None,
    })?;
    if !held {
        return Ok(Round::Standby);
    }
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
        message: Failure::from_db(&e).message,
        retry_after: None,
    };
    // The generation: the first publish uses the command's own; a republish the next one; the
    // relay's retry of a publish it could not confirm (no mark) the same one.
    let rows: Vec<(String, String, i32, DateTime<Utc>, f64)> = sqlx::query_as(
        "select c.command_id, c.run_id,
                case when c.published_generation is null then c.publish_generation
                     else greatest(c.publish_generation, c.published_generation + 1) end,
                c.next_attempt_at,
                greatest(0, extract(epoch from c.next_attempt_at - sweeper.now()))::float8
           from sweeper.commands c join sweeper.runs r using (run_id)
          where c.transport = $2 and c.publish_due
            and c.next_attempt_at <= sweeper.now() + make_interval(secs => $3)
            and (c.state = 'pending' or (c.state = 'leased' and c.lease_until < sweeper.now()))
            and not exists (select 1 from sweeper.policy_state ps
                             where ps.policy = r.policy and ps.suspended)
          order by c.next_attempt_at
          limit $1",
    )
    .bind(RELAY_BATCH)
    .bind(publisher.transport().as_str())
    .bind(publisher.horizon_seconds(state))
    .fetch_all(&state.pool)
    .await
    .map_err(db)?;
    if rows.is_empty() {
        return Ok((0, 0));
    }
    let messages: Vec<Outbound> = rows
        .iter()
        .map(|(id, run, g, next, due_in)| Outbound {
            command_id: id.clone(),
            run_id: run.clone(),
            generation: *g,
            next_attempt_at: *next,
            due_in_seconds: *due_in,
        })
        .collect();
    let (published, error) = publisher.publish(&messages).await;
    crate::crash_point!("relay_after_publish");
    if !published.is_empty() {
        // Marked published; a decision committed since the read (it moves next_attempt_at)
        // keeps the command due for the next publish.
        let ids: Vec<&str> = published
            .iter()
            .map(|&i| messages[i].command_id.as_str())
            .collect();
        let gens: Vec<i32> = published.iter().map(|&i| messages[i].generation).collect();
        let nexts: Vec<DateTime<Utc>> = published
            .iter()
            .map(|&i| messages[i].next_attempt_at)
            .collect();
        sqlx::query(
            "update sweeper.commands c
                set publish_due = case when c.next_attempt_at = u.next then false
                                       else c.publish_due end,
                    published_at = sweeper.now(), published_generation = u.generation,
                    publish_generation = greatest(c.publish_generation, u.generation)
               from unnest($1::text[], $2::int4[], $3::timestamptz[]) as u(command_id, generation, next)
              where c.command_id = u.command_id",
        )
        .bind(&ids)
        .bind(&gens)
        .bind(&nexts)
        .execute(&state.pool)
        .await
        .map_err(db)?;
    }
    match error {
        Some(e) => Err(e),
        None => Ok((rows.len(), published.len())),
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
    let interval = publisher.relay_interval(&state);
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

/// Commits "publish this command again when it is due, and not before `not_before_seconds`"
/// for a push delivery answered "not now". Returns whether the command exists.
pub async fn request_republish(
    state: &AppState,
    command_id: &str,
    not_before_seconds: u64,
) -> Result<bool, Failure> {
    let n = sqlx::query(
        "update sweeper.commands
            set publish_due = true,
                next_attempt_at = greatest(next_attempt_at,
                                           sweeper.now() + make_interval(secs => $2))
          where command_id = $1 and state in ('pending', 'leased')",
    )
    .bind(command_id)
    .bind(not_before_seconds.clamp(1, 86_400) as f64)
    .execute(&state.pool)
    .await
    .map_err(|e| Failure::from_db(&e))?
    .rows_affected();
    Ok(n > 0)
}

/// Housekeeping: due, non-terminal push commands never published, or whose last publish (or,
/// when later, their due time: QStash may hold a message until then) is older than the
/// transport's `republish_after`, are published again. Returns how many were marked.
pub async fn mark_stale_for_republish(state: &AppState) -> sqlx::Result<u64> {
    let mut total = 0;
    let horizons = [
        (
            Transport::Pubsub,
            state.config.pubsub.as_ref().map(|p| p.republish_after),
        ),
        (
            Transport::Qstash,
            state
                .config
                .qstash
                .as_ref()
                .map(|q| q.config.republish_after),
        ),
    ];
    for (transport, after) in horizons {
        let Some(after) = after else { continue };
        total += sqlx::query(
            "update sweeper.commands
                set publish_due = true
              where transport = $1 and not publish_due
                and (state = 'pending' or (state = 'leased' and lease_until < sweeper.now()))
                and next_attempt_at <= sweeper.now()
                and (published_at is null
                     or greatest(published_at, next_attempt_at)
                        < sweeper.now() - make_interval(secs => $2))",
        )
        .bind(transport.as_str())
        .bind(after.seconds() as f64)
        .execute(&state.pool)
        .await?
        .rows_affected();
    }
    Ok(total)
}
