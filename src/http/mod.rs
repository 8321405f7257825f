//! The HTTP surface: routes, authentication, problem+json errors, and the thin trigger and
//! consume handlers (DESIGN §4, §5). `openapi.yaml` describes exactly [`ROUTES`]; a test keeps
//! them in step.

pub mod answer;
pub mod ops;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use tracing::{error, info};

use crate::auth::token::Refusal;
use crate::auth::{self, Principal};
use crate::execute::{self, ConsumeOutcome, Executor};
use crate::state::AppState;
use crate::trigger::{self, TriggerError, TriggerOutcome, WindowHints};
use answer::{Answer, answer};

/// Largest `/consume` body, in bytes (the built-in envelope is well under 1 KiB).
pub const CONSUME_BODY_LIMIT: usize = 64 * 1024;
/// Largest body on every other route, in bytes.
pub const SMALL_BODY_LIMIT: usize = 16 * 1024;

/// Every route as (method, path template), the single list the router is built from.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/trigger/{policy}"),
    ("POST", "/consume"),
    ("GET", "/runs"),
    ("GET", "/runs/{run_id}"),
    ("GET", "/runs/{run_id}/items"),
    ("GET", "/policies"),
    ("POST", "/runs/{run_id}/cancel"),
    ("GET", "/dead-letters"),
    ("POST", "/dead-letters/redrive"),
    ("GET", "/dead-letters/{id}"),
    ("POST", "/dead-letters/{id}/redrive"),
    ("POST", "/dead-letters/{id}/abandon"),
    ("POST", "/policies/{policy}/suspend"),
    ("POST", "/policies/{policy}/resume"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
];

fn handler_for(method: &str, path: &str, state: &AppState) -> MethodRouter<AppState> {
    match (method, path) {
        ("POST", "/trigger/{policy}") => post(trigger_handler),
        ("POST", "/consume") => {
            // One semaphore for the whole route (a per-route layer, so the limit is global to
            // /consume); a request that finds no permit is shed at once, never queued.
            let retry_after = state.config.consume.retry_after.seconds() as u64;
            let slots = Arc::new(tokio::sync::Semaphore::new(
                state.config.consume.max_in_flight as usize,
            ));
            // The body is read by the handler itself, against a limit that depends on the
            // credential (see `read_body`).
            post(consume_handler).layer::<_, std::convert::Infallible>(
                tower::ServiceBuilder::new()
                    .layer(axum::error_handling::HandleErrorLayer::new(
                        move |_: tower::BoxError| async move {
                            crate::metrics::consume_shed();
                            Problem::new(
                                StatusCode::SERVICE_UNAVAILABLE,
                                "overloaded",
                                "this replica is handling consume.max_in_flight deliveries; \
                                     nothing was recorded, retry later",
                            )
                            .retry_after(retry_after)
                        },
                    ))
                    .layer(tower::load_shed::LoadShedLayer::new())
                    .layer(tower::limit::GlobalConcurrencyLimitLayer::with_semaphore(
                        slots,
                    )),
            )
        }
        ("GET", "/runs") => get(ops::list_runs),
        ("GET", "/runs/{run_id}") => get(ops::get_run),
        ("GET", "/runs/{run_id}/items") => get(ops::run_items),
        ("GET", "/policies") => get(ops::policies),
        ("POST", "/runs/{run_id}/cancel") => post(ops::cancel_run),
        ("GET", "/dead-letters") => get(ops::list_dead_letters),
        ("POST", "/dead-letters/redrive") => post(ops::redrive_dead_letters),
        ("GET", "/dead-letters/{id}") => get(ops::get_dead_letter),
        ("POST", "/dead-letters/{id}/redrive") => post(ops::redrive_dead_letter),
        ("POST", "/dead-letters/{id}/abandon") => post(ops::abandon_dead_letter),
        ("POST", "/policies/{policy}/suspend") => post(ops::suspend_policy),
        ("POST", "/policies/{policy}/resume") => post(ops::resume_policy),
        ("GET", "/healthz") => get(ops::healthz),
        ("GET", "/readyz") => get(ops::readyz),
        ("GET", "/metrics") => get(ops::metrics),
        _ => unreachable!("every entry of ROUTES has a handler"),
    }
}

