//! Bearer-token authentication: HS256 issuers with key sets, and scopes (docs/design.md §10).
//!
//! A token is accepted when its header's `kid` names a configured key, its HS256 signature
//! verifies with that key, `iss` is that key's issuer, `aud` contains the issuer's audience, it
//! passes the time rule of [`token`] (`exp` required; `exp`, `nbf`, `iat` within
//! `auth.leeway`), and `sub` is a non-empty string. Scopes are the space-separated `scope`
//! claim (RFC 8693 §4.2). The algorithm is pinned to HS256 whatever the header says.

use std::collections::HashSet;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

pub mod jwks;
pub mod query_token;
pub mod token;

use crate::config::AuthConfig;
use token::Refusal;

/// Smallest accepted HS256 secret, in bytes (RFC 7518 §3.2: a key of at least the hash size).
pub const MIN_SECRET_BYTES: usize = 32;

/// A configured issuer with its secrets resolved.
#[derive(Clone)]
pub struct Issuer {
    /// Expected `iss`.
    pub iss: String,
    /// Expected `aud`.
    pub audience: String,
    /// `(kid, secret)`, newest first.
    pub keys: Vec<(String, SecretString)>,
}

impl std::fmt::Debug for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer")
            .field("iss", &self.iss)
            .field("audience", &self.audience)
            .field(
                "kids",
                &self
                    .keys
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Issuer {
    /// Resolves every issuer's secrets, pushing a message per problem onto `errors`.
    pub fn from_config(c: &AuthConfig, errors: &mut Vec<String>) -> Vec<Issuer> {
        let mut kids = HashSet::new();
        let mut out = Vec::new();
        for (i, ic) in c.issuer.iter().enumerate() {
            let label = format!("auth.issuer[{i}]");
            if ic.iss.trim().is_empty() || ic.audience.trim().is_empty() {
                errors.push(format!("{label}: `iss` and `audience` must not be empty"));
            }
            if ic.keys.is_empty() {
                errors.push(format!("{label}.keys: give at least one key"));
            }
            let mut keys = Vec::new();
            for k in &ic.keys {
                let klabel = format!("{label}.keys[{}]", k.kid);
                if k.kid.is_empty() || !kids.insert(k.kid.clone()) {
                    errors.push(format!(
                        "{klabel}: `kid` must be non-empty and unique across all issuers"
                    ));
                }
                let secret = match (&k.secret, &k.secret_env) {
                    (Some(s), None) => Some(s.clone()),
                    (None, Some(var)) => match std::env::var(var) {
                        Ok(v) if !v.is_empty() => Some(SecretString::from(v)),
                        _ => {
                            errors.push(format!(
                                "{klabel}: environment variable {var} is not set (it holds this key's secret)"
                            ));
                            None
                        }
                    },
                    _ => {
                        errors.push(format!(
                            "{klabel}: give exactly one of `secret` and `secret_env`"
                        ));
                        None
                    }
                };
                if let Some(s) = secret {
                    if s.expose_secret().len() < MIN_SECRET_BYTES {
                        errors.push(format!(
                            "{klabel}: the secret is shorter than {MIN_SECRET_BYTES} bytes"
                        ));
                    }
                    keys.push((k.kid.clone(), s));
                }
            }
            out.push(Issuer {
                iss: ic.iss.clone(),
                audience: ic.audience.clone(),
                keys,
            });
        }
        out
    }
}

/// The claims sweeper reads and `sweeper token` writes.
#[derive(Debug, Serialize, Deserialize)]
pub struct Claims {
    /// Who the caller is; recorded as the actor of what it does.
    pub sub: String,
    /// Issuer.
    pub iss: String,
    /// Audience.
    pub aud: String,
    /// Expiry, seconds since the Unix epoch.
    pub exp: u64,
    /// Issued at, seconds since the Unix epoch.
    #[serde(default)]
    pub iat: Option<u64>,
    /// Space-separated scopes.
    #[serde(default)]
    pub scope: String,
}

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Principal {
    /// The token's `sub`.
    pub subject: String,
    /// Its scopes.
    pub scopes: HashSet<String>,
    /// How it authenticated.
    pub credential: Credential,
}

/// The kind of credential a caller presented. Push systems authenticate with OIDC tokens
/// (Pub/Sub push), query tokens (push systems without headers) or QStash signatures; a delivery
/// so authenticated is answered by docs/design.md §5's push column whatever its body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential {
    /// An HS256 token of `[[auth.issuer]]` (crons, curl, on-call).
    Bearer,
    /// An RS256/ES256 token of `[[auth.jwks_issuer]]` (Google OIDC from Pub/Sub push and
    /// Cloud Scheduler).
    Oidc,
    /// A `[[auth.query_token]]` secret in `/consume?token=`.
    QueryToken,
    /// An `Upstash-Signature`.
    QstashSignature,
}

impl Credential {
    /// Whether a `/consume` delivery with this credential comes from a push system.
    pub fn is_push(self) -> bool {
        !matches!(self, Credential::Bearer)
    }
}

