//! The governor and the restore and clone guard against real servers: a throwaway primary with a
//! streaming standby on other loopback ports (`initdb`, `pg_basebackup`), sweeper connected as a
//! role with `pg_monitor` (not a superuser) and as one without it, replay paused and resumed,
//! standbys promoted, and a `pg_dump | pg_restore` into another cluster.

use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool};

use crate::common::*;
use crate::kit::cluster::Cluster;

const NOW: &str = "2026-09-01T02:01:00Z";

async fn exec(url: &str, sql: &str) {
    let mut c = PgConnection::connect(url).await.unwrap();
    for stmt in sql.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        sqlx::query(stmt).execute(&mut c).await.unwrap();
    }
    c.close().await.unwrap();
}

/// Migrates `url`'s database, moves its ledger clock to [`NOW`] and seeds `n` eligible tickets.
async fn prepare(url: &str, n: i64) {
    let pool = PgPool::connect(url).await.unwrap();
    sweeper::ledger::migrations::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    set_clock(&pool, at(NOW)).await;
    for stmt in TICKETS.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        sqlx::query(stmt).execute(&pool).await.unwrap();
    }
    sqlx::query(
        "insert into demo.tickets select g, 'closed', false, timestamptz '2026-01-01'
           from generate_series(1, $1) g",
    )
    .bind(n)
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
}

async fn promote(standby: &Cluster) {
    let mut c = PgConnection::connect(&standby.url("postgres"))
        .await
        .unwrap();
    let promoted: bool = sqlx::query_scalar("select pg_promote(true, 30)")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert!(promoted);
}

