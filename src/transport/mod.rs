//! Transports (DESIGN §8): how commands reach `/consume`. The built-in queue's workers are in
//! [`crate::app::worker`]; this module holds what the push transports share — the envelope a
//! message carries, a command to publish, a publish failure, and the `Publisher` seam with one
//! implementation per queue API (Pub/Sub, QStash) — and the push protocols themselves.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::policy::Transport;
use crate::settings::Config;

pub mod pubsub;
pub mod qstash;

/// The built-in envelope: identity only, never data (DESIGN §2.12).
///
/// ```json
/// {"command_id": "ticket-retention:2026-11-29T02:00:00Z:0", "publish_generation": 1}
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// `{run_id}:{batch_no}`.
    pub command_id: String,
    /// The run, informational (the ledger is authoritative).
    #[serde(default)]
    pub run_id: Option<String>,
    /// Envelope schema version; 1 if absent.
    #[serde(default)]
    pub schema_version: Option<u32>,
    /// The publish generation, informational.
    #[serde(default)]
    pub publish_generation: Option<i32>,
}

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

impl From<crate::ledger::outbox::Due> for Outbound {
    fn from(d: crate::ledger::outbox::Due) -> Self {
        Outbound {
            command_id: d.command_id,
            run_id: d.run_id,
            generation: d.generation,
            next_attempt_at: d.next_attempt_at,
            due_in_seconds: d.due_in_seconds,
        }
    }
}

/// A push transport's publisher.
pub enum Publisher {
    /// Google Cloud Pub/Sub.
    Pubsub(pubsub::Publisher),
    /// Upstash QStash.
    Qstash(qstash::Publisher),
}

impl Publisher {
    /// The name of this relay's job lease: `relay:{transport}`.
    pub fn job(&self) -> String {
        format!("relay:{}", self.transport().as_str())
    }

    /// The transport it publishes for.
    pub fn transport(&self) -> Transport {
        match self {
            Publisher::Pubsub(_) => Transport::Pubsub,
            Publisher::Qstash(_) => Transport::Qstash,
        }
    }

    /// How far ahead of due a command may be published: QStash holds a message until its
    /// `Upstash-Not-Before`; Pub/Sub delivers at once, so only due commands are published.
    pub fn horizon_seconds(&self, config: &Config) -> f64 {
        match self {
            Publisher::Pubsub(_) => 0.0,
            Publisher::Qstash(_) => config
                .qstash
                .as_ref()
                .map_or(0.0, |q| q.config.max_delay.seconds() as f64),
        }
    }

    /// How often its relay looks for commands to publish.
    pub fn relay_interval(&self, config: &Config) -> Duration {
        match self {
            Publisher::Pubsub(_) => config.pubsub.as_ref().map(|p| p.relay_interval.std()),
            Publisher::Qstash(_) => config
                .qstash
                .as_ref()
                .map(|q| q.config.relay_interval.std()),
        }
        .unwrap_or(Duration::from_secs(1))
    }

    /// Publishes `messages`; returns which of them went through (by index) and the first
    /// failure, if any. Pub/Sub publishes all or none; QStash one request per message.
    pub async fn publish(&self, messages: &[Outbound]) -> (Vec<usize>, Option<PublishError>) {
        match self {
            Publisher::Pubsub(p) => match p.publish(messages).await {
                Ok(()) => ((0..messages.len()).collect(), None),
                Err(e) => (Vec::new(), Some(e)),
            },
            Publisher::Qstash(q) => q.publish(messages).await,
        }
    }
}
