//! Production safety (docs/design.md §14 "Holds"): active hours, the blast-radius guard's approval, the
//! restore and clone guard, the governor on a real open snapshot, and the pace across two
//! replicas. Every test asserts the durable end state: what was deleted, what the run says.

use std::time::Duration;

use chrono::{Timelike, Utc};
use serde_json::{Value, json};
use sqlx::{Connection, PgPool};

use crate::common::*;

const NOW: &str = "2026-09-01T02:01:00Z";

/// `n` tickets closed long before the cutoff (all eligible).
async fn eligible_tickets(pool: &PgPool, n: i64) {
    sqlx::query(
        "insert into demo.tickets select g, 'closed', false, timestamptz '2026-01-01'
           from generate_series(1, $1) g",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

async fn remaining(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from demo.tickets")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn policy_with(batch: usize, extra: &str) -> String {
    format!("{}{extra}\n", ticket_policy(batch))
}

async fn spawn(policies: String, extra_toml: &str) -> TestApp {
    TestApp::spawn(Spawn {
        now: Some(at(NOW)),
        policies,
        extra_toml: extra_toml.into(),
        ..Default::default()
    })
    .await
}

async fn trigger_planned(app: &TestApp) -> String {
    let (status, run) = app.trigger("ticket-retention", "").await;
    assert!(status == 202 || status == 200, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    run_id
}

/// `HH:00` `h` hours from now (UTC, machine clock).
fn hour_from_now(h: i64) -> String {
    let hour = (Utc::now().hour() as i64 + h).rem_euclid(24);
    format!("{hour:02}:00")
}

#[tokio::test]
async fn outside_active_hours_nothing_is_claimed_and_inside_the_run_resumes() {
    let closed = format!(
        "active = {{ from = \"{}\", to = \"{}\", timezone = \"UTC\" }}",
        hour_from_now(2),
        hour_from_now(3)
    );
    let app = spawn(policy_with(10, &closed), "").await;
    eligible_tickets(&app.pool, 25).await;
    let run_id = trigger_planned(&app).await;
    assert_eq!(app.drain().await, 0, "nothing is claimed outside the hours");
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "active_hours", "{run}");
    assert!(run["held"]["until"].is_string(), "{run}");
    // A delivery that arrives anyway is held: its attempt given back, no item touched.
    let commands = app.command_ids(&run_id).await;
    let a = app.consume(&commands[0]).await;
    assert_eq!(a.status, 503, "{:?}", a.body);
    let (attempts, kind): (i32, Option<String>) =
        sqlx::query_as("select attempts, held_kind from sweeper.commands where command_id = $1")
            .bind(&commands[0])
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((attempts, kind.as_deref()), (0, Some("active_hours")));
    let metrics = app.api.metrics().await;
    assert!(
        metrics.contains("sweeper_held{kind=\"active_hours\"} 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sweeper_held_overdue{kind=\"active_hours\"} 0"),
        "{metrics}"
    );
    assert_eq!(app.api.run(&run_id).await["held"]["overdue"], false);
    assert_eq!(remaining(&app.pool).await, 25);

    // The same policy with hours that include now: the run resumes where it stopped.
    let (db, pool) = app.stop().await;
    let open = format!(
        "active = {{ from = \"{}\", to = \"{}\", timezone = \"UTC\" }}",
        hour_from_now(-1),
        hour_from_now(2)
    );
    sqlx::query("update sweeper.commands set next_attempt_at = sweeper.now()")
        .execute(&pool)
        .await
        .unwrap();
    let app = TestApp::start(db, pool, 0, "", &policy_with(10, &open)).await;
    assert_eq!(app.drain().await, 3);
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 25);
    assert_eq!(remaining(&app.pool).await, 0);
    // The time it was held counts against no budget: credited to its age.
    let credit: f64 =
        sqlx::query_scalar("select age_credit_seconds from sweeper.commands where command_id = $1")
            .bind(&commands[0])
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(credit > 0.0, "held time credited: {credit}");
}

#[tokio::test]
async fn a_run_over_the_guard_waits_for_approval_and_approve_releases_it() {
    let app = spawn(policy_with(10, "guard = { max_items = 20 }"), "").await;
    eligible_tickets(&app.pool, 30).await;
    // A dry run says its live run would be held, and is not held itself.
    let (status, dry) = app.trigger("ticket-retention", "?dry_run=true").await;
    assert_eq!(status, 202, "{dry}");
    let dry_id = dry["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&dry_id).await;
    app.drain().await;
    let dry = app.wait_terminal(&dry_id).await;
    assert_eq!(
        dry["approval"]["guard_verdict"]["would_be_held"], true,
        "{dry}"
    );
    assert_eq!(dry["would_delete"], 30);

    let run_id = trigger_planned(&app).await;
    assert_eq!(app.drain().await, 0, "a held run executes nothing");
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "approval", "{run}");
    assert_eq!(run["approval"]["state"], "required", "{run}");
    assert!(
        run["approval"]["guard_verdict"]["reason"]
            .as_str()
            .unwrap()
            .contains("max_items 20"),
        "{run}"
    );
    assert_eq!(remaining(&app.pool).await, 30);
    // Approval needs ops:write and a reason.
    let read_only = app.api.with_token(app.token(&["ops:read"]));
    let path = format!("/runs/{run_id}/approve");
    let a = read_only
        .send(reqwest::Method::POST, &path, Some(json!({"reason": "x"})))
        .await;
    assert_eq!(a.status, 403);
    let a = app
        .api
        .send(reqwest::Method::POST, &path, Some(json!({})))
        .await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    // Two operators approve at once: both answered 200, both logged, one of them acted.
    let (a, b) = tokio::join!(
        app.api.expect(
            200,
            reqwest::Method::POST,
            &path,
            Some(json!({"reason": "the backlog after the outage is expected"})),
        ),
        app.api.expect(
            200,
            reqwest::Method::POST,
            &path,
            Some(json!({"reason": "a second operator agrees"})),
        )
    );
    assert_eq!(a["approval"], "approved", "{a}");
    assert_eq!(b["approval"], "approved", "{b}");
    let log = app
        .get_json(&format!("/operator-log?action=approve&target=run:{run_id}"))
        .await;
    let changed: Vec<bool> = log["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["changed"].as_bool().unwrap())
        .collect();
    assert_eq!(changed.len(), 2, "{log}");
    assert_eq!(changed.iter().filter(|c| **c).count(), 1, "{log}");
    // Approving again changes nothing; its reason is logged like every act's.
    let again = app
        .api
        .expect(
            200,
            reqwest::Method::POST,
            &path,
            Some(json!({"reason": "again"})),
        )
        .await;
    assert_eq!(again["approved_by"], "test-operator", "{again}");
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 30);
    assert_eq!(run["approval"]["approved_by"], "test-operator", "{run}");
    let logged: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.operator_log where action = 'approve' and target = $1
            and reason = 'the backlog after the outage is expected'",
    )
    .bind(format!("run:{run_id}"))
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(logged, 1);
    let acts: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.operator_log where action = 'approve' and target = $1",
    )
    .bind(format!("run:{run_id}"))
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(acts, 3);
    // A completed run is not waiting for approval.
    let a = app
        .api
        .send(
            reqwest::Method::POST,
            &path,
            Some(json!({"reason": "late"})),
        )
        .await;
    assert_eq!(a.status, 409, "{:?}", a.body);
    assert!(
        a.body["detail"].as_str().unwrap().contains("completed"),
        "{:?}",
        a.body
    );
    // A body that is not JSON is refused in our words, not the parser's.
    let a = app.api.send(reqwest::Method::POST, &path, None).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    assert!(
        !a.body["detail"].as_str().unwrap().contains("EOF"),
        "{:?}",
        a.body
    );
}

