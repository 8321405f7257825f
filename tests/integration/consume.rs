//! The consume pipeline: eligibility re-checked at the effect, exactly-once deletion and audit
//! under duplicate deliveries, per-item failures, dry runs, policy changes mid-run.

use std::collections::{BTreeMap, HashSet};

use crate::common::*;
use serde_json::Value;

const WINDOW: &str = "2026-09-01T02:00:00Z";

async fn planned_app(batch_size: usize, setup_sql: &'static str) -> TestApp {
    TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: ticket_policy(batch_size),
        setup_sql,
        ..Default::default()
    })
    .await
}

async fn trigger_and_plan(app: &TestApp, query: &str) -> String {
    let (status, run) = app.trigger("ticket-retention", query).await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    run_id
}

#[tokio::test]
async fn rows_that_change_after_planning_are_rechecked_at_delete_time() {
    let app = planned_app(10, TICKETS).await;
    let cutoff = at("2026-06-03T02:00:00Z");
    let old = cutoff - chrono::TimeDelta::days(1);
    insert_tickets(
        &app.pool,
        &[
            (1, Some("closed"), Some(false), Some(old)),    // deleted
            (2, Some("closed"), Some(false), Some(old)),    // put on legal hold after planning
            (3, Some("closed"), Some(false), Some(old)),    // reopened: timestamp moves past cutoff
            (4, Some("closed"), None, Some(old)), // NULL legal_hold: protected at planning
            (5, Some("closed"), Some(false), Some(old)), // legal_hold becomes NULL after planning
            (6, None, Some(false), Some(old)),    // NULL status: protected at planning
            (7, Some("closed"), Some(false), None), // NULL timestamp: never eligible
            (8, Some("closed"), Some(false), Some(cutoff)), // exactly at the cutoff: strict <
            (
                9,
                Some("closed"),
                Some(false),
                Some(cutoff - chrono::TimeDelta::microseconds(1)),
            ),
            (10, Some("closed"), Some(false), Some(old)), // deleted by someone else first
        ],
    )
    .await;
    let run_id = trigger_and_plan(&app, "").await;
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["eligible_planned"], 6, "{run}");
    assert_eq!(
        run["held_at_planning"],
        serde_json::json!({"unknown:legal_hold": 1, "unknown:status": 1, "null_timestamp": 1})
    );

    sqlx::query("update demo.tickets set legal_hold = true where id = 2")
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("update demo.tickets set closed_at = '2026-08-30T00:00:00Z' where id = 3")
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("update demo.tickets set legal_hold = null where id = 5")
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("delete from demo.tickets where id = 10")
        .execute(&app.pool)
        .await
        .unwrap();
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;

    let audit: BTreeMap<String, (String, Option<String>)> = app
        .audit(&run_id)
        .await
        .into_iter()
        .map(|(k, o, r)| (k, (o, r)))
        .collect();
    let expect = |k: &str, o: &str, r: Option<&str>| {
        assert_eq!(audit[k], (o.to_string(), r.map(str::to_string)), "item {k}");
    };
    expect("1", "deleted", None);
    expect("2", "excluded", Some("legal_hold"));
    expect(
        "3",
        "not_eligible",
        Some("younger_than_cutoff: closed_at >= 2026-06-03T02:00:00Z, the run's cutoff"),
    );
    expect("5", "excluded", Some("unknown:legal_hold"));
    expect("9", "deleted", None);
    expect("10", "already_absent", None);
    assert_eq!(
        audit.len(),
        6,
        "held rows are counted, not audited: {audit:?}"
    );
    assert_eq!(app.ticket_ids().await, vec![2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(run["deleted"], 2);
    assert_eq!(run["excluded"], 2);
    assert_eq!(run["not_eligible"], 1);
    assert_eq!(run["already_absent"], 1);
    assert_eq!(run["remaining_eligible"], 0);
    assert_eq!(run["status"], "completed");
}

#[tokio::test]
async fn duplicate_and_concurrent_deliveries_delete_once_and_audit_once() {
    let app = planned_app(10, TICKETS).await;
    let eligible = seed_mixed(&app.pool, 60, at(WINDOW)).await;
    let run_id = trigger_and_plan(&app, "").await;
    let commands = app.command_ids(&run_id).await;
    assert!(commands.len() >= 3);

    // Twice in a row.
    let first: Value = app.consume(&commands[0]).await.body;
    assert_eq!(first["result"], "executed", "{first}");
    let again = app.consume(&commands[0]).await;
    assert_eq!(again.status, 200);
    let again: Value = again.body;
    assert_eq!(again["result"], "duplicate");

    // Ten at once.
    let mut calls = Vec::new();
    for _ in 0..10 {
        let (client, base, token, id) = (
            app.client.clone(),
            app.base.clone(),
            app.token(&["consume"]),
            commands[1].clone(),
        );
        calls.push(tokio::spawn(async move {
            let r = client
                .post(format!("{base}/consume"))
                .bearer_auth(token)
                .json(&serde_json::json!({ "command_id": id }))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }));
    }
    let mut executed = 0;
    for c in calls {
        let (status, body) = c.await.unwrap();
        assert_eq!(status, 200, "{body}");
        if body["result"] == "executed" {
            executed += 1;
        } else {
            assert_eq!(body["result"], "duplicate");
        }
    }
    assert_eq!(executed, 1);

    // The rest through the queue, and then every command delivered once more.
    app.drain().await;
    for c in &commands {
        let r: Value = app.consume(c).await.body;
        assert_eq!(r["result"], "duplicate");
    }
    let run = app.wait_terminal(&run_id).await;
    let audit = app.audit(&run_id).await;
    let keys: HashSet<&String> = audit.iter().map(|(k, _, _)| k).collect();
    assert_eq!(keys.len(), audit.len(), "one audit row per key");
    assert_eq!(
        audit.iter().filter(|(_, o, _)| o == "deleted").count(),
        eligible.len()
    );
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    let attempts: Vec<i32> =
        sqlx::query_scalar("select attempts from sweeper.commands where run_id = $1")
            .bind(&run_id)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert!(
        attempts.iter().all(|a| *a == 1),
        "one attempt each: {attempts:?}"
    );
}

#[tokio::test]
async fn a_row_blocked_by_a_foreign_key_fails_alone() {
    let app = planned_app(10, TICKETS_WITH_CHILD).await;
    let eligible = seed_mixed(&app.pool, 20, at(WINDOW)).await;
    let blocked = eligible[2];
    sqlx::query("insert into demo.attachments values (1, $1)")
        .bind(blocked)
        .execute(&app.pool)
        .await
        .unwrap();
    let run_id = trigger_and_plan(&app, "").await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed_with_dead_letters");
    assert_eq!(run["failed"], 1);
    assert_eq!(
        run["deleted"].as_i64().unwrap() as usize,
        eligible.len() - 1
    );
    let audit = app.audit(&run_id).await;
    let failed: Vec<_> = audit.iter().filter(|(_, o, _)| o == "failed").collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, blocked.to_string());
    assert!(
        failed[0].2.as_deref().unwrap().contains("foreign key"),
        "{failed:?}"
    );
    assert_eq!(
        app.ticket_ids()
            .await
            .iter()
            .filter(|id| eligible.contains(id))
            .collect::<Vec<_>>(),
        vec![&blocked]
    );
    let states: Vec<String> =
        sqlx::query_scalar("select distinct state from sweeper.commands where run_id = $1")
            .bind(&run_id)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(states, vec!["succeeded"]);
}