impl Principal {
    /// Whether the principal holds `scope`; `trigger:*` covers every `trigger:{policy}`.
    pub fn has(&self, scope: &str) -> bool {
        self.scopes.contains(scope)
            || (scope.starts_with("trigger:") && self.scopes.contains("trigger:*"))
    }
}

/// Every configured way to authenticate, with its secrets resolved (docs/design.md §10): what the HTTP
/// layer verifies credentials against.
#[derive(Debug, Clone)]
pub struct Credentials {
    /// `auth.leeway` in seconds: the clock skew of the one time rule (see [`token`]).
    pub leeway_seconds: u64,
    /// HS256 issuers.
    pub issuers: Vec<Issuer>,
    /// RS256/ES256 issuers verified against a JWKS.
    pub jwks_issuers: Vec<jwks::JwksIssuer>,
    /// Query-string tokens for `/consume`.
    pub query_tokens: Vec<query_token::QueryToken>,
}

impl Credentials {
    /// Resolves `[auth]`, pushing a message per problem onto `errors`.
    pub fn from_config(c: &AuthConfig, errors: &mut Vec<String>) -> Credentials {
        if c.leeway.seconds() > 300 {
            errors.push(format!(
                "auth.leeway ({}): at most 5m; a token's clock may be off by that much, no more",
                c.leeway
            ));
        }
        Credentials {
            leeway_seconds: c.leeway.seconds().max(0) as u64,
            issuers: Issuer::from_config(c, errors),
            jwks_issuers: jwks::JwksIssuer::from_config(&c.jwks_issuer, errors),
            query_tokens: query_token::QueryToken::from_config(&c.query_token, errors),
        }
    }
}

/// Whether `scope` is one sweeper knows: `trigger:*`, `trigger:{policy}`, `consume`, `ops:read`,
/// `ops:write`.
pub fn is_known_scope(scope: &str) -> bool {
    matches!(scope, "trigger:*" | "consume" | "ops:read" | "ops:write")
        || scope
            .strip_prefix("trigger:")
            .is_some_and(|p| crate::policy::PolicyName::parse(p).is_ok())
}

/// Verifies `token` against every configured issuer: HS256 key sets, then JWKS issuers for
/// RS256/ES256 (see [`crate::auth::jwks`]). The shape is checked first (tokens longer than
/// [`crate::auth::jwks::MAX_TOKEN_BYTES`] are malformed), and any other algorithm is refused before
/// any key is looked at; every issuer kind then applies the same time rule
/// ([`crate::auth::token::check_times`], with `auth.leeway`).
pub async fn verify_any(credentials: &Credentials, token: &str) -> Result<Principal, Refusal> {
    let header = crate::auth::token::read_header(token, crate::auth::jwks::MAX_TOKEN_BYTES)?;
    let leeway = credentials.leeway_seconds;
    match header.alg.as_str() {
        "HS256" => verify(&credentials.issuers, token, leeway),
        "RS256" => {
            crate::auth::jwks::verify(
                &credentials.jwks_issuers,
                Algorithm::RS256,
                header.kid,
                token,
                leeway,
            )
            .await
        }
        "ES256" => {
            crate::auth::jwks::verify(
                &credentials.jwks_issuers,
                Algorithm::ES256,
                header.kid,
                token,
                leeway,
            )
            .await
        }
        _ => Err(Refusal::UnsupportedAlgorithm),
    }
}

/// Verifies an HS256 `token` against the configured HS256 issuers, with the time rule's
/// `leeway` in seconds.
pub fn verify(issuers: &[Issuer], token: &str, leeway: u64) -> Result<Principal, Refusal> {
    let header = crate::auth::token::read_header(token, crate::auth::jwks::MAX_TOKEN_BYTES)?;
    if header.alg != "HS256" {
        return Err(Refusal::UnsupportedAlgorithm);
    }
    let kid = header.kid.ok_or(Refusal::UnknownKey)?;
    let (issuer, secret) = issuers
        .iter()
        .find_map(|i| i.keys.iter().find(|(k, _)| *k == kid).map(|(_, s)| (i, s)))
        .ok_or(Refusal::UnknownKey)?;
    let key = DecodingKey::from_secret(secret.expose_secret().as_bytes())
        .map_err(|_| Refusal::UnknownKey)?;
    let v = crate::auth::token::validation(
        Algorithm::HS256,
        &issuer.iss,
        Some(std::slice::from_ref(&issuer.audience)),
    );
    let claims =
        jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(token, &key, &v)
            .map_err(|e| crate::auth::token::from_library(&e))?
            .claims;
    crate::auth::token::required(&claims, "iss")?;
    // One string or an array of strings; the library compared the value.
    crate::auth::token::audience_shape(&claims)?;
    crate::auth::token::check_times(&claims, crate::auth::token::now_seconds(), leeway, false)?;
    let sub = crate::auth::token::required(&claims, "sub")?;
    if sub.trim().is_empty() {
        return Err(Refusal::ClaimUnusable("sub"));
    }
    let scope = crate::auth::token::string_claim(&claims, "scope")?.unwrap_or("");
    Ok(Principal {
        credential: Credential::Bearer,
        subject: sub.to_string(),
        scopes: scope
            // RFC 6749 §3.3: scopes are separated by the space character (%x20) only.
            .split(' ')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
    })
}

