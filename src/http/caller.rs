//! The authenticated caller of a request: a bearer token, a QStash signature (on the routes
//! that check the body against it) or a query token (`/consume` only), verified against
//! [`crate::auth::Credentials`].

use super::*;

/// The authenticated caller of a request. A QStash signature also names the body it was issued
/// for; the handler compares it with [`Caller::verify_body`] before anything else.
pub struct Caller(pub Principal, Option<String>);

impl Caller {
    /// Fails with 403 unless the caller holds `scope`.
    pub fn require(&self, scope: &str) -> Result<(), Problem> {
        if self.0.has(scope) {
            Ok(())
        } else {
            Err(Problem::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("this endpoint needs scope `{scope}`"),
            ))
        }
    }

    /// For a caller authenticated by `Upstash-Signature`: fails with 401 unless the signature's
    /// `body` claim is the hash of exactly these bytes. Other callers pass.
    pub fn verify_body(&self, body: &[u8]) -> Result<(), Problem> {
        use sha2::Digest;
        self.verify_digest(&sha2::Sha256::digest(body).into())
    }

    /// [`Caller::verify_body`] for a body whose SHA-256 is already known.
    pub fn verify_digest(&self, sha256: &[u8; 32]) -> Result<(), Problem> {
        match &self.1 {
            Some(claimed) if !crate::transport::qstash::digest_matches(claimed, sha256) => {
                info!("Upstash-Signature names another body");
                Err(Problem::unauthenticated(
                    Some("Upstash-Signature"),
                    &Refusal::BodyMismatch,
                ))
            }
            _ => Ok(()),
        }
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Problem> {
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(crate::auth::token::bearer);
        let signature = parts
            .headers
            .get(crate::transport::qstash::SIGNATURE_HEADER);
        let path = parts.uri.path();
        // A QStash signature is accepted only where the handler checks the body against it.
        let signed_route =
            parts.method == Method::POST && (path == "/consume" || path.starts_with("/trigger/"));
        let leeway = state.config.credentials.leeway_seconds;
        let (credential, result) = match (token, signature, &state.config.qstash) {
            (Some(t), _, _) => (
                None,
                auth::verify_any(&state.config.credentials, t)
                    .await
                    .map(|p| (p, None)),
            ),
            (None, Some(sig), Some(q)) if signed_route => (
                Some("Upstash-Signature"),
                sig.to_str()
                    .map_err(|_| Refusal::Malformed)
                    .and_then(|sig| {
                        let target = parts.uri.path_and_query().map_or(path, |pq| pq.as_str());
                        q.verify(sig.trim(), target, leeway)
                    })
                    .map(|s| (s.principal, Some(s.body_hash))),
            ),
            // Push systems that cannot send a header may present a configured secret as
            // `/consume?token=...` (scope `consume` only, docs/design.md §10).
            _ => (
                None,
                match path {
                    "/consume" if !state.config.credentials.query_tokens.is_empty() => parts
                        .uri
                        .query()
                        .and_then(|q| {
                            url::form_urlencoded::parse(q.as_bytes())
                                .find(|(k, _)| k == "token")
                                .map(|(_, v)| v.into_owned())
                        })
                        .map_or(Err(Refusal::Missing), |t| {
                            // A token that is no configured one is an unknown key, not a
                            // missing credential.
                            crate::auth::query_token::QueryToken::verify(
                                &state.config.credentials.query_tokens,
                                &t,
                            )
                            .map(|p| (p, None))
                            .ok_or(Refusal::UnknownKey)
                        }),
                    _ => Err(Refusal::Missing),
                },
            ),
        };
        let result = result.and_then(|(p, body)| {
            // The subject becomes the actor of audit rows: PostgreSQL text refuses NUL.
            if p.subject.chars().any(char::is_control) || p.subject.len() > 512 {
                Err(Refusal::ClaimUnusable("sub"))
            } else {
                Ok((p, body))
            }
        });
        result.map(|(p, body)| Caller(p, body)).map_err(|refusal| {
            info!(reason = refusal.code(), "authentication failed");
            Problem::unauthenticated(credential, &refusal)
        })
    }
}