#[tokio::test]
async fn dry_runs_delete_nothing_record_would_delete_and_repeat_freely() {
    let app = planned_app(10, TICKETS).await;
    let eligible = seed_mixed(&app.pool, 50, at(WINDOW)).await;
    let first = trigger_and_plan(&app, "?dry_run=true").await;
    let second = trigger_and_plan(&app, "?dry_run=true").await;
    assert_eq!(first, format!("ticket-retention:{WINDOW}:dry-1"));
    assert_eq!(second, format!("ticket-retention:{WINDOW}:dry-2"));
    app.drain().await;
    for run_id in [&first, &second] {
        let run = app.wait_terminal(run_id).await;
        assert_eq!(run["dry_run"], true);
        assert_eq!(run["deleted"], 0);
        assert!(
            run["remaining_eligible"].is_null(),
            "dry runs skip the closure check"
        );
        let mut would: Vec<i64> = app
            .audit(run_id)
            .await
            .into_iter()
            .filter(|(_, o, _)| o == "would_delete")
            .map(|(k, _, _)| k.parse().unwrap())
            .collect();
        would.sort();
        assert_eq!(would, eligible);
    }
    assert_eq!(
        app.ticket_ids().await.len(),
        50,
        "a dry run deletes nothing"
    );
    // A real run for the same window is still its own, single run.
    let real = trigger_and_plan(&app, "").await;
    assert_eq!(real, format!("ticket-retention:{WINDOW}"));
}

