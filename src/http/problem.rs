//! Errors as RFC 9457 problems (`application/problem+json`): a stable `type`, a human `detail`,
//! no internal detail in a 5xx; and the same shape for errors axum or tower-http make themselves.

use super::*;

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
    /// The human detail.
    pub fn detail(&self) -> &str {
        &self.detail
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
        resp.extensions_mut().insert(ProblemType(self.slug));
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
    /// Uses the one classification ([`crate::retry::Setback::from_db`]): what another try may
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
        match crate::retry::Setback::from_db(&e).class() {
            Some(
                FailureClass::Transient
                | FailureClass::Throttled { .. }
                | FailureClass::Locked { .. },
            ) => Problem::unavailable(e, 5),
            // A schema the request's statement does not match (a hold for a command) is ours.
            Some(FailureClass::Permanent) | None => Problem::internal(e),
        }
    }
}

/// The problem type of a response, for its log line ([`log_response`]).
#[derive(Debug, Clone, Copy)]
pub struct ProblemType(pub &'static str);

/// How a response is logged: its class decides, not its status alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogClass {
    /// Served as asked, or a refusal of the caller's input: DEBUG.
    Served,
    /// A documented "not now" (the command is held, backing off, or this replica is at its
    /// limit): INFO; the sender retries as told.
    NotNow,
    /// The ledger is unreachable or a request timed out: WARN; it cures itself or pages.
    Unavailable,
    /// A fault of ours: ERROR.
    Failed,
}

/// The class of a response of `status` whose problem type (if any) is `problem`.
pub fn log_class(status: StatusCode, problem: Option<&str>) -> LogClass {
    match (status.as_u16(), problem) {
        (503, Some("not-now" | "overloaded")) => LogClass::NotNow,
        (503, Some("unavailable" | "timeout")) | (504, _) => LogClass::Unavailable,
        (s, _) if s >= 500 => LogClass::Failed,
        _ => LogClass::Served,
    }
}

/// The one log line of every response, at the level of its [`LogClass`].
pub fn log_response(resp: &Response, latency: std::time::Duration, _: &tracing::Span) {
    let problem = resp.extensions().get::<ProblemType>().map(|p| p.0);
    let status = resp.status().as_u16();
    let ms = latency.as_millis() as u64;
    match log_class(resp.status(), problem) {
        LogClass::Served => tracing::debug!(status, problem, latency_ms = ms, "response"),
        LogClass::NotNow => tracing::info!(status, problem, latency_ms = ms, "not now"),
        LogClass::Unavailable => tracing::warn!(status, problem, latency_ms = ms, "unavailable"),
        LogClass::Failed => tracing::error!(status, problem, latency_ms = ms, "response failed"),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_logged_by_class_not_by_status() {
        let c = |status: u16, problem| log_class(StatusCode::from_u16(status).unwrap(), problem);
        assert_eq!(c(503, Some("not-now")), LogClass::NotNow);
        assert_eq!(c(503, Some("overloaded")), LogClass::NotNow);
        assert_eq!(c(503, Some("unavailable")), LogClass::Unavailable);
        assert_eq!(c(503, Some("timeout")), LogClass::Unavailable);
        assert_eq!(c(500, Some("internal")), LogClass::Failed);
        assert_eq!(c(503, None), LogClass::Failed);
        assert_eq!(c(404, Some("unknown-command")), LogClass::Served);
        assert_eq!(c(200, None), LogClass::Served);
    }

    #[test]
    fn a_problem_response_carries_its_type_for_the_log() {
        let resp = Problem::new(StatusCode::SERVICE_UNAVAILABLE, "not-now", "held").into_response();
        assert_eq!(
            resp.extensions().get::<ProblemType>().map(|p| p.0),
            Some("not-now")
        );
    }
}
