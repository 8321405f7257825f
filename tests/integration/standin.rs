//! A stand-in for a downstream HTTP API: a real axum server on loopback that records every
//! request (arrival time, method, path, idempotency key, body), tracks how many are in flight,
//! and answers what the test's reply function says.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

/// One request as the stand-in saw it.
#[derive(Debug, Clone)]
pub struct Call {
    pub at: Instant,
    pub method: String,
    pub path: String,
    pub idempotency_key: Option<String>,
    pub authorization: Option<String>,
    pub body: String,
}

/// `(status, headers, body)`.
pub type Reply = (u16, Vec<(String, String)>, String);

type ReplyFn = dyn Fn(&Call, &[Call]) -> Reply + Send + Sync;

struct Inner {
    calls: Mutex<Vec<Call>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    delay: Duration,
    reply: Box<ReplyFn>,
}

pub struct StandIn {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn ok() -> Reply {
    (200, vec![], "{\"ok\":true}".into())
}

async fn handle(
    State(inner): State<Arc<Inner>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = Call {
        at: Instant::now(),
        method: method.to_string(),
        path: uri.path().to_string(),
        idempotency_key: headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(String::from),
        authorization: headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(String::from),
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    let now = inner.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    inner.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let reply = {
        let mut calls = inner.calls.lock().unwrap();
        let r = (inner.reply)(&call, &calls);
        calls.push(call);
        r
    };
    let (status, mut headers, body) = reply;
    // A reply may ask for its own delay (a slow answer) with this pseudo-header.
    let mut delay = inner.delay;
    if let Some(i) = headers.iter().position(|(k, _)| k == "x-standin-delay-ms") {
        delay = Duration::from_millis(headers.remove(i).1.parse().unwrap());
    }
    tokio::time::sleep(delay).await;
    inner.in_flight.fetch_sub(1, Ordering::SeqCst);
    let mut resp = (StatusCode::from_u16(status).unwrap(), body).into_response();
    for (k, v) in headers {
        resp.headers_mut().insert(
            axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    resp
}

impl StandIn {
    /// Starts on `127.0.0.1:0`. `reply` sees the request and every earlier one.
    pub async fn start(
        delay: Duration,
        reply: impl Fn(&Call, &[Call]) -> Reply + Send + Sync + 'static,
    ) -> StandIn {
        let inner = Arc::new(Inner {
            calls: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            delay,
            reply: Box::new(reply),
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        StandIn { addr, inner, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn calls(&self) -> Vec<Call> {
        self.inner.calls.lock().unwrap().clone()
    }

    pub fn max_in_flight(&self) -> usize {
        self.inner.max_in_flight.load(Ordering::SeqCst)
    }
}
