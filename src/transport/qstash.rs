//! The Upstash QStash transport (docs/design.md §5, §8): request signatures and publishing.
//!
//! **Deliveries** carry `Upstash-Signature`, a compact HS256 JWT signed with the current signing
//! key, or during a rotation the next one (Upstash docs, `qstash/features/security.mdx`; the
//! official receiver, `upstash/qstash-js: src/receiver.ts`). It is accepted when its signature
//! verifies with the UTF-8 bytes of either key, `iss` is `Upstash`, `sub` is exactly
//! `public_url` + the request's path and query, the time rule of [`crate::auth::token`] holds (`exp`
//! and `nbf` required, `auth.leeway` as for bearer tokens),
//! and its `body` claim equals base64url(SHA-256(raw body)) with `=` padding ignored on both sides.
//! The body check needs the body, so it is the handler's first step
//! ([`crate::http::Caller::verify_body`]). A QStash schedule may call `/trigger/{policy}` the
//! same way when `scopes` grants it.
//!
//! **Publishing** (`POST {api_url}/v2/publish/{public_url}/consume`, `qstash/api/publish.mdx`):
//! the body is the built-in envelope; `Upstash-Deduplication-Id` is `{command_id}:{generation}`;
//! a command not yet due is sent with `Upstash-Not-Before` (unix seconds), so QStash holds it. A
//! 429 is waited out by `Retry-After` or the `RateLimit-Reset`/`Burst-RateLimit-Reset` headers
//! (unix timestamps, `qstash/api/api-ratelimiting.mdx`).

use std::time::{Duration, SystemTime};

use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use serde_json::{Map, Value};

use crate::auth::Principal;
use crate::auth::token::Refusal;
use crate::config::DurationSpec;
use crate::retry::{ResetFormat, parse_reset, parse_retry_after};
use crate::transport::{Outbound, PublishError};

/// The `iss` of every QStash signature.
pub const ISSUER: &str = "Upstash";
/// The header carrying the signature.
pub const SIGNATURE_HEADER: &str = "upstash-signature";
/// Longest wait a throttled publish may impose on the relay.
const PUBLISH_PAUSE_CAP: Duration = Duration::from_secs(60);
/// Publish requests in flight at once.
const PUBLISH_CONCURRENCY: usize = 8;

/// `[qstash]`.
///
/// ```toml
/// [qstash]
/// public_url = "https://sweeper.example.com"
/// scopes = ["consume", "trigger:ticket-retention"]
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QstashConfig {
    /// The base URL QStash calls, exactly as it calls it (no trailing `/`): messages are
    /// published to `{public_url}/consume`, and a signature's `sub` must be `public_url` + the
    /// request's path (and query).
    pub public_url: String,
    /// The QStash API (default `https://qstash.upstash.io`).
    #[serde(default = "default_api_url")]
    pub api_url: String,
    /// The environment variable holding the API token used to publish (default `QSTASH_TOKEN`);
    /// needed when a policy uses `transport = "qstash"`.
    #[serde(default = "default_token_env")]
    pub token_env: String,
    /// The environment variable holding the current signing key (default
    /// `QSTASH_CURRENT_SIGNING_KEY`); required.
    #[serde(default = "default_current_env")]
    pub current_signing_key_env: String,
    /// The environment variable holding the next signing key (default
    /// `QSTASH_NEXT_SIGNING_KEY`); optional, tried when the current key does not verify.
    #[serde(default = "default_next_env")]
    pub next_signing_key_env: String,
    /// The principal a verified signature authenticates, recorded as the actor (default
    /// `upstash-qstash`).
    #[serde(default = "default_subject")]
    pub subject: String,
    /// Its scopes (default `["consume"]`); add `trigger:{policy}` or `trigger:*` for QStash
    /// schedules.
    #[serde(default = "default_scopes")]
    pub scopes: Vec<String>,
    /// `Upstash-Retries` sent with every publish; the plan's maximum when unset.
    #[serde(default)]
    pub retries: Option<u32>,
    /// A pending command whose last publish (or due time, if later) is older than this is
    /// published again (default `10m`).
    #[serde(default = "default_republish_after")]
    pub republish_after: DurationSpec,
    /// How often the relay looks for commands to publish (default `1s`).
    #[serde(default = "default_relay_interval")]
    pub relay_interval: DurationSpec,
    /// How far ahead of its due time a command is handed to QStash with `Upstash-Not-Before`
    /// (default `1d`; keep it within the plan's maximum delay).
    #[serde(default = "default_max_delay")]
    pub max_delay: DurationSpec,
}

