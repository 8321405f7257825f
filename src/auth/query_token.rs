//! Query-string tokens (docs/design.md §10): for push systems that cannot send an Authorization
//! header, a configured secret accepted as `/consume?token=...`, for the `consume` scope only.
//! Weaker than OIDC (URLs are often logged); `check-config` says so.

use std::collections::HashSet;

use sha2::{Digest, Sha256};

use super::Principal;

pub use crate::config::QueryTokenConfig;

/// A validated query-string token: its SHA-256, compared in constant time.
#[derive(Clone)]
pub struct QueryToken {
    /// The actor.
    pub subject: String,
    digest: [u8; 32],
}

impl std::fmt::Debug for QueryToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryToken")
            .field("subject", &self.subject)
            .finish()
    }
}

impl QueryToken {
    /// Reads every query token's secret from the environment.
    pub fn from_config(c: &[QueryTokenConfig], errors: &mut Vec<String>) -> Vec<QueryToken> {
        let mut out = Vec::new();
        for (i, q) in c.iter().enumerate() {
            match std::env::var(&q.token_env) {
                Ok(v) if v.len() >= crate::auth::MIN_SECRET_BYTES => out.push(QueryToken {
                    subject: q.subject.clone(),
                    digest: Sha256::digest(v.as_bytes()).into(),
                }),
                _ => errors.push(format!(
                    "auth.query_token[{i}]: environment variable {} must hold at least {} bytes",
                    q.token_env,
                    crate::auth::MIN_SECRET_BYTES
                )),
            }
        }
        out
    }

    /// The principal for `presented`, if it is one of `tokens`: scope `consume` only.
    pub fn verify(tokens: &[QueryToken], presented: &str) -> Option<Principal> {
        let d: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        tokens
            .iter()
            .find(|t| {
                t.digest
                    .iter()
                    .zip(d)
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
            })
            .map(|t| Principal {
                credential: crate::auth::Credential::QueryToken,
                subject: t.subject.clone(),
                scopes: HashSet::from(["consume".to_string()]),
            })
    }
}
