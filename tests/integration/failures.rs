//! Failure handling and operator control: retries to quarantine, snoozes past max_age, item
//! dead letters and redrive, poison envelopes, suspend/resume, cancel, leases, purge, metrics.

use std::time::Duration;

use crate::common::*;
use crate::kit::ledger::{
    advance_clock, force_all_dead_letters_abandoned, force_claimed, force_envelope_dead_letter,
    force_quarantined, hold_concurrency_slot,
};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};
use sweeper::app::worker::{WorkerStep, run_one_command};
use sweeper::execute::{ConsumeOutcome, Executor};

const WINDOW: &str = "2026-09-01T02:00:00Z";

async fn planned_run(app: &TestApp) -> String {
    let (status, run) = app.trigger("ticket-retention", "").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    run_id
}

async fn post_json(app: &TestApp, path: &str, body: Value) -> (u16, Value) {
    let r = app
        .client
        .post(format!("{}{path}", app.base))
        .bearer_auth(app.ops_token())
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn dead_letters(app: &TestApp) -> Vec<Value> {
    app.get_json("/dead-letters").await["dead_letters"]
        .as_array()
        .unwrap()
        .clone()
}

async fn advance(app: &TestApp, seconds: i64) {
    advance_clock(&app.pool, seconds).await;
}

#[tokio::test]
async fn a_command_failing_transiently_is_quarantined_once_after_max_attempts_and_redrive_completes_it()
 {
    let app = ticket_app(
        r#"retry = { max_attempts = 3, base = "1s", cap = "2s", max_age = "1d" }"#,
        "[consume]\nlock_timeout = \"1s\"",
        TICKETS,
    )
    .await;
    let eligible = seed_mixed(&app.pool, 12, at(WINDOW)).await;
    let run_id = planned_run(&app).await;
    let command = app.command_ids(&run_id).await.remove(0);

    // One of the command's rows cannot be deleted (a transient error) for the whole test.
    fail_ticket_deletes(&app.pool, eligible[0]).await;

    for attempt in 1..=3 {
        match run_one_command(&app.state).await.unwrap() {
            WorkerStep::Ran(ConsumeOutcome::NotNow { .. }) if attempt < 3 => {}
            WorkerStep::Ran(ConsumeOutcome::Quarantined { error, .. }) if attempt == 3 => {
                assert!(error.contains("40001"), "{error}");
            }
            other => panic!("attempt {attempt}: {other:?}"),
        }
        advance(&app, 3).await;
    }
    assert!(matches!(
        run_one_command(&app.state).await.unwrap(),
        WorkerStep::Idle
    ));
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed_with_dead_letters");
    assert_eq!(run["commands"]["quarantined"], 1);
    assert_eq!(run["stopped_commands"][0]["command_id"], command.as_str());
    assert_eq!(run["stopped_commands"][0]["last_error_class"], "transient");
    assert_eq!(run["open_dead_letters"][0]["replay_safe"]["safe"], true);

    let dls = dead_letters(&app).await;
    assert_eq!(dls.len(), 1);
    let dl = &dls[0];
    assert_eq!(
        (dl["kind"].as_str(), dl["class"].as_str()),
        (Some("command"), Some("transient"))
    );
    let history = dl["attempts"].as_array().unwrap();
    assert_eq!(history.len(), 3, "{history:?}");
    assert!(history.iter().all(|a| a["class"] == "transient"));
    assert_eq!(history[2]["outcome"], "quarantined");
    assert!(history[0]["delay_seconds"].as_f64().unwrap() <= 2.0);

    // Later duplicate deliveries add nothing.
    for _ in 0..3 {
        let r: Value = app.consume(&command).await.body;
        assert_eq!(r["result"], "duplicate");
    }
    assert_eq!(dead_letters(&app).await.len(), 1);

    // The cause goes away; one curl redrives it; it really runs and the dead letter resolves.
    heal_ticket_deletes(&app.pool, eligible[0]).await;
    let id = dl["dead_letter_id"].as_i64().unwrap();
    let (status, body) = post_json(
        &app,
        &format!("/dead-letters/{id}/redrive"),
        json!({"reason": "lock released"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["result"]["redriven"]["command_id"], command.as_str());
    let generation: i32 =
        sqlx::query_scalar("select publish_generation from sweeper.commands where command_id = $1")
            .bind(&command)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(generation, 2);
    assert!(matches!(
        run_one_command(&app.state).await.unwrap(),
        WorkerStep::Ran(ConsumeOutcome::Executed { .. })
    ));
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed");
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    let dl = app.get_json(&format!("/dead-letters/{id}")).await;
    assert_eq!(dl["status"], "resolved");
    assert_eq!(dl["resolved_by"], "test-operator");
    // Redriving it again is a no-op.
    let (status, body) = post_json(
        &app,
        &format!("/dead-letters/{id}/redrive"),
        json!({"reason": "again"}),
    )
    .await;
    assert_eq!(
        (status, &body["result"]["no_op"]["status"]),
        (200, &json!("resolved"))
    );
    let log: Vec<(String, String, String)> = sqlx::query_as(
        "select subject, action, reason from sweeper.operator_log order by entry_id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        log,
        vec![(
            "test-operator".into(),
            "redrive".into(),
            "lock released".into()
        )]
    );
}

#[tokio::test]
async fn a_command_snoozed_past_max_age_is_quarantined_as_throttled_without_spending_attempts() {
    let app = ticket_app(
        "max_concurrent_commands = 1\nretry = { max_attempts = 2, max_age = \"5m\" }",
        "",
        TICKETS,
    )
    .await;
    seed_mixed(&app.pool, 5, at(WINDOW)).await;
    let run_id = planned_run(&app).await;
    // Another executor holds the policy's only slot.
    let _holder = hold_concurrency_slot(&app.db.url, "ticket-retention", 0).await;
    for _ in 0..4 {
        match run_one_command(&app.state).await.unwrap() {
            WorkerStep::Ran(ConsumeOutcome::NotNow { reason, .. }) => {
                assert!(reason.starts_with("snoozed (throttled)"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        advance(&app, 10).await;
    }
    let attempts: i32 =
        sqlx::query_scalar("select attempts from sweeper.commands where run_id = $1")
            .bind(&run_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 0, "snoozes spend no attempt");
    let why: String =
        sqlx::query_scalar("select last_error from sweeper.commands where run_id = $1")
            .bind(&run_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(why.contains("max_concurrent_commands"), "{why}");
    advance(&app, 300).await;
    match run_one_command(&app.state).await.unwrap() {
        WorkerStep::Ran(ConsumeOutcome::Quarantined { error, .. }) => {
            assert!(error.contains("max_age"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    let dls = dead_letters(&app).await;
    assert_eq!(dls.len(), 1);
    assert_eq!(dls[0]["class"], "throttled");
    let snoozes = dls[0]["attempts"].as_array().unwrap();
    assert_eq!(
        snoozes.iter().filter(|a| a["outcome"] == "snoozed").count(),
        4
    );
    assert_eq!(app.ticket_ids().await.len(), 5, "nothing ran");
}

#[tokio::test]
async fn a_failed_item_is_an_item_dead_letter_and_its_redrive_reexecutes_only_it() {
    let app = ticket_app("", "", TICKETS_WITH_CHILD).await;
    let eligible = seed_mixed(&app.pool, 20, at(WINDOW)).await;
    let blocked = eligible[1];
    sqlx::query("insert into demo.attachments values (1, $1)")
        .bind(blocked)
        .execute(&app.pool)
        .await
        .unwrap();
    let run_id = planned_run(&app).await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed_with_dead_letters");
    let dls = dead_letters(&app).await;
    assert_eq!(dls.len(), 1);
    assert_eq!(
        (dls[0]["kind"].as_str(), dls[0]["item_key"].as_str()),
        (Some("item"), Some(blocked.to_string().as_str()))
    );
    assert_eq!(dls[0]["class"], "permanent");

    // Redriving before the cause is fixed fails again and reopens the same dead letter.
    let id = dls[0]["dead_letter_id"].as_i64().unwrap();
    let (status, _) = post_json(
        &app,
        &format!("/dead-letters/{id}/redrive"),
        json!({"reason": "try"}),
    )
    .await;
    assert_eq!(status, 200);
    app.drain().await;
    app.wait_terminal(&run_id).await;
    let dl = app.get_json(&format!("/dead-letters/{id}")).await;
    assert_eq!(
        (dl["status"].as_str(), dl["failures"].as_i64()),
        (Some("open"), Some(2))
    );

    sqlx::query("delete from demo.attachments")
        .execute(&app.pool)
        .await
        .unwrap();
    let (status, body) = post_json(
        &app,
        &format!("/dead-letters/{id}/redrive"),
        json!({"reason": "attachment moved"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["failed"], 0);
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    assert_eq!(run["remaining_eligible"], 0);
    // Two redrives of one dead letter re-queue one command: the run counts it once.
    let commands: i64 =
        sqlx::query_scalar("select count(*) from sweeper.commands where run_id = $1")
            .bind(&run_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(run["commands_total"], commands, "{run}");
    let trail: Vec<String> = app
        .audit(&run_id)
        .await
        .into_iter()
        .filter(|(k, _, _)| *k == blocked.to_string())
        .map(|(_, o, _)| o)
        .collect();
    assert_eq!(
        trail,
        vec!["failed", "failed", "deleted"],
        "each execution adds a row"
    );
    assert_eq!(
        app.get_json(&format!("/dead-letters/{id}")).await["status"],
        "resolved"
    );
    // Neighbours were not redone: one audit row each.
    let others: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.audit_trail where run_id = $1 and item_key <> $2",
    )
    .bind(&run_id)
    .bind(blocked.to_string())
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(others as usize, eligible.len() - 1);
}

#[tokio::test]
async fn an_envelope_refusal_says_what_is_wrong_in_our_words() {
    let app = ticket_app("", "", TICKETS).await;
    // Each refusal in our words, naming what an envelope is.
    for (bytes, says) in [
        ("", "the body is empty, not JSON"),
        ("{\"command_id\": \"x\"", "it ends before its value does"),
        (
            "[1]",
            "not an object; an envelope is an object with command_id (text)",
        ),
        ("{}", "the member `command_id` is missing"),
        ("{\"command_id\": 7}", "`command_id` must be text"),
        (
            "{\"command_id\": \"x\", \"schema_version\": -1}",
            "`schema_version` must be an integer from 0 to 4294967295",
        ),
        // Whichever copy a parser would keep, the delivery is not read.
        (
            "{\"command_id\": \"x\", \"command_id\": \"y\"}",
            "a member is named twice",
        ),
        (
            "{\"command_id\": \"x\", \"\\u0063ommand_id\": \"y\"}",
            "a member is named twice",
        ),
    ] {
        let r = app
            .client
            .post(format!("{}/consume", app.base))
            .bearer_auth(app.token(&["consume"]))
            .body(bytes)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["result"], "quarantined_envelope", "{bytes}: {body}");
        let error = body["error"].as_str().unwrap();
        assert!(error.contains(says), "{bytes}: {error}");
        for library in ["EOF", "invalid type", "expected", "missing field"] {
            assert!(!error.contains(library), "{bytes}: {error}");
        }
    }
}

#[tokio::test]
async fn an_unparseable_envelope_is_quarantined_once_and_acknowledged() {
    let app = ticket_app("", "", TICKETS).await;
    for _ in 0..2 {
        let r = app
            .client
            .post(format!("{}/consume", app.base))
            .bearer_auth(app.token(&["consume"]))
            .body("{\"command\": [1, 2, \u{0}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["result"], "quarantined_envelope");
        assert!(
            body["error"]
                .as_str()
                .unwrap()
                .contains("the body is not JSON: unexpected input at line 1, column "),
            "{body}"
        );
    }
    let dls = dead_letters(&app).await;
    assert_eq!(dls.len(), 1);
    assert_eq!(dls[0]["kind"], "envelope");
    assert_eq!(dls[0]["failures"], 2);
    assert_eq!(dls[0]["raw_sha256"].as_str().unwrap().len(), 64);
    let id = dls[0]["dead_letter_id"].as_i64().unwrap();
    let (status, _) = post_json(
        &app,
        &format!("/dead-letters/{id}/redrive"),
        json!({"reason": "x"}),
    )
    .await;
    assert_eq!(status, 409, "nothing to run");
    let (status, _) = post_json(&app, &format!("/dead-letters/{id}/abandon"), json!({})).await;
    assert_eq!(status, 400, "a reason is required");
    let (status, body) = post_json(
        &app,
        &format!("/dead-letters/{id}/abandon"),
        json!({"reason": "garbage from a test"}),
    )
    .await;
    assert_eq!((status, body["result"].as_str()), (200, Some("abandoned")));
    assert!(
        dead_letters(&app)
            .await
            .iter()
            .all(|d| d["status"] == "abandoned")
    );
    // Unauthenticated garbage is refused, not quarantined.
    let r = app
        .client
        .post(format!("{}/consume", app.base))
        .body("garbage")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(dead_letters(&app).await.len(), 1);
}

#[tokio::test]
async fn a_suspended_policy_claims_nothing_until_resumed() {
    let app = ticket_app("", "", TICKETS).await;
    let eligible = seed_mixed(&app.pool, 30, at(WINDOW)).await;
    let run_id = planned_run(&app).await;
    let (status, body) = post_json(
        &app,
        "/policies/ticket-retention/suspend",
        json!({"reason": "incident 42"}),
    )
    .await;
    assert_eq!((status, body["suspended"].as_bool()), (200, Some(true)));

    let (status, body) = app
        .trigger("ticket-retention", "?window=2026-08-31T02:00:00Z")
        .await;
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("suspended")),
        "{body}"
    );
    assert!(matches!(
        run_one_command(&app.state).await.unwrap(),
        WorkerStep::Idle
    ));
    let command = app.command_ids(&run_id).await.remove(0);
    assert_eq!(app.consume(&command).await.status, 503);
    assert_eq!(app.ticket_ids().await.len(), 30);
    let runs: i64 = sqlx::query_scalar("select count(*) from sweeper.runs")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(runs, 1, "no run while suspended");

    let (status, _) = post_json(
        &app,
        "/policies/ticket-retention/resume",
        json!({"reason": "fixed"}),
    )
    .await;
    assert_eq!(status, 200);
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    let actions: Vec<String> =
        sqlx::query_scalar("select action from sweeper.operator_log order by entry_id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(actions, vec!["suspend", "resume"]);
}

#[tokio::test]
async fn a_cancelled_run_stops_and_deletes_nothing_more() {
    let app = ticket_app("", "", TICKETS).await;
    seed_mixed(&app.pool, 40, at(WINDOW)).await;
    let run_id = planned_run(&app).await;
    let commands = app.command_ids(&run_id).await;
    let r: Value = app.consume(&commands[0]).await.body;
    assert_eq!(r["result"], "executed");
    let left = app.ticket_ids().await.len();

    let (status, body) = post_json(
        &app,
        &format!("/runs/{run_id}/cancel"),
        json!({"reason": "wrong policy"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["commands_cancelled"].as_u64().unwrap() as usize,
        commands.len() - 1
    );
    assert!(matches!(
        run_one_command(&app.state).await.unwrap(),
        WorkerStep::Idle
    ));
    let r: Value = app.consume(&commands[1]).await.body;
    assert_eq!(
        (r["result"].as_str(), r["state"].as_str()),
        (Some("duplicate"), Some("cancelled"))
    );
    assert_eq!(app.ticket_ids().await.len(), left);
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "cancelled");
    assert_eq!(
        run["commands"]["cancelled"].as_u64().unwrap() as usize,
        commands.len() - 1
    );
    // A completed run cannot be cancelled.
    let (_, other) = app
        .trigger("ticket-retention", "?window=2026-08-31T02:00:00Z")
        .await;
    let other = other["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&other).await;
    app.drain().await;
    app.wait_terminal(&other).await;
    let (status, _) = post_json(
        &app,
        &format!("/runs/{other}/cancel"),
        json!({"reason": "late"}),
    )
    .await;
    assert_eq!(status, 409);
}

#[tokio::test]
async fn a_stale_worker_cannot_overwrite_a_newer_attempt_and_leases_are_reclaimed() {
    let app = ticket_app("", "lease = \"2m\"\nclaim_batch = 1", TICKETS).await;
    let eligible = seed_mixed(&app.pool, 5, at(WINDOW)).await;
    let run_id = planned_run(&app).await;
    let command = app.command_ids(&run_id).await.remove(0);
    // A worker claims attempt 1 and dies (its claim is all that happened).
    force_claimed(&app.pool, &command, 1, 120, None).await;
    assert!(
        matches!(run_one_command(&app.state).await.unwrap(), WorkerStep::Idle),
        "a live lease is respected"
    );
    advance(&app, 121).await;
    match run_one_command(&app.state).await.unwrap() {
        WorkerStep::Ran(ConsumeOutcome::Executed { .. }) => {}
        other => panic!("{other:?}"),
    }
    // The first worker wakes up and tries to finish attempt 1.
    let late = sweeper::execute::execute(
        &app.state,
        &command,
        Executor::Claimed(sweeper::ledger::commands::CommandTry::claimed(&command, 1)),
        "stale",
    )
    .await
    .unwrap();
    assert!(
        matches!(
            late,
            ConsumeOutcome::Duplicate { .. } | ConsumeOutcome::Stale(_)
        ),
        "{late:?}"
    );
    let attempts: i32 =
        sqlx::query_scalar("select attempts from sweeper.commands where command_id = $1")
            .bind(&command)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 2);
    let rows: i64 = sqlx::query_scalar("select count(*) from sweeper.audit_trail")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        rows as usize,
        eligible.len(),
        "one audit row per planned key"
    );
}

#[tokio::test]
async fn shutdown_releases_this_replicas_leases() {
    let app = ticket_app("", "", TICKETS).await;
    seed_mixed(&app.pool, 5, at(WINDOW)).await;
    let run_id = planned_run(&app).await;
    let command = app.command_ids(&run_id).await.remove(0);
    force_claimed(&app.pool, &command, 1, 300, Some(app.state.replica_id)).await;
    let (_db, pool) = app.stop().await;
    let (state, attempts, owner): (String, i32, Option<uuid::Uuid>) = sqlx::query_as(
        "select state, attempts, lease_owner from sweeper.commands where command_id = $1",
    )
    .bind(&command)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((state.as_str(), attempts, owner), ("pending", 0, None));
}

#[tokio::test]
async fn old_terminal_commands_are_purged_and_their_redelivery_is_acknowledged() {
    let app = ticket_app("", "", TICKETS_WITH_CHILD).await;
    let eligible = seed_mixed(&app.pool, 40, at(WINDOW)).await;
    // One command will be quarantined: keep its dead letter open.
    let run_id = planned_run(&app).await;
    let commands = app.command_ids(&run_id).await;
    force_quarantined(&app.pool, "ticket-retention", &run_id, &commands[0]).await;
    app.drain().await;
    app.wait_terminal(&run_id).await;
    let audit_before = app.audit(&run_id).await.len();
    assert_eq!(
        sweeper::app::housekeeping::housekeeping_once(&app.state)
            .await
            .unwrap(),
        0,
        "nothing is old yet"
    );
    advance(&app, 31 * 86_400).await;
    let purged = sweeper::app::housekeeping::housekeeping_once(&app.state)
        .await
        .unwrap();
    assert_eq!(
        purged as usize,
        commands.len() - 1,
        "all but the one with an open dead letter"
    );
    let left: Vec<String> = sqlx::query_scalar("select command_id from sweeper.commands")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, vec![commands[0].clone()]);
    assert_eq!(
        app.audit(&run_id).await.len(),
        audit_before,
        "audit is never purged"
    );
    let r: Value = app.consume(&commands[1]).await.body;
    assert_eq!(r["result"], "unknown_command_of_terminal_run");
    assert_eq!(
        app.get_json(&format!("/runs/{run_id}")).await["run_id"],
        run_id.as_str()
    );
    let _ = eligible;
}

#[tokio::test]
async fn metrics_expose_dead_letter_age_and_a_monotonic_quarantine_counter() {
    let app = ticket_app("", "", TICKETS).await;
    let metric = |text: &str, name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in:\n{text}"))
    };
    let scrape = || async {
        app.client
            .get(format!("{}/metrics", app.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    force_envelope_dead_letter(&app.pool, "a").await;
    advance(&app, 6 * 86_400).await;
    let text = scrape().await;
    assert_eq!(metric(&text, "sweeper_dead_letters_open"), 1.0);
    assert!(metric(&text, "sweeper_dead_letters_oldest_open_age_seconds") >= 518_400.0);
    assert_eq!(metric(&text, "sweeper_quarantined_total"), 1.0);
    force_envelope_dead_letter(&app.pool, "b").await;
    force_envelope_dead_letter(&app.pool, "c").await;
    let text = scrape().await;
    assert_eq!(metric(&text, "sweeper_dead_letters_open"), 3.0);
    assert_eq!(metric(&text, "sweeper_quarantined_total"), 3.0);
    force_all_dead_letters_abandoned(&app.pool).await;
    let text = scrape().await;
    assert_eq!(metric(&text, "sweeper_dead_letters_open"), 0.0);
    assert_eq!(
        metric(&text, "sweeper_quarantined_total"),
        3.0,
        "the counter never goes down"
    );
    assert!(text.contains("sweeper_commands{state=\"pending\"}"));
    assert!(text.contains("sweeper_runs{status=\"completed\"}"));
}

#[tokio::test]
async fn killing_the_servers_connections_mid_run_does_not_stop_the_run() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: format!(
            "{}retry = {{ max_attempts = 20, base = \"1s\", cap = \"1s\" }}\n",
            ticket_policy(5)
        ),
        // Short leases: a claim whose commit reply was lost with its connection stays leased
        // until its lease expires.
        extra_toml: "lease = \"15s\"\nclaim_batch = 1\n[planning]\nlease = \"5s\"\n\
                     [consume]\nstatement_timeout = \"5s\"\ncommand_deadline = \"10s\""
            .into(),
        workers: 2,
        ..Default::default()
    })
    .await;
    let eligible = seed_mixed(&app.pool, 3_000, at(WINDOW)).await;
    let (_, run) = app.trigger("ticket-retention", "").await;
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let mut killer = PgConnection::connect(&app.db.url).await.unwrap();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        sqlx::query(
            "select pg_terminate_backend(pid) from pg_stat_activity
              where application_name = 'sweeper' and datname = current_database()",
        )
        .execute(&mut killer)
        .await
        .unwrap();
    }
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    let dup: i64 = sqlx::query_scalar(
        "select count(*) from (select item_key from sweeper.audit_trail group by item_key having count(*) > 1) d",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(dup, 0);
}

#[tokio::test]
async fn a_command_that_keeps_killing_its_workers_is_quarantined_after_max_attempts() {
    let app = ticket_app(
        r#"retry = { max_attempts = 3 }"#,
        "lease = \"2m\"\nclaim_batch = 1",
        TICKETS,
    )
    .await;
    seed_mixed(&app.pool, 5, at(WINDOW)).await;
    let run_id = planned_run(&app).await;
    let command = app.command_ids(&run_id).await.remove(0);
    // Three claims whose workers died: attempts 3, leased, lease expired.
    force_claimed(&app.pool, &command, 3, -1, None).await;
    match run_one_command(&app.state).await.unwrap() {
        WorkerStep::Ran(ConsumeOutcome::Quarantined { error, .. }) => {
            assert!(error.contains("past max_attempts"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        app.ticket_ids().await.len(),
        5,
        "not executed a fourth time"
    );
    assert_eq!(dead_letters(&app).await.len(), 1);
}

#[tokio::test]
async fn hostile_inputs_get_problem_json_never_a_5xx() {
    let app = ticket_app("", "", TICKETS).await;
    let token = app.ops_token();
    // A NUL in a command id is a poison envelope: quarantined and acknowledged.
    let r = app
        .client
        .post(format!("{}/consume", app.base))
        .bearer_auth(app.token(&["consume"]))
        .body("{\"command_id\": \"a\\u0000b\"}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap()["result"],
        "quarantined_envelope"
    );
    for (method, path, status) in [
        ("GET", "/runs/a%00b", 400),
        ("GET", "/runs?policy=%00", 400),
        ("GET", "/dead-letters?run_id=%00", 400),
        ("GET", "/dead-letters/abc", 400),
        ("GET", "/dead-letters/99999999999999999999", 400),
        ("GET", "/runs/%FF", 400),
        ("POST", "/runs/a%00b/cancel", 400),
    ] {
        let mut req = app
            .client
            .request(method.parse().unwrap(), format!("{}{path}", app.base))
            .bearer_auth(&token);
        if method == "POST" {
            req = req.body("{\"reason\": \"x\"}");
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{method} {path}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{method} {path}"
        );
    }
    let big = "x".repeat(70 * 1024);
    let r = app
        .client
        .post(format!("{}/consume", app.base))
        .bearer_auth(app.token(&["consume"]))
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
}

#[tokio::test]
async fn a_failing_planning_page_is_visible_on_the_run_and_in_metrics_and_resumes() {
    // Another session locks the whole table: every planning page fails on lock_timeout (a
    // schema error, by contrast, holds planning: see schema_blip.rs).
    let app = ticket_app(
        "",
        "[database]\nmax_connections = 8\nlock_timeout = \"1s\"",
        TICKETS,
    )
    .await;
    let eligible = seed_mixed(&app.pool, 30, at(WINDOW)).await;
    let mut locker = sqlx::PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::raw_sql("begin; lock table demo.tickets in access exclusive mode")
        .execute(&mut locker)
        .await
        .unwrap();
    let (status, run) = app.trigger("ticket-retention", "").await;
    assert_eq!(status, 202);
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let run = app
        .wait_until(&run_id, "a recorded planning failure", |r| {
            r["planning"]["consecutive_failures"].as_i64().unwrap_or(0) >= 1
        })
        .await;
    assert_eq!(run["status"], "planning");
    assert!(
        run["planning"]["last_error"]
            .as_str()
            .unwrap()
            .contains("lock timeout"),
        "{run}"
    );
    let text = app
        .client
        .get(format!("{}/metrics", app.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("sweeper_planning_jobs_failing 1"), "{text}");

    sqlx::raw_sql("commit").execute(&mut locker).await.unwrap();
    app.wait_planned(&run_id).await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["planning"]["consecutive_failures"], 0);
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
}

/// An ops endpoint that meets another session's lock gives up after `database.lock_timeout`
/// with a 503 the caller may retry, never a 500.
#[tokio::test]
async fn an_ops_read_blocked_by_a_lock_is_a_503_with_retry_after() {
    let app = ticket_app(
        "",
        "[database]\nmax_connections = 8\nlock_timeout = \"1s\"",
        TICKETS,
    )
    .await;
    let mut locker = PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::raw_sql("begin; lock table sweeper.runs in access exclusive mode")
        .execute(&mut locker)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let r = app
        .client
        .get(format!("{}/runs", app.base))
        .bearer_auth(app.ops_token())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["type"], "urn:sweeper:problem:unavailable", "{body}");
    assert!(started.elapsed() < Duration::from_secs(5));
    sqlx::raw_sql("commit").execute(&mut locker).await.unwrap();
    assert_eq!(app.get_json("/runs").await["runs"], json!([]));
}
