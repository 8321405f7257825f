//! The reconciliation quick start's stand-in for a payment provider, over real HTTP on a
//! loopback port.
//!
//! It holds its own copy of the payments (id to amount in cents), given at start: most equal to
//! ours, about 1 % with another amount, a few missing. `POST /v1/payments/{id}/reconcile` with
//! an `Idempotency-Key` header and our amount in the body (`{"amount_cents": "1250", ...}`)
//! answers `200` with every field, `null` where it has none:
//! - `{"status": "match", "provider_amount": 1250, "provider_ref": "pi_..."}` when its amount
//!   equals ours;
//! - `{"status": "mismatch", "provider_amount": <its amount>, "provider_ref": "pi_..."}` when not;
//! - `{"status": "unknown", "provider_amount": null, "provider_ref": null}` for a payment it does
//!   not know (never a 404, which a not-found signature would read as already absent).
//!
//! A first answer is stored under its key; a repeated key gets the stored answer (with
//! `Idempotent-Replayed: true`, as Stripe's API does) and is counted as a replay, not as a
//! second reconciliation. Like a real provider it pushes back: four calls in a row answer 429
//! with `Retry-After: 1` every [`BURST_EVERY`] calls, and once [`Api::outage_at_call`] calls
//! have come it answers 503 (no `Retry-After`) to everything for [`OUTAGE`]. It answers a few
//! milliseconds after storing, so a worker aborted in that gap leaves a reconciliation the
//! provider made and sweeper never heard of.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// A 429 burst starts every this many calls.
const BURST_EVERY: u64 = 400;
/// Calls answered 429 in each burst.
const BURST_LEN: u64 = 4;
/// How long the 503 stretch lasts.
const OUTAGE: Duration = Duration::from_millis(1500);
/// Delay between storing an answer and sending it.
const ANSWER_DELAY: Duration = Duration::from_millis(4);

/// What the stand-in saw.
#[derive(Debug, Default)]
pub struct Book {
    /// HTTP calls received.
    pub calls: u64,
    /// Calls answered 429 (with `Retry-After`).
    pub throttled_429: u64,
    /// Calls answered 503 (the outage).
    pub unavailable_503: u64,
    /// Calls carrying a key the stand-in had answered 429 or 503 before: the retries.
    pub retried: u64,
    /// Calls carrying a key with a stored answer, answered from the store.
    pub replays: u64,
    /// First answers by status (`match`, `mismatch`, `unknown`).
    pub answered: BTreeMap<&'static str, u64>,
    /// Per payment, the keys it was first answered `match` under: more than one is a payment
    /// reconciled twice.
    pub matched: BTreeMap<String, BTreeSet<String>>,
    stored: HashMap<String, String>,
    pushed_back: HashSet<String>,
    outage_since: Option<Instant>,
}

impl Book {
    /// Payments answered `match` under more than one idempotency key.
    pub fn reconciled_twice(&self) -> i64 {
        self.matched.values().filter(|k| k.len() > 1).count() as i64
    }

    /// First answers with `status`.
    pub fn answered(&self, status: &str) -> i64 {
        self.answered.get(status).copied().unwrap_or(0) as i64
    }
}

/// The provider's state: its copy of the payments and the book.
struct Api {
    copy: HashMap<String, i64>,
    /// The 503 stretch begins with the call numbered this.
    outage_at_call: u64,
    book: Mutex<Book>,
}

/// A running stand-in.
pub struct PaymentsApi {
    /// `http://127.0.0.1:{port}`.
    pub url: String,
    api: Arc<Api>,
    task: tokio::task::JoinHandle<()>,
}

impl PaymentsApi {
    /// Binds a free loopback port and serves `copy` (payment id to amount in cents); the 503
    /// stretch begins at call `outage_at_call`.
    pub async fn start(copy: HashMap<String, i64>, outage_at_call: u64) -> anyhow::Result<Self> {
        let api = Arc::new(Api {
            copy,
            outage_at_call,
            book: Mutex::new(Book::default()),
        });
        let app = Router::new()
            .route("/v1/payments/{id}/reconcile", post(reconcile))
            .with_state(api.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(PaymentsApi { url, api, task })
    }

    /// Reads the book.
    pub fn with<T>(&self, f: impl FnOnce(&Book) -> T) -> T {
        f(&self.api.book.lock().unwrap())
    }
}

impl Drop for PaymentsApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The provider's reference of a payment it knows.
fn provider_ref(id: &str) -> String {
    format!("pi_{}", id.trim_start_matches("pay_"))
}

/// Our amount from the request body: `amount_cents` as a JSON string or number.
fn our_amount(body: &[u8]) -> Option<i64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    match &v["amount_cents"] {
        Value::String(s) => s.parse().ok(),
        other => other.as_i64(),
    }
}

async fn reconcile(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let answer = {
        let mut b = api.book.lock().unwrap();
        b.calls += 1;
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
        if key.is_empty() {
            return (StatusCode::BAD_REQUEST, "missing Idempotency-Key").into_response();
        }
        let Some(ours) = our_amount(&body) else {
            return (StatusCode::BAD_REQUEST, "amount_cents missing").into_response();
        };
        if b.pushed_back.contains(&key) {
            b.retried += 1;
        }
        if b.calls % BURST_EVERY >= BURST_EVERY / 2
            && b.calls % BURST_EVERY < BURST_EVERY / 2 + BURST_LEN
        {
            b.throttled_429 += 1;
            b.pushed_back.insert(key);
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "1")],
                "rate limit exceeded",
            )
                .into_response();
        }
        if b.calls >= api.outage_at_call && b.outage_since.is_none() {
            b.outage_since = Some(Instant::now());
        }
        if b.outage_since.is_some_and(|t| t.elapsed() < OUTAGE) {
            b.unavailable_503 += 1;
            b.pushed_back.insert(key);
            return (StatusCode::SERVICE_UNAVAILABLE, "down for maintenance").into_response();
        }
        let (status, answer) = match api.copy.get(&id) {
            None => (
                "unknown",
                json!({"status": "unknown", "provider_amount": null, "provider_ref": null}),
            ),
            Some(&theirs) => {
                let status = if theirs == ours { "match" } else { "mismatch" };
                let answer = json!({
                    "status": status,
                    "provider_amount": theirs,
                    "provider_ref": provider_ref(&id),
                });
                (status, answer)
            }
        };
        *b.answered.entry(status).or_default() += 1;
        if status == "match" {
            b.matched.entry(id).or_default().insert(key.clone());
        }
        let answer = answer.to_string();
        b.stored.insert(key, answer.clone());
        answer
    };
    tokio::time::sleep(ANSWER_DELAY).await;
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        answer,
    )
        .into_response()
}
