//! `POST /trigger/{policy}`: one window, one run; windows, early triggers, backfills, errors.

use crate::common::*;
use serde_json::Value;
use sweeper::app::worker::{WorkerStep, run_one_command};

#[tokio::test]
async fn concurrent_triggers_for_one_window_create_one_run_planned_once() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:00:30Z")),
        ..Default::default()
    })
    .await;
    let eligible = seed_mixed(&app.pool, 95, at("2026-09-01T02:00:00Z")).await;

    let token = app.token(&["trigger:ticket-retention"]);
    let mut calls = Vec::new();
    for _ in 0..20 {
        let (client, base, token) = (app.client.clone(), app.base.clone(), token.clone());
        calls.push(tokio::spawn(async move {
            let r = client
                .post(format!("{base}/trigger/ticket-retention"))
                .bearer_auth(token)
                .header("X-CloudScheduler-ScheduleTime", "2026-09-01T02:00:00Z")
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let location = r
                .headers()
                .get("location")
                .map(|v| v.to_str().unwrap().to_string());
            let body: Value = r.json().await.unwrap();
            (status, location, body)
        }));
    }
    let mut created = 0;
    for c in calls {
        let (status, location, body) = c.await.unwrap();
        assert_eq!(body["run_id"], "ticket-retention:2026-09-01T02:00:00Z");
        assert!(body.get("held").is_some_and(Value::is_null), "{body}");
        assert_eq!(body["cutoff"], "2026-06-03T02:00:00Z");
        match status {
            202 => {
                created += 1;
                assert_eq!(
                    location.as_deref(),
                    Some("/runs/ticket-retention:2026-09-01T02:00:00Z")
                );
            }
            200 => {}
            other => panic!("unexpected status {other}: {body}"),
        }
    }
    assert_eq!(created, 1, "exactly one trigger creates the run");
    let runs: i64 = sqlx::query_scalar("select count(*) from sweeper.runs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(runs, 1);

    let run_id = "ticket-retention:2026-09-01T02:00:00Z";
    app.wait_planned(run_id).await;
    let planned: Vec<i64> = sqlx::query_scalar(
        "select k::bigint from sweeper.commands, unnest(item_keys) k where run_id = $1 order by 1",
    )
    .bind(run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(planned, eligible, "every eligible key planned exactly once");

    // The same daily window, 55 minutes later, without the header (a late scheduler retry), and
    // from a workflow naming only the date: the same run, 200.
    set_clock(&app.pool, at("2026-09-01T02:55:00Z")).await;
    let (status, body) = app.trigger("ticket-retention", "").await;
    assert_eq!((status, body["run_id"].as_str()), (200, Some(run_id)));
    let (status, body) = app.trigger("ticket-retention", "?window=2026-09-01").await;
    assert_eq!((status, body["run_id"].as_str()), (200, Some(run_id)));
    let commands: i64 = sqlx::query_scalar("select count(*) from sweeper.commands")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        commands as usize,
        eligible.len().div_ceil(10),
        "planned once"
    );
}

#[tokio::test]
async fn early_trigger_creates_the_coming_ticks_run_and_deletes_nothing_before_it() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T01:59:58Z")),
        ..Default::default()
    })
    .await;
    let eligible = seed_mixed(&app.pool, 30, at("2026-09-01T02:00:00Z")).await;
    let (status, run) = app.trigger("ticket-retention", "").await;
    assert_eq!(status, 202, "{run}");
    assert_eq!(run["window"], "2026-09-01T02:00:00Z");
    let run_id = run["run_id"].as_str().unwrap();
    app.wait_planned(run_id).await;

    // Before the tick: the queue claims nothing and a push delivery is told to come back.
    assert!(matches!(
        run_one_command(&app.state).await.unwrap(),
        WorkerStep::Idle
    ));
    let first = app.command_ids(run_id).await[0].clone();
    let r = app.consume(&first).await;
    assert_eq!(r.status, 503);
    let retry_after: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=3).contains(&retry_after), "Retry-After {retry_after}");
    assert_eq!(
        app.ticket_ids().await.len(),
        30,
        "nothing deleted before the tick"
    );
    assert!(app.audit(run_id).await.is_empty());

    set_clock(&app.pool, at("2026-09-01T02:00:01Z")).await;
    assert!(app.drain().await > 0);
    let run = app.wait_terminal(run_id).await;
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    assert_eq!(run["remaining_eligible"], 0);
}