#[tokio::test]
async fn a_stricter_configuration_mid_run_wins_and_older_replicas_wait() {
    let app = planned_app(100, TICKETS).await;
    let cutoff = at("2026-06-03T02:00:00Z");
    insert_tickets(
        &app.pool,
        &[
            (
                1,
                Some("closed"),
                Some(false),
                Some(cutoff - chrono::TimeDelta::days(30)),
            ),
            (
                2,
                Some("solved"),
                Some(false),
                Some(cutoff - chrono::TimeDelta::days(30)),
            ),
            // Old enough for 90 days, not for 100.
            (
                3,
                Some("closed"),
                Some(false),
                Some(cutoff - chrono::TimeDelta::days(5)),
            ),
        ],
    )
    .await;
    let run_id = trigger_and_plan(&app, "").await;
    let command = app.command_ids(&run_id).await.remove(0);
    let (db, pool) = app.stop().await;

    // A replica that started on the old configuration and is still running...
    let old = sweeper::app::Application::build(
        sweeper::settings::Config::from_toml(&config_toml(&db.url, 0, "", &ticket_policy(100)))
            .unwrap(),
    )
    .await
    .unwrap();
    // ...when a new configuration rolls out: keep `solved` tickets too, retain for 100 days.
    let stricter = ticket_policy(100)
        .replace(
            r#"in = ["open", "pending_export"]"#,
            r#"in = ["open", "pending_export", "solved"]"#,
        )
        .replace(r#"retain_for = "90d""#, r#"retain_for = "100d""#);
    let new = TestApp::start(db, pool, 0, "", &stricter).await;

    // The old replica must not act.
    let outcome = sweeper::execute::execute(
        &old.state(),
        &command,
        sweeper::execute::Executor::Delivery { push: false },
        "old",
    )
    .await
    .unwrap();
    assert!(
        matches!(outcome, sweeper::execute::ConsumeOutcome::NotNow { .. }),
        "{outcome:?}"
    );
    assert_eq!(new.ticket_ids().await, vec![1, 2, 3]);

    let r: Value = new.consume(&command).await.body;
    assert_eq!(r["result"], "executed", "{r}");
    let audit: BTreeMap<String, (String, Option<String>)> = new
        .audit(&run_id)
        .await
        .into_iter()
        .map(|(k, o, r)| (k, (o, r)))
        .collect();
    assert_eq!(audit["1"].0, "deleted");
    assert_eq!(audit["2"], ("excluded".into(), Some("status".into())));
    // Kept for being younger than the stricter cutoff, and the audit row says so.
    let (outcome, reason) = &audit["3"];
    assert_eq!(outcome, "not_eligible");
    let version: String =
        sqlx::query_scalar("select version from sweeper.policy_versions order by seq desc limit 1")
            .fetch_one(&new.pool)
            .await
            .unwrap();
    assert_eq!(
        reason.as_deref(),
        Some(
            format!(
                "younger_than_cutoff: closed_at >= 2026-05-24T02:00:00Z, the cutoff of the \
                 current version {version}, stricter than the run's"
            )
            .as_str()
        )
    );
    assert_eq!(new.ticket_ids().await, vec![2, 3]);
    // The run shows the cutoff it acts under, and whose it is.
    let run = new.api.run(&run_id).await;
    assert_eq!(run["cutoff"], "2026-06-03T02:00:00Z", "{run}");
    assert_eq!(run["effective_cutoff"], "2026-05-24T02:00:00Z", "{run}");
    assert_eq!(run["stricter_cutoff"]["version"], version.as_str(), "{run}");
}

const DEFERRED_CHILD: &str = "
create schema demo;
create table demo.tickets (id bigint primary key, status text, legal_hold boolean, closed_at timestamptz);
create index on demo.tickets (closed_at);
create table demo.attachments (id bigint primary key,
    ticket_id bigint references demo.tickets (id) deferrable initially deferred)
";

#[tokio::test]
async fn a_row_blocked_by_a_deferred_foreign_key_fails_alone_too() {
    let app = planned_app(10, DEFERRED_CHILD).await;
    let eligible = seed_mixed(&app.pool, 20, at(WINDOW)).await;
    let blocked = eligible[3];
    sqlx::query("insert into demo.attachments values (1, $1)")
        .bind(blocked)
        .execute(&app.pool)
        .await
        .unwrap();
    let run_id = trigger_and_plan(&app, "").await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["failed"], 1, "{run}");
    assert_eq!(
        run["deleted"].as_i64().unwrap() as usize,
        eligible.len() - 1
    );
    let failed: Vec<String> = app
        .audit(&run_id)
        .await
        .into_iter()
        .filter(|(_, o, _)| o == "failed")
        .map(|(k, _, _)| k)
        .collect();
    assert_eq!(failed, vec![blocked.to_string()]);
}

