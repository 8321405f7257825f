//! The digest quick start's stand-in for a digest provider, over real HTTP on a loopback port.
//!
//! `POST /v1/digests/{customer}` with an `Idempotency-Key` header: the first successful call
//! with a key records one digest for (week, customer) — the week read from the key
//! `support-digest:{window}:{customer}` — and stores its answer; a repeated key gets the stored
//! answer (with `Idempotent-Replayed: true`, as Stripe's API does) and records nothing. Like a
//! real provider it fails now and then: the first call for every 41st customer answers 503,
//! and the 7th call overall answers 429 with `Retry-After: 1`. It answers 30 ms after
//! recording, so a worker aborted in that gap leaves a digest sent that sweeper never heard of.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;

/// What the stand-in saw.
#[derive(Debug, Default)]
pub struct Book {
    /// HTTP calls received.
    pub calls: u64,
    /// Calls answered from a stored result (a repeated key).
    pub replays: u64,
    /// 503 and 429 answers given.
    pub failures: u64,
    /// Digests recorded per (window, customer): more than 1 is a duplicate digest.
    pub recorded: BTreeMap<(String, i64), u32>,
    stored: HashMap<String, String>,
    failed_once: HashSet<String>,
    throttled: bool,
}

/// A running stand-in.
pub struct DigestApi {
    /// `http://127.0.0.1:{port}`.
    pub url: String,
    book: Arc<Mutex<Book>>,
    task: tokio::task::JoinHandle<()>,
}

impl DigestApi {
    /// Binds a free loopback port and serves.
    pub async fn start() -> anyhow::Result<DigestApi> {
        let book = Arc::new(Mutex::new(Book::default()));
        let app = Router::new()
            .route("/v1/digests/{customer}", post(send))
            .with_state(book.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(DigestApi { url, book, task })
    }

    /// Reads the book.
    pub fn with<T>(&self, f: impl FnOnce(&Book) -> T) -> T {
        f(&self.book.lock().unwrap())
    }
}

impl Drop for DigestApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn send(
    State(book): State<Arc<Mutex<Book>>>,
    Path(customer): Path<i64>,
    headers: HeaderMap,
) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let answer = {
        let mut b = book.lock().unwrap();
        b.calls += 1;
        let week = key
            .strip_prefix("support-digest:")
            .and_then(|rest| rest.rsplit_once(':'))
            .map(|(w, _)| w.to_string());
        if let Some(stored) = b.stored.get(&key).cloned() {
            b.replays += 1;
            return (
                StatusCode::OK,
                [
                    ("idempotent-replayed", "true"),
                    ("content-type", "application/json"),
                ],
                stored,
            )
                .into_response();
        }
        let Some(week) = week else {
            return (StatusCode::BAD_REQUEST, "missing Idempotency-Key").into_response();
        };
        if !b.throttled && b.calls >= 7 {
            b.throttled = true;
            b.failures += 1;
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "1")],
                "slow down",
            )
                .into_response();
        }
        if customer % 41 == 0 && b.failed_once.insert(key.clone()) {
            b.failures += 1;
            return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
        }
        *b.recorded.entry((week, customer)).or_default() += 1;
        let answer = format!(
            "{{\"digest_id\": \"dg_{}\", \"customer\": {customer}}}",
            b.stored.len() + 1
        );
        b.stored.insert(key, answer.clone());
        answer
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        answer,
    )
        .into_response()
}