/// Builds the router with request ids, tracing and body limits.
pub fn router(state: AppState) -> Router {
    let request_timeout = state.config.http.request_timeout.std();
    let retry_after = state.config.consume.retry_after.seconds() as u64;
    let mut r = Router::new();
    for (method, path) in ROUTES {
        let h = handler_for(method, path, &state);
        // A declared Content-Length over the limit is answered 413 at once, before any body
        // arrives (tower-http's limit reads the header); /consume decides its own limit.
        let h = if *path == "/consume" {
            h
        } else {
            h.layer(tower_http::limit::RequestBodyLimitLayer::new(
                SMALL_BODY_LIMIT,
            ))
        };
        r = r.route(path, h);
    }
    r.fallback(|| async {
        Problem::new(
            StatusCode::NOT_FOUND,
            "not-found",
            "no such endpoint; see openapi.yaml",
        )
    })
    .method_not_allowed_fallback(|| async {
        Problem::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "this endpoint does not accept that method; see openapi.yaml",
        )
    })
    .layer(DefaultBodyLimit::max(SMALL_BODY_LIMIT))
    .layer(axum::middleware::map_response(problem_for_plain_errors))
    .layer(
        tower::ServiceBuilder::new()
            .layer(axum::error_handling::HandleErrorLayer::new(
                move |_: tower::BoxError| async move {
                    Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "timeout",
                        "the request took longer than http.request_timeout and was abandoned; \
                         what it had not committed was rolled back; retry later",
                    )
                    .retry_after(retry_after)
                },
            ))
            .layer(tower::timeout::TimeoutLayer::new(request_timeout)),
    )
    .with_state(state)
    .layer(PropagateRequestIdLayer::x_request_id())
    .layer(TraceLayer::new_for_http().make_span_with(|req: &axum::http::Request<_>| {
        let request_id = req
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(|s| s.chars().take(64).collect::<String>())
            .unwrap_or_default();
        tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id)
    }))
    .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
}

/// An RFC 9457 problem: `application/problem+json` with a stable `type`, a `title` and a human
/// `detail`. 5xx problems never carry internal detail.
#[derive(Debug)]
pub struct Problem {
    status: StatusCode,
    slug: &'static str,
    detail: String,
    retry_after: Option<u64>,
    members: serde_json::Map<String, serde_json::Value>,
}

impl Problem {
    /// A problem of type `urn:sweeper:problem:{slug}`.
    pub fn new(status: StatusCode, slug: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            slug,
            detail: detail.into(),
            retry_after: None,
            members: serde_json::Map::new(),
        }
    }
    /// Adds an extension member (RFC 9457 §3.2), e.g. `reason` of a refused credential.
    pub fn member(mut self, name: &str, value: impl Into<serde_json::Value>) -> Self {
        self.members.insert(name.to_string(), value.into());
        self
    }
    /// A 401 for a refused credential: type `unauthenticated`, the refusal's stable code as
    /// `reason`, its detail prefixed by the credential's name when there is one.
    pub fn unauthenticated(credential: Option<&str>, refusal: &Refusal) -> Self {
        let detail = match credential {
            Some(c) => format!("{c}: {}", refusal.detail()),
            None => refusal.detail(),
        };
        Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", detail)
            .member("reason", refusal.code())
    }
    /// Adds `Retry-After: {seconds}` (RFC 9110 §10.2.3, delta-seconds form).
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }
    /// A 500 whose cause is logged, not shown.
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        error!(error = %cause, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "an internal error occurred; the request id identifies it in the logs",
        )
    }
    /// A 503 for a ledger that cannot be reached; the cause is logged.
    pub fn unavailable(cause: impl std::fmt::Display, retry_after: u64) -> Self {
        error!(error = %cause, "ledger unavailable");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the ledger is unavailable; retry later",
        )
        .retry_after(retry_after)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = self.members;
        body.insert(
            "type".into(),
            format!("urn:sweeper:problem:{}", self.slug).into(),
        );
        body.insert(
            "title".into(),
            self.status.canonical_reason().unwrap_or("error").into(),
        );
        body.insert("status".into(), self.status.as_u16().into());
        body.insert("detail".into(), self.detail.into());
        let mut resp = (self.status, Json(body)).into_response();
        let headers = resp.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(s) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

