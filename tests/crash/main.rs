//! Crash tests (DESIGN §12): the real `sweeper serve` process is aborted at named crash points
//! (`SWEEPER_CRASH_AT`, compiled in by the `failpoints` feature), restarted, and time is moved
//! past leases with the ledger's test clock. The durable end state must be exact: every planned
//! command terminal, every eligible row deleted once, one audit outcome per item, no held row
//! touched, no command lost.

#[allow(dead_code)]
#[path = "../integration/common.rs"]
mod common;
#[path = "../integration/emulator.rs"]
mod emulator;
#[allow(dead_code)]
#[path = "../integration/ext_common.rs"]
mod ext_common;
mod external;
mod pubsub;
mod shutdown;
#[allow(dead_code)]
#[path = "../integration/standin.rs"]
mod standin;
mod tls;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use sqlx::PgPool;

const BIN: &str = env!("CARGO_BIN_EXE_sweeper");
const WINDOW: &str = "2026-09-01T02:00:00Z";

struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(db_url: &str, workers: usize) -> String {
    config_toml(
        db_url,
        workers,
        "[planning]\npage_rows = 50",
        &ticket_policy(10),
    )
}

async fn start(db_url: &str, workers: usize, crash_at: Option<&str>) -> Server {
    start_with(&config(db_url, workers), &[], crash_at).await
}

/// Starts `sweeper serve` on a free port with the configuration `text` (its `listen` replaced)
/// and extra environment variables; waits until it is ready.
async fn start_with(text: &str, env: &[(&str, &str)], crash_at: Option<&str>) -> Server {
    start_on(free_port(), text, env, crash_at).await
}

