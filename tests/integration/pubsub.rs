//! The Pub/Sub transport against the real Pub/Sub emulator (Java, on loopback): the relay
//! publishes, the emulator pushes to `/consume` (with the query-string token: the emulator sends
//! no OIDC token), every "not now" is a committed decision plus an ack and a republish.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::emulator::{Emulator, emulator, subscribe};
use crate::ext_common::*;
use crate::standin::{Call, StandIn, ok};

fn pubsub_toml(em: &Emulator) -> String {
    format!(
        "[consume]\nlock_timeout = \"1s\"\n\
         [pubsub]\nproject = \"test\"\ntopic = \"sweeper\"\nemulator_host = \"{}\"\n\
         [[auth.query_token]]\nsubject = \"pubsub-push\"\ntoken_env = \"CARGO_PKG_DESCRIPTION\"\n",
        em.host
    )
}

#[tokio::test]
async fn a_run_completes_through_real_pushes_and_transient_failures_converge() {
    let em = emulator().await;
    let policy = ticket_policy(10).replace(
        "batch_size = 10",
        "batch_size = 10\ntransport = \"pubsub\"\nretry = { max_attempts = 10, base = \"1s\", cap = \"1s\", max_age = \"1h\" }",
    );
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: policy,
        extra_toml: pubsub_toml(&em),
        ..Default::default()
    })
    .await;
    subscribe(&em, &app.base, 10).await;
    let eligible = seed_mixed(&app.pool, 200, at("2026-09-01T02:00:00Z")).await;
    // Hold one eligible row until a delivery fails on it (lock_timeout 1s): its command must
    // come back by republish.
    let held = eligible[eligible.len() / 2];
    let blocker = lock_ticket(&app.db.url, held).await;
    let (status, run) = app.trigger("ticket-retention", "").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    wait_transient_failure(&app.pool).await;
    release_ticket(blocker).await;

    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"].as_i64().unwrap(), eligible.len() as i64);
    let dup: i64 = sqlx::query_scalar(
        "select count(*) from (select item_key from sweeper.audit group by item_key
                                having count(*) > 1) d",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(dup, 0, "one outcome per item");
    // Every command went through the relay; the held one failed, was acknowledged and came back.
    let (unpublished, retried): (i64, i64) = sqlx::query_as(
        "select count(*) filter (where published_at is null),
                count(*) filter (where published_generation >= 2)
           from sweeper.commands where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(unpublished, 0);
    assert!(
        retried >= 1,
        "the failed command was republished with a new generation"
    );
    let transient: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.attempts where outcome = 'failed' and class = 'transient'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(transient >= 1, "the held row made an attempt fail");
}

#[tokio::test]
async fn a_snooze_longer_than_the_ack_deadline_is_acked_and_republished() {
    let em = emulator().await;
    // The provider throttles the first call for 12 s, longer than the 10 s ack deadline.
    let provider = StandIn::start(Duration::ZERO, |_, earlier: &[Call]| {
        if earlier.is_empty() {
            (
                429,
                vec![("retry-after".into(), "12".into())],
                String::new(),
            )
        } else {
            ok()
        }
    })
    .await;
    let policies = dependency("payments", &provider.url(), "pause_wait = \"0s\"")
        + &payments_policy("reconcile", "payments", 10, "", "transport = \"pubsub\"");
    let app = TestApp::spawn(Spawn {
        setup_sql: EXT,
        now: Some(at(NOW)),
        policies,
        extra_toml: pubsub_toml(&em),
        ..Default::default()
    })
    .await;
    subscribe(&em, &app.base, 10).await;
    seed_payments(&app, 5).await;
    let started = Instant::now();
    let (status, run) = app.trigger("reconcile", "?window=2026-09-01").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["reconciled"], 5);
    assert!(
        started.elapsed() >= Duration::from_secs(11),
        "{:?}",
        started.elapsed()
    );
    let (snoozes, generation): (i64, Option<i32>) = sqlx::query_as(
        "select (select count(*) from sweeper.attempts where outcome = 'snoozed'),
                (select published_generation from sweeper.commands where run_id = $1)",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(snoozes, 1);
    assert_eq!(
        generation,
        Some(2),
        "republished once, with the next generation"
    );
    let calls = provider.calls();
    assert_eq!(calls.len(), 6, "one throttled call, then one per item");
    let gap = calls[1].at - calls[0].at;
    assert!(
        gap >= Duration::from_secs(11),
        "no call during the pause: {gap:?}"
    );
}