#[tokio::test]
async fn replay_lag_holds_work_until_the_standby_catches_up_and_promotions_are_judged_by_silence() {
    let primary = Cluster::primary("primary");
    exec(
        &primary.url("postgres"),
        "create role monitor login; grant pg_monitor to monitor;
         create role plain login;
         create database sweeper owner monitor; create database plain owner plain",
    )
    .await;
    let url = primary.url_as("monitor", "sweeper");
    prepare(&url, 3_000).await;
    let standby = Cluster::standby_of(&primary, "standby1");
    let policies = format!(
        "{}governor = {{ replay_lag_bytes_high = 1048576, replay_lag_bytes_low = 65536, \
         replay_lag_seconds_high = 86400, replay_lag_seconds_low = 86400 }}\n",
        ticket_policy(100)
    );
    let a = Served::start(&url, &policies).await;
    a.governor_until("saw the standby", |g| {
        g["standbys"].as_array().is_some_and(|s| s.len() == 1)
            && signal(g, "replay_lag_bytes")["verdict"] == "ok"
    })
    .await;
    let run = a.api.trigger("ticket-retention", "").await;
    assert_eq!(run.status, 202, "{:?}", run.body);
    let run_id = run.body["run_id"].as_str().unwrap().to_string();
    a.api
        .wait_run(&run_id, "planned", |r| r["planning_done"] == true)
        .await;

    // Replay paused on the standby, then 4 MB of WAL on the primary.
    exec(&standby.url("postgres"), "select pg_wal_replay_pause()").await;
    exec(
        &url,
        "create table demo.filler (pad text);
         insert into demo.filler select repeat('x', 400) from generate_series(1, 10000)",
    )
    .await;
    let paused_at = Instant::now();
    let g = a
        .governor_until("held", |g| !g["policies"][0]["held"].is_null())
        .await;
    let lag = signal(&g, "replay_lag_bytes").clone();
    assert_eq!(lag["verdict"], "above_high", "{g}");
    eprintln!(
        "replay lag {} bytes > high mark {}: held {:.1} s after the pause",
        lag["reading"],
        lag["high"],
        paused_at.elapsed().as_secs_f64()
    );
    assert_eq!(
        a.drain().await,
        0,
        "nothing is claimed while the standby lags"
    );
    let held = a.api.run(&run_id).await;
    assert_eq!(held["held"]["kind"], "governor", "{held}");
    let before: i64 = sqlx::query_scalar("select count(*) from demo.tickets")
        .fetch_one(&a.state.pool)
        .await
        .unwrap();
    assert_eq!(before, 3_000);

    exec(&standby.url("postgres"), "select pg_wal_replay_resume()").await;
    let resumed_at = Instant::now();
    a.governor_until("resumed", |g| g["policies"][0]["held"].is_null())
        .await;
    eprintln!(
        "replay resumed: work released {:.1} s later",
        resumed_at.elapsed().as_secs_f64()
    );
    a.drain().await;
    let done = a.api.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"], 3_000);
    let (rows, once): (i64, i64) = sqlx::query_as(
        "select (select count(*) from demo.tickets),
                (select count(distinct item_key) from sweeper.audit_trail
                  where run_id = $1 and outcome = 'deleted')",
    )
    .bind(&run_id)
    .fetch_one(&a.state.pool)
    .await
    .unwrap();
    assert_eq!((rows, once), (0, 3_000), "every eligible row deleted once");
    let attempts: i64 = sqlx::query_scalar("select sum(attempts) from sweeper.commands")
        .fetch_one(&a.state.pool)
        .await
        .unwrap();
    assert_eq!(attempts, 30, "holding spent no attempt");

    // A role without pg_monitor sees the standby but not its positions: unreadable, never 0.
    let plain_url = primary.url_as("plain", "plain");
    prepare(&plain_url, 1).await;
    let b = Served::start(&plain_url, &ticket_policy(100)).await;
    let g = b
        .governor_until("read", |g| {
            g["standbys"].as_array().is_some_and(|s| !s.is_empty())
        })
        .await;
    let lag = signal(&g, "replay_lag_bytes");
    assert_eq!(lag["verdict"], "unreadable", "{g}");
    assert!(lag["reading"].is_null(), "{g}");
    assert!(
        lag["detail"].as_str().unwrap().contains("pg_monitor"),
        "{g}"
    );
    assert_eq!(signal(&g, "xmin_age")["verdict"], "ok", "{g}");
    b.stop().await;

    // The first standby: the heartbeat it replayed is seconds old (written when `a` started). Its
    // promotion is a failover: recorded, not held.
    a.stop().await;
    let recent: f64 = {
        let mut c = PgConnection::connect(&standby.url_as("monitor", "sweeper"))
            .await
            .unwrap();
        sqlx::query_scalar(
            "select extract(epoch from sweeper.now() - heartbeat_at)::float8
               from sweeper.database_identity",
        )
        .fetch_one(&mut c)
        .await
        .unwrap()
    };
    promote(&standby).await;
    let c = Served::start(&standby.url_as("monitor", "sweeper"), &ticket_policy(100)).await;
    let guard = c
        .api
        .expect(200, reqwest::Method::GET, "/guard", None)
        .await;
    eprintln!("standby1 promoted {recent:.1} s after its last replayed heartbeat: {guard}");
    assert_eq!(guard["observed"]["timeline"], 2, "{guard}");
    assert_eq!(
        guard["recorded"]["timeline"], 2,
        "a failover is recorded: {guard}"
    );
    assert!(
        guard["recorded"]["held_since"].is_null(),
        "not held: {guard}"
    );
    c.stop().await;

    // A second standby whose copy of the ledger has a heartbeat two hours old (no sweeper serves
    // the primary any more to refresh it).
    exec(
        &url,
        "update sweeper.database_identity set heartbeat_at = sweeper.now() - interval '2 hours'",
    )
    .await;
    let standby2 = Cluster::standby_of(&primary, "standby2");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut c = PgConnection::connect(&standby2.url_as("monitor", "sweeper"))
            .await
            .unwrap();
        let old: bool = sqlx::query_scalar(
            "select heartbeat_at < sweeper.now() - interval '1 hour' from sweeper.database_identity",
        )
        .fetch_one(&mut c)
        .await
        .unwrap();
        if old {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "standby2 never replayed the heartbeat"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    promote(&standby2).await;
    let d = Served::start(&standby2.url_as("monitor", "sweeper"), &ticket_policy(100)).await;
    let guard = d
        .api
        .expect(200, reqwest::Method::GET, "/guard", None)
        .await;
    eprintln!(
        "standby2 promoted after a 2 h silence: {}",
        guard["recorded"]["held_detail"]
    );
    assert!(
        guard["recorded"]["held_detail"]
            .as_str()
            .is_some_and(|d| d.contains("timeline 1 → 2")),
        "{guard}"
    );
    // Held: a new run plans but nothing executes.
    let run = d
        .api
        .trigger("ticket-retention", "?window=2026-08-31T02:00:00Z")
        .await;
    assert_eq!(run.status, 202, "{:?}", run.body);
    d.stop().await;
}

#[tokio::test]
async fn a_dump_restored_into_another_cluster_holds_every_policy_until_accepted() {
    let app = TestApp::spawn(Spawn {
        now: Some(at(NOW)),
        ..Default::default()
    })
    .await;
    sqlx::query(
        "insert into demo.tickets select g, 'closed', false, timestamptz '2026-01-01'
           from generate_series(1, 40) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let source = app.db.url.clone();
    let other = Cluster::primary("restore");
    exec(&other.url("postgres"), "create database restored").await;
    let dump = std::process::Command::new(crate::kit::cluster::bin_dir().join("pg_dump"))
        .args(["-Fc", "-d", &source])
        .output()
        .unwrap();
    assert!(
        dump.status.success(),
        "{}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let mut restore = std::process::Command::new(crate::kit::cluster::bin_dir().join("pg_restore"))
        .args(["--no-owner", "-d", &other.url("restored")])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    restore
        .stdin
        .take()
        .unwrap()
        .write_all(&dump.stdout)
        .unwrap();
    let out = restore.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    app.stop().await;

    let r = Served::start(&other.url("restored"), &ticket_policy(10)).await;
    let run = r.api.trigger("ticket-retention", "").await;
    assert_eq!(run.status, 202, "{:?}", run.body);
    // The trigger's own answer says the run is held: a cron's log sees only this answer.
    assert_eq!(run.body["held"]["kind"], "identity", "{:?}", run.body);
    let again = r.api.trigger("ticket-retention", "").await;
    assert_eq!(again.status, 200, "{:?}", again.body);
    assert_eq!(again.body["held"]["kind"], "identity", "{:?}", again.body);
    let run_id = run.body["run_id"].as_str().unwrap().to_string();
    r.api
        .wait_run(&run_id, "planned", |r| r["planning_done"] == true)
        .await;
    assert_eq!(r.drain().await, 0, "nothing executes on the restored copy");
    let held = r.api.run(&run_id).await;
    assert_eq!(held["held"]["kind"], "identity", "{held}");
    assert!(
        held["held"]["detail"]
            .as_str()
            .unwrap()
            .contains("system identifier"),
        "{held}"
    );
    let rows: i64 = sqlx::query_scalar("select count(*) from demo.tickets")
        .fetch_one(&r.state.pool)
        .await
        .unwrap();
    assert_eq!(rows, 40, "nothing deleted");
    r.api
        .expect(
            200,
            reqwest::Method::POST,
            "/guard/accept",
            Some(json!({"reason": "the restore is the new production database"})),
        )
        .await;
    r.drain().await;
    let done = r.api.wait_terminal(&run_id).await;
    assert_eq!(done["deleted"], 40, "{done}");
    let logged: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.operator_log where action = 'accept_identity'",
    )
    .fetch_one(&r.state.pool)
    .await
    .unwrap();
    assert_eq!(logged, 1);
    r.stop().await;
}
