//! Hostile load on the front door: `/consume` sheds what it cannot take instead of queueing it.

use std::collections::HashMap;

use crate::common::*;

#[tokio::test]
async fn a_thousand_concurrent_deliveries_against_a_small_limit_shed_some_and_lose_none() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        extra_toml: "[consume]\nmax_in_flight = 4".into(),
        ..Default::default()
    })
    .await;
    let eligible = seed_mixed(&app.pool, 300, at("2026-09-01T02:00:00Z")).await;
    let (status, run) = app.trigger("ticket-retention", "").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    let commands = app.command_ids(&run_id).await;
    assert!(commands.len() >= 10);

    let token = app.token(&["consume"]);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..1_000 {
        let command_id = commands[i % commands.len()].clone();
        let (client, token, base) = (client.clone(), token.clone(), app.base.clone());
        tasks.push(tokio::spawn(async move {
            let r = client
                .post(format!("{base}/consume"))
                .bearer_auth(token)
                .json(&serde_json::json!({ "command_id": command_id }))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let retry_after = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            let content_type = r
                .headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap().to_string());
            let body: serde_json::Value = r.json().await.unwrap_or_default();
            (status, retry_after, content_type, body)
        }));
    }
    let mut by_status: HashMap<u16, usize> = HashMap::new();
    for t in tasks {
        let (status, retry_after, content_type, body) = t.await.unwrap();
        *by_status.entry(status).or_default() += 1;
        match status {
            200 => {}
            503 => {
                assert_eq!(retry_after.as_deref(), Some("5"), "{body}");
                assert_eq!(content_type.as_deref(), Some("application/problem+json"));
                assert_eq!(body["type"], "urn:sweeper:problem:overloaded", "{body}");
            }
            other => panic!("unexpected status {other}: {body}"),
        }
    }
    assert!(
        by_status.get(&503).copied().unwrap_or(0) > 0,
        "{by_status:?}"
    );
    assert!(
        by_status.get(&200).copied().unwrap_or(0) > 0,
        "{by_status:?}"
    );

    // None lost: the queue's redelivery (here: one more delivery each) completes every command.
    for c in &commands {
        assert_eq!(app.consume(c).await.status(), 200, "{c}");
    }
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"].as_i64().unwrap(), eligible.len() as i64);
    let dup: i64 = sqlx::query_scalar(
        "select count(*) from (select item_key from sweeper.audit group by item_key having count(*) > 1) d",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(dup, 0, "one outcome per item");
    let metrics = app
        .client
        .get(format!("{}/metrics", app.base))
        .bearer_auth(app.ops_token())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("sweeper_consume_shed_total"), "{metrics}");
    eprintln!("1000 concurrent deliveries, max_in_flight 4: {by_status:?}");
}
