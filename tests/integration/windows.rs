//! Missed windows: `GET /policies/{policy}/windows` lists every tick the schedule expected with
//! its run, or `missed` / `suspended` / `due`; `POST /policies/{policy}/backfill` creates the
//! missed runs, each with its own window's cutoff, and its digests carry that week's key.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};

use crate::common::*;
use crate::stages::{SETUP, items, policies};
use crate::standin::{StandIn, ok};

const W1: &str = "2026-09-07T09:00:00Z";
const W2: &str = "2026-09-14T09:00:00Z";
const W3: &str = "2026-09-21T09:00:00Z";

/// (window, status) of each listed tick.
fn statuses(page: &Value) -> Vec<(String, String)> {
    page["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["window"].as_str().unwrap().to_string(),
                t["status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(w, s)| (w.to_string(), s.to_string()))
        .collect()
}

fn missed_metric(metrics: &str, policy: &str) -> String {
    let series = format!("sweeper_missed_windows{{policy=\"{policy}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or("absent")
        .to_string()
}

/// A digest API that answers every call, and an app whose digest and cleanup of week 1
/// (`2026-09-07T09:00:00Z`) both completed.
async fn week_one_done() -> (StandIn, TestApp) {
    let api = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let app = TestApp::spawn(Spawn {
        setup_sql: SETUP,
        now: Some(at("2026-09-07T09:01:00Z")),
        policies: policies(&api.url(), ""),
        workers: 2,
        ..Default::default()
    })
    .await;
    for p in ["support-digest", "support-digest-cleanup"] {
        let run = app.api.trigger_new(p, "").await;
        assert_eq!(app.wait_terminal(&run).await["status"], "completed");
    }
    (api, app)
}

#[tokio::test]
async fn a_skipped_week_shows_missed_and_its_backfill_uses_that_weeks_key_and_cutoff() {
    let (api, app) = week_one_done().await;
    assert_eq!(
        items(&app).await,
        14,
        "week 1 deleted what is older than 14 days"
    );

    // The scheduler skips week 2; week 3's digest arrives on time.
    set_clock(&app.pool, at("2026-09-21T09:01:00Z")).await;
    let page = app.api.windows("support-digest", "").await;
    assert_eq!(
        statuses(&page),
        pairs(&[(W1, "completed"), (W2, "missed"), (W3, "due")]),
        "{page}"
    );
    assert_eq!(page["missed"], 1);
    assert_eq!(page["next_from"], Value::Null);
    let run = app.api.trigger_new("support-digest", "").await;
    app.wait_terminal(&run).await;
    let metrics = app.api.metrics().await;
    assert_eq!(missed_metric(&metrics, "support-digest"), "1");
    assert_eq!(missed_metric(&metrics, "support-digest-cleanup"), "1");
    // Pages of one tick chain through next_from.
    let first = app.api.windows("support-digest", "?limit=1").await;
    assert_eq!(statuses(&first), pairs(&[(W1, "completed")]));
    assert_eq!(first["next_from"], W2);
    let second = app
        .api
        .windows("support-digest", &format!("?limit=1&from={W2}"))
        .await;
    assert_eq!(statuses(&second), pairs(&[(W2, "missed")]));

    // A range backfill creates week 2's run only; its digests carry week 2's key.
    let a = app
        .api
        .backfill("support-digest", json!({ "from": W1, "to": W3 }))
        .await;
    assert_eq!(a.status, 202, "{}", a.body);
    let created = &a.body["created"];
    assert_eq!(created.as_array().unwrap().len(), 1, "{}", a.body);
    assert_eq!(created[0]["window"], W2);
    assert_eq!(created[0]["run_id"], format!("support-digest:{W2}"));
    let skipped: BTreeSet<String> = a.body["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["window"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(skipped, BTreeSet::from([W1.to_string(), W3.to_string()]));
    let done = app.wait_terminal(&format!("support-digest:{W2}")).await;
    assert_eq!(done["status"], "completed", "{done}");
    let keys: Vec<String> = api
        .calls()
        .into_iter()
        .map(|c| c.idempotency_key.unwrap_or_default())
        .collect();
    for week in [W1, W2, W3] {
        let mut of_week: Vec<&String> = keys
            .iter()
            .filter(|k| k.starts_with(&format!("support-digest:{week}:")))
            .collect();
        of_week.sort();
        assert_eq!(
            of_week,
            vec![
                &format!("support-digest:{week}:1"),
                &format!("support-digest:{week}:2")
            ],
            "{keys:?}"
        );
    }
    assert_eq!(keys.len(), 6, "{keys:?}");
    // Backfilling again creates nothing.
    let again = app
        .api
        .backfill("support-digest", json!({ "from": W1, "to": W3 }))
        .await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body["created"], json!([]));

    // The cleanup of week 2, named, waits for week 2's digest (completed) and uses week 2's
    // cutoff: items older than 2026-08-31T09:00.
    let a = app
        .api
        .backfill("support-digest-cleanup", json!({ "windows": [W2] }))
        .await;
    assert_eq!(a.status, 202, "{}", a.body);
    assert_eq!(a.body["created"][0]["cutoff"], "2026-08-31T09:00:00Z");
    let c = app
        .wait_terminal(&format!("support-digest-cleanup:{W2}"))
        .await;
    assert_eq!(c["status"], "completed", "{c}");
    assert_eq!(c["deleted"], 7, "{c}");
    assert_eq!(items(&app).await, 7);
    let page = app.api.windows("support-digest-cleanup", "").await;
    assert_eq!(
        statuses(&page),
        pairs(&[(W1, "completed"), (W2, "completed"), (W3, "due")])
    );
    let metrics = app.api.metrics().await;
    assert_eq!(missed_metric(&metrics, "support-digest"), "0");
    let log: Vec<(String, String)> = sqlx::query_as(
        "select target, detail->>'windows' from sweeper.operator_log
          where action = 'backfill' order by entry_id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        log,
        vec![
            ("policy:support-digest".into(), format!("[\"{W2}\"]")),
            (
                "policy:support-digest-cleanup".into(),
                format!("[\"{W2}\"]")
            ),
        ]
    );
}

#[tokio::test]
async fn a_week_skipped_while_suspended_is_backfilled_only_when_named() {
    let (_api, app) = week_one_done().await;
    app.api
        .suspend("support-digest", "the desk is closed next week")
        .await;
    set_clock(&app.pool, at("2026-09-14T11:00:00Z")).await;
    // Suspended: a backfill is refused and creates nothing.
    let a = app
        .api
        .backfill("support-digest", json!({ "windows": [W2] }))
        .await;
    assert_eq!(a.status, 409, "{}", a.body);
    app.api.resume("support-digest", "the desk is open").await;
    let page = app.api.windows("support-digest", "").await;
    assert_eq!(
        statuses(&page),
        pairs(&[(W1, "completed"), (W2, "suspended")]),
        "{page}"
    );
    assert_eq!(page["missed"], 0);

    // A range leaves the suspended week alone.
    let a = app
        .api
        .backfill("support-digest", json!({ "from": W1, "to": W2 }))
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["skipped"][1]["status"], "suspended", "{}", a.body);

    // Bad requests say what is wrong and create nothing.
    for (body, says) in [
        (
            json!({ "windows": ["2026-09-15T09:00:00Z"] }),
            "is not a tick of the schedule",
        ),
        (json!({ "from": W2, "to": W1 }), "`from` is later than `to`"),
        (json!({ "windows": [W3] }), "is in the future"),
        (json!({ "from": W1, "windows": [W2] }), "give either"),
        (json!({ "windows": ["next monday"] }), "RFC 3339"),
        (json!({ "windows": [] }), "1-100 windows"),
    ] {
        let a = app.api.backfill("support-digest", body).await;
        assert_eq!(a.status, 400, "{}", a.body);
        assert!(
            a.body["detail"].as_str().unwrap().contains(says),
            "{}",
            a.body
        );
    }
    for query in ["?from=yesterday", "?limit=0", "?limit=1001", "?page=2"] {
        let a = app
            .api
            .send(
                reqwest::Method::GET,
                &format!("/policies/support-digest/windows{query}"),
                None,
            )
            .await;
        assert_eq!(a.status, 400, "{query}: {}", a.body);
    }
    let a = app
        .api
        .with_token(app.token(&["ops:read"]))
        .backfill("support-digest", json!({ "windows": [W2] }))
        .await;
    assert_eq!(a.status, 403, "{}", a.body);
    let runs: i64 = sqlx::query_scalar("select count(*) from sweeper.runs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(runs, 2, "nothing was created");

    // Named, the suspended week is backfilled.
    let a = app
        .api
        .backfill("support-digest", json!({ "windows": [W2] }))
        .await;
    assert_eq!(a.status, 202, "{}", a.body);
    let done = app.wait_terminal(&format!("support-digest:{W2}")).await;
    assert_eq!(done["called"], 2, "{done}");
    let page = app.api.windows("support-digest", "").await;
    assert_eq!(
        statuses(&page),
        pairs(&[(W1, "completed"), (W2, "completed")])
    );

    // The cleanup skipped week 2 too; week 3's completed cleanup, with its later cutoff,
    // supersedes it.
    let page = app.api.windows("support-digest-cleanup", "").await;
    assert_eq!(statuses(&page), pairs(&[(W1, "completed"), (W2, "missed")]));
    set_clock(&app.pool, at("2026-09-21T09:01:00Z")).await;
    for p in ["support-digest", "support-digest-cleanup"] {
        let run = app.api.trigger_new(p, "").await;
        assert_eq!(app.wait_terminal(&run).await["status"], "completed");
    }
    let page = app.api.windows("support-digest-cleanup", "").await;
    assert_eq!(
        statuses(&page),
        pairs(&[(W1, "completed"), (W2, "superseded"), (W3, "completed")])
    );
    // A selection policy is never superseded: each window has its own digests.
    let page = app.api.windows("support-digest", "").await;
    assert_eq!(
        statuses(&page),
        pairs(&[(W1, "completed"), (W2, "completed"), (W3, "completed")])
    );
}

#[tokio::test]
async fn a_backfill_before_the_first_registration_is_listed_and_never_makes_earlier_ticks_missed() {
    let (_api, app) = week_one_done().await;
    // Long before the service knew the policy (registered at 2026-09-07T09:01:00Z).
    let early = "2025-03-03T09:00:00Z";
    let a = app
        .api
        .backfill("support-digest-cleanup", json!({ "windows": [early] }))
        .await;
    assert_eq!(a.status, 202, "{}", a.body);
    app.wait_terminal(&format!("support-digest-cleanup:{early}"))
        .await;
    // A range over the time before the registration creates nothing: those ticks were never
    // expected.
    let a = app
        .api
        .backfill(
            "support-digest-cleanup",
            json!({ "from": "2025-01-06T09:00:00Z", "to": W1 }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["created"], json!([]), "{}", a.body);
    // It says why: each window it left alone, and the request as a whole.
    let skipped = a.body["skipped"].as_array().unwrap();
    assert!(
        skipped.iter().all(|t| t["why"]
            .as_str()
            .is_some_and(|w| w.starts_with("it has a run"))),
        "{}",
        a.body
    );
    assert!(
        a.body["detail"]
            .as_str()
            .unwrap()
            .contains("every window of the request has a run or is not missed"),
        "{}",
        a.body
    );
    assert!(
        a.body["detail"].as_str().unwrap().contains(
            "ticks before the policy's first registration (2026-09-07T09:01:00Z) were not expected"
        ),
        "{}",
        a.body
    );
    let a = app
        .api
        .backfill(
            "support-digest-cleanup",
            json!({ "from": "2025-01-06T09:00:00Z", "to": "2025-02-24T09:00:00Z" }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(
        a.body["detail"].as_str().unwrap().contains(
            "holds no tick the schedule expected (ticks are expected from the policy's first \
             registration, 2026-09-07T09:01:00Z)"
        ),
        "{}",
        a.body
    );
    let page = app.api.windows("support-digest-cleanup", "").await;
    assert_eq!(
        statuses(&page),
        pairs(&[(early, "completed"), (W1, "completed")]),
        "{page}"
    );
    assert_eq!(page["missed"], 0, "{page}");
    let metrics = app.api.metrics().await;
    assert_eq!(missed_metric(&metrics, "support-digest-cleanup"), "0");
    // A week after registration with no run is missed, as before.
    set_clock(&app.pool, at("2026-09-14T11:00:00Z")).await;
    let page = app.api.windows("support-digest-cleanup", "").await;
    assert_eq!(
        statuses(&page),
        pairs(&[(early, "completed"), (W1, "completed"), (W2, "missed")]),
        "{page}"
    );
}