fn default_api_url() -> String {
    "https://qstash.upstash.io".into()
}
fn default_token_env() -> String {
    "QSTASH_TOKEN".into()
}
fn default_current_env() -> String {
    "QSTASH_CURRENT_SIGNING_KEY".into()
}
fn default_next_env() -> String {
    "QSTASH_NEXT_SIGNING_KEY".into()
}
fn default_subject() -> String {
    "upstash-qstash".into()
}
fn default_scopes() -> Vec<String> {
    vec!["consume".into()]
}
fn default_republish_after() -> DurationSpec {
    DurationSpec::from_seconds(600)
}
fn default_relay_interval() -> DurationSpec {
    DurationSpec::from_seconds(1)
}
fn default_max_delay() -> DurationSpec {
    DurationSpec::from_seconds(86_400)
}

/// `[qstash]` with its secrets resolved.
#[derive(Clone)]
pub struct Qstash {
    /// The settings.
    pub config: QstashConfig,
    current_key: SecretString,
    next_key: Option<SecretString>,
    token: Option<SecretString>,
}

impl std::fmt::Debug for Qstash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qstash")
            .field("config", &self.config)
            .field("next_key", &self.next_key.is_some())
            .field("token", &self.token.is_some())
            .finish()
    }
}

fn secret_from_env(var: &str) -> Option<SecretString> {
    std::env::var(var)
        .ok()
        .filter(|v| !v.is_empty())
        .map(SecretString::from)
}

impl Qstash {
    /// Resolves `c`'s secrets from the environment, pushing a message per problem onto
    /// `errors`. `publishes` says whether a policy uses the transport (then the token is needed).
    pub fn from_config(c: QstashConfig, publishes: bool, errors: &mut Vec<String>) -> Option<Self> {
        let mut c = c;
        c.public_url = c.public_url.trim_end_matches('/').to_string();
        match url::Url::parse(&c.public_url) {
            Ok(u) if matches!(u.scheme(), "https" | "http") && u.query().is_none() => {}
            _ => errors.push(format!(
                "qstash.public_url: `{}` is not an http(s) URL without a query",
                c.public_url
            )),
        }
        if url::Url::parse(&c.api_url).is_err() {
            errors.push(format!("qstash.api_url: `{}` is not a URL", c.api_url));
        }
        if c.subject.trim().is_empty() {
            errors.push("qstash.subject: must not be empty".into());
        }
        for s in &c.scopes {
            if !crate::auth::is_known_scope(s) || s.starts_with("ops:") {
                errors.push(format!(
                    "qstash.scopes: `{s}` is not allowed (consume, trigger:*, trigger:{{policy}})"
                ));
            }
        }
        if c.relay_interval.seconds() < 1 || c.republish_after.seconds() < 60 {
            errors.push(
                "qstash: relay_interval must be at least 1s and republish_after at least 1m".into(),
            );
        }
        let current = secret_from_env(&c.current_signing_key_env);
        if current.is_none() {
            errors.push(format!(
                "qstash: environment variable {} is not set (it holds the current signing key)",
                c.current_signing_key_env
            ));
        }
        let token = secret_from_env(&c.token_env);
        if publishes && token.is_none() {
            errors.push(format!(
                "qstash: environment variable {} is not set (it holds the API token the relay \
                 publishes with)",
                c.token_env
            ));
        }
        let next_key = secret_from_env(&c.next_signing_key_env);
        Some(Qstash {
            current_key: current?,
            next_key,
            token,
            config: c,
        })
    }

