//! The Google Cloud Pub/Sub transport (DESIGN §5, §8).
//!
//! Commands of a `transport = "pubsub"` policy are written with `publish_due` in the run's
//! transaction (the outbox). The relay publishes due ones through the REST `:publish` API, then
//! marks them published; a crash between the two publishes again with the same generation and
//! the consumer absorbs the duplicate. Every "not now" answered to a push is a committed decision
//! plus an acknowledgement: the command is marked `publish_due` and republished, with the next
//! generation, when it is due. Housekeeping marks pending commands whose last publish is older
//! than `republish_after` (a message lost or dead-lettered by Pub/Sub still completes).
//!
//! Messages carry identity only (DESIGN §2.12): `data` is the built-in envelope as JSON, and the
//! attributes repeat `command_id` and `publish_generation`.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use serde::Deserialize;
use serde_json::json;
use tracing::{info, warn};

use crate::app::AppState;
use crate::config::DurationSpec;
use crate::consume::Envelope;
use crate::retry::{Failure, parse_retry_after};

/// `[pubsub]`.
///
/// ```toml
/// [pubsub]
/// project = "my-project"
/// topic = "sweeper-commands"
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PubsubConfig {
    /// The Google Cloud project.
    pub project: String,
    /// The topic commands are published to; its push subscription targets `/consume`.
    pub topic: String,
    /// `host:port` of the Pub/Sub emulator (plain HTTP, no credentials); `PUBSUB_EMULATOR_HOST`
    /// is honoured when this is unset.
    #[serde(default)]
    pub emulator_host: Option<String>,
    /// A pending command whose last publish is older than this is published again (default
    /// `10m`; keep it above the subscription's ack deadline × its retries).
    #[serde(default = "default_republish_after")]
    pub republish_after: DurationSpec,
    /// How often the relay looks for commands to publish (default `1s`).
    #[serde(default = "default_relay_interval")]
    pub relay_interval: DurationSpec,
}

fn default_republish_after() -> DurationSpec {
    DurationSpec::from_seconds(600)
}
fn default_relay_interval() -> DurationSpec {
    DurationSpec::from_seconds(1)
}

/// Most messages per `:publish` call (Pub/Sub allows 1,000).
const PUBLISH_BATCH: i64 = 100;
/// Longest wait a `Retry-After` from the publish API may impose on the relay.
const PUBLISH_PAUSE_CAP: Duration = Duration::from_secs(60);

/// Publishes to the configured topic.
pub struct Publisher {
    client: reqwest::Client,
    url: String,
    emulator: bool,
    auth: tokio::sync::OnceCell<Arc<dyn gcp_auth::TokenProvider>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").field("url", &self.url).finish()
    }
}

/// Why a publish did not go through.
#[derive(Debug)]
pub struct PublishError {
    /// What happened.
    pub message: String,
    /// How long the API asked us to wait (429/503 with `Retry-After`, or `RetryInfo`).
    pub retry_after: Option<Duration>,
}

impl Publisher {
    /// A publisher for `c`.
    pub fn new(c: &PubsubConfig) -> anyhow::Result<Publisher> {
        let emulator_host = c
            .emulator_host
            .clone()
            .or_else(|| std::env::var("PUBSUB_EMULATOR_HOST").ok());
        let (base, emulator) = match emulator_host {
            Some(h) => (format!("http://{h}"), true),
            None => ("https://pubsub.googleapis.com".to_string(), false),
        };
        Ok(Publisher {
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .no_proxy()
                .build()?,
            url: format!(
                "{base}/v1/projects/{}/topics/{}:publish",
                c.project, c.topic
            ),
            emulator,
            auth: tokio::sync::OnceCell::new(),
        })
    }

    /// Publishes one message per `(command_id, run_id, generation)`.
    pub async fn publish(&self, messages: &[(String, String, i32)]) -> Result<(), PublishError> {
        let fail = |message: String| PublishError {
            message,
            retry_after: None,
        };
        let body = json!({"messages": messages.iter().map(|(id, run, generation)| {
            let envelope = json!({"command_id": id, "run_id": run, "schema_version": 1,
                                  "publish_generation": generation});
            json!({
                "data": base64::engine::general_purpose::STANDARD.encode(envelope.to_string()),
                "attributes": {"command_id": id, "publish_generation": generation.to_string(),
                               "dedup_id": format!("{id}:{generation}")},
            })
        }).collect::<Vec<_>>()});
        let mut req = self.client.post(&self.url).json(&body);
        if !self.emulator {
            let provider = self
                .auth
                .get_or_try_init(|| async { gcp_auth::provider().await })
                .await
                .map_err(|e| fail(format!("no Google credentials: {e}")))?;
            let token = provider
                .token(&["https://www.googleapis.com/auth/pubsub"])
                .await
                .map_err(|e| fail(format!("getting a token: {e}")))?;
            req = req.bearer_auth(token.as_str());
        }
        let resp = req
            .send()
            .await
            .map_err(|e| fail(format!("publishing: {e}")))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, std::time::SystemTime::now(), PUBLISH_PAUSE_CAP));
        let text = resp.text().await.unwrap_or_default();
        // google.rpc.RetryInfo: {"error": {"details": [{"retryDelay": "3s"}]}}.
        let retry_info = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| {
                v["error"]["details"].as_array().and_then(|d| {
                    d.iter().find_map(|x| {
                        x["retryDelay"]
                            .as_str()
                            .and_then(|s| s.strip_suffix('s'))
                            .and_then(|s| s.parse::<f64>().ok())
                    })
                })
            })
            .map(|s| Duration::from_secs_f64(s.clamp(0.0, PUBLISH_PAUSE_CAP.as_secs_f64())));
        Err(PublishError {
            message: format!(
                "the publish API answered {status}: {}",
                text.chars().take(300).collect::<String>()
            ),
            retry_after: retry_after
                .or(retry_info)
                .or((status.as_u16() == 429 || status.as_u16() == 503)
                    .then_some(Duration::from_secs(1))),
        })
    }
}

