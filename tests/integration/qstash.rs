//! The QStash transport against a stand-in that speaks QStash's protocol on loopback: the
//! publish API (`POST /v2/publish/{destination}` with a bearer token, `Upstash-Deduplication-Id`,
//! `Upstash-Not-Before`, `Upstash-Retries`; 201 with a `messageId`, 202 for a duplicate dedup id;
//! 429 with `RateLimit-Reset` when told to throttle) and delivery (the raw body POSTed to the
//! destination with `Upstash-Signature`, an HS256 JWT over `iss`, `sub`, `exp`, `nbf`, `iat`,
//! `jti` and `body` = base64url SHA-256 of the body; `Upstash-Message-Id`, `Upstash-Retried`;
//! a non-2xx retried). Signing keys and the API token come from variables cargo sets for every
//! test run, so no test writes the environment.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::common::*;
use crate::scenarios::{Ended, Transport, a_transient_failure_converges};

/// The API token (the relay publishes with it).
fn api_token() -> String {
    std::env::var("CARGO_PKG_NAME").unwrap()
}
/// The current signing key.
fn current_key() -> String {
    std::env::var("CARGO_PKG_DESCRIPTION").unwrap()
}
/// The next signing key.
fn next_key() -> String {
    std::env::var("CARGO_MANIFEST_DIR").unwrap()
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// An `Upstash-Signature` as QStash issues it: `claims` override the defaults.
pub fn signature(key: &str, url: &str, body: &[u8], claims: Value) -> String {
    let now = unix_now();
    let mut c = json!({
        "iss": "Upstash", "sub": url, "exp": now + 300, "nbf": now, "iat": now,
        "jti": format!("jwt_{}", uuid::Uuid::new_v4().simple()),
        // QStash's documented example keeps the `=` padding.
        "body": base64::engine::general_purpose::URL_SAFE.encode(Sha256::digest(body)),
    });
    for (k, v) in claims.as_object().unwrap() {
        if v.is_null() {
            c.as_object_mut().unwrap().remove(k);
        } else {
            c[k] = v.clone();
        }
    }
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &c,
        &jsonwebtoken::EncodingKey::from_secret(key.as_bytes()).unwrap(),
    )
    .unwrap()
}

/// A publish request as the stand-in saw it.
#[derive(Debug, Clone)]
pub struct Published {
    pub dedup_id: String,
    pub not_before: Option<i64>,
    pub status: u16,
    pub body: String,
}

/// A delivery attempt and the status `/consume` answered.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message_id: String,
    pub retried: u32,
    pub status: u16,
    pub body: String,
}

#[derive(Default)]
struct Inner {
    published: Mutex<Vec<Published>>,
    deliveries: Mutex<Vec<Delivery>>,
    by_dedup: Mutex<HashMap<String, String>>,
    throttle: AtomicUsize,
}