impl From<sqlx::Error> for Problem {
    /// Uses the one classification ([`crate::retry::Failure::from_db`]): what another try may
    /// cure (a lock or statement timeout, a lost connection, a pool timeout) is 503 + Retry-After;
    /// a data exception (class 22: the input cannot be stored or compared as text, such as a NUL
    /// byte in a path or query parameter) is the client's 400; anything else a 500.
    fn from(e: sqlx::Error) -> Self {
        use crate::retry::FailureClass;
        if let sqlx::Error::Database(db) = &e
            && db.code().is_some_and(|c| c.starts_with("22"))
        {
            return Problem::new(
                StatusCode::BAD_REQUEST,
                "bad-input",
                "a parameter holds characters that cannot be used (e.g. a NUL byte)",
            );
        }
        match crate::retry::Failure::from_db(&e).class {
            FailureClass::Transient | FailureClass::Throttled { .. } => Problem::unavailable(e, 5),
            FailureClass::Permanent | FailureClass::Held(_) => Problem::internal(e),
        }
    }
}

/// Turns error responses that axum or tower-http produce on their own (a malformed path
/// parameter, a body over the limit) into problem+json, so every error has one shape.
pub async fn problem_for_plain_errors(resp: Response) -> Response {
    let status = resp.status();
    let is_problem = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    if !(status.is_client_error() || status.is_server_error()) || is_problem {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 4_096).await.unwrap_or_default();
    let slug = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "body-too-large",
        StatusCode::NOT_FOUND => "not-found",
        StatusCode::METHOD_NOT_ALLOWED => "method-not-allowed",
        s if s.is_server_error() => "internal",
        _ => "bad-request",
    };
    let detail = if status.is_server_error() {
        "an internal error occurred; the request id identifies it in the logs".to_string()
    } else if status == StatusCode::PAYLOAD_TOO_LARGE {
        format!(
            "the body is larger than this endpoint accepts ({SMALL_BODY_LIMIT} bytes); nothing \
             was recorded"
        )
    } else {
        String::from_utf8_lossy(&text).chars().take(500).collect()
    };
    let mut out = Problem::new(status, slug, detail).into_response();
    for name in [header::RETRY_AFTER, header::WWW_AUTHENTICATE] {
        if let Some(v) = parts.headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    out
}

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
            // `/consume?token=...` (scope `consume` only, DESIGN §10).
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

/// `?window=` and `?dry_run=` of a trigger.
#[derive(Debug, Deserialize)]
pub struct TriggerQuery {
    window: Option<String>,
    #[serde(default)]
    dry_run: bool,
}

