//! Transports (docs/design.md §8): how commands reach `/consume`. The built-in queue's workers are in
//! [`crate::app::worker`]; this module holds what the push transports share — the envelope a
//! message carries, a command to publish, a publish failure, and the `Publisher` seam with one
//! implementation per queue API (Pub/Sub, QStash) — and the push protocols themselves.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::policy::Transport;

pub mod pubsub;
pub mod qstash;

/// The built-in envelope: identity only, never data (docs/design.md §2.12).
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
    /// The dedup id sent to the queue: `{command_id}:{generation}` (docs/design.md §8).
    pub fn dedup_id(&self) -> String {
        format!("{}:{}", self.command_id, self.generation)
    }

    /// The message body: the built-in envelope, identity only (docs/design.md §2.12).
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
    /// `Upstash-Not-Before` (up to `qstash.max_delay`); Pub/Sub delivers at once, so only due
    /// commands are published.
    pub fn horizon_seconds(&self) -> f64 {
        match self {
            Publisher::Pubsub(_) => 0.0,
            Publisher::Qstash(q) => q.max_delay_seconds,
        }
    }

    /// How often its relay looks for commands to publish.
    pub fn relay_interval(&self) -> Duration {
        match self {
            Publisher::Pubsub(p) => p.relay_interval,
            Publisher::Qstash(q) => q.relay_interval,
        }
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

/// The envelope a `/consume` body carries: from the Pub/Sub push `push` when the body is one
/// (see [`crate::transport::pubsub::parse_push`]), else the body as the built-in envelope. `Err` says why
/// the body is a poison message: not an envelope, a `schema_version` other than 1, or a
/// `command_id` that is empty, longer than 512 bytes or holds a control character. Total: any
/// bytes give `Ok` or `Err`, never a panic (the fuzz target `consume_body` checks that).
pub fn delivered_envelope(
    push: Option<&pubsub::PushDelivery>,
    body: &[u8],
) -> Result<Envelope, String> {
    // serde's messages quote the offending input (an unknown field's name may hold a NUL, which
    // PostgreSQL text refuses, or be 60 KiB long): store and show a bounded, printable reason.
    parse_delivered(push, body).map_err(|why| crate::ledger::printable(&why, MAX_REASON_CHARS))
}

fn parse_delivered(push: Option<&pubsub::PushDelivery>, body: &[u8]) -> Result<Envelope, String> {
    match push {
        Some(p) => p.envelope.clone(),
        None => read_envelope(body),
    }
    .and_then(|e| match e.schema_version.unwrap_or(1) {
        1 => Ok(e),
        v => Err(format!("schema_version {v} is not supported (1 is)")),
    })
    .and_then(|e| {
        let id = &e.command_id;
        if id.is_empty() || id.len() > 512 || id.chars().any(char::is_control) {
            Err("command_id must be 1-512 characters without control characters".into())
        } else {
            Ok(e)
        }
    })
}

/// Reads the built-in envelope from `bytes`, saying in sweeper's words what is wrong: not JSON
/// (and where), not an object, a member missing, of the wrong type, or unknown.
pub fn read_envelope(bytes: &[u8]) -> Result<Envelope, String> {
    const MEMBERS: &str = "command_id (text), run_id (text), schema_version (integer), \
                           publish_generation (integer)";
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            _ if bytes.iter().all(u8::is_ascii_whitespace) => "the body is empty, not JSON".into(),
            Category::Eof => "the body is not JSON: it ends before its value does".into(),
            _ => format!(
                "the body is not JSON: unexpected input at line {}, column {}",
                e.line(),
                e.column()
            ),
        }
    })?;
    if crate::strict_json::repeats_a_name(bytes) {
        return Err(format!(
            "a member is named twice; an envelope names each of {MEMBERS} at most once"
        ));
    }
    let serde_json::Value::Object(members) = value else {
        return Err(format!(
            "the body is JSON but not an object; an envelope is an object with {MEMBERS}"
        ));
    };
    if let Some(name) = members.keys().find(|k| {
        !matches!(
            k.as_str(),
            "command_id" | "run_id" | "schema_version" | "publish_generation"
        )
    }) {
        return Err(format!(
            "unknown member `{}`; an envelope has {MEMBERS}",
            crate::ledger::printable(name, 64)
        ));
    }
    let text = |name: &str| match members.get(name) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("`{name}` must be text")),
    };
    let integer = |name: &str, min: i64, max: i64| match members.get(name) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .filter(|n| (min..=max).contains(n))
            .map(Some)
            .ok_or_else(|| format!("`{name}` must be an integer from {min} to {max}")),
    };
    Ok(Envelope {
        command_id: text("command_id")?.ok_or("the member `command_id` is missing")?,
        run_id: text("run_id")?,
        schema_version: integer("schema_version", 0, u32::MAX.into())?.map(|n| n as u32),
        publish_generation: integer("publish_generation", i32::MIN.into(), i32::MAX.into())?
            .map(|n| n as i32),
    })
}

/// Longest reason given for a quarantined envelope, in characters.
pub const MAX_REASON_CHARS: usize = 300;