#[tokio::test]
async fn a_run_awaiting_its_plans_approval_is_held_on_the_attention_list_as_the_gate_holds_it() {
    // The gate holds a run whose guard waits for its plan; the attention list, the run and the
    // gauges say the same: held, kind approval.
    let app = spawn(policy_with(10, "guard = { max_items = 1000 }"), "").await;
    eligible_tickets(&app.pool, 30).await;
    let run_id = trigger_planned(&app).await;
    crate::kit::ledger::force_awaiting_plan(&app.pool, &run_id).await;
    assert_eq!(app.drain().await, 0, "the gate holds it");
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "approval", "{run}");
    let list = app.get_json("/runs?status=attention").await;
    let listed = list["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run_id"] == run_id.as_str())
        .unwrap_or_else(|| panic!("{list}"));
    assert_eq!(listed["held_kind"], "approval", "{listed}");
    let reason = listed["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("held (approval): the blast-radius guard decides when planning is done"),
        "{reason}"
    );
    let metrics = app.api.metrics().await;
    assert!(
        metrics.contains("sweeper_held_runs{kind=\"approval\"} 1"),
        "{metrics}"
    );
    assert_eq!(remaining(&app.pool).await, 30);
}

#[tokio::test]
async fn a_run_twenty_times_the_median_waits_and_cancel_ends_it() {
    let app = spawn(
        policy_with(10, "guard = { max_ratio = 10.0, ratio_floor = 0 }"),
        "",
    )
    .await;
    // Three completed runs of 5 items (median 5), then a window with 100.
    for day in 0..3 {
        sqlx::query(
            "insert into demo.tickets select g, 'closed', false, timestamptz '2026-01-01'
               from generate_series($1, $1 + 4) g",
        )
        .bind(day * 10 + 1)
        .execute(&app.pool)
        .await
        .unwrap();
        let window = format!("2026-08-{:02}T02:00:00Z", 28 + day);
        let (_, run) = app
            .trigger("ticket-retention", &format!("?window={window}"))
            .await;
        let id = run["run_id"].as_str().unwrap().to_string();
        app.wait_planned(&id).await;
        app.drain().await;
        assert_eq!(app.wait_terminal(&id).await["status"], "completed");
    }
    sqlx::query(
        "insert into demo.tickets select g, 'closed', false, timestamptz '2026-01-01'
           from generate_series(1000, 1099) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let run_id = trigger_planned(&app).await;
    assert_eq!(app.drain().await, 0);
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "approval", "{run}");
    assert_eq!(
        run["approval"]["guard_verdict"]["median_of_last_completed"], 5.0,
        "{run}"
    );
    app.api
        .cancel_run(&run_id, "twenty times the usual: investigate")
        .await;
    let run = app.api.run(&run_id).await;
    assert_eq!(run["status"], "cancelled", "{run}");
    assert_eq!(remaining(&app.pool).await, 100);
    let path = format!("/runs/{run_id}/approve");
    let a = app
        .api
        .send(
            reqwest::Method::POST,
            &path,
            Some(json!({"reason": "late"})),
        )
        .await;
    assert_eq!(a.status, 409, "{:?}", a.body);
}