    /// Verifies an `Upstash-Signature` for a request to `path_and_query` (as received, e.g.
    /// `/consume`), with the time rule's `leeway` in seconds (the same rule as bearer tokens:
    /// `exp` and `nbf` required). Returns the caller and the body hash the signature names; the
    /// caller must still compare it with the raw body ([`body_matches`]).
    pub fn verify(
        &self,
        token: &str,
        path_and_query: &str,
        leeway: u64,
    ) -> Result<Signed, Refusal> {
        let header = crate::auth::token::read_header(token, crate::auth::jwks::MAX_TOKEN_BYTES)?;
        if header.alg != "HS256" {
            return Err(Refusal::UnsupportedAlgorithm);
        }
        let mut v = crate::auth::token::validation(Algorithm::HS256, ISSUER, None);
        v.sub = Some(format!("{}{path_and_query}", self.config.public_url));
        let decode = |key: &SecretString| {
            let key = DecodingKey::from_secret(key.expose_secret().as_bytes())
                .map_err(|_| jsonwebtoken::errors::ErrorKind::InvalidKeyFormat)?;
            jsonwebtoken::decode::<Map<String, Value>>(token, &key, &v)
        };
        // The current key first; the next one only when the current's signature fails
        // (a rotation in progress), as the official receiver does.
        let claims = match (decode(&self.current_key), &self.next_key) {
            (Err(e), Some(next))
                if matches!(e.kind(), jsonwebtoken::errors::ErrorKind::InvalidSignature) =>
            {
                decode(next)
            }
            (r, _) => r,
        }
        .map_err(|e| crate::auth::token::from_library(&e))?
        .claims;
        crate::auth::token::required(&claims, "iss")?;
        crate::auth::token::required(&claims, "sub")?;
        crate::auth::token::check_times(&claims, crate::auth::token::now_seconds(), leeway, true)?;
        let body_hash = crate::auth::token::required(&claims, "body")?.to_string();
        Ok(Signed {
            principal: Principal {
                credential: crate::auth::Credential::QstashSignature,
                subject: self.config.subject.clone(),
                scopes: self.config.scopes.iter().cloned().collect(),
            },
            body_hash,
        })
    }
}

/// A verified signature whose body hash is still to be compared.
#[derive(Debug, Clone)]
pub struct Signed {
    /// The caller it authenticates.
    pub principal: Principal,
    /// Its `body` claim: base64url SHA-256 of the body it was issued for.
    pub body_hash: String,
}

/// Whether `claimed` (the signature's `body` claim) is base64url(SHA-256(`body`)), ignoring
/// `=` padding on both sides (QStash's documented example is padded; the receiver strips it).
pub fn body_matches(claimed: &str, body: &[u8]) -> bool {
    digest_matches(claimed, &Sha256::digest(body).into())
}

/// [`body_matches`] for a body whose SHA-256 is already known (read as a stream).
pub fn digest_matches(claimed: &str, sha256: &[u8; 32]) -> bool {
    claimed.trim_end_matches('=') == base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sha256)
}

/// Publishes commands to QStash.
pub struct Publisher {
    client: reqwest::Client,
    url: String,
    token: SecretString,
    retries: Option<u32>,
    /// `qstash.relay_interval`.
    pub(crate) relay_interval: Duration,
    /// `qstash.max_delay`, in seconds: how far ahead of due a command may be handed over.
    pub(crate) max_delay_seconds: f64,
}

impl Publisher {
    /// A publisher for `q`; fails when the API token is missing.
    pub fn new(q: &Qstash) -> anyhow::Result<Publisher> {
        let token = q.token.clone().ok_or_else(|| {
            anyhow::anyhow!(
                "qstash: {} is not set; the relay cannot publish",
                q.config.token_env
            )
        })?;
        Ok(Publisher {
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()?,
            url: format!(
                "{}/v2/publish/{}/consume",
                q.config.api_url.trim_end_matches('/'),
                q.config.public_url
            ),
            token,
            retries: q.config.retries,
            relay_interval: q.config.relay_interval.std(),
            max_delay_seconds: q.config.max_delay.seconds() as f64,
        })
    }