/// Publishes the due commands once; returns how many were published.
pub async fn relay_once(state: &AppState, publisher: &Publisher) -> Result<usize, PublishError> {
    let db = |e: sqlx::Error| PublishError {
        message: Failure::from_db(&e).message,
        retry_after: None,
    };
    // The generation: the first publish uses the command's own; a republish the next one; the
    // relay's retry of a publish it could not confirm (no mark) the same one.
    let rows: Vec<(String, String, i32, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "select c.command_id, c.run_id,
                case when c.published_generation is null then c.publish_generation
                     else greatest(c.publish_generation, c.published_generation + 1) end,
                c.next_attempt_at
           from sweeper.commands c join sweeper.runs r using (run_id)
          where c.transport = 'pubsub' and c.publish_due
            and c.next_attempt_at <= sweeper.now()
            and (c.state = 'pending' or (c.state = 'leased' and c.lease_until < sweeper.now()))
            and not exists (select 1 from sweeper.policy_state ps
                             where ps.policy = r.policy and ps.suspended)
          order by c.next_attempt_at
          limit $1",
    )
    .bind(PUBLISH_BATCH)
    .fetch_all(&state.pool)
    .await
    .map_err(db)?;
    if rows.is_empty() {
        return Ok(0);
    }
    let messages: Vec<(String, String, i32)> = rows
        .iter()
        .map(|(id, run, g, _)| (id.clone(), run.clone(), *g))
        .collect();
    publisher.publish(&messages).await?;
    crate::crash_point!("relay_after_publish");
    // Marked published; a decision committed since the read (it moves next_attempt_at) keeps
    // the command due for the next publish.
    let ids: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    let gens: Vec<i32> = rows.iter().map(|r| r.2).collect();
    let nexts: Vec<chrono::DateTime<chrono::Utc>> = rows.iter().map(|r| r.3).collect();
    sqlx::query(
        "update sweeper.commands c
            set publish_due = case when c.next_attempt_at = u.next then false else c.publish_due end,
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
    Ok(rows.len())
}

/// The relay: publishes due commands every `relay_interval` until `shutdown`, backing off when
/// the publish API throttles or fails.
pub async fn relay_loop(
    state: AppState,
    publisher: Publisher,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let interval = state
        .config
        .pubsub
        .as_ref()
        .map(|p| p.relay_interval.std())
        .unwrap_or(Duration::from_secs(1));
    let mut failures = 0u32;
    loop {
        let wait = match relay_once(&state, &publisher).await {
            Ok(n) if n as i64 == PUBLISH_BATCH => Duration::ZERO,
            Ok(n) => {
                if n > 0 {
                    info!(published = n, "relay published commands");
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
                warn!(error = %e.message, retry_in = ?wait, "relay could not publish");
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

/// Housekeeping: pending push commands whose last publish is older than `republish_after` are
/// published again (a message lost or dead-lettered by the queue still completes).
pub async fn mark_stale_for_republish(state: &AppState) -> sqlx::Result<u64> {
    let Some(p) = &state.config.pubsub else {
        return Ok(0);
    };
    Ok(sqlx::query(
        "update sweeper.commands
            set publish_due = true
          where transport = 'pubsub' and not publish_due
            and (state = 'pending' or (state = 'leased' and lease_until < sweeper.now()))
            and next_attempt_at <= sweeper.now()
            and (published_at is null
                 or published_at < sweeper.now() - make_interval(secs => $1))",
    )
    .bind(p.republish_after.seconds() as f64)
    .execute(&state.pool)
    .await?
    .rows_affected())
}

/// A push delivery from Pub/Sub, parsed.
#[derive(Debug)]
pub struct PushDelivery {
    /// The envelope the message carries.
    pub envelope: Result<Envelope, String>,
    /// Pub/Sub's own delivery counter, informational (the ledger's attempts are the budget).
    pub delivery_attempt: Option<i64>,
    /// The message id.
    pub message_id: Option<String>,
}

// Pub/Sub sends both spellings of some fields (`messageId` and `message_id`), so each is its
// own optional field rather than a serde alias (which refuses duplicates).
#[derive(Deserialize)]
struct Wrapped {
    message: Message,
    #[serde(default, rename = "deliveryAttempt")]
    delivery_attempt: Option<i64>,
    #[serde(default, rename = "delivery_attempt")]
    delivery_attempt_snake: Option<i64>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    data: Option<String>,
    #[serde(default)]
    attributes: Option<std::collections::HashMap<String, String>>,
    #[serde(default, rename = "messageId")]
    message_id: Option<String>,
    #[serde(default, rename = "message_id")]
    message_id_snake: Option<String>,
}

/// Recognises a Pub/Sub push: the wrapped JSON envelope (`message.data` base64, possibly absent,
/// `attributes`, `messageId`/`message_id`, optional `deliveryAttempt`; unknown fields ignored),
/// or an unwrapped push (the body is the data; `x-goog-pubsub-message-id` is present). `None`
/// for anything else (the generic envelope).
pub fn parse_push(headers: &axum::http::HeaderMap, body: &[u8]) -> Option<PushDelivery> {
    if let Some(id) = headers.get("x-goog-pubsub-message-id") {
        return Some(PushDelivery {
            envelope: parse_envelope(body),
            delivery_attempt: None,
            message_id: id.to_str().ok().map(String::from),
        });
    }
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("message")?.as_object()?;
    let wrapped: Wrapped = match serde_json::from_value(v) {
        Ok(w) => w,
        Err(e) => {
            return Some(PushDelivery {
                envelope: Err(format!("a Pub/Sub push of the wrong shape: {e}")),
                delivery_attempt: None,
                message_id: None,
            });
        }
    };
    let m = wrapped.message;
    let envelope = match m.data.as_deref().filter(|d| !d.is_empty()) {
        Some(d) => base64::engine::general_purpose::STANDARD
            .decode(d)
            .map_err(|e| format!("message.data is not base64: {e}"))
            .and_then(|bytes| parse_envelope(&bytes)),
        None => match m.attributes.as_ref().and_then(|a| a.get("command_id")) {
            Some(id) => Ok(Envelope {
                command_id: id.clone(),
                run_id: None,
                schema_version: Some(1),
                publish_generation: m
                    .attributes
                    .as_ref()
                    .and_then(|a| a.get("publish_generation"))
                    .and_then(|g| g.parse().ok()),
            }),
            None => Err("the message has neither data nor a command_id attribute".into()),
        },
    };
    Some(PushDelivery {
        envelope,
        delivery_attempt: wrapped.delivery_attempt.or(wrapped.delivery_attempt_snake),
        message_id: m.message_id.or(m.message_id_snake),
    })
}

fn parse_envelope(bytes: &[u8]) -> Result<Envelope, String> {
    serde_json::from_slice::<Envelope>(bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push(body: serde_json::Value) -> PushDelivery {
        parse_push(&axum::http::HeaderMap::new(), body.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn push_envelopes_in_every_documented_shape() {
        let data = base64::engine::general_purpose::STANDARD
            .encode(r#"{"command_id":"p:2026-01-01T00:00:00Z:3","publish_generation":2}"#);
        // Both spellings at once, as Pub/Sub sends them, plus unknown fields.
        let p = push(
            json!({"message": {"data": data, "messageId": "1", "message_id": "1",
                                        "publishTime": "2026-01-01T00:00:00Z",
                                        "publish_time": "2026-01-01T00:00:00Z", "extra": 1},
                            "subscription": "projects/x/subscriptions/y",
                            "deliveryAttempt": 4}),
        );
        let e = p.envelope.unwrap();
        assert_eq!(e.command_id, "p:2026-01-01T00:00:00Z:3");
        assert_eq!(e.publish_generation, Some(2));
        assert_eq!(
            (p.delivery_attempt, p.message_id.as_deref()),
            (Some(4), Some("1"))
        );
        // No data: the attributes carry the identity.
        let p = push(
            json!({"message": {"attributes": {"command_id": "c:1", "publish_generation": "3"},
                                        "message_id": "2"}}),
        );
        let e = p.envelope.unwrap();
        assert_eq!(
            (e.command_id.as_str(), e.publish_generation),
            ("c:1", Some(3))
        );
        // Garbage inside a push is a poison message, not a generic envelope.
        assert!(push(json!({"message": {"data": "%%%"}})).envelope.is_err());
        assert!(push(json!({"message": {}})).envelope.is_err());
        // Not a push at all.
        assert!(parse_push(&axum::http::HeaderMap::new(), br#"{"command_id":"c:1"}"#).is_none());
        // Unwrapped push: the body is the data.
        let mut h = axum::http::HeaderMap::new();
        h.insert("x-goog-pubsub-message-id", "9".parse().unwrap());
        let p = parse_push(&h, br#"{"command_id":"c:1"}"#).unwrap();
        assert_eq!(p.envelope.unwrap().command_id, "c:1");
    }
}
