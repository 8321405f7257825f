//! Rows that are kept are never invisible: NULL timestamps and NULL keys are reported as held on
//! every run and in a metric; every documented series is exported from start-up.

use serde_json::Value;

use crate::common::*;

async fn metrics(app: &TestApp) -> String {
    reqwest::get(format!("{}/metrics", app.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn rows_with_a_null_timestamp_are_reported_held_on_every_run() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: ticket_policy(100),
        workers: 1,
        extra_toml: "[planning]\npage_rows = 300".into(),
        ..Default::default()
    })
    .await;
    let old = at("2026-01-01T00:00:00Z");
    let rows: Vec<Ticket> = (1..=2_000)
        .map(|id| {
            let closed = (id % 2 == 0).then_some(old);
            (id, Some("closed"), Some(false), closed)
        })
        .collect();
    insert_tickets(&app.pool, &rows).await;
    for (window, now) in [
        ("2026-09-01", "2026-09-01T02:01:00Z"),
        ("2026-09-02", "2026-09-02T02:01:00Z"),
    ] {
        set_clock(&app.pool, at(now)).await;
        let (status, run) = app
            .trigger("ticket-retention", &format!("?window={window}"))
            .await;
        assert_eq!(status, 202, "{run}");
        let run = app.wait_terminal(run["run_id"].as_str().unwrap()).await;
        assert_eq!(run["status"], "completed", "{run}");
        assert_eq!(run["held_at_planning"]["null_timestamp"], 1_000, "{run}");
        assert_eq!(run["remaining_eligible"], 0);
        let text = metrics(&app).await;
        assert!(
            text.lines()
                .any(|l| l.starts_with("sweeper_held_at_planning{")
                    && l.contains("policy=\"ticket-retention\"")
                    && l.contains("reason=\"null_timestamp\"")
                    && l.ends_with(" 1000")),
            "{text}"
        );
    }
    // The first run deleted the 1,000 with a timestamp; the NULL ones are all still there.
    let (left, nulls): (i64, i64) = sqlx::query_as(
        "select count(*), count(*) filter (where closed_at is null) from demo.tickets",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((left, nulls), (1_000, 1_000));
}

#[tokio::test]
async fn rows_with_a_null_key_are_reported_held_never_an_unexplained_remainder() {
    let app = TestApp::spawn(Spawn {
        setup_sql: "create schema app;
                    create table app.nk (k text unique, at timestamptz not null)",
        policies: r#"
[[policy]]
name = "nk"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "app.nk", key = "k", timestamp = "at" }
retain_for = "1d"
"#
        .into(),
        now: Some(at("2026-09-01T02:01:00Z")),
        workers: 1,
        ..Default::default()
    })
    .await;
    sqlx::query(
        "insert into app.nk values (null, '2026-01-01Z'), (null, '2026-01-02Z'), ('a', '2026-01-01Z'),
                                   (null, '2026-08-31T12:00:00Z')",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (status, run) = app.trigger("nk", "").await;
    assert_eq!(status, 202, "{run}");
    let run: Value = app.wait_terminal(run["run_id"].as_str().unwrap()).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 1, "{run}");
    assert_eq!(run["remaining_eligible"], 0, "{run}");
    assert_eq!(run["held_at_planning"]["null_key"], 2, "{run}");
    let left: i64 = sqlx::query_scalar("select count(*) from app.nk where k is null")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, 3);
}

/// `sweeper_run_execution_seconds` counts from a run's creation and tells a live run from a
/// backfill (a window older than the latest tick minus the early tolerance); the window-based
/// `sweeper_run_duration_seconds` keeps its meaning. A policy of its own, so the process-wide
/// series of other tests do not mix in.
#[tokio::test]
async fn run_execution_seconds_tells_live_runs_from_backfills() {
    let policy = crate::common::ticket_policy(10).replace("ticket-retention", "execution-metric");
    let app = crate::common::TestApp::spawn(crate::common::Spawn {
        now: Some(crate::common::at("2026-09-01T02:01:00Z")),
        policies: policy,
        ..Default::default()
    })
    .await;
    crate::common::seed_mixed(&app.pool, 30, crate::common::at("2026-09-01T02:00:00Z")).await;
    for window in ["2026-09-01T02:00:00Z", "2026-08-29T02:00:00Z"] {
        let (status, run) = app
            .trigger("execution-metric", &format!("?window={window}"))
            .await;
        assert!(status == 202 || status == 200, "{run}");
        let run_id = run["run_id"].as_str().unwrap().to_string();
        app.wait_planned(&run_id).await;
        app.drain().await;
        app.wait_terminal(&run_id).await;
    }
    let text = app.api.metrics().await;
    let count = |labels: &str| -> f64 {
        let prefix = format!("sweeper_run_execution_seconds_count{{{labels}}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"))
            .parse()
            .unwrap()
    };
    assert_eq!(count("policy=\"execution-metric\",trigger=\"live\""), 1.0);
    assert_eq!(
        count("policy=\"execution-metric\",trigger=\"backfill\""),
        1.0
    );
    // The backfill's window-based duration is days; its execution seconds are not.
    let sum = |family: &str, labels: &str| -> f64 {
        let prefix = format!("{family}_sum{{{labels}}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"))
            .parse()
            .unwrap()
    };
    assert!(
        sum(
            "sweeper_run_duration_seconds",
            "policy=\"execution-metric\""
        ) > 3.0 * 86_400.0
    );
    assert!(
        sum(
            "sweeper_run_execution_seconds",
            "policy=\"execution-metric\",trigger=\"backfill\""
        ) < 3_600.0
    );
}
