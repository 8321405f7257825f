//! External token issuers (docs/design.md §10): RS256/ES256 tokens verified against a JWKS, e.g. Google
//! OIDC tokens sent by Cloud Scheduler and Pub/Sub push; and query-string tokens for push systems
//! that cannot send a header.
//!
//! A JWKS token is accepted when its header's algorithm is one the issuer pins, its `kid` names a
//! key of the issuer's key set, the signature verifies, `iss` is the issuer, `aud` is a single
//! string equal to one of the configured audiences (no normalisation: a trailing slash or a query
//! string is another audience; an array is refused), the time rule of [`crate::auth::token`] holds
//! (the same for every issuer kind, with `auth.leeway`), and — for Google — `email` is present and `email_verified` is
//! true. Scopes come from the issuer's `principals` map (the verified email for Google, else
//! `sub`), never from the token.
//!
//! The key set is fetched with the configured URL, cached for the response's `Cache-Control:
//! max-age` (default 5 min, at most a day), refreshed when stale, and refreshed at most once a
//! minute on an unknown `kid`; a failed fetch keeps the last good set. One fetch at a time:
//! concurrent verifications wait for it instead of failing.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey};

use serde_json::{Map, Value};

use super::Principal;
use super::token::Refusal;

/// Longest token accepted, in bytes (Google ID tokens are about 1 KiB).
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// An unknown `kid` triggers at most one key-set fetch per this interval.
pub const MIN_REFRESH: Duration = Duration::from_secs(60);
const RETRY_FAILED_FETCH: Duration = Duration::from_secs(5);
const DEFAULT_MAX_AGE: Duration = Duration::from_secs(300);
const LONGEST_MAX_AGE: Duration = Duration::from_secs(86_400);

pub use crate::config::JwksIssuerConfig;

/// A validated JWKS issuer with its key cache.
#[derive(Clone)]
pub struct JwksIssuer {
    /// The exact `iss`.
    pub iss: String,
    /// Pinned algorithms.
    pub algorithms: Vec<Algorithm>,
    /// Accepted audiences.
    pub audiences: Vec<String>,
    /// Google OIDC rules.
    pub google: bool,
    /// Lowercased principal → scopes.
    pub principals: HashMap<String, HashSet<String>>,
    cache: std::sync::Arc<KeyCache>,
}

impl std::fmt::Debug for JwksIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwksIssuer")
            .field("iss", &self.iss)
            .field("jwks_url", &self.cache.url.as_str())
            .finish()
    }
}

struct KeyCache {
    url: url::Url,
    client: reqwest::Client,
    state: tokio::sync::Mutex<CacheState>,
}

#[derive(Default)]
struct CacheState {
    set: Option<JwkSet>,
    expires: Option<Instant>,
    last_fetch: Option<Instant>,
    last_failed: Option<Instant>,
    last_unknown: Option<Instant>,
}

impl JwksIssuer {
    /// Validates every configured JWKS issuer.
    pub fn from_config(c: &[JwksIssuerConfig], errors: &mut Vec<String>) -> Vec<JwksIssuer> {
        let mut out = Vec::new();
        for (i, ic) in c.iter().enumerate() {
            let label = format!("auth.jwks_issuer[{i}]");
            let url = match url::Url::parse(&ic.jwks_url) {
                Ok(u) if u.scheme() == "https" || (u.scheme() == "http" && ic.allow_http) => {
                    Some(u)
                }
                _ => {
                    errors.push(format!(
                        "{label}.jwks_url: `{}` must be an https URL (http only with allow_http)",
                        ic.jwks_url
                    ));
                    None
                }
            };
            let mut algorithms = Vec::new();
            for a in &ic.algorithms {
                match a.as_str() {
                    "RS256" => algorithms.push(Algorithm::RS256),
                    "ES256" => algorithms.push(Algorithm::ES256),
                    other => errors.push(format!(
                        "{label}.algorithms: `{other}` is not accepted (RS256, ES256)"
                    )),
                }
            }
            if ic.algorithms.is_empty() {
                errors.push(format!("{label}.algorithms: pin at least one"));
            }
            if ic.iss.is_empty()
                || ic.audiences.is_empty()
                || ic.audiences.iter().any(String::is_empty)
            {
                errors.push(format!(
                    "{label}: `iss` and every audience must be non-empty"
                ));
            }
            let mut principals = HashMap::new();
            for (p, scopes) in &ic.principals {
                for s in scopes {
                    if !crate::auth::is_known_scope(s) {
                        errors.push(format!("{label}.principals[{p}]: unknown scope `{s}`"));
                    }
                }
                principals.insert(p.to_lowercase(), scopes.iter().cloned().collect());
            }
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .build();
            if let (Some(url), Ok(client)) = (url, client) {
                out.push(JwksIssuer {
                    iss: ic.iss.clone(),
                    algorithms,
                    audiences: ic.audiences.clone(),
                    google: ic.google,
                    principals,
                    cache: std::sync::Arc::new(KeyCache {
                        url,
                        client,
                        state: tokio::sync::Mutex::new(CacheState::default()),
                    }),
                });
            }
        }
        out
    }