#[tokio::test]
async fn reverting_a_configuration_makes_the_reverted_version_current_again() {
    let app = planned_app(10, TICKETS).await;
    let v1 = app.get_json("/policies").await["policies"][0]["version"].clone();
    let (db, pool) = app.stop().await;
    let v2_policy = ticket_policy(10).replace(r#"retain_for = "90d""#, r#"retain_for = "91d""#);
    let b = TestApp::start(db, pool, 0, "", &v2_policy).await;
    let v2 = b.get_json("/policies").await["policies"][0]["current_version"].clone();
    assert_ne!(v1, v2);
    let (db, pool) = b.stop().await;
    let a = TestApp::start(db, pool, 0, "", &ticket_policy(10)).await;
    let p = &a.get_json("/policies").await["policies"][0];
    assert_eq!(p["current_version"], v1, "{p}");
    seed_mixed(&a.pool, 10, at(WINDOW)).await;
    let run_id = trigger_and_plan(&a, "").await;
    a.drain().await;
    assert_eq!(a.wait_terminal(&run_id).await["status"], "completed");
}

/// The run row is not written per command (docs/design.md §7: its totals are summed from its
/// commands): a session holding the run row locked delays only the run's completion,
/// never its commands. Before, every command updated the run row under its lock and waited here.
#[tokio::test]
async fn commands_execute_while_their_run_row_is_locked_and_the_last_completes_the_run() {
    use sqlx::Connection;
    let app = planned_app(10, TICKETS).await;
    let eligible = seed_mixed(&app.pool, 60, at(WINDOW)).await;
    let run_id = trigger_and_plan(&app, "").await;
    let commands = app.command_ids(&run_id).await;
    assert!(commands.len() >= 3, "{commands:?}");

    let mut holder = sqlx::PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("begin").execute(&mut holder).await.unwrap();
    sqlx::query("select 1 from sweeper.runs where run_id = $1 for update")
        .bind(&run_id)
        .execute(&mut holder)
        .await
        .unwrap();
    let (last, rest) = commands.split_last().unwrap();
    for c in rest {
        let answer = tokio::time::timeout(std::time::Duration::from_secs(5), app.consume(c))
            .await
            .expect("a command does not wait for its run row");
        assert_eq!(answer.body["result"], "executed", "{}", answer.body);
        assert_eq!(answer.body["run_status"], "running", "{}", answer.body);
    }
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["pending_commands"], 1, "{run}");
    assert_eq!(run["status"], "running", "{run}");
    let deleted_so_far = run["deleted"].as_i64().unwrap();
    assert!(deleted_so_far > 0, "{run}");

    // The last command commits; only its completion check waits for the run row.
    let release = async {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let state: String =
            sqlx::query_scalar("select state from sweeper.commands where command_id = $1")
                .bind(last)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        sqlx::query("rollback").execute(&mut holder).await.unwrap();
        state
    };
    let (answer, state_while_locked) = tokio::join!(app.consume(last), release);
    assert_eq!(state_while_locked, "succeeded");
    assert_eq!(answer.body["result"], "executed", "{}", answer.body);
    assert_eq!(answer.body["run_status"], "completed", "{}", answer.body);
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["pending_commands"], 0, "{run}");
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    assert_eq!(run["remaining_eligible"], 0, "the closure check ran: {run}");
}

/// A completion that cannot happen now never holds anything up: with the run row held longer
/// than a second, the last command answers at once (`running`) and housekeeping completes the
/// run; a closure check that cannot read the table (locked exclusively) is left out rather
/// than keeping the run open, and housekeeping goes on.
#[tokio::test]
async fn a_run_completes_without_waiting_on_its_row_or_on_its_closure_check() {
    use sqlx::Connection;
    let app = planned_app(10, TICKETS).await;
    let eligible = seed_mixed(&app.pool, 30, at(WINDOW)).await;
    let run_id = trigger_and_plan(&app, "").await;
    let commands = app.command_ids(&run_id).await;
    let mut holder = sqlx::PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("begin").execute(&mut holder).await.unwrap();
    sqlx::query("select 1 from sweeper.runs where run_id = $1 for update")
        .bind(&run_id)
        .execute(&mut holder)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    for c in &commands {
        let answer = app.consume(c).await;
        assert_eq!(answer.body["result"], "executed", "{}", answer.body);
        assert_eq!(answer.body["run_status"], "running", "{}", answer.body);
    }
    assert!(
        started.elapsed() < std::time::Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    sqlx::query("rollback").execute(&mut holder).await.unwrap();
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(
        (run["status"].as_str(), run["pending_commands"].as_i64()),
        (Some("running"), Some(0))
    );

    // Done but open; the table is locked exclusively while housekeeping completes the run.
    sqlx::query("begin").execute(&mut holder).await.unwrap();
    sqlx::query("lock table demo.tickets in access exclusive mode")
        .execute(&mut holder)
        .await
        .unwrap();
    sweeper::app::housekeeping::housekeeping_once(&app.state)
        .await
        .unwrap();
    sqlx::query("rollback").execute(&mut holder).await.unwrap();
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    assert!(
        run["remaining_eligible"].is_null(),
        "the check was left out: {run}"
    );
}