#[tokio::test]
async fn a_template_clone_of_a_served_database_holds_every_policy_until_accepted() {
    let app = spawn(ticket_policy(10), "").await;
    let recorded = app.get_json("/guard").await;
    assert_eq!(
        recorded["recorded"]["recorded_by"], "sweeper:serve",
        "{recorded}"
    );
    let (db, pool) = app.stop().await;
    pool.close().await;
    // The clone: same rows, same ledger, another database oid.
    let clone = format!("{}_clone", db.name);
    let mut admin = crate::kit::db::admin().await;
    sqlx::query(&format!("drop database if exists {clone}"))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query(&format!("create database {clone} template {}", db.name))
        .execute(&mut admin)
        .await
        .unwrap();
    let clone_url = crate::kit::db::database_url(&clone);
    let clone_pool = PgPool::connect(&clone_url).await.unwrap();
    eligible_tickets(&clone_pool, 15).await;
    let served = Served::start(&clone_url, &ticket_policy(10)).await;
    let (api, state) = (served.api.clone(), served.state.clone());
    let answer = api.trigger("ticket-retention", "").await;
    let (status, run) = (answer.status, answer.body);
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    api.wait_run(&run_id, "planned", |r| r["planning_done"] == true)
        .await;
    let step = sweeper::app::worker::run_one_command(&state).await.unwrap();
    assert!(
        matches!(step, sweeper::app::worker::WorkerStep::Idle),
        "{step:?}"
    );
    let run = api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "identity", "{run}");
    assert!(
        run["held"]["detail"]
            .as_str()
            .unwrap()
            .contains("database oid"),
        "{run}"
    );
    assert_eq!(
        remaining(&clone_pool).await,
        15,
        "nothing deleted on the clone"
    );
    // A push transport's relay would not publish them either: as if the run's commands were
    // Pub/Sub's and due for publishing, none is due while the guard holds.
    sqlx::query(
        "update sweeper.commands set transport = 'pubsub', publish_due = true where run_id = $1",
    )
    .bind(&run_id)
    .execute(&clone_pool)
    .await
    .unwrap();
    let due = |pool: PgPool| async move {
        sweeper::ledger::outbox::due(&pool, "pubsub", 100, 0.0, &[])
            .await
            .unwrap()
            .len()
    };
    assert_eq!(due(clone_pool.clone()).await, 0, "held: not published");
    let metrics = api.metrics().await;
    assert!(
        metrics.contains("sweeper_held{kind=\"identity\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sweeper_holds_total{kind=\"identity\"}"),
        "{metrics}"
    );
    assert_eq!(api.run(&run_id).await["held"]["held_commands"], 2);
    let accepted = api
        .expect(
            200,
            reqwest::Method::POST,
            "/guard/accept",
            Some(json!({"reason": "staging copy, cleaning it is intended"})),
        )
        .await;
    assert!(accepted["held_since"].is_null(), "{accepted}");
    assert_eq!(
        due(clone_pool.clone()).await,
        2,
        "released: due for publishing"
    );
    sqlx::query("update sweeper.commands set transport = 'builtin', publish_due = false")
        .execute(&clone_pool)
        .await
        .unwrap();
    served.drain().await;
    let run = api.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(remaining(&clone_pool).await, 0);
    served.stop().await;
    clone_pool.close().await;
    sqlx::query(&format!("drop database if exists {clone} with (force)"))
        .execute(&mut admin)
        .await
        .unwrap();
}