/// The QStash stand-in.
pub struct Qstash {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Qstash {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Qstash {
    pub async fn start() -> Qstash {
        let inner = Arc::new(Inner::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = axum::Router::new()
            .fallback(publish)
            .with_state(inner.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        });
        Qstash { addr, inner, task }
    }
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// Answers the next `n` publishes with 429.
    pub fn throttle(&self, n: usize) {
        self.inner.throttle.store(n, Ordering::SeqCst);
    }
    pub fn published(&self) -> Vec<Published> {
        self.inner.published.lock().unwrap().clone()
    }
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.inner.deliveries.lock().unwrap().clone()
    }
}

async fn publish(
    State(inner): State<Arc<Inner>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let Some(destination) = uri.path().strip_prefix("/v2/publish/") else {
        return (StatusCode::NOT_FOUND, "no such API").into_response();
    };
    if header("authorization") != Some(format!("Bearer {}", api_token())) {
        return (StatusCode::UNAUTHORIZED, r#"{"error":"unauthorized"}"#).into_response();
    }
    let dedup_id = header("upstash-deduplication-id").unwrap_or_default();
    let not_before = header("upstash-not-before").and_then(|v| v.parse::<i64>().ok());
    let record = |status: u16| {
        inner.published.lock().unwrap().push(Published {
            dedup_id: dedup_id.clone(),
            not_before,
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    if inner
        .throttle
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        record(429);
        let mut r = (
            StatusCode::TOO_MANY_REQUESTS,
            r#"{"error":"too many requests"}"#,
        )
            .into_response();
        r.headers_mut().insert(
            "ratelimit-reset",
            (unix_now() + 1).to_string().parse().unwrap(),
        );
        return r;
    }
    let existing = inner.by_dedup.lock().unwrap().get(&dedup_id).cloned();
    if let Some(id) = existing {
        record(202);
        return (
            StatusCode::ACCEPTED,
            axum::Json(json!({"messageId": id, "deduplicated": true})),
        )
            .into_response();
    }
    let message_id = format!("msg_{}", uuid::Uuid::new_v4().simple());
    inner
        .by_dedup
        .lock()
        .unwrap()
        .insert(dedup_id.clone(), message_id.clone());
    record(201);
    let retries: u32 = header("upstash-retries")
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let destination = destination.to_string();
    let content_type = header("content-type").unwrap_or_default();
    let (inner2, id) = (inner.clone(), message_id.clone());
    tokio::spawn(async move {
        if let Some(at) = not_before {
            let wait = (at - unix_now()).max(0) as u64;
            tokio::time::sleep(Duration::from_secs(wait)).await;
        }
        let client = reqwest::Client::new();
        for retried in 0..=retries {
            let r = client
                .post(&destination)
                .header("content-type", &content_type)
                .header("user-agent", "Upstash-QStash")
                .header(
                    "upstash-signature",
                    signature(&current_key(), &destination, &body, json!({})),
                )
                .header("upstash-message-id", &id)
                .header("upstash-retried", retried.to_string())
                .body(body.clone())
                .send()
                .await;
            let (status, text) = match r {
                Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
                Err(e) => (0, e.to_string()),
            };
            inner2.deliveries.lock().unwrap().push(Delivery {
                message_id: id.clone(),
                retried,
                status,
                body: text,
            });
            if (200..300).contains(&status) {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    (
        StatusCode::CREATED,
        axum::Json(json!({"messageId": message_id, "url": destination_url(&uri)})),
    )
        .into_response()
}

fn destination_url(uri: &Uri) -> String {
    uri.path().trim_start_matches("/v2/publish/").to_string()
}

pub fn qstash_toml(port: u16, api: &str, scopes: &str) -> String {
    format!(
        "listen = \"127.0.0.1:{port}\"\n\
         [consume]\nlock_timeout = \"1s\"\n\
         [qstash]\npublic_url = \"http://127.0.0.1:{port}\"\napi_url = \"{api}\"\n\
         token_env = \"CARGO_PKG_NAME\"\ncurrent_signing_key_env = \"CARGO_PKG_DESCRIPTION\"\n\
         next_signing_key_env = \"CARGO_MANIFEST_DIR\"\nscopes = {scopes}\nretries = 2\n"
    )
}

pub fn qstash_policy(max_attempts: u32) -> String {
    ticket_policy(10).replace(
        "batch_size = 10",
        &format!(
            "batch_size = 10\ntransport = \"qstash\"\n\
             retry = {{ max_attempts = {max_attempts}, base = \"2s\", cap = \"2s\", max_age = \"1h\" }}"
        ),
    )
}

#[tokio::test]
async fn a_run_completes_through_signed_deliveries_with_throttled_publishes_and_republishes() {
    let transport = Transport::qstash().await;
    let qstash = transport.qstash_stand_in();
    qstash.throttle(2);
    let Ended {
        app,
        run_id,
        eligible,
    } = a_transient_failure_converges(&transport).await;
    // One outcome per item, attributed to the QStash principal.
    let (audit_rows, items, actors): (i64, i64, Vec<String>) = sqlx::query_as(
        "select count(*), count(distinct item_key), array_agg(distinct actor)
           from sweeper.audit_trail where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (audit_rows, items),
        (eligible.len() as i64, eligible.len() as i64)
    );
    assert_eq!(actors, vec!["upstash-qstash".to_string()]);

    let published = qstash.published();
    assert_eq!(
        published.iter().filter(|p| p.status == 429).count(),
        2,
        "the throttled publishes were answered 429"
    );
    let commands = app.command_ids(&run_id).await;
    for id in &commands {
        assert!(
            published
                .iter()
                .any(|p| p.status == 201 && p.dedup_id == format!("{id}:1")),
            "{id} was published with dedup id {{command_id}}:1 after the throttling"
        );
    }
    // The held command: a second publish with the next generation (whether it also carried
    // Upstash-Not-Before depends on the jittered backoff; the next test pins that down).
    let republished: Vec<&Published> = published
        .iter()
        .filter(|p| p.status == 201 && !p.dedup_id.ends_with(":1"))
        .collect();
    assert!(!republished.is_empty(), "{published:?}");
    let body: Value = serde_json::from_str(&republished[0].body).unwrap();
    assert_eq!(body["publish_generation"], 2, "{body}");
    assert_eq!(
        republished[0].dedup_id,
        format!("{}:2", body["command_id"].as_str().unwrap())
    );
    // Every delivery was acknowledged: "not now" is a committed decision plus 200.
    let deliveries = qstash.deliveries();
    assert!(deliveries.len() > commands.len(), "{deliveries:?}");
    assert!(
        deliveries.iter().all(|d| d.status == 200),
        "{:?}",
        deliveries
            .iter()
            .filter(|d| d.status != 200)
            .collect::<Vec<_>>()
    );
    assert!(
        deliveries.iter().any(|d| d.body.contains("not_now")),
        "the held command was answered not_now"
    );
    // ... so QStash never had to retry, and each accepted publish was delivered once.
    assert!(deliveries.iter().all(|d| d.retried == 0));
    let messages: std::collections::HashSet<&str> =
        deliveries.iter().map(|d| d.message_id.as_str()).collect();
    assert_eq!(
        (messages.len(), deliveries.len()),
        (
            published.iter().filter(|p| p.status == 201).count(),
            deliveries.len()
        )
    );
    let transient: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.attempts where outcome = 'failed' and class = 'transient'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(transient >= 1, "the held row made an attempt fail");
}

/// Signs `body` for `/consume` of `app` with `key` and `claims`, and POSTs it.
async fn deliver(app: &TestApp, key: &str, path: &str, body: &[u8], claims: Value) -> (u16, Value) {
    let url = format!("{}{path}", app.base);
    let sig = signature(key, &url, body, claims);
    let r = app
        .client
        .post(&url)
        .header("upstash-signature", sig)
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn signatures_are_verified_over_key_issuer_subject_time_and_the_exact_body() {
    // A [qstash] section without QStash policies: signatures verify, nothing is published.
    let port = free_port();
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: ticket_policy(10),
        extra_toml: qstash_toml(port, "http://127.0.0.1:9", r#"["consume", "trigger:*"]"#),
        ..Default::default()
    })
    .await;
    seed_mixed(&app.pool, 30, at("2026-09-01T02:00:00Z")).await;
    // A QStash schedule's trigger, signed over its empty body.
    let (status, run) = deliver(
        &app,
        &current_key(),
        "/trigger/ticket-retention",
        b"",
        json!({}),
    )
    .await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    let ids = app.command_ids(&run_id).await;
    assert!(ids.len() >= 2, "{ids:?}");
    let envelope = |id: &str| json!({"command_id": id}).to_string().into_bytes();

    let wrong_key = "sig_0000000000000000000000000000000000";
    let now = unix_now();
    let consume = "/consume";
    let body = envelope(&ids[0]);
    let mut one_byte_changed = body.clone();
    *one_byte_changed.last_mut().unwrap() = b' ';
    let refused: Vec<(&str, String, Value, &str)> = vec![
        (
            "wrong key",
            wrong_key.into(),
            json!({}),
            "signature does not verify",
        ),
        (
            "wrong issuer",
            current_key(),
            json!({"iss": "Evil"}),
            "wrong issuer",
        ),
        (
            "another URL",
            current_key(),
            json!({"sub": format!("{}/consume?x=1", app.base)}),
            "wrong subject",
        ),
        (
            "expired",
            current_key(),
            json!({"exp": now - 120, "nbf": now - 420, "iat": now - 420}),
            "expired",
        ),
        (
            "not yet valid",
            current_key(),
            json!({"nbf": now + 600}),
            "not yet valid",
        ),
        (
            "no body claim",
            current_key(),
            json!({"body": null}),
            "body",
        ),
        ("no nbf", current_key(), json!({"nbf": null}), "nbf"),
        // The one time rule of every credential: iat past the leeway in the future.
        (
            "issued in the future",
            current_key(),
            json!({"iat": now + 300, "exp": now + 600}),
            "issued in the future",
        ),
        (
            "nbf past every date",
            current_key(),
            json!({"nbf": 1e30}),
            "claim `nbf` unusable",
        ),
    ];
    for (what, key, claims, why) in &refused {
        let (status, problem) = deliver(&app, key, consume, &body, claims.clone()).await;
        assert_eq!(status, 401, "{what}: {problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains(why),
            "{what}: {problem}"
        );
    }
    // The body changed by one byte after signing.
    let url = format!("{}{consume}", app.base);
    let sig = signature(&current_key(), &url, &body, json!({}));
    let r = app
        .client
        .post(&url)
        .header("upstash-signature", &sig)
        .body(one_byte_changed.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.text().await.unwrap().contains("another body"));
    // A signature is no credential for the ops endpoints, even with a valid one.
    let r = app
        .client
        .get(format!("{}/runs", app.base))
        .header(
            "upstash-signature",
            signature(
                &current_key(),
                &format!("{}/runs", app.base),
                b"",
                json!({}),
            ),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    // Nothing was executed, recorded or quarantined by the refused deliveries.
    let (audit, dead, attempts): (i64, i64, i64) = sqlx::query_as(
        "select (select count(*) from sweeper.audit_trail), (select count(*) from sweeper.dead_letters),
                (select count(*) from sweeper.attempts)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((audit, dead, attempts), (0, 0, 0));
    let state: String =
        sqlx::query_scalar("select state from sweeper.commands where command_id = $1")
            .bind(&ids[0])
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(state, "pending");

    // The current key, then the next one (a rotation in progress), are accepted; unpadded
    // body hashes too.
    let (status, out) = deliver(&app, &current_key(), consume, &body, json!({})).await;
    assert_eq!(
        (status, out["result"].as_str()),
        (200, Some("executed")),
        "{out}"
    );
    let body1 = envelope(&ids[1]);
    let unpadded = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(&body1));
    let (status, out) = deliver(
        &app,
        &next_key(),
        consume,
        &body1,
        json!({"body": unpadded}),
    )
    .await;
    assert_eq!(
        (status, out["result"].as_str()),
        (200, Some("executed")),
        "{out}"
    );
    // A redelivery of the same message is a duplicate, acknowledged.
    let (status, out) = deliver(&app, &current_key(), consume, &body, json!({})).await;
    assert_eq!(
        (status, out["result"].as_str()),
        (200, Some("duplicate")),
        "{out}"
    );
    let actors: Vec<String> =
        sqlx::query_scalar("select distinct actor from sweeper.audit_trail where run_id = $1")
            .bind(&run_id)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(actors, vec!["upstash-qstash".to_string()]);
    // Unparseable but signed: quarantined and acknowledged, not retried for ever.
    let (status, out) = deliver(&app, &current_key(), consume, b"{\"nope\":1}", json!({})).await;
    assert_eq!(
        (status, out["result"].as_str()),
        (200, Some("quarantined_envelope")),
        "{out}"
    );
}

#[tokio::test]
async fn a_redriven_command_is_published_again_under_a_new_dedup_id() {
    let qstash = Qstash::start().await;
    let port = free_port();
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: qstash_policy(1),
        extra_toml: qstash_toml(port, &qstash.url(), r#"["consume"]"#),
        ..Default::default()
    })
    .await;
    let eligible = seed_mixed(&app.pool, 5, at("2026-09-01T02:00:00Z")).await;
    // max_attempts = 1 and a row whose delete fails: the only attempt fails and the command is
    // quarantined.
    fail_ticket_deletes(&app.pool, eligible[0]).await;
    let (_, run) = app.trigger("ticket-retention", "").await;
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed_with_dead_letters", "{done}");
    heal_ticket_deletes(&app.pool, eligible[0]).await;
    let command = app.command_ids(&run_id).await.remove(0);
    let dl: Vec<Value> = app.get_json("/dead-letters").await["dead_letters"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(dl.len(), 1, "{dl:?}");
    let r = app
        .client
        .post(format!(
            "{}/dead-letters/{}/redrive",
            app.base, dl[0]["dead_letter_id"]
        ))
        .bearer_auth(app.ops_token())
        .json(&json!({"reason": "lock released"}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let done = app
        .wait_until(&run_id, "completed", |r| r["status"] == "completed")
        .await;
    assert_eq!(done["deleted"].as_i64().unwrap(), eligible.len() as i64);
    let ids: Vec<String> = qstash
        .published()
        .iter()
        .filter(|p| p.status == 201 && p.dedup_id.starts_with(&format!("{command}:")))
        .map(|p| p.dedup_id.clone())
        .collect();
    assert_eq!(
        ids,
        vec![format!("{command}:1"), format!("{command}:2")],
        "a new dedup id, so QStash does not swallow it"
    );
}

#[tokio::test]
async fn a_command_not_yet_due_is_handed_over_with_not_before_and_arrives_no_earlier() {
    let qstash = Qstash::start().await;
    let port = free_port();
    // relay_interval 1h: the background relay runs once at start, the test drives it after.
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: qstash_policy(5),
        extra_toml: qstash_toml(port, &qstash.url(), r#"["consume"]"#)
            + "relay_interval = \"1h\"\n",
        ..Default::default()
    })
    .await;
    let eligible = seed_mixed(&app.pool, 30, at("2026-09-01T02:00:00Z")).await;
    let (run_id, commands) = app.planned_run().await;
    assert!(commands.len() >= 2);
    // One command is due in 5 s (by the ledger's clock, which runs months behind the wall).
    crate::kit::ledger::force_due_in(&app.pool, &commands[0], 5).await;
    let handed_over = unix_now();
    let publisher = sweeper::transport::Publisher::Qstash(
        sweeper::transport::qstash::Publisher::new(app.state.config.qstash.as_ref().unwrap())
            .unwrap(),
    );
    let (read, published) = sweeper::app::relay::relay_once(&app.state, &publisher)
        .await
        .unwrap();
    assert_eq!((read, published), (commands.len(), commands.len()));
    let seen = qstash.published();
    let delayed = seen
        .iter()
        .find(|p| p.dedup_id == format!("{}:1", commands[0]))
        .unwrap();
    let not_before = delayed
        .not_before
        .expect("Upstash-Not-Before on the command not yet due");
    assert!(
        (handed_over + 4..=handed_over + 7).contains(&not_before),
        "not before {not_before}, handed over at {handed_over}"
    );
    assert!(
        seen.iter()
            .filter(|p| p.dedup_id != delayed.dedup_id)
            .all(|p| p.not_before.is_none()),
        "{seen:?}"
    );
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"].as_i64().unwrap(), eligible.len() as i64);
    // QStash delivered it no earlier, and it was executed on that delivery, not answered not_now.
    assert!(unix_now() >= not_before);
    let deliveries = qstash.deliveries();
    assert_eq!(deliveries.len(), commands.len(), "{deliveries:?}");
    assert!(
        deliveries.iter().all(|d| d.body.contains("executed")),
        "{deliveries:?}"
    );
}

/// Locks `command_id`'s row on a session of its own for `hold`, as the relay's mark or another
/// delivery's gate (short) or an execution (long) would.
async fn hold_command_row(db_url: &str, command_id: &str, hold: std::time::Duration) {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(db_url).await.unwrap();
    sqlx::query("begin").execute(&mut c).await.unwrap();
    sqlx::query("select 1 from sweeper.commands where command_id = $1 for update")
        .bind(command_id)
        .execute(&mut c)
        .await
        .unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(hold).await;
        sqlx::query("commit").execute(&mut c).await.unwrap();
    });
}

async fn publish_state(pool: &sqlx::PgPool, command_id: &str) -> (bool, f64) {
    sqlx::query_as(
        "select publish_due, extract(epoch from next_attempt_at - sweeper.now())::float8
           from sweeper.commands where command_id = $1",
    )
    .bind(command_id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_republish_request_waits_out_a_short_lock_and_leaves_a_long_one_to_its_holder() {
    let qstash = Qstash::start().await;
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: qstash_policy(5),
        extra_toml: qstash_toml(free_port(), &qstash.url(), r#"["consume"]"#)
            + "relay_interval = \"1h\"\n",
        ..Default::default()
    })
    .await;
    seed_mixed(&app.pool, 30, at("2026-09-01T02:00:00Z")).await;
    let (_run_id, commands) = app.planned_run().await;
    let command = &commands[0];
    // Published, not due for a while: as the relay's mark leaves it.
    sqlx::query("update sweeper.commands set publish_due = false where command_id = $1")
        .bind(command)
        .execute(&app.pool)
        .await
        .unwrap();
    crate::kit::ledger::force_due_in(&app.pool, command, 30).await;

    // Locked for 300 ms, as while the relay marks it published: the request waits, and lands.
    hold_command_row(&app.db.url, command, Duration::from_millis(300)).await;
    let recorded = sweeper::ledger::outbox::request_republish(&app.pool, command, 60)
        .await
        .unwrap();
    let (due, due_in) = publish_state(&app.pool, command).await;
    assert!(recorded && due, "a request behind a short lock is recorded");
    assert!((55.0..=61.0).contains(&due_in), "not before 60 s: {due_in}");

    // Locked past the wait, as by an execution (which commits its own decision): the request
    // gives up without changing anything.
    sqlx::query("update sweeper.commands set publish_due = false where command_id = $1")
        .bind(command)
        .execute(&app.pool)
        .await
        .unwrap();
    hold_command_row(&app.db.url, command, Duration::from_secs(3)).await;
    let started = std::time::Instant::now();
    let recorded = sweeper::ledger::outbox::request_republish(&app.pool, command, 120)
        .await
        .unwrap();
    assert!(!recorded);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (due, due_in) = publish_state(&app.pool, command).await;
    assert!(!due && due_in < 61.0, "nothing changed: {due} {due_in}");
}

/// A replica that builds on `db_url` with `extra` but does not serve: its relay is driven by hand.
async fn idle_replica(db_url: &str, extra: &str) -> sweeper::app::Application {
    let text = config_toml(db_url, 0, extra, &qstash_policy(5));
    sweeper::app::Application::build(sweeper::settings::Config::from_toml(&text).unwrap())
        .await
        .unwrap()
}

async fn lease_owner(pool: &sqlx::PgPool) -> Option<uuid::Uuid> {
    sqlx::query_scalar("select lease_owner from sweeper.job_leases where job = 'relay:qstash'")
        .fetch_optional(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn one_replica_relays_at_a_time_and_another_takes_over_on_shutdown_or_expiry() {
    use sweeper::app::relay::{Round, relay_round};
    use sweeper::transport::Publisher;
    let qstash = Qstash::start().await;
    let port = free_port();
    let extra = qstash_toml(port, &qstash.url(), r#"["consume"]"#);
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: qstash_policy(5),
        extra_toml: extra.clone(),
        ..Default::default()
    })
    .await;
    let others = extra.replace(&format!("127.0.0.1:{port}\"\n["), "127.0.0.1:0\"\n[");
    let b = idle_replica(&app.db.url, &others).await;
    let publisher = |a: &sweeper::app::Application| {
        Publisher::Qstash(
            sweeper::transport::qstash::Publisher::new(a.state().config.qstash.as_ref().unwrap())
                .unwrap(),
        )
    };
    let pb = publisher(&b);
    // A's relay took the lease at start; B stands by, even with commands due.
    let started = std::time::Instant::now();
    while lease_owner(&app.pool).await != Some(app.state.replica_id) {
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    seed_mixed(&app.pool, 20, at("2026-09-01T02:00:00Z")).await;
    let (_, run) = app.trigger("ticket-retention", "").await;
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_terminal(&run_id).await;
    assert_eq!(relay_round(&b.state(), &pb).await.unwrap(), Round::Standby);

    // A shuts down cleanly and releases the lease: B takes over at once.
    let (db, pool) = app.stop().await;
    assert!(matches!(
        relay_round(&b.state(), &pb).await.unwrap(),
        Round::Published { .. }
    ));
    assert_eq!(lease_owner(&pool).await, Some(b.state().replica_id));

    // B stops renewing without releasing (a crash): C stands by until the lease expires.
    let c = idle_replica(&db.url, &others).await;
    let pc = publisher(&c);
    assert_eq!(relay_round(&c.state(), &pc).await.unwrap(), Round::Standby);
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("select sweeper.now()")
        .fetch_one(&pool)
        .await
        .unwrap();
    set_clock(&pool, now + chrono::TimeDelta::seconds(61)).await;
    assert!(matches!(
        relay_round(&c.state(), &pc).await.unwrap(),
        Round::Published { .. }
    ));
    assert_eq!(lease_owner(&pool).await, Some(c.state().replica_id));
    drop((b, c, db));
}
