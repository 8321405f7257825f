//! The Pub/Sub transport against the real Pub/Sub emulator (Java, on loopback): the relay
//! publishes, the emulator pushes to `/consume` (with the query-string token: the emulator sends
//! no OIDC token), every "not now" is a committed decision plus an ack and a republish.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::emulator::{Emulator, emulator, subscribe};
use crate::ext_common::*;
use crate::scenarios::{Ended, Transport, a_transient_failure_converges};
use crate::standin::{Call, StandIn, ok};

pub fn pubsub_toml(em: &Emulator) -> String {
    format!(
        "[consume]\nlock_timeout = \"1s\"\n\
         [pubsub]\nproject = \"test\"\ntopic = \"sweeper\"\nemulator_host = \"{}\"\n\
         [[auth.query_token]]\nsubject = \"pubsub-push\"\ntoken_env = \"CARGO_PKG_DESCRIPTION\"\n",
        em.host
    )
}

#[tokio::test]
async fn a_run_completes_through_real_pushes_and_transient_failures_converge() {
    let Ended { app, run_id, .. } = a_transient_failure_converges(&Transport::pubsub().await).await;
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
