//! Push deliveries that can never succeed are acknowledged, never redelivered for ever: an
//! unknown command, a body over the envelope limit (quarantined with its size, SHA-256 and
//! first 8 KiB). A declared Content-Length over the limit is refused at once from the header.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;
use crate::emulator::emulator;

const QUERY_TOKEN_TOML: &str =
    "[[auth.query_token]]\nsubject = \"pubsub-push\"\ntoken_env = \"CARGO_PKG_DESCRIPTION\"\n";

fn query_token() -> String {
    let secret = std::env::var("CARGO_PKG_DESCRIPTION").unwrap();
    url::form_urlencoded::byte_serialize(secret.as_bytes()).collect()
}

async fn push_app() -> TestApp {
    TestApp::spawn(Spawn {
        extra_toml: QUERY_TOKEN_TOML.into(),
        ..Default::default()
    })
    .await
}

#[tokio::test]
async fn an_authenticated_push_that_can_never_succeed_is_acknowledged_and_recorded() {
    let app = push_app().await;
    let url = format!("{}/consume?token={}", app.base, query_token());
    // An unknown command of an unknown run: acknowledged, nothing recorded.
    let r = app
        .client
        .post(&url)
        .json(&json!({"command_id": "nobody:2026-01-01T00:00:00Z:0"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["result"], "unknown_command", "{body}");
    // The same from a generic sender keeps plain HTTP semantics.
    let r = app.consume("nobody:2026-01-01T00:00:00Z:0").await;
    assert_eq!(r.status, 404);
    let metrics = reqwest::get(format!("{}/metrics", app.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("sweeper_consume_unknown_commands_total"),
        "{metrics}"
    );

    // A 300 KB body: read, hashed, quarantined with its size and first 8 KiB, acknowledged.
    let big: Vec<u8> = format!(
        "{{\"command_id\": \"x\", \"pad\": \"{}\"}}",
        "p".repeat(300_000)
    )
    .into_bytes();
    let r = app
        .client
        .post(&url)
        .body(big.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["result"], "quarantined_envelope", "{body}");
    let id = body["dead_letter_id"].as_i64().unwrap();
    let dl = app.get_json(&format!("/dead-letters/{id}")).await;
    assert_eq!(dl["kind"], "envelope");
    assert_eq!(dl["raw_size"], big.len() as i64, "{dl}");
    assert_eq!(dl["raw_sha256"], hex::encode(Sha256::digest(&big)));
    assert_eq!(
        dl["raw_body"].as_str().unwrap().as_bytes(),
        &big[..8 * 1024]
    );
    // Delivered again: the same open dead letter counts it.
    let r = app.client.post(&url).body(big).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let dl = app.get_json(&format!("/dead-letters/{id}")).await;
    assert_eq!(dl["failures"], 2);

    // Past the hard cap (10 MiB), streamed without a length: 413, nothing recorded.
    let addr = app.base.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let path = format!("/consume?token={}", query_token());
    s.write_all(
        format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\ntransfer-encoding: chunked\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let chunk = format!("{:x}\r\n{}\r\n", 1024 * 1024, " ".repeat(1024 * 1024));
    for _ in 0..11 {
        if s.write_all(chunk.as_bytes()).await.is_err() {
            break;
        }
    }
    let mut answer = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut answer))
        .await
        .unwrap()
        .unwrap_or(0);
    let status = String::from_utf8_lossy(&answer[..n]).into_owned();
    assert!(status.starts_with("HTTP/1.1 413"), "{status}");
    let envelopes: i64 =
        sqlx::query_scalar("select count(*) from sweeper.dead_letters where kind = 'envelope'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(envelopes, 1);
}

/// Sends only a request head declaring `length` bytes of body, and returns the status line and
/// how long the answer took.
async fn head_only(base: &str, path: &str, auth: &str, length: usize) -> (String, Duration) {
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\n{auth}content-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("no answer within 5 s")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    (
        text.lines().next().unwrap_or("").to_string(),
        started.elapsed(),
    )
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_refused_at_once() {
    let app = push_app().await;
    let consume = format!("authorization: Bearer {}\r\n", app.token(&["consume"]));
    let ops = format!("authorization: Bearer {}\r\n", app.ops_token());
    let push_path = format!("/consume?token={}", query_token());
    for (what, path, auth, length) in [
        (
            "generic envelope",
            "/consume".to_string(),
            consume.as_str(),
            64 * 1024 + 1,
        ),
        (
            "authenticated push",
            push_path.clone(),
            "",
            10 * 1024 * 1024 + 1,
        ),
        (
            "unauthenticated",
            "/consume".to_string(),
            "",
            11 * 1024 * 1024,
        ),
        (
            "an ops endpoint",
            "/policies/ticket-retention/suspend".to_string(),
            ops.as_str(),
            16 * 1024 + 1,
        ),
    ] {
        let (status, took) = head_only(&app.base, &path, auth, length).await;
        assert!(
            status.contains(" 413 ") || (auth.is_empty() && status.contains(" 401 ")),
            "{what}: {status}"
        );
        assert!(took < Duration::from_secs(2), "{what}: {took:?}");
    }
    // Within the push limit, a push declaring 1 MiB is read (and waits for its body).
    let addr = app.base.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(
        format!(
            "POST {push_path} HTTP/1.1\r\nhost: {addr}\r\ncontent-length: {}\r\n\r\n",
            1024 * 1024
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = [0u8; 64];
    assert!(
        tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf))
            .await
            .is_err(),
        "the server answered before the body arrived"
    );
}

/// A loopback forwarder in front of `/consume` that records the status of every push, so a
/// test can see what the Pub/Sub emulator was answered and how often it delivered.
async fn recording_forwarder(target: String) -> (String, Arc<Mutex<Vec<u16>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let app = axum::Router::new().route(
        "/consume",
        axum::routing::post(
            move |q: axum::extract::RawQuery,
                  headers: axum::http::HeaderMap,
                  body: axum::body::Bytes| {
                let (target, s) = (target.clone(), s.clone());
                async move {
                    let mut r = reqwest::Client::new()
                        .post(format!("{target}/consume?{}", q.0.unwrap_or_default()))
                        .body(body);
                    if let Some(ct) = headers.get("content-type") {
                        r = r.header("content-type", ct);
                    }
                    let resp = r.send().await.unwrap();
                    let status = resp.status().as_u16();
                    s.lock().unwrap().push(status);
                    (
                        axum::http::StatusCode::from_u16(status).unwrap(),
                        resp.bytes().await.unwrap(),
                    )
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

#[tokio::test]
async fn the_pubsub_emulator_delivers_an_unknown_command_and_a_300_kb_message_once() {
    let em = emulator().await;
    let app = push_app().await;
    let (forwarder, seen) = recording_forwarder(app.base.clone()).await;
    crate::emulator::subscribe(&em, &forwarder, 10).await;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let unknown = json!({"command_id": "nobody:2026-01-01T00:00:00Z:0"}).to_string();
    let big = format!("{{\"pad\": \"{}\"}}", "p".repeat(300_000));
    let r = reqwest::Client::new()
        .post(format!(
            "http://{}/v1/projects/test/topics/sweeper:publish",
            em.host
        ))
        .json(&json!({"messages": [{"data": b64(unknown.as_bytes())},
                                   {"data": b64(big.as_bytes())}]}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let started = Instant::now();
    while seen.lock().unwrap().len() < 2 {
        assert!(started.elapsed() < Duration::from_secs(30), "not pushed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Acknowledged: the emulator does not come back with either of them.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(*seen.lock().unwrap(), vec![200, 200]);
    let (size, sha): (Option<i64>, Option<String>) = sqlx::query_as(
        "select raw_size, raw_sha256 from sweeper.dead_letters where kind = 'envelope'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    // The wrapped push carries the message base64-encoded: over 64 KiB as delivered.
    assert!(size.unwrap() > 400_000, "{size:?}");
    assert_eq!(sha.unwrap().len(), 64);
}
