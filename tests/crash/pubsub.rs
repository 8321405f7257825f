//! The Pub/Sub transport across a crash: the process dies mid-delivery while the real Pub/Sub
//! emulator holds unacknowledged pushes; after a restart on the same port the emulator's
//! redeliveries (and the relay, for anything not yet published) complete the run exactly once.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::emulator::{emulator, subscribe};
use crate::kit::process::{Launch, Server};
use crate::{advance, assert_end_state, prepare, trigger};

#[tokio::test]
async fn a_server_killed_with_pushes_in_flight_completes_the_run_after_a_restart() {
    let em = emulator().await;
    let (db, pool, eligible) = prepare().await;
    let port = free_port();
    let extra = format!(
        "[planning]\npage_rows = 50\n\
         [pubsub]\nproject = \"test\"\ntopic = \"sweeper\"\nemulator_host = \"{}\"\n\
         [[auth.query_token]]\nsubject = \"pubsub-push\"\ntoken_env = \"CARGO_PKG_DESCRIPTION\"\n",
        em.host
    );
    let policy =
        ticket_policy(10).replace("batch_size = 10", "batch_size = 10\ntransport = \"pubsub\"");
    let text = config_toml(&db.url, 0, &extra, &policy);
    let base = format!("http://127.0.0.1:{port}");
    subscribe(&em, &base, 10).await;
    // The first push aborts the process after its delete, before its commit.
    let mut server = Server::launch(
        &text,
        Launch {
            port: Some(port),
            crash_at: Some("consume_before_commit"),
            ..Default::default()
        },
    )
    .await;
    let run_id = trigger(&server).await;
    server.wait_crashed().await;
    let (audit, published): (i64, i64) = sqlx::query_as(
        "select (select count(*) from sweeper.audit_trail),
                (select count(*) from sweeper.commands where published_at is not null)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(audit, 0, "the aborted transaction left nothing");
    assert!(
        published >= 1,
        "the emulator holds published, unacknowledged messages"
    );
    // Pushes fail against the dead port for a while.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let _server = Server::launch(
        &text,
        Launch {
            port: Some(port),
            ..Default::default()
        },
    )
    .await;
    // Past the dead process's planning and relay leases, so this one resumes both.
    advance(&pool, 61).await;
    let started = Instant::now();
    loop {
        let status: String =
            sqlx::query_scalar("select status from sweeper.runs where run_id = $1")
                .bind(&run_id)
                .fetch_one(&pool)
                .await
                .unwrap();
        if status == "completed" {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "run {run_id} still {status} two minutes after the restart"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_end_state(&pool, &run_id, &eligible).await;
    let actors: Vec<String> = sqlx::query_scalar("select distinct actor from sweeper.audit_trail")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        actors,
        vec!["pubsub-push".to_string()],
        "every item came through a push"
    );
}
