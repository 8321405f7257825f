//! The Google Cloud Pub/Sub transport (docs/design.md §5, §8).
//!
//! Commands of a `transport = "pubsub"` policy are published by the outbox relay
//! ([`crate::relay`]) through the REST `:publish` API; the topic's push subscription delivers them
//! to `/consume`, which recognises the push envelope parsed here.
//!
//! Messages carry identity only (docs/design.md §2.12): `data` is the built-in envelope as JSON, and the
//! attributes repeat `command_id` and `publish_generation`.

use std::sync::Arc;
use std::time::Duration;

use super::Envelope;
use crate::config::DurationSpec;
use crate::retry::parse_retry_after;
use crate::transport::{Outbound, PublishError};
use base64::Engine;
use serde::Deserialize;
use serde_json::json;

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

/// Longest wait a `Retry-After` from the publish API may impose on the relay.
const PUBLISH_PAUSE_CAP: Duration = Duration::from_secs(60);

/// Publishes to the configured topic.
pub struct Publisher {
    client: reqwest::Client,
    url: String,
    emulator: bool,
    auth: tokio::sync::OnceCell<Arc<dyn gcp_auth::TokenProvider>>,
    /// `pubsub.relay_interval`.
    pub(crate) relay_interval: Duration,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").field("url", &self.url).finish()
    }
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
            relay_interval: c.relay_interval.std(),
        })
    }

    /// Publishes one message per command, all or none.
    pub async fn publish(&self, messages: &[Outbound]) -> Result<(), PublishError> {
        let fail = |message: String| PublishError {
            message,
            retry_after: None,
        };
        let body = json!({"messages": messages.iter().map(|m| json!({
            "data": base64::engine::general_purpose::STANDARD.encode(m.envelope().to_string()),
            "attributes": {"command_id": m.command_id,
                           "publish_generation": m.generation.to_string(),
                           "dedup_id": m.dedup_id()},
        })).collect::<Vec<_>>()});
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
            envelope: crate::transport::read_envelope(body),
            delivery_attempt: None,
            message_id: id.to_str().ok().map(String::from),
        });
    }
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("message")?.as_object()?;
    if crate::strict_json::repeats_a_name(body) {
        return Some(PushDelivery {
            envelope: Err("a Pub/Sub push that names a member twice".into()),
            delivery_attempt: None,
            message_id: None,
        });
    }
    let wrapped: Wrapped = match serde_json::from_value(v) {
        Ok(w) => w,
        Err(_) => {
            return Some(PushDelivery {
                envelope: Err(
                    "a Pub/Sub push whose `message` is not of the documented shape \
                               (data: base64 text, attributes: text values, messageId: text)"
                        .into(),
                ),
                delivery_attempt: None,
                message_id: None,
            });
        }
    };
    let m = wrapped.message;
    let envelope = match m.data.as_deref().filter(|d| !d.is_empty()) {
        Some(d) => decode_data(d)
            .map_err(|_| "message.data is not base64".to_string())
            .and_then(|bytes| crate::transport::read_envelope(&bytes)),
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

/// `message.data`: the proto3 JSON mapping of `bytes` lets writers use the standard or the
/// URL-safe alphabet, padded or not (push-protocols §1.1), so all four are read.
fn decode_data(d: &str) -> Result<Vec<u8>, base64::DecodeError> {
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    let lenient =
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
    GeneralPurpose::new(&base64::alphabet::STANDARD, lenient)
        .decode(d)
        .or_else(|e| {
            GeneralPurpose::new(&base64::alphabet::URL_SAFE, lenient)
                .decode(d)
                .map_err(|_| e)
        })
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
        // Unpadded and URL-safe data are read too.
        let raw = br#"{"command_id":"c:1?~?"}"#; // "/" in standard base64, "_" in URL-safe
        for engine in [
            base64::engine::general_purpose::STANDARD_NO_PAD,
            base64::engine::general_purpose::URL_SAFE,
            base64::engine::general_purpose::URL_SAFE_NO_PAD,
        ] {
            let p = push(json!({"message": {"data": engine.encode(raw)}}));
            assert_eq!(p.envelope.unwrap().command_id, "c:1?~?");
        }
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