/// [`start_with`] on a given port (a restart on the same port keeps a push endpoint valid).
async fn start_on(port: u16, text: &str, env: &[(&str, &str)], crash_at: Option<&str>) -> Server {
    let text = text.replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
    let dir = std::env::temp_dir().join(format!("sweeper-crash-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sweeper.toml");
    std::fs::write(&path, &text).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--config", path.to_str().unwrap()])
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(point) = crash_at {
        cmd.env("SWEEPER_CRASH_AT", point);
    }
    let child = cmd.spawn().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    if text.contains("\n[tls]") {
        // HTTPS: the caller waits for readiness with a client that trusts its certificate.
        return Server { child, base };
    }
    let started = Instant::now();
    while reqwest::get(format!("{base}/readyz"))
        .await
        .map(|r| r.status() != 200)
        .unwrap_or(true)
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "server did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Server { child, base }
}

/// Waits until the process aborted at its crash point.
async fn wait_crashed(server: &mut Server) {
    let started = Instant::now();
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert!(
                !status.success(),
                "the server exited cleanly instead of crashing"
            );
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the crash point was never reached"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn token() -> String {
    let issuer = sweeper::auth::Issuer {
        iss: "sweeper-test".into(),
        audience: "sweeper".into(),
        keys: vec![("k2".into(), secrecy::SecretString::from(SECRET))],
    };
    let scopes: Vec<String> = ["trigger:*", "consume", "ops:read", "ops:write"]
        .map(String::from)
        .to_vec();
    sweeper::auth::mint(&issuer, "crash-test", &scopes, 600).unwrap()
}

async fn trigger(server: &Server) -> String {
    let r = reqwest::Client::new()
        .post(format!("{}/trigger/ticket-retention", server.base))
        .bearer_auth(token())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let run: Value = r.json().await.unwrap();
    run["run_id"].as_str().unwrap().to_string()
}

async fn wait_terminal(pool: &PgPool, run_id: &str) {
    let started = Instant::now();
    loop {
        let status: String =
            sqlx::query_scalar("select status from sweeper.runs where run_id = $1")
                .bind(run_id)
                .fetch_one(pool)
                .await
                .unwrap();
        if status.starts_with("completed") || status == "cancelled" {
            assert_eq!(status, "completed");
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "run {run_id} still {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn advance(pool: &PgPool, seconds: i64) {
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("select sweeper.now()")
        .fetch_one(pool)
        .await
        .unwrap();
    set_clock(pool, now + chrono::TimeDelta::seconds(seconds)).await;
}

/// A database with 400 tickets, the clock at the window; returns (db, pool, eligible ids).
async fn prepare() -> (TestDb, PgPool, Vec<i64>) {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    for stmt in TICKETS.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        sqlx::query(stmt).execute(&pool).await.unwrap();
    }
    set_clock(&pool, at("2026-09-01T02:01:00Z")).await;
    let eligible = seed_mixed(&pool, 400, at(WINDOW)).await;
    (db, pool, eligible)
}

/// The durable end state every crash must leave.
async fn assert_end_state(pool: &PgPool, run_id: &str, eligible: &[i64]) {
    let states: Vec<String> =
        sqlx::query_scalar("select distinct state from sweeper.commands where run_id = $1")
            .bind(run_id)
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(states, vec!["succeeded"], "every planned command terminal");
    let planned: Vec<i64> = sqlx::query_scalar(
        "select k::bigint from sweeper.commands, unnest(item_keys) k where run_id = $1 order by 1",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        planned, eligible,
        "every eligible key in exactly one command"
    );
    let audited: Vec<(String, String)> = sqlx::query_as(
        "select item_key, outcome from sweeper.audit where run_id = $1 order by item_key::bigint",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        audited.len(),
        eligible.len(),
        "one final audit outcome per item"
    );
    assert!(audited.iter().all(|(_, o)| o == "deleted"), "{audited:?}");
    let left: Vec<i64> = sqlx::query_scalar("select id from demo.tickets order by id")
        .fetch_all(pool)
        .await
        .unwrap();
    let expected: Vec<i64> = (1..=400).filter(|id| !eligible.contains(id)).collect();
    assert_eq!(
        left, expected,
        "eligible rows deleted, held and young rows untouched"
    );
    let remaining: Option<i64> =
        sqlx::query_scalar("select remaining_eligible from sweeper.runs where run_id = $1")
            .bind(run_id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(remaining, Some(0));
}

#[tokio::test]
async fn a_crash_while_planning_resumes_from_the_persisted_cursor() {
    let (db, pool, eligible) = prepare().await;
    let mut server = start(&db.url, 0, Some("plan_after_page")).await;
    let run_id = trigger(&server).await;
    wait_crashed(&mut server).await;
    let pages: i32 =
        sqlx::query_scalar("select pages_done from sweeper.planning_jobs where run_id = $1")
            .bind(&run_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(pages, 1, "the crash came after the first page committed");
    let _server = start(&db.url, 2, None).await;
    advance(&pool, 61).await; // past the planning lease
    wait_terminal(&pool, &run_id).await;
    assert_end_state(&pool, &run_id, &eligible).await;
}

#[tokio::test]
async fn a_crash_after_the_delete_before_commit_loses_nothing() {
    let (db, pool, eligible) = prepare().await;
    let mut server = start(&db.url, 1, Some("consume_before_commit")).await;
    let run_id = trigger(&server).await;
    wait_crashed(&mut server).await;
    let audit: i64 = sqlx::query_scalar("select count(*) from sweeper.audit")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(audit, 0, "the aborted transaction left nothing");
    let left: i64 = sqlx::query_scalar("select count(*) from demo.tickets")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 400);
    let _server = start(&db.url, 2, None).await;
    advance(&pool, 301).await; // past the queue lease of the claimed command
    wait_terminal(&pool, &run_id).await;
    assert_end_state(&pool, &run_id, &eligible).await;
}

#[tokio::test]
async fn a_crash_after_commit_before_the_answer_is_absorbed_by_redelivery() {
    let (db, pool, eligible) = prepare().await;
    let mut server = start(&db.url, 0, Some("consume_after_commit")).await;
    let run_id = trigger(&server).await;
    let started = Instant::now();
    let commands: Vec<String> = loop {
        let done: bool =
            sqlx::query_scalar("select planning_done from sweeper.runs where run_id = $1")
                .bind(&run_id)
                .fetch_one(&pool)
                .await
                .unwrap();
        if done {
            break sqlx::query_scalar(
                "select command_id from sweeper.commands where run_id = $1 order by batch_no",
            )
            .bind(&run_id)
            .fetch_all(&pool)
            .await
            .unwrap();
        }
        assert!(started.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let client = reqwest::Client::new();
    let deliver = |base: String, id: String| {
        let client = client.clone();
        async move {
            client
                .post(format!("{base}/consume"))
                .bearer_auth(token())
                .json(&serde_json::json!({"command_id": id}))
                .send()
                .await
        }
    };
    let first = deliver(server.base.clone(), commands[0].clone()).await;
    assert!(
        first.is_err(),
        "the process died before answering: {first:?}"
    );
    wait_crashed(&mut server).await;
    let state: String =
        sqlx::query_scalar("select state from sweeper.commands where command_id = $1")
            .bind(&commands[0])
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(state, "succeeded", "committed before the crash");

    // The queue redelivers (it never saw an answer): a duplicate, acknowledged, nothing redone.
    let server = start(&db.url, 0, None).await;
    let again = deliver(server.base.clone(), commands[0].clone())
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.json::<Value>().await.unwrap()["result"], "duplicate");
    for id in &commands[1..] {
        let r = deliver(server.base.clone(), id.clone()).await.unwrap();
        assert_eq!(r.status(), 200);
    }
    wait_terminal(&pool, &run_id).await;
    assert_end_state(&pool, &run_id, &eligible).await;
}

#[tokio::test]
async fn a_crash_while_holding_a_lease_is_reclaimed_after_it_expires() {
    let (db, pool, eligible) = prepare().await;
    let mut server = start(&db.url, 1, Some("worker_after_claim")).await;
    let run_id = trigger(&server).await;
    wait_crashed(&mut server).await;
    let leased: Vec<(String, i32)> =
        sqlx::query_as("select command_id, attempts from sweeper.commands where state = 'leased'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(
        !leased.is_empty(),
        "the worker died holding its claimed commands"
    );
    assert!(leased.iter().all(|(_, a)| *a == 1));
    let _server = start(&db.url, 2, None).await;
    // Before the lease expires nobody takes it over; after, it is reclaimed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let still: String =
        sqlx::query_scalar("select state from sweeper.commands where command_id = $1")
            .bind(&leased[0].0)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(still, "leased");
    advance(&pool, 301).await;
    wait_terminal(&pool, &run_id).await;
    assert_end_state(&pool, &run_id, &eligible).await;
    for (id, _) in &leased {
        let attempts: i32 =
            sqlx::query_scalar("select attempts from sweeper.commands where command_id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(attempts, 2, "the dead worker's attempt counts");
    }
}