async fn trigger_handler(
    State(state): State<AppState>,
    Path(policy): Path<String>,
    caller: Caller,
    query: Result<Query<TriggerQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    caller.verify_body(&body)?;
    caller.require(&format!("trigger:{policy}"))?;
    let Query(query) =
        query.map_err(|e| Problem::new(StatusCode::BAD_REQUEST, "bad-query", e.body_text()))?;
    let policy = state.config.policy(&policy).ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-policy",
            format!("no policy named `{policy}` is configured"),
        )
    })?;
    let hints = WindowHints {
        schedule_time_header: headers
            .get("x-cloudscheduler-scheduletime")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        window_param: query.window,
    };
    let outcome = trigger::trigger(&state, policy, hints, query.dry_run, &caller.0)
        .await
        .map_err(|e| match e {
            TriggerError::BadWindow(m) => Problem::new(StatusCode::BAD_REQUEST, "bad-window", m),
            TriggerError::Forbidden(m) => {
                Problem::new(StatusCode::FORBIDDEN, "backfill-forbidden", m)
            }
            TriggerError::Busy(m) => {
                Problem::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", m).retry_after(1)
            }
            TriggerError::Db(e) => Problem::from(e),
        })?;
    let (status, run) = match outcome {
        TriggerOutcome::Created(run) => (StatusCode::ACCEPTED, run),
        TriggerOutcome::Existing(run) => (StatusCode::OK, run),
        TriggerOutcome::Suspended(ps) => {
            return Ok((
                StatusCode::OK,
                Json(json!({"policy": ps.policy, "state": "suspended", "suspended_at": ps.suspended_at,
                            "suspended_by": ps.changed_by, "reason": ps.reason,
                            "detail": "the policy is suspended: no run was created"})),
            )
                .into_response());
        }
    };
    let location = format!("/runs/{}", run.run_id);
    let mut resp = (status, Json(run)).into_response();
    if let Ok(v) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    Ok(resp)
}

/// Largest `/consume` body accepted from an authenticated push system, in bytes. A push body
/// over [`CONSUME_BODY_LIMIT`] can never succeed, and a push system redelivers what it is not
/// acknowledged: such a body is read as a stream up to this cap (hashed, its first 8 KiB kept),
/// quarantined as an envelope and answered 200 (DESIGN §5). Past the cap: 413.
pub const PUSH_BODY_HARD_CAP: usize = 10 * 1024 * 1024;

/// A `/consume` body as read: all of it when it is within [`CONSUME_BODY_LIMIT`], else its first
/// [`execute::RAW_BODY_LIMIT`] bytes; its size and SHA-256 always cover every byte.
struct ReadBody {
    bytes: Vec<u8>,
    size: usize,
    sha256: [u8; 32],
}

fn too_large(limit: usize) -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body-too-large",
        format!("the body is larger than {limit} bytes; nothing was recorded"),
    )
}