#[tokio::test]
async fn an_open_snapshot_past_the_xmin_mark_holds_work_and_its_commit_resumes_it() {
    let app = spawn(
        policy_with(10, "governor = { xmin_age_high = 200, xmin_age_low = 100 }"),
        "",
    )
    .await;
    eligible_tickets(&app.pool, 30).await;
    let run_id = trigger_planned(&app).await;
    // Another session opens a snapshot and keeps it; 300 transactions later its xmin is 300 old.
    let mut holder = sqlx::PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("begin isolation level repeatable read")
        .execute(&mut holder)
        .await
        .unwrap();
    sqlx::query("select count(*) from demo.tickets")
        .execute(&mut holder)
        .await
        .unwrap();
    for _ in 0..300 {
        sqlx::query("select txid_current()")
            .execute(&app.pool)
            .await
            .unwrap();
    }
    // Held, by a reading taken after the 300 (a tick during the loop may already hold it at a
    // lower age: on a loaded machine the loop spans several ticks).
    let governor = wait_json(&app, "/governor", "held at the full age", |g| {
        !g["policies"][0]["held"].is_null()
            && signal(g, "xmin_age")["reading"].as_f64().unwrap_or(0.0) >= 300.0
    })
    .await;
    let xmin = signal(&governor, "xmin_age").clone();
    assert_eq!(xmin["verdict"], "above_high", "{governor}");
    assert!(xmin["reading"].as_f64().unwrap() >= 300.0, "{xmin}");
    eprintln!("governor held at xmin age {}", xmin["reading"]);
    // No standby here: the lag signals say so, never a silent 0.
    let lag = signal(&governor, "replay_lag_bytes").clone();
    assert_eq!(lag["verdict"], "no_standby", "{lag}");
    assert!(lag["reading"].is_null(), "no reading, not a 0: {lag}");
    assert_eq!(app.drain().await, 0, "nothing is claimed while held");
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "governor", "{run}");
    // Planning pages are held too (they read the target table).
    let (status, dry) = app.trigger("ticket-retention", "?dry_run=true").await;
    assert_eq!(status, 202, "{dry}");
    let dry_id = dry["run_id"].as_str().unwrap().to_string();
    let dry = app
        .wait_until(&dry_id, "planning held", |r| {
            r["held"]["planning_held"] == true
        })
        .await;
    assert_eq!(dry["held"]["kind"], "governor", "{dry}");
    assert_eq!(dry["planning_done"], false, "{dry}");
    assert_eq!(remaining(&app.pool).await, 30);

    sqlx::query("commit").execute(&mut holder).await.unwrap();
    wait_json(&app, "/governor", "resumed", |g| {
        g["policies"][0]["held"].is_null()
    })
    .await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 30);
    // The held dry run plans once released (after the hold's recheck) and runs.
    app.wait_planned(&dry_id).await;
    app.drain().await;
    assert_eq!(app.wait_terminal(&dry_id).await["status"], "completed");
    let attempts: i64 = sqlx::query_scalar(
        "select coalesce(sum(attempts), 0) from sweeper.commands where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 3, "holding spent no attempt");
}