/// Mints a token with the issuer's newest key: `sub`, `iss`, `aud`, `iat`, `exp` and `scope`.
///
/// `ttl_seconds` is the lifetime; `scopes` are joined with spaces.
pub fn mint(
    issuer: &Issuer,
    subject: &str,
    scopes: &[String],
    ttl_seconds: i64,
) -> anyhow::Result<String> {
    let (kid, secret) = issuer
        .keys
        .first()
        .ok_or_else(|| anyhow::anyhow!("issuer {} has no key", issuer.iss))?;
    let now = chrono::Utc::now().timestamp().max(0) as u64;
    let claims = Claims {
        sub: subject.to_string(),
        iss: issuer.iss.clone(),
        aud: issuer.audience.clone(),
        exp: now + ttl_seconds.max(1) as u64,
        iat: Some(now),
        scope: scopes.join(" "),
    };
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some(kid.clone());
    let key = EncodingKey::from_secret(secret.expose_secret().as_bytes())?;
    Ok(jsonwebtoken::encode(&header, &claims, &key)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issuer() -> Issuer {
        Issuer {
            iss: "sweeper-test".into(),
            audience: "sweeper".into(),
            keys: vec![
                ("new".into(), SecretString::from("n".repeat(32))),
                ("old".into(), SecretString::from("o".repeat(32))),
            ],
        }
    }

    #[test]
    fn minted_tokens_verify_and_carry_scopes() {
        let i = issuer();
        let t = mint(&i, "alice", &["trigger:*".into(), "ops:read".into()], 60).unwrap();
        let p = verify(&[i], &t, 30).unwrap();
        assert_eq!(p.subject, "alice");
        assert!(p.has("trigger:ticket-retention"));
        assert!(p.has("ops:read"));
        assert!(!p.has("ops:write"));
    }

    #[test]
    fn rotated_keys_still_verify_and_foreign_ones_do_not() {
        let mut old_only = issuer();
        old_only.keys.remove(0);
        let t = mint(&old_only, "cron", &["consume".into()], 60).unwrap();
        assert!(verify(&[issuer()], &t, 30).is_ok());
        let mut forged = issuer();
        forged.keys = vec![("new".into(), SecretString::from("x".repeat(32)))];
        let t = mint(&forged, "mallory", &["ops:write".into()], 60).unwrap();
        assert!(matches!(
            verify(&[issuer()], &t, 30),
            Err(Refusal::BadSignature)
        ));
    }

    #[test]
    fn alg_none_is_refused() {
        // {"alg":"none","kid":"new"} . {"sub":"x","iss":"sweeper-test","aud":"sweeper","exp":9999999999}
        let t = "eyJhbGciOiJub25lIiwia2lkIjoibmV3In0.eyJzdWIiOiJ4IiwiaXNzIjoic3dlZXBlci10ZXN0IiwiYXVkIjoic3dlZXBlciIsImV4cCI6OTk5OTk5OTk5OX0.";
        assert_eq!(
            verify(&[issuer()], t, 30).unwrap_err(),
            Refusal::UnsupportedAlgorithm
        );
    }
}

#[cfg(test)]
mod claim_tests {
    use super::*;

    fn sign(claims: serde_json::Value) -> String {
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("k".into());
        jsonwebtoken::encode(&h, &claims, &EncodingKey::from_secret(&[b'k'; 32]).unwrap()).unwrap()
    }

    fn issuer() -> Issuer {
        Issuer {
            iss: "i".into(),
            audience: "a".into(),
            keys: vec![("k".into(), SecretString::from("k".repeat(32)))],
        }
    }

    #[test]
    fn a_token_not_yet_valid_is_refused() {
        let now = chrono::Utc::now().timestamp();
        let t = sign(
            serde_json::json!({"sub": "s", "iss": "i", "aud": "a", "exp": now + 600,
                                        "nbf": now + 300, "scope": "ops:read"}),
        );
        assert_eq!(
            verify(&[issuer()], &t, 30).unwrap_err(),
            Refusal::NotYetValid
        );
    }

    #[test]
    fn scopes_split_on_spaces_only() {
        let now = chrono::Utc::now().timestamp();
        let t = sign(
            serde_json::json!({"sub": "s", "iss": "i", "aud": "a", "exp": now + 600,
                                        "scope": "ops:read\u{00a0}trigger:*"}),
        );
        let p = verify(&[issuer()], &t, 30).unwrap();
        assert!(!p.has("trigger:x"));
        assert!(!p.has("ops:read"));
    }
}