    /// The decoding key for `kid`, fetching the key set when it is stale or `kid` is unknown.
    async fn key(&self, kid: &str) -> Option<DecodingKey> {
        let mut st = self.cache.state.lock().await;
        let known = st.set.as_ref().is_some_and(|s| s.find(kid).is_some());
        let stale = st.expires.is_none_or(|e| Instant::now() >= e);
        // A failing key server is asked at most every few seconds; an unknown kid (a rotation,
        // or a forged header) triggers at most one refresh a minute.
        let may_fetch = st
            .last_failed
            .is_none_or(|t| t.elapsed() >= RETRY_FAILED_FETCH);
        let unknown_refresh = !known && st.last_unknown.is_none_or(|t| t.elapsed() >= MIN_REFRESH);
        if may_fetch && (stale || unknown_refresh) {
            if !known && st.set.is_some() {
                st.last_unknown = Some(Instant::now());
            }
            st.last_fetch = Some(Instant::now());
            match self.fetch().await {
                Ok((set, max_age)) => {
                    st.set = Some(set);
                    st.expires = Some(Instant::now() + max_age);
                    st.last_failed = None;
                }
                Err(e) => {
                    st.last_failed = Some(Instant::now());
                    tracing::warn!(jwks_url = %self.cache.url, error = %e, "fetching the key set failed; keeping the last good one");
                }
            }
        }
        st.set
            .as_ref()
            .and_then(|s| s.find(kid))
            .and_then(|k| DecodingKey::from_jwk(k).ok())
    }

    async fn fetch(&self) -> anyhow::Result<(JwkSet, Duration)> {
        let resp = self
            .cache
            .client
            .get(self.cache.url.clone())
            .send()
            .await?
            .error_for_status()?;
        let max_age = resp
            .headers()
            .get(reqwest::header::CACHE_CONTROL)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.split(',')
                    .filter_map(|d| d.trim().strip_prefix("max-age="))
                    .find_map(|n| n.trim().parse::<u64>().ok())
            })
            .map(|s| Duration::from_secs(s).min(LONGEST_MAX_AGE))
            .unwrap_or(DEFAULT_MAX_AGE);
        let bytes = resp.bytes().await?;
        anyhow::ensure!(bytes.len() <= 256 * 1024, "key set larger than 256 KiB");
        Ok((serde_json::from_slice(&bytes)?, max_age))
    }
}

/// Verifies an RS256/ES256 token against the JWKS issuers, with the time rule's `leeway` in
/// seconds.
pub async fn verify(
    issuers: &[JwksIssuer],
    alg: Algorithm,
    kid: Option<String>,
    token: &str,
    leeway: u64,
) -> Result<Principal, Refusal> {
    let candidates: Vec<&JwksIssuer> = issuers
        .iter()
        .filter(|i| i.algorithms.contains(&alg))
        .collect();
    if candidates.is_empty() {
        return Err(Refusal::UnsupportedAlgorithm);
    }
    let kid = kid.ok_or(Refusal::UnknownKey)?;
    for issuer in candidates {
        let Some(key) = issuer.key(&kid).await else {
            continue;
        };
        let v = crate::auth::token::validation(alg, &issuer.iss, Some(&issuer.audiences));
        let claims = jsonwebtoken::decode::<Map<String, Value>>(token, &key, &v)
            .map_err(|e| crate::auth::token::from_library(&e))?
            .claims;
        crate::auth::token::required(&claims, "iss")?;
        // One string: an array of audiences is refused (module docs).
        crate::auth::token::required(&claims, "aud")?;
        crate::auth::token::check_times(&claims, crate::auth::token::now_seconds(), leeway, false)?;
        let sub = crate::auth::token::required(&claims, "sub")?;
        let principal = if issuer.google {
            let email = crate::auth::token::string_claim(&claims, "email")?;
            match (email, claims.get("email_verified")) {
                (Some(e), Some(Value::Bool(true))) if !e.is_empty() => e.to_lowercase(),
                _ => return Err(Refusal::EmailNotVerified),
            }
        } else {
            sub.to_string()
        };
        if principal.trim().is_empty() {
            return Err(Refusal::ClaimUnusable("sub"));
        }
        let scopes = issuer
            .principals
            .get(&principal.to_lowercase())
            .cloned()
            .unwrap_or_default();
        return Ok(Principal {
            credential: crate::auth::Credential::Oidc,
            subject: principal,
            scopes,
        });
    }
    Err(Refusal::UnknownKey)
}
