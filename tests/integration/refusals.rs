//! Refused requests in sweeper's words: every malformed query or path parameter is a 400
//! problem naming the parameter and what it accepts; an item key over 4 KiB is our own 414; a
//! request line over the HTTP server's limit is its bare 414. Nothing refused changes the ledger.

use serde_json::Value;

use crate::common::*;

async fn get(app: &TestApp, path: &str) -> (u16, Option<String>, Value) {
    let r = app
        .client
        .get(format!("{}{path}", app.base))
        .bearer_auth(app.ops_token())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let content_type = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string());
    (status, content_type, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn malformed_parameters_are_refused_by_name_in_our_words() {
    let app = TestApp::spawn(Spawn::default()).await;
    let item = "/policies/ticket-retention/items/7";
    let cases: Vec<(String, &str)> = vec![
        (
            "/runs?limit=abc".into(),
            "`limit` must be an integer from 1 to 500",
        ),
        (
            "/runs?limit=99999999999999999999".into(),
            "`limit` must be an integer",
        ),
        ("/runs?limit=".into(), "`limit` must be an integer"),
        (
            "/runs?limit=5&limit=6".into(),
            "`limit` is given more than once",
        ),
        (
            "/runs?status=running&status=running".into(),
            "`status` is given more than once",
        ),
        (
            "/runs?sort=window".into(),
            "unknown parameter `sort`: this endpoint accepts `policy`, `status`, `limit`",
        ),
        ("/runs?policy=%FF".into(), "`policy` is not valid UTF-8"),
        (
            "/operator-log?before=x".into(),
            "`before` must be a value returned as `next_before`",
        ),
        (
            "/operator-log?limit=-".into(),
            "`limit` must be an integer from 1 to 1000",
        ),
        ("/operator-log?x=1".into(), "unknown parameter `x`"),
        ("/dead-letters?before=1.5".into(), "`before` must be"),
        (
            "/runs/ticket-retention:2026-11-01T02:00:00Z/items?limit=1e3".into(),
            "`limit` must be an integer from 1 to 1000",
        ),
        (
            format!("{item}?limit=ten"),
            "`limit` must be an integer from 1 to 1000",
        ),
        (
            format!("{item}?cursor=1&cursor=2"),
            "`cursor` is given more than once",
        ),
        (
            format!("{item}?page=2"),
            "unknown parameter `page`: this endpoint accepts `cursor`, `limit`",
        ),
        (
            "/policies/ticket-retention/windows?limit=many".into(),
            "`limit` must be an integer",
        ),
        (
            "/policies/ticket-retention/items/%FF%FE".into(),
            "`key` is not valid UTF-8 after percent-decoding",
        ),
        (
            "/dead-letters/abc".into(),
            "`id` must be a dead letter id, an integer",
        ),
        (
            "/dead-letters/99999999999999999999".into(),
            "`id` must be a dead letter id",
        ),
        ("/runs/%C0%AF".into(), "`run_id` is not valid UTF-8"),
        // Endpoints that take no parameters refuse any.
        (
            "/runs/ticket-retention:2026-11-01T02:00:00Z?bogus=1".into(),
            "unknown parameter `bogus`: this endpoint takes no query parameters",
        ),
        (
            "/policies?limit=5".into(),
            "this endpoint takes no query parameters",
        ),
        ("/governor?x".into(), "unknown parameter `x`"),
        (
            "/dead-letters/1?verbose=true".into(),
            "unknown parameter `verbose`",
        ),
    ];
    for (path, says) in cases {
        let (status, content_type, body) = get(&app, &path).await;
        assert_eq!(status, 400, "{path}: {body}");
        assert_eq!(
            content_type.as_deref(),
            Some("application/problem+json"),
            "{path}"
        );
        let detail = body["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(says), "{path}: {detail}");
        for library in [
            "Failed to deserialize",
            "Invalid URL",
            "invalid digit",
            "Cannot parse",
            "number too large",
        ] {
            assert!(
                !detail.contains(library),
                "{path} leaks `{library}`: {detail}"
            );
        }
    }
    // The trigger's query too, and a refused trigger records nothing.
    for query in [
        "?dry_run=maybe",
        "?window=2026-11-01T02:00:00Z&window=2026-11-02T02:00:00Z",
        "?windw=x",
    ] {
        let r = app
            .post(
                &format!("/trigger/ticket-retention{query}"),
                Some(&app.ops_token()),
            )
            .await;
        assert_eq!(r.status(), 400, "{query}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(
            body["type"], "urn:sweeper:problem:bad-query",
            "{query}: {body}"
        );
    }
    // Operator acts too, and a refused act logs nothing; a path id followed by more path names
    // the parameter.
    for (path, says) in [
        (
            "/policies/ticket-retention/suspend?x=1",
            "unknown parameter `x`",
        ),
        (
            "/dead-letters/abc/redrive",
            "`id` must be a dead letter id, an integer",
        ),
        (
            "/dead-letters/1.5/abandon",
            "`id` must be a dead letter id, an integer",
        ),
    ] {
        let r = app
            .client
            .post(format!("{}{path}", app.base))
            .bearer_auth(app.ops_token())
            .json(&serde_json::json!({"reason": "probe"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{path}");
        let body: Value = r.json().await.unwrap();
        assert!(
            body["detail"].as_str().unwrap().contains(says),
            "{path}: {body}"
        );
    }
    let runs: i64 = sqlx::query_scalar("select count(*) from sweeper.runs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(runs, 0);
    let acts: i64 = sqlx::query_scalar("select count(*) from sweeper.operator_log")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(acts, 0);
}

#[tokio::test]
async fn a_key_over_four_kib_is_our_414_and_a_request_line_over_the_server_limit_its_own() {
    let app = TestApp::spawn(Spawn::default()).await;
    let at_limit = "7".repeat(4_096);
    let (status, _, body) = get(
        &app,
        &format!("/policies/ticket-retention/items/{at_limit}"),
    )
    .await;
    // 4,096 digits is no bigint, but it is read: the refusal is about its type.
    assert_eq!(
        (status, body["type"].as_str()),
        (400, Some("urn:sweeper:problem:bad-key")),
        "{body}"
    );
    // 4,097 bytes after percent-decoding (each %41 is one byte).
    let over = "%41".repeat(4_097);
    let (status, content_type, body) =
        get(&app, &format!("/policies/ticket-retention/items/{over}")).await;
    assert_eq!(status, 414, "{body}");
    assert_eq!(content_type.as_deref(), Some("application/problem+json"));
    assert_eq!(body["type"], "urn:sweeper:problem:key-too-long");
    assert!(
        body["detail"].as_str().unwrap().contains("at most 4096"),
        "{body}"
    );
    // Over 64 KiB the request line never reaches a handler: hyper's bare 414, as documented
    // (sent over a plain socket: HTTP clients refuse to build such a URI).
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = app.base.trim_start_matches("http://").to_string();
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let huge = "7".repeat(70_000);
    let request = format!(
        "GET /policies/ticket-retention/items/{huge} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    );
    // The server may answer and close before it has read every byte.
    let _ = socket.write_all(request.as_bytes()).await;
    let mut answer = Vec::new();
    let _ = socket.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 414"),
        "{}",
        &answer[..answer.len().min(200)]
    );
}
