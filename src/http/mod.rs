//! The HTTP surface: routes, authentication, problem+json errors, and the thin trigger and
//! consume handlers (docs/design.md §4, §5). `openapi.yaml` describes exactly [`ROUTES`]; a test keeps
//! them in step.

pub mod answer;
mod caller;
mod consume;
pub mod ops;
mod params;
mod problem;
pub mod tls;
mod trigger_handler;

pub use caller::Caller;
pub use consume::PUSH_BODY_HARD_CAP;
pub use params::{NoQuery, Params, QueryParams, Segments};
pub use problem::{Problem, problem_for_plain_errors};

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, FromRequestParts, State};
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
use crate::execute::{self, ConsumeOutcome};
use crate::state::AppState;
use crate::trigger::{TriggerError, TriggerOutcome, WindowHints};
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
    ("POST", "/runs/{run_id}/approve"),
    ("GET", "/governor"),
    ("GET", "/guard"),
    ("POST", "/guard/accept"),
    ("GET", "/dead-letters"),
    ("POST", "/dead-letters/redrive"),
    ("GET", "/dead-letters/{id}"),
    ("POST", "/dead-letters/{id}/redrive"),
    ("POST", "/dead-letters/{id}/abandon"),
    ("POST", "/policies/{policy}/suspend"),
    ("POST", "/policies/{policy}/resume"),
    ("GET", "/policies/{policy}/windows"),
    ("POST", "/policies/{policy}/backfill"),
    ("GET", "/policies/{policy}/items/{key}"),
    ("GET", "/operator-log"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
];

fn handler_for(method: &str, path: &str, state: &AppState) -> MethodRouter<AppState> {
    match (method, path) {
        ("POST", "/trigger/{policy}") => post(trigger_handler::trigger_handler),
        ("POST", "/consume") => {
            // One semaphore for the whole route (a per-route layer, so the limit is global to
            // /consume); a request that finds no permit is shed at once, never queued.
            let retry_after = state.config.consume.retry_after.seconds() as u64;
            let slots = Arc::new(tokio::sync::Semaphore::new(
                state.config.consume.max_in_flight as usize,
            ));
            // The body is read by the handler itself, against a limit that depends on the
            // credential (see `read_body`).
            post(consume::consume_handler).layer::<_, std::convert::Infallible>(
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
        ("POST", "/runs/{run_id}/approve") => post(ops::approve_run),
        ("GET", "/governor") => get(ops::governor),
        ("GET", "/guard") => get(ops::guard),
        ("POST", "/guard/accept") => post(ops::accept_identity),
        ("GET", "/dead-letters") => get(ops::list_dead_letters),
        ("POST", "/dead-letters/redrive") => post(ops::redrive_dead_letters),
        ("GET", "/dead-letters/{id}") => get(ops::get_dead_letter),
        ("POST", "/dead-letters/{id}/redrive") => post(ops::redrive_dead_letter),
        ("POST", "/dead-letters/{id}/abandon") => post(ops::abandon_dead_letter),
        ("POST", "/policies/{policy}/suspend") => post(ops::suspend_policy),
        ("POST", "/policies/{policy}/resume") => post(ops::resume_policy),
        ("GET", "/policies/{policy}/windows") => get(ops::policy_windows),
        ("POST", "/policies/{policy}/backfill") => post(ops::backfill),
        ("GET", "/policies/{policy}/items/{key}") => get(ops::item_history),
        ("GET", "/operator-log") => get(ops::list_operator_log),
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
    })
    // Logged by class, not by status: a documented "not now" 503 is not a failure.
    .on_failure(())
    .on_response(problem::log_response))
    .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
}

/// `Retry-After` default for endpoints that have nothing better to say.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(5);

/// The HTTP method of a route entry.
pub fn method_of(m: &str) -> Method {
    m.parse().expect("ROUTES holds valid methods")
}