/// Reads `body` up to `cap` bytes, hashing all of it. A declared `Content-Length` over `cap` is
/// refused before any byte is read.
async fn read_body(
    headers: &HeaderMap,
    body: axum::body::Body,
    cap: usize,
) -> Result<ReadBody, Problem> {
    use axum::body::HttpBody;
    use sha2::Digest;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > cap as u64) {
        return Err(too_large(cap));
    }
    let mut body = std::pin::pin!(body);
    let mut hasher = sha2::Sha256::new();
    let mut bytes = Vec::new();
    let mut size = 0usize;
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = frame.map_err(|e| {
            info!(error = %e, "the request body could not be read");
            Problem::new(
                StatusCode::BAD_REQUEST,
                "bad-request",
                "the request body could not be read (the client stopped sending, or its framing is invalid)",
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        size += data.len();
        if size > cap {
            return Err(too_large(cap));
        }
        hasher.update(&data);
        let room = (CONSUME_BODY_LIMIT + 1).saturating_sub(bytes.len());
        bytes.extend_from_slice(&data[..data.len().min(room)]);
    }
    if size > CONSUME_BODY_LIMIT {
        bytes.truncate(execute::RAW_BODY_LIMIT);
    }
    Ok(ReadBody {
        bytes,
        size,
        sha256: hasher.finalize().into(),
    })
}

/// Acknowledges a body that can never succeed from an authenticated sender, after quarantining
/// it (DESIGN §5: a push system would redeliver it for ever).
async fn quarantine_and_ack(
    state: &AppState,
    body: &ReadBody,
    why: &str,
    caller: &Caller,
) -> Result<Response, Problem> {
    let retry_after = state.config.consume.retry_after.seconds() as u64;
    let id = execute::quarantine_envelope(
        state,
        &body.bytes,
        body.size,
        &hex::encode(body.sha256),
        why,
        &caller.0.subject,
    )
    .await
    .map_err(|f| Problem::unavailable(f.message, retry_after))?;
    info!(dead_letter_id = id, size = body.size, error = %why, "unusable envelope quarantined");
    Ok((
        StatusCode::OK,
        Json(json!({"result": "quarantined_envelope", "dead_letter_id": id, "error": why})),
    )
        .into_response())
}

async fn consume_handler(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, Problem> {
    // Whether this is an authenticated push is decided by the credential, before the body is
    // read: it decides the body limit and DESIGN §5's column.
    let push_credential = caller.0.credential.is_push();
    let cap = if push_credential {
        PUSH_BODY_HARD_CAP
    } else {
        CONSUME_BODY_LIMIT
    };
    caller.require("consume")?;
    let body = read_body(&headers, body, cap).await?;
    caller.verify_digest(&body.sha256)?;
    if body.size > CONSUME_BODY_LIMIT {
        let why = format!(
            "the body is {} bytes, over the {CONSUME_BODY_LIMIT}-byte limit of an envelope",
            body.size
        );
        return quarantine_and_ack(&state, &body, &why, &caller).await;
    }
    let retry_after = state.config.consume.retry_after.seconds() as u64;
    // A Pub/Sub push (wrapped or unwrapped) or a QStash delivery is answered by DESIGN §5's
    // push column.
    let pubsub = crate::transport::pubsub::parse_push(&headers, &body.bytes);
    if let Some(p) = &pubsub {
        info!(message_id = ?p.message_id, delivery_attempt = ?p.delivery_attempt, "Pub/Sub push");
    }
    if caller.0.credential == crate::auth::Credential::QstashSignature {
        let header = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
        info!(message_id = ?header("upstash-message-id"), retried = ?header("upstash-retried"),
              "QStash delivery");
    }
    let push = push_credential || pubsub.is_some();
    let envelope = match crate::transport::delivered_envelope(pubsub.as_ref(), &body.bytes) {
        Ok(e) => e,
        // A poison message from an authenticated sender: quarantine it and acknowledge, so
        // the queue does not redeliver it for ever (DESIGN §5).
        Err(why) => return quarantine_and_ack(&state, &body, &why, &caller).await,
    };
    let outcome = execute::execute(
        &state,
        &envelope.command_id,
        Executor::Delivery,
        &caller.0.subject,
    )
    .await
    .map_err(|f| Problem::unavailable(f.message, retry_after))?;
    if let ConsumeOutcome::Unknown { command_id } = &outcome {
        info!(
            command_id,
            push, "delivery of a command the ledger does not know"
        );
        crate::metrics::consume_unknown_command();
    }
    match answer(&envelope.command_id, outcome, push) {
        Answer::Ok(body) => Ok((StatusCode::OK, Json(body)).into_response()),
        Answer::Republish {
            body,
            retry_after_seconds,
        } => {
            // Pub/Sub ignores Retry-After and slows the whole subscription after nacks; QStash
            // spends one of its few retries on every non-2xx: commit "publish again when due",
            // then acknowledge.
            crate::ledger::outbox::request_republish(
                &state.pool,
                &envelope.command_id,
                retry_after_seconds,
            )
            .await
            .map_err(|e| Problem::unavailable(e, retry_after))?;
            Ok((StatusCode::OK, Json(body)).into_response())
        }
        Answer::NotNow {
            reason,
            retry_after_seconds,
        } => Err(
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, "not-now", reason)
                .retry_after(retry_after_seconds),
        ),
        Answer::UnknownCommand { command_id } => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-command",
            format!("no command `{command_id}` in the ledger"),
        )),
    }
}

/// `Retry-After` default for endpoints that have nothing better to say.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(5);

/// The HTTP method of a route entry.
pub fn method_of(m: &str) -> Method {
    m.parse().expect("ROUTES holds valid methods")
}