#[tokio::test]
async fn windows_must_be_ticks_not_in_the_future_and_old_ones_need_ops_write() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-03T12:00:00Z")),
        ..Default::default()
    })
    .await;
    let trigger_only = app.token(&["trigger:ticket-retention"]);
    let cases = [
        ("?window=2026-09-03T02:30:00Z", 400, "bad-window"),
        ("?window=2026-09-04T02:00:00Z", 400, "bad-window"),
        ("?window=yesterday", 400, "bad-window"),
        ("?window=2026-09-01T02:00:00Z", 403, "backfill-forbidden"),
    ];
    for (query, status, slug) in cases {
        let r = app
            .post(
                &format!("/trigger/ticket-retention{query}"),
                Some(&trigger_only),
            )
            .await;
        assert_eq!(r.status().as_u16(), status, "{query}");
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        let body: Value = r.json().await.unwrap();
        assert_eq!(
            body["type"],
            format!("urn:sweeper:problem:{slug}"),
            "{query}: {body}"
        );
        assert!(body["detail"].as_str().unwrap().len() > 10);
    }
    let runs: i64 = sqlx::query_scalar("select count(*) from sweeper.runs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(runs, 0, "refused triggers create nothing");

    // The same backfill with ops:write is allowed; a sub-second header is normalized.
    let (status, run) = app
        .trigger("ticket-retention", "?window=2026-09-01T02:00:00Z")
        .await;
    assert_eq!(status, 202);
    let r = app
        .client
        .post(format!("{}/trigger/ticket-retention", app.base))
        .bearer_auth(&trigger_only)
        .header(
            "X-CloudScheduler-ScheduleTime",
            "2026-09-03T02:00:00.000+00:00",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let latest: Value = r.json().await.unwrap();
    assert_eq!(latest["run_id"], "ticket-retention:2026-09-03T02:00:00Z");
    assert_ne!(run["run_id"], latest["run_id"]);
}

#[tokio::test]
async fn authentication_and_lookup_failures_are_problem_json() {
    let app = TestApp::spawn(Spawn::default()).await;
    let good = app.token(&["trigger:*"]);
    // Hand-signed HS256 tokens with kid k2: (audience, exp offset in seconds, secret).
    let sign = |aud: &str, exp_in: i64, secret: &[u8]| {
        let claims = serde_json::json!({"sub": "x", "iss": "sweeper-test", "aud": aud,
                                        "exp": chrono::Utc::now().timestamp() + exp_in,
                                        "scope": "trigger:*"});
        let mut h = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256);
        h.kid = Some("k2".into());
        let key = jsonwebtoken::EncodingKey::from_secret(secret).unwrap();
        jsonwebtoken::encode(&h, &claims, &key).unwrap()
    };
    // Expired an hour ago, signed with the right key.
    let expired = sign("sweeper", -3600, SECRET.as_bytes());
    let wrong_signature = sign(
        "sweeper",
        3600,
        b"not-the-secret-not-the-secret-not-the-secret",
    );
    let wrong_audience = sign("someone-else", 3600, SECRET.as_bytes());
    let cases: Vec<(&str, Option<String>, u16, &str)> = vec![
        (
            "/trigger/no-such-policy",
            Some(good.clone()),
            404,
            "unknown-policy",
        ),
        ("/trigger/ticket-retention", None, 401, "unauthenticated"),
        (
            "/trigger/ticket-retention",
            Some(expired),
            401,
            "unauthenticated",
        ),
        (
            "/trigger/ticket-retention",
            Some(wrong_signature),
            401,
            "unauthenticated",
        ),
        (
            "/trigger/ticket-retention",
            Some(wrong_audience),
            401,
            "unauthenticated",
        ),
        (
            "/trigger/ticket-retention",
            Some("not.a.jwt".into()),
            401,
            "unauthenticated",
        ),
        (
            "/trigger/ticket-retention",
            Some(app.token(&["trigger:other", "ops:read"])),
            403,
            "forbidden",
        ),
        ("/consume", Some(app.token(&["ops:read"])), 403, "forbidden"),
    ];
    for (path, token, status, slug) in cases {
        let r = app.post(path, token.as_deref()).await;
        assert_eq!(r.status().as_u16(), status, "{path}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{path}"
        );
        assert!(r.headers().contains_key("x-request-id"));
        let body: Value = r.json().await.unwrap();
        assert_eq!(
            body["type"],
            format!("urn:sweeper:problem:{slug}"),
            "{path}: {body}"
        );
        assert_eq!(body["status"], status);
    }
    let runs: i64 = sqlx::query_scalar("select count(*) from sweeper.runs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(runs, 0);
}

#[tokio::test]
async fn a_repeat_trigger_while_suspended_answers_the_existing_run_held() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:00:30Z")),
        ..Default::default()
    })
    .await;
    // Rows to delete, and no worker: the run stays open.
    seed_mixed(&app.pool, 20, at("2026-09-01T02:00:00Z")).await;
    let (status, run) = app
        .trigger("ticket-retention", "?window=2026-09-01T02:00:00Z")
        .await;
    assert_eq!(status, 202, "{run}");
    app.api.suspend("ticket-retention", "maintenance").await;
    // The window's run exists: the answer is that run, and it says what holds it.
    let (status, again) = app
        .trigger("ticket-retention", "?window=2026-09-01T02:00:00Z")
        .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["run_id"], run["run_id"], "{again}");
    assert_eq!(again["held"]["kind"], "suspended", "{again}");
    // A window without a run: nothing is created.
    let (status, none) = app
        .trigger("ticket-retention", "?window=2026-08-31T02:00:00Z")
        .await;
    assert_eq!(status, 200, "{none}");
    assert_eq!(none["state"], "suspended", "{none}");
    let runs: i64 = sqlx::query_scalar("select count(*) from sweeper.runs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(runs, 1);
}