async fn wait_json(app: &TestApp, path: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let v = app.get_json(path).await;
        if done(&v) {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{path} never {what}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn two_replicas_keep_the_pace_in_every_ten_second_interval() {
    const RATE: i64 = 2_000;
    const ROWS: i64 = 30_000;
    let policies = policy_with(200, &format!("max_items_per_second = {RATE}"));
    let extra = "[database]\nmax_connections = 12";
    let app = spawn(policies.clone(), extra).await;
    eligible_tickets(&app.pool, ROWS).await;
    let run_id = trigger_planned(&app).await;
    // Two replicas, four workers each, on the same ledger.
    let (db, pool) = app.stop().await;
    let a = TestApp::start(db, pool, 4, extra, &policies).await;
    let b_config =
        sweeper::settings::Config::from_toml(&config_toml(&a.db.url, 4, extra, &policies)).unwrap();
    let b = sweeper::app::Application::build(b_config).await.unwrap();
    let b_shutdown = tokio_util::sync::CancellationToken::new();
    let b_server = tokio::spawn(b.run_until(b_shutdown.clone()));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let run = loop {
        let run = a.api.run(&run_id).await;
        if run["status"] == "completed" {
            break run;
        }
        assert!(std::time::Instant::now() < deadline, "{run}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    b_shutdown.cancel();
    b_server.await.unwrap().unwrap();
    assert_eq!(run["deleted"], ROWS);
    // Deletions per commit instant (audit rows share their transaction's recorded_at).
    let commits: Vec<(f64, i64)> = sqlx::query_as(
        "select extract(epoch from recorded_at)::float8, count(*) from sweeper.audit_trail
          where run_id = $1 and outcome = 'deleted' group by recorded_at order by recorded_at",
    )
    .bind(&run_id)
    .fetch_all(&a.pool)
    .await
    .unwrap();
    let (mut worst, mut j, mut sum) = (0i64, 0usize, 0i64);
    for i in 0..commits.len() {
        sum += commits[i].1;
        while commits[i].0 - commits[j].0 >= 10.0 {
            sum -= commits[j].1;
            j += 1;
        }
        worst = worst.max(sum);
    }
    let span = commits.last().unwrap().0 - commits[0].0;
    eprintln!(
        "pace {RATE}/s: {ROWS} items in {span:.1} s ({:.0}/s); worst 10 s interval {worst} items ({:.0}/s)",
        ROWS as f64 / span,
        worst as f64 / 10.0
    );
    assert!(worst <= RATE * 10 * 11 / 10, "worst 10 s interval {worst}");
    a.stop().await;
}

#[tokio::test]
async fn a_table_never_analyzed_holds_a_run_whose_fraction_cannot_be_checked() {
    let app = spawn(policy_with(10, "guard = { max_fraction = 0.5 }"), "").await;
    sqlx::query("alter table demo.tickets set (autovacuum_enabled = false)")
        .execute(&app.pool)
        .await
        .unwrap();
    eligible_tickets(&app.pool, 20).await;
    let run_id = trigger_planned(&app).await;
    assert_eq!(app.drain().await, 0);
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "approval", "{run}");
    assert!(
        run["approval"]["guard_verdict"]["reason"]
            .as_str()
            .unwrap()
            .contains("never analyzed"),
        "{run}"
    );
    assert_eq!(remaining(&app.pool).await, 20);
}

#[tokio::test]
async fn a_session_waiting_on_a_row_lock_of_a_mixed_case_table_holds_the_work() {
    let setup = r#"
create schema demo;
create table demo."Tix" (id bigint primary key, closed_at timestamptz not null);
create table demo.tix (id bigint primary key, closed_at timestamptz not null);
insert into demo."Tix" select g, timestamptz '2026-01-01' from generate_series(1, 20) g
"#;
    let policy = r#"
[[policy]]
name = "tix"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "demo.Tix", key = "id", timestamp = "closed_at" }
retain_for = "90d"
batch_size = 10
"#;
    let app = TestApp::spawn(Spawn {
        now: Some(at(NOW)),
        policies: policy.into(),
        setup_sql: Box::leak(setup.to_string().into_boxed_str()),
        ..Default::default()
    })
    .await;
    let (status, run) = app.trigger("tix", "").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    // One session holds a row; another waits for it (a transaction-id lock, no relation named).
    let mut holder = sqlx::PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("begin").execute(&mut holder).await.unwrap();
    sqlx::query(r#"select id from demo."Tix" where id = 1 for update"#)
        .execute(&mut holder)
        .await
        .unwrap();
    let url = app.db.url.clone();
    let waiter = tokio::spawn(async move {
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query(r#"update demo."Tix" set closed_at = closed_at where id = 1"#)
            .execute(&mut c)
            .await
            .unwrap();
    });
    let g = wait_json(&app, "/governor", "held", |g| {
        !g["policies"][0]["held"].is_null()
    })
    .await;
    let waits = signal(&g, "lock_waiters").clone();
    assert_eq!(waits["reading"], 1.0, "{g}");
    assert!(waits["detail"].as_str().unwrap().contains("\"Tix\""), "{g}");
    assert_eq!(
        app.drain().await,
        0,
        "nothing is claimed while a session waits"
    );
    sqlx::query("rollback").execute(&mut holder).await.unwrap();
    waiter.await.unwrap();
    wait_json(&app, "/governor", "resumed", |g| {
        g["policies"][0]["held"].is_null()
    })
    .await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["deleted"], 20, "{run}");
}

#[tokio::test]
async fn a_governor_or_hours_marker_left_on_commands_is_not_a_hold_once_released() {
    // Commands a governor hold reached keep its marker until they run; the governor has since
    // released. The run, the attention list and the gauges describe the present: not held.
    let app = TestApp::spawn(Spawn::default()).await;
    seed_mixed(&app.pool, 30, at("2026-09-01T02:00:00Z")).await;
    let (run_id, commands) = app.planned_run().await;
    assert!(commands.len() >= 2);
    sqlx::query(
        "update sweeper.commands
            set held_kind = case when batch_no = 0 then 'governor' else 'active_hours' end,
                held_reason = 'the database-health governor: replay_lag_seconds 10.19 > high mark 10',
                held_since = sweeper.now() - interval '1 minute'
          where run_id = $1",
    )
    .bind(&run_id)
    .execute(&app.pool)
    .await
    .unwrap();
    let run = app.api.run(&run_id).await;
    assert!(run["held"].is_null(), "{run}");
    let list = app.get_json("/runs?status=attention").await;
    let entry = list["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run_id"] == run_id.as_str())
        .cloned()
        .unwrap_or_default();
    assert!(entry["held_kind"].is_null(), "{list}");
    let metrics = app.api.metrics().await;
    for kind in ["governor", "active_hours"] {
        assert!(
            metrics.contains(&format!("sweeper_held{{kind=\"{kind}\"}} 0")),
            "{kind}: {}",
            metrics
                .lines()
                .filter(|l| l.starts_with("sweeper_held"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    // A recorded hold of another kind (the schema) still holds: it is the ledger's to say.
    sqlx::query(
        "update sweeper.commands set held_kind = 'schema', held_reason = 'column gone'
          where run_id = $1 and batch_no = 0",
    )
    .bind(&run_id)
    .execute(&app.pool)
    .await
    .unwrap();
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "schema", "{run}");
}

#[tokio::test]
async fn concurrent_first_suspends_of_a_policy_log_one_act_that_changed_it() {
    // A policy never suspended has no state row to lock: suspends at once must still agree on
    // which of them acted. Ten rounds of six, each on a policy with no state row.
    let app = TestApp::spawn(Spawn::default()).await;
    for round in 0..10 {
        sqlx::query("delete from sweeper.policy_state")
            .execute(&app.pool)
            .await
            .unwrap();
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(6));
        let calls: Vec<_> = (0..6)
            .map(|i| {
                let (api, start) = (app.api.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    api.suspend("ticket-retention", &format!("round {round} operator {i}"))
                        .await
                })
            })
            .collect();
        for c in calls {
            c.await.unwrap();
        }
        let changed: Vec<bool> = sqlx::query_scalar(
            "select (detail->>'changed')::boolean from sweeper.operator_log
              where action = 'suspend' and reason like $1",
        )
        .bind(format!("round {round} %"))
        .fetch_all(&app.pool)
        .await
        .unwrap();
        assert_eq!(changed.len(), 6, "round {round}");
        assert_eq!(
            changed.iter().filter(|c| **c).count(),
            1,
            "round {round}: {changed:?}"
        );
    }
}

/// A command the identity guard held keeps its `identity` marker until it is tried again; once
/// the guard is accepted, the marker is history: a run held by something else (its suspension,
/// its approval, its active hours) shows that, on the run and on the attention list.
async fn a_command_marked_by_the_identity_guard(extra_policy: &str) -> (TestApp, String) {
    let app = spawn(policy_with(10, extra_policy), "").await;
    eligible_tickets(&app.pool, 15).await;
    let run_id = trigger_planned(&app).await;
    let command = app.command_ids(&run_id).await.remove(0);
    sqlx::query(
        "update sweeper.database_identity
            set held_since = sweeper.now(), held_detail = 'the database oid changed'",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let a = app.consume(&command).await;
    assert_eq!(a.status, 503, "{:?}", a.body);
    let kind: Option<String> =
        sqlx::query_scalar("select held_kind from sweeper.commands where command_id = $1")
            .bind(&command)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(kind.as_deref(), Some("identity"));
    (app, run_id)
}

async fn accept_the_identity_guard(app: &TestApp) {
    app.api
        .expect(
            200,
            reqwest::Method::POST,
            "/guard/accept",
            Some(json!({"reason": "the restore was intended"})),
        )
        .await;
}

fn listed_kind(list: &Value, run_id: &str) -> Value {
    list["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run_id"] == run_id)
        .unwrap_or_else(|| panic!("{list}"))["held_kind"]
        .clone()
}

#[tokio::test]
async fn an_identity_marker_left_after_the_guard_is_accepted_does_not_hide_a_suspension() {
    let (app, run_id) = a_command_marked_by_the_identity_guard("").await;
    app.api.suspend("ticket-retention", "incident 42").await;
    accept_the_identity_guard(&app).await;
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "suspended", "{run}");
    let list = app.get_json("/runs?status=attention").await;
    assert_eq!(listed_kind(&list, &run_id), "suspended", "{list}");
}

#[tokio::test]
async fn an_identity_marker_left_after_the_guard_is_accepted_does_not_hide_an_approval() {
    let (app, run_id) = a_command_marked_by_the_identity_guard("").await;
    sqlx::query("update sweeper.runs set approval = 'required' where run_id = $1")
        .bind(&run_id)
        .execute(&app.pool)
        .await
        .unwrap();
    accept_the_identity_guard(&app).await;
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "approval", "{run}");
    let list = app.get_json("/runs?status=attention").await;
    assert_eq!(listed_kind(&list, &run_id), "approval", "{list}");
}

#[tokio::test]
async fn an_identity_marker_left_after_the_guard_is_accepted_does_not_hide_active_hours() {
    let closed = format!(
        "active = {{ from = \"{}\", to = \"{}\", timezone = \"UTC\" }}",
        hour_from_now(2),
        hour_from_now(3)
    );
    let (app, run_id) = a_command_marked_by_the_identity_guard(&closed).await;
    accept_the_identity_guard(&app).await;
    let run = app.api.run(&run_id).await;
    assert_eq!(run["held"]["kind"], "active_hours", "{run}");
    let metrics = app.api.metrics().await;
    assert!(
        metrics.contains("sweeper_held_runs{kind=\"active_hours\"} 1")
            && metrics.contains("sweeper_held_runs{kind=\"identity\"} 0"),
        "{metrics}"
    );
}
