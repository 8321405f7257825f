//! Bearer-token authentication: HS256 issuers with key sets, and scopes (DESIGN §10).
//!
//! A token is accepted when its header's `kid` names a configured key, its HS256 signature
//! verifies with that key, `iss` is that key's issuer, `aud` contains the issuer's audience, `exp`
//! is in the future and `nbf`, when present, is not (30 s leeway each), and `sub` is present. Scopes are the space-separated `scope`
//! claim (RFC 8693 §4.2). The algorithm is pinned to HS256 whatever the header says.

use std::collections::HashSet;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use crate::config::AuthConfig;

/// Smallest accepted HS256 secret, in bytes (RFC 7518 §3.2: a key of at least the hash size).
pub const MIN_SECRET_BYTES: usize = 32;

/// Clock skew allowed on `exp` and `nbf`, in seconds.
pub const LEEWAY_SECONDS: u64 = 30;

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
}

impl Principal {
    /// Whether the principal holds `scope`; `trigger:*` covers every `trigger:{policy}`.
    pub fn has(&self, scope: &str) -> bool {
        self.scopes.contains(scope)
            || (scope.starts_with("trigger:") && self.scopes.contains("trigger:*"))
    }
}

/// Why a token was refused. The message is safe to show the caller.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    #[error("missing bearer token: send `Authorization: Bearer <jwt>`")]
    Missing,
    /// Anything wrong with the token itself.
    #[error("invalid token: {0}")]
    Invalid(String),
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
/// RS256/ES256 (see [`crate::jwks`]). Tokens longer than [`crate::jwks::MAX_TOKEN_BYTES`] and
/// any other algorithm are refused before any key is looked at.
pub async fn verify_any(
    config: &crate::config::Config,
    token: &str,
) -> Result<Principal, AuthError> {
    if token.len() > crate::jwks::MAX_TOKEN_BYTES {
        return Err(AuthError::Invalid(format!(
            "longer than {} bytes",
            crate::jwks::MAX_TOKEN_BYTES
        )));
    }
    let header = jsonwebtoken::decode_header(token)
        .map_err(|e| AuthError::Invalid(format!("malformed: {e}")))?;
    match header.alg {
        Algorithm::HS256 => verify(&config.issuers, token),
        alg @ (Algorithm::RS256 | Algorithm::ES256) => {
            crate::jwks::verify(&config.jwks_issuers, alg, header.kid, token).await
        }
        other => Err(AuthError::Invalid(format!(
            "algorithm {other:?} is not accepted"
        ))),
    }
}

/// Why `jsonwebtoken` refused a token, in words safe to show the caller.
pub(crate) fn refusal(e: &jsonwebtoken::errors::Error) -> String {
    use jsonwebtoken::errors::ErrorKind as K;
    match e.kind() {
        K::ExpiredSignature => "expired".to_string(),
        K::InvalidSignature => "signature does not verify".to_string(),
        K::InvalidAudience => "wrong audience".to_string(),
        K::InvalidIssuer => "wrong issuer".to_string(),
        K::InvalidSubject => "wrong subject".to_string(),
        K::ImmatureSignature => "not yet valid".to_string(),
        K::MissingRequiredClaim(c) => format!("missing claim `{c}`"),
        K::Json(_) => "claims of the wrong shape".to_string(),
        other => format!("{other:?}"),
    }
}

/// Verifies an HS256 `token` against the configured HS256 issuers.
pub fn verify(issuers: &[Issuer], token: &str) -> Result<Principal, AuthError> {
    let header = jsonwebtoken::decode_header(token)
        .map_err(|e| AuthError::Invalid(format!("malformed: {e}")))?;
    if header.alg != Algorithm::HS256 {
        return Err(AuthError::Invalid(format!(
            "algorithm {:?} is not accepted",
            header.alg
        )));
    }
    let kid = header
        .kid
        .ok_or_else(|| AuthError::Invalid("no `kid` in the header".into()))?;
    let (issuer, secret) = issuers
        .iter()
        .find_map(|i| i.keys.iter().find(|(k, _)| *k == kid).map(|(_, s)| (i, s)))
        .ok_or_else(|| AuthError::Invalid(format!("unknown kid `{kid}`")))?;
    let key = DecodingKey::from_secret(secret.expose_secret().as_bytes())
        .map_err(|_| AuthError::Invalid("key unusable".into()))?;
    let mut v = Validation::new(Algorithm::HS256);
    v.leeway = LEEWAY_SECONDS;
    v.validate_nbf = true;
    v.set_audience(&[&issuer.audience]);
    v.set_issuer(&[&issuer.iss]);
    v.set_required_spec_claims(&["exp", "sub", "iss", "aud"]);
    let data = jsonwebtoken::decode::<Claims>(token, &key, &v)
        .map_err(|e| AuthError::Invalid(refusal(&e)))?;
    if data.claims.sub.trim().is_empty() {
        return Err(AuthError::Invalid("empty `sub`".into()));
    }
    Ok(Principal {
        subject: data.claims.sub,
        scopes: data
            .claims
            .scope
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
        let p = verify(&[i], &t).unwrap();
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
        assert!(verify(&[issuer()], &t).is_ok());
        let mut forged = issuer();
        forged.keys = vec![("new".into(), SecretString::from("x".repeat(32)))];
        let t = mint(&forged, "mallory", &["ops:write".into()], 60).unwrap();
        assert!(matches!(
            verify(&[issuer()], &t),
            Err(AuthError::Invalid(_))
        ));
    }

    #[test]
    fn alg_none_is_refused() {
        // {"alg":"none","kid":"new"} . {"sub":"x","iss":"sweeper-test","aud":"sweeper","exp":9999999999}
        let t = "eyJhbGciOiJub25lIiwia2lkIjoibmV3In0.eyJzdWIiOiJ4IiwiaXNzIjoic3dlZXBlci10ZXN0IiwiYXVkIjoic3dlZXBlciIsImV4cCI6OTk5OTk5OTk5OX0.";
        assert!(verify(&[issuer()], t).is_err());
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
        assert!(verify(&[issuer()], &t).is_err());
    }

    #[test]
    fn scopes_split_on_spaces_only() {
        let now = chrono::Utc::now().timestamp();
        let t = sign(
            serde_json::json!({"sub": "s", "iss": "i", "aud": "a", "exp": now + 600,
                                        "scope": "ops:read\u{00a0}trigger:*"}),
        );
        let p = verify(&[issuer()], &t).unwrap();
        assert!(!p.has("trigger:x"));
        assert!(!p.has("ops:read"));
    }
}