    /// Publishes each message with its own request, [`PUBLISH_CONCURRENCY`] at a time. Returns
    /// the indices that QStash accepted (a duplicate dedup id is accepted too) and the first
    /// failure.
    pub async fn publish(&self, messages: &[Outbound]) -> (Vec<usize>, Option<PublishError>) {
        let mut done = Vec::new();
        let mut first_error = None;
        for chunk in (0..messages.len())
            .collect::<Vec<_>>()
            .chunks(PUBLISH_CONCURRENCY)
        {
            let mut set = tokio::task::JoinSet::new();
            for &i in chunk {
                let request = self.request(&messages[i]);
                set.spawn(async move { (i, send(request).await) });
            }
            while let Some(joined) = set.join_next().await {
                match joined {
                    Ok((i, Ok(()))) => done.push(i),
                    Ok((_, Err(e))) => {
                        first_error.get_or_insert(e);
                    }
                    Err(e) => {
                        first_error.get_or_insert(PublishError {
                            message: format!("publish task failed: {e}"),
                            retry_after: None,
                        });
                    }
                }
            }
            if first_error.is_some() {
                // Throttled or failing: leave the rest for the next round.
                break;
            }
        }
        (done, first_error)
    }

    fn request(&self, m: &Outbound) -> reqwest::RequestBuilder {
        let mut r = self
            .client
            .post(&self.url)
            .bearer_auth(self.token.expose_secret())
            .header("Upstash-Method", "POST")
            .header("Upstash-Deduplication-Id", m.dedup_id())
            .json(&m.envelope());
        // The ledger's clock decides when the command is due; QStash gets the same delay on
        // the wall clock, the instant rounded up to a whole second (the header is unix
        // seconds). Any delay counts: a message delivered even a fraction of a second early is
        // answered "not now" and costs another publish.
        if let Some(at) = not_before(chrono::Utc::now(), m.due_in_seconds) {
            r = r.header("Upstash-Not-Before", at.to_string());
        }
        if let Some(n) = self.retries {
            r = r.header("Upstash-Retries", n.to_string());
        }
        r
    }
}

/// `Upstash-Not-Before` for a command due in `due_in_seconds` at `now`: the first whole unix
/// second at or after its due instant; `None` when it is due now.
fn not_before(now: chrono::DateTime<chrono::Utc>, due_in_seconds: f64) -> Option<i64> {
    (due_in_seconds > 0.0).then(|| {
        let due = now.timestamp_millis() as f64 / 1000.0 + due_in_seconds;
        due.ceil() as i64
    })
}

async fn send(request: reqwest::RequestBuilder) -> Result<(), PublishError> {
    let resp = request.send().await.map_err(|e| PublishError {
        message: format!("publishing to QStash: {e}"),
        retry_after: None,
    })?;
    let status = resp.status();
    if status.is_success() {
        return Ok(());
    }
    let now = SystemTime::now();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let retry_after = header("retry-after")
        .and_then(|v| parse_retry_after(&v, now, PUBLISH_PAUSE_CAP))
        .or_else(|| {
            // The rate-limit resets are Unix timestamps (seconds), not deltas.
            ["burst-ratelimit-reset", "ratelimit-reset"]
                .iter()
                .filter_map(|h| {
                    parse_reset(&header(h)?, ResetFormat::Epoch, now, PUBLISH_PAUSE_CAP)
                })
                .max()
        })
        .or((status.as_u16() == 429 || status.is_server_error()).then_some(Duration::from_secs(1)));
    let text = resp.text().await.unwrap_or_default();
    Err(PublishError {
        message: format!(
            "QStash answered {status}: {}",
            text.chars().take(300).collect::<String>()
        ),
        retry_after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_hash_ignores_padding_and_notices_one_byte() {
        let body = br#"{"command_id":"c:1"}"#;
        let h = base64::engine::general_purpose::URL_SAFE.encode(Sha256::digest(body));
        assert!(h.ends_with('='));
        assert!(body_matches(&h, body));
        assert!(body_matches(h.trim_end_matches('='), body));
        assert!(!body_matches(&h, br#"{"command_id":"c:2"}"#));
        assert!(!body_matches("", body));
    }

    #[test]
    fn not_before_is_never_before_the_due_instant() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-09-01T02:00:00.900Z")
            .unwrap()
            .to_utc();
        let t = now.timestamp();
        assert_eq!(not_before(now, 0.0), None);
        // Due at .9 + 0.4 = 1.3 s past t: the first whole second after that is t + 2 (a sum of
        // the truncated second and the rounded-up delay gave t + 1, early).
        assert_eq!(not_before(now, 0.4), Some(t + 2));
        assert_eq!(not_before(now, 1.2), Some(t + 3));
        assert_eq!(not_before(now, 0.1), Some(t + 1));
    }
}
