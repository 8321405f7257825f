//! On-call reads: the runs that need a look and why, a retrying command's reason and the run's
//! progress, whether a dead letter's cause is gone, one record's history, the operator log,
//! and the policies' state.

use crate::common::*;
use crate::kit::ledger::advance_clock;
use serde_json::{Value, json};
use sweeper::app::worker::{WorkerStep, run_one_command};
use sweeper::execute::ConsumeOutcome;

const WINDOW: &str = "2026-09-01T02:00:00Z";

fn attention_entry(list: &Value, run_id: &str) -> Option<Value> {
    list["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run_id"] == run_id)
        .cloned()
}

#[tokio::test]
async fn a_foreign_key_dead_letter_is_listed_for_attention_says_it_will_fail_again_and_leaves_when_abandoned()
 {
    let app = ticket_app("", "", TICKETS_WITH_CHILD).await;
    let eligible = seed_mixed(&app.pool, 20, at(WINDOW)).await;
    let blocked = eligible[1];
    let (run_id, run) = run_with_blocked_item(&app, blocked).await;
    assert_eq!(run["status"], "completed_with_dead_letters");

    // 1. Which runs need a look, and why: one call.
    let list = app.get_json("/runs?status=attention").await;
    let entry = attention_entry(&list, &run_id).expect("the run needs a look");
    let reason = entry["reason"].as_str().unwrap();
    assert!(
        reason.contains("1 dead letter(s) open") && reason.contains("SQLSTATE 23503"),
        "{reason}"
    );
    assert_eq!(entry["open_dead_letters"], 1);

    // 2. The run names the dead letter; its cause is still there.
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(
        run["dead_letters"],
        json!({"open": 1, "redriven": 0, "abandoned": 0, "resolved": 0})
    );
    assert_eq!(run["progress"]["executed_fraction"], 1.0, "{run}");
    assert_eq!(run["progress"]["planned_fraction"], 1.0);
    let dl = &run["open_dead_letters"][0];
    assert_eq!(dl["replay_safe"]["safe"], true);
    assert_eq!(dl["replay_safe"]["will_fail_again"], true, "{dl}");
    assert_eq!(
        dl["replay_safe"]["references"][0]["table"], "demo.attachments",
        "{dl}"
    );
    let attempts = dl["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "{dl}");
    assert!(attempts[0]["error"].as_str().unwrap().contains("23503"));
    let id = dl["dead_letter_id"].as_i64().unwrap();

    // `?status=` and its older name `?state=` answer the same.
    for q in ["status=open", "state=open"] {
        let page = app.get_json(&format!("/dead-letters?{q}")).await;
        assert_eq!(page["dead_letters"].as_array().unwrap().len(), 1, "{q}");
        assert_eq!(
            page["dead_letters"][0]["replay_safe"]["will_fail_again"],
            true
        );
    }
    let both = app
        .api
        .send(
            reqwest::Method::GET,
            "/dead-letters?status=open&state=resolved",
            None,
        )
        .await;
    assert_eq!(both.status, 400, "{}", both.body);

    // A redrive before the cause is removed fails again: open, the redrive's resolution
    // cleared, the second failure in its attempts.
    let acted = app
        .api
        .send(
            reqwest::Method::POST,
            &format!("/dead-letters/{id}/redrive"),
            Some(json!({"reason": "try it"})),
        )
        .await;
    assert_eq!(
        (acted.status, &acted.body["will_fail_again"]),
        (200, &json!(true)),
        "{}",
        acted.body
    );
    app.drain().await;
    app.wait_terminal(&run_id).await;
    let dl = app.get_json(&format!("/dead-letters/{id}")).await;
    assert_eq!(
        (
            dl["status"].as_str(),
            dl["resolved_at"].is_null(),
            dl["resolved_by"].is_null()
        ),
        (Some("open"), true, true),
        "{dl}"
    );
    assert_eq!(dl["attempts"].as_array().unwrap().len(), 2, "{dl}");

    // The record's whole history, with the key written as a bigint is not (`007` is `7`).
    let key = format!("00{blocked}");
    let h = app
        .get_json(&format!("/policies/ticket-retention/items/{key}"))
        .await;
    assert_eq!(h["item_key"], blocked.to_string());
    let outcomes: Vec<&str> = h["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["failed", "failed"], "{h}");
    assert_eq!(h["audit"][0]["run_id"], run_id.as_str());
    assert_eq!(h["audit"][0]["cutoff"], "2026-06-03T02:00:00Z");
    assert_eq!(h["dead_letters"][0]["dead_letter_id"], id);
    assert!(h["history_complete_since"].is_null());
    let page = app
        .get_json(&format!(
            "/policies/ticket-retention/items/{blocked}?limit=1"
        ))
        .await;
    assert_eq!(page["audit"].as_array().unwrap().len(), 1);
    let next = page["next_cursor"].as_str().unwrap();
    let page = app
        .get_json(&format!(
            "/policies/ticket-retention/items/{blocked}?limit=1&cursor={next}"
        ))
        .await;
    assert_eq!(page["audit"][0]["outcome"], "failed");
    let bad = app
        .api
        .send(
            reqwest::Method::GET,
            "/policies/ticket-retention/items/abc",
            None,
        )
        .await;
    assert_eq!(
        (bad.status, bad.body["type"].as_str().unwrap_or_default()),
        (400, "urn:sweeper:problem:bad-key"),
        "{}",
        bad.body
    );
    let unknown = app
        .api
        .send(reqwest::Method::GET, "/policies/nope/items/1", None)
        .await;
    assert_eq!(unknown.status, 404);

    // The referencing row goes: the cause is gone.
    sqlx::query("delete from demo.attachments")
        .execute(&app.pool)
        .await
        .unwrap();
    let dl = app.get_json(&format!("/dead-letters/{id}")).await;
    assert_eq!(dl["replay_safe"]["will_fail_again"], false, "{dl}");

    // Abandoned instead: the run leaves the list, completed, its abandoned count kept.
    app.api.abandon(id, "ticket kept on purpose").await;
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["dead_letters"]["abandoned"], 1);
    let list = app.get_json("/runs?status=attention").await;
    assert!(attention_entry(&list, &run_id).is_none(), "{list}");

    // The operator log says who did both, and why.
    let log = app.get_json("/operator-log?target=dead_letter:").await;
    let acts: Vec<(&str, &str)> = log["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["action"].as_str().unwrap(), e["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(
        acts,
        [("abandon", "ticket kept on purpose"), ("redrive", "try it")]
    );
    let page = app.get_json("/operator-log?action=redrive&limit=1").await;
    assert_eq!(page["entries"].as_array().unwrap().len(), 1);
    assert!(page["next_before"].is_i64());
    for bad in [
        "/operator-log?action=delete",
        "/operator-log?since=yesterday",
        "/operator-log?limit=0",
    ] {
        let a = app.api.send(reqwest::Method::GET, bad, None).await;
        assert_eq!(a.status, 400, "{bad}: {}", a.body);
    }

    // The policy shows its last run and next window.
    let policies = app.get_json("/policies").await;
    let p = &policies["policies"][0];
    assert_eq!(p["suspended"], Value::Null);
    assert_eq!(p["last_run"]["run_id"], run_id.as_str());
    assert_eq!(p["last_run"]["status"], "completed");
    assert_eq!(p["next_window"], "2026-09-02T02:00:00Z");
}

#[tokio::test]
async fn a_retrying_command_shows_its_last_error_on_the_run_and_in_the_attention_list() {
    let app = ticket_app(
        r#"retry = { max_attempts = 5, base = "1s", cap = "2s", max_age = "1d" }"#,
        "[consume]\nlock_timeout = \"1s\"",
        TICKETS,
    )
    .await;
    let eligible = seed_mixed(&app.pool, 12, at(WINDOW)).await;
    let (run_id, commands) = app.planned_run().await;
    fail_ticket_deletes(&app.pool, eligible[0]).await;

    for _ in 0..2 {
        match run_one_command(&app.state).await.unwrap() {
            WorkerStep::Ran(ConsumeOutcome::NotNow { .. }) => {}
            other => panic!("{other:?}"),
        }
        advance_clock(&app.pool, 3).await;
    }
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "running");
    assert_eq!(run["retrying"], 1, "{run}");
    let r = &run["retrying_commands"][0];
    assert_eq!(r["command_id"], commands[0].as_str());
    assert_eq!(r["attempts"], 2);
    assert_eq!(r["last_error_class"], "transient");
    assert!(r["last_error"].as_str().unwrap().contains("40001"), "{r}");
    assert!(r["next_attempt_at"].is_string());
    let p = &run["progress"];
    assert_eq!(p["planned_fraction"], 1.0);
    assert!(p["executed_fraction"].as_f64().unwrap() < 1.0, "{p}");

    let list = app.get_json("/runs?status=attention").await;
    let entry = attention_entry(&list, &run_id).unwrap();
    let reason = entry["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("1 command(s) retrying; attempt 3 at ")
            && reason.contains("after 2 failed (transient)")
            && reason.contains("40001"),
        "{reason}"
    );
    assert_eq!(entry["retrying_commands"], 1);

    heal_ticket_deletes(&app.pool, eligible[0]).await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed");
    assert_eq!(run["retrying"], 0);
    assert_eq!(run["progress"]["executed_fraction"], 1.0);
    assert!(attention_entry(&app.get_json("/runs?status=attention").await, &run_id).is_none());

    // Items by outcome, the run's duration and the trigger's lag are exported.
    // (Process counters: other tests in this process add to them.)
    let metrics = app.api.metrics().await;
    let deleted = "sweeper_items_total{policy=\"ticket-retention\",outcome=\"deleted\"} ";
    let n: i64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(deleted))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{deleted}\n{metrics}"));
    assert!(n >= run["deleted"].as_i64().unwrap(), "{n}");
    for series in [
        "sweeper_items_total{policy=\"ticket-retention\",outcome=\"would_call\"}",
        "sweeper_run_duration_seconds_count{policy=\"ticket-retention\"}",
        "sweeper_trigger_lag_seconds_count",
        "sweeper_consume_duration_seconds_count",
        "sweeper_held_runs{kind=\"identity\"} 0",
    ] {
        assert!(metrics.contains(series), "{series}\n{metrics}");
    }
}

#[tokio::test]
async fn planning_progress_is_estimated_from_the_cursor_against_the_key_range_and_the_oldest_row() {
    use sweeper::plan::estimate::{Cursor, planned_fraction};
    let app = ticket_app("", "", TICKETS).await;
    // Keys 1..=20, closed from a year before the window onwards.
    seed_mixed(&app.pool, 20, at(WINDOW)).await;
    let target = &app
        .state
        .config
        .policy("ticket-retention")
        .unwrap()
        .spec
        .target;
    let cutoff = at("2026-06-03T02:00:00Z");
    let (lo, hi): (i64, i64) = sqlx::query_as("select min(id), max(id) from demo.tickets")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let mid = ((lo + hi) / 2).to_string();
    let key_order = |key| Cursor {
        path: Some("key_order"),
        key,
        timestamp: None,
    };
    let f = planned_fraction(&app.pool, target, &key_order(Some(&mid)), cutoff)
        .await
        .unwrap();
    let expected = ((lo + hi) / 2 - lo) as f64 / (hi - lo) as f64;
    assert!((f - expected).abs() < 1e-9, "{f} {expected}");
    assert_eq!(
        planned_fraction(&app.pool, target, &Cursor::default(), cutoff).await,
        Some(0.0),
        "before the first page"
    );
    // The timestamp walk: halfway between the oldest row and the cutoff.
    let oldest: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("select min(closed_at) from demo.tickets")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    let half = oldest + (cutoff - oldest) / 2;
    let by_time = Cursor {
        path: Some("timestamp_index"),
        key: None,
        timestamp: Some(half.timestamp() as f64 + f64::from(half.timestamp_subsec_micros()) / 1e6),
    };
    let f = planned_fraction(&app.pool, target, &by_time, cutoff)
        .await
        .unwrap();
    assert!((f - 0.5).abs() < 1e-6, "{f}");
    // An `-infinity` timestamp (planned like any old row) neither moves the estimate nor
    // breaks it, as the oldest row or as the cursor.
    sqlx::query("insert into demo.tickets values (1000, 'closed', false, '-infinity')")
        .execute(&app.pool)
        .await
        .unwrap();
    let f = planned_fraction(&app.pool, target, &by_time, cutoff)
        .await
        .unwrap();
    assert!((f - 0.5).abs() < 1e-6, "{f}");
    let at_infinity = Cursor {
        timestamp: Some(f64::NEG_INFINITY),
        ..by_time
    };
    assert_eq!(
        planned_fraction(&app.pool, target, &at_infinity, cutoff).await,
        None
    );
}

/// Runs the built-in queue's next command (advancing the ledger's clock past any backoff)
/// until it quarantines one; panics after `tries`.
async fn until_quarantined(app: &TestApp, tries: usize) {
    for _ in 0..tries {
        if let WorkerStep::Ran(ConsumeOutcome::Quarantined { .. }) =
            run_one_command(&app.state).await.unwrap()
        {
            return;
        }
        advance_clock(&app.pool, 5).await;
    }
    panic!("nothing was quarantined in {tries} tries");
}

#[tokio::test]
async fn a_redrive_that_is_quarantined_reopens_its_dead_letter_cleared_and_nothing_stays_redriven()
{
    let app = ticket_app(
        r#"retry = { max_attempts = 2, base = "1s", cap = "1s", max_age = "1d" }"#,
        "[consume]\nlock_timeout = \"1s\"",
        TICKETS_WITH_CHILD,
    )
    .await;
    let eligible = seed_mixed(&app.pool, 20, at(WINDOW)).await;
    let blocked = eligible[1];
    let (run_id, _) = run_with_blocked_item(&app, blocked).await;
    let id = app.get_json("/dead-letters").await["dead_letters"][0]["dead_letter_id"]
        .as_i64()
        .unwrap();

    // The item's redrive command cannot delete its row: it is quarantined, and that reopens the
    // item's own dead letter (no second one), its redrive's resolution cleared.
    sqlx::query("delete from demo.attachments")
        .execute(&app.pool)
        .await
        .unwrap();
    fail_ticket_deletes(&app.pool, blocked).await;
    app.api.redrive(id, "references removed").await;
    until_quarantined(&app, 6).await;
    let dls = app.get_json("/dead-letters").await["dead_letters"].clone();
    assert_eq!(dls.as_array().unwrap().len(), 1, "{dls}");
    let dl = &dls[0];
    assert_eq!(
        (
            dl["dead_letter_id"].as_i64(),
            dl["status"].as_str(),
            dl["resolved_by"].is_null(),
            dl["failures"].as_i64()
        ),
        (Some(id), Some("open"), true, Some(2)),
        "{dl}"
    );
    let last = dl["attempts"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["outcome"], "quarantined", "{dl}");
    assert!(last["error"].as_str().unwrap().contains("40001"), "{dl}");
    // Its cause is not a reference: not re-checked.
    assert_eq!(dl["replay_safe"]["will_fail_again"], "unknown");
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed_with_dead_letters", "{run}");
    assert_eq!(run["dead_letters"]["redriven"], 0);

    // The cause goes; the same dead letter is redriven again and resolves; the run completes
    // with nothing counted quarantined.
    heal_ticket_deletes(&app.pool, blocked).await;
    app.api.redrive(id, "lock released").await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(
        (run["status"].as_str(), run["quarantined_commands"].as_i64()),
        (Some("completed"), Some(0)),
        "{run}"
    );
    assert_eq!(
        app.get_json(&format!("/dead-letters/{id}")).await["status"],
        "resolved"
    );
}

#[tokio::test]
async fn a_command_dead_letter_whose_redrive_fails_again_is_open_without_the_redrives_resolution() {
    let app = ticket_app(
        r#"retry = { max_attempts = 1, base = "1s", cap = "1s", max_age = "1d" }"#,
        "[consume]\nlock_timeout = \"1s\"",
        TICKETS,
    )
    .await;
    let eligible = seed_mixed(&app.pool, 12, at(WINDOW)).await;
    let (run_id, _) = app.planned_run().await;
    fail_ticket_deletes(&app.pool, eligible[0]).await;
    until_quarantined(&app, 3).await;
    let dl = app.get_json("/dead-letters").await["dead_letters"][0].clone();
    let id = dl["dead_letter_id"].as_i64().unwrap();
    assert_eq!(dl["kind"], "command");
    app.api.redrive(id, "try while locked").await;
    until_quarantined(&app, 3).await;
    let dl = app.get_json(&format!("/dead-letters/{id}")).await;
    assert_eq!(
        (
            dl["status"].as_str(),
            dl["resolved_at"].is_null(),
            dl["resolved_by"].is_null(),
            dl["resolution_reason"].is_null(),
            dl["failures"].as_i64()
        ),
        (Some("open"), true, true, true, Some(2)),
        "{dl}"
    );
    heal_ticket_deletes(&app.pool, eligible[0]).await;
    app.api.redrive(id, "lock released").await;
    app.drain().await;
    assert_eq!(app.wait_terminal(&run_id).await["status"], "completed");
}

#[tokio::test]
async fn a_failure_further_down_a_cascade_is_not_called_gone_and_suspended_work_shows_in_the_held_metrics()
 {
    const CASCADE: &str = "
create schema demo;
create table demo.tickets (id bigint primary key, status text, legal_hold boolean, closed_at timestamptz);
create index on demo.tickets (closed_at);
create table demo.child (id bigint primary key, ticket_id bigint references demo.tickets (id) on delete cascade);
create table demo.grandchild (id bigint primary key, child_id bigint references demo.child (id))
";
    let app = ticket_app("", "", CASCADE).await;
    let eligible = seed_mixed(&app.pool, 20, at(WINDOW)).await;
    sqlx::query("insert into demo.child values (1, $1)")
        .bind(eligible[0])
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("insert into demo.grandchild values (1, 1)")
        .execute(&app.pool)
        .await
        .unwrap();
    let (run_id, _) = app.planned_run().await;
    app.drain().await;
    app.wait_terminal(&run_id).await;
    let dl = app.get_json("/dead-letters").await["dead_letters"][0].clone();
    assert!(
        dl["reason"].as_str().unwrap().contains("grandchild"),
        "{dl}"
    );
    // The target's own reference (demo.child, CASCADE) refuses nothing: the refusing one is
    // further down, so the answer is unknown, not "gone".
    assert_eq!(dl["replay_safe"]["will_fail_again"], "unknown", "{dl}");
    assert!(
        dl["replay_safe"]["cause"]
            .as_str()
            .unwrap()
            .contains("grandchild_child_id_fkey")
    );

    // A suspended policy's pending commands count as held, kind suspended.
    // The next day: the young rows of the first day are old enough now.
    set_clock(&app.pool, at("2026-09-02T02:01:00Z")).await;
    let (second, _) = app.planned_run().await;
    app.api.suspend("ticket-retention", "INC-1").await;
    let pending = app.get_json(&format!("/runs/{second}")).await["commands"]["pending"].clone();
    let metrics = app.api.metrics().await;
    for series in [
        format!("sweeper_held{{kind=\"suspended\"}} {pending}"),
        "sweeper_held_runs{kind=\"suspended\"} 1".to_string(),
    ] {
        assert!(metrics.contains(&series), "{series}\n{metrics}");
    }
}

#[tokio::test]
async fn a_record_kept_at_planning_is_answered_by_its_present_state_and_the_runs_that_counted_it() {
    let app = ticket_app("", "", TICKETS).await;
    let eligible = seed_mixed(&app.pool, 30, at(WINDOW)).await;
    let key = eligible[0];
    // Run 1 deletes the record.
    let (run1, _) = app.planned_run().await;
    app.drain().await;
    assert_eq!(app.wait_terminal(&run1).await["status"], "completed");
    // A new row with the same key arrives, old and already on legal hold: run 2 counts it as
    // held at planning and writes no row for it.
    sqlx::query("insert into demo.tickets values ($1, 'closed', true, timestamptz '2026-01-01')")
        .bind(key)
        .execute(&app.pool)
        .await
        .unwrap();
    set_clock(&app.pool, at("2026-09-02T02:01:00Z")).await;
    let (run2, _) = app.planned_run().await;
    app.drain().await;
    let done = app.wait_terminal(&run2).await;
    assert!(
        done["held_at_planning"]["legal_hold"].as_i64().unwrap() >= 1,
        "{done}"
    );
    let h = app
        .get_json(&format!("/policies/ticket-retention/items/{key}"))
        .await;
    let audit = h["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 1, "{h}");
    assert_eq!(audit[0]["run_id"], run1.as_str());
    let now = &h["present_state"];
    assert_eq!(now["present"], true, "{h}");
    assert_eq!(now["old_enough"], true, "{h}");
    assert_eq!(now["held_by"], "legal_hold", "{h}");
    assert_eq!(now["eligible"], false, "{h}");
    assert!(
        now["cutoff"]
            .as_str()
            .unwrap()
            .starts_with("2026-06-04T02:01:"),
        "{h}"
    );
    assert_eq!(h["unitemized_runs"]["count"], 1, "{h}");
    assert_eq!(
        h["unitemized_runs"]["runs"][0]["run_id"],
        run2.as_str(),
        "{h}"
    );
    assert!(
        h["unitemized_runs"]["detail"]
            .as_str()
            .unwrap()
            .contains("without writing a row per record"),
        "{h}"
    );
    // Young and not held: not eligible, and why; absent: not present.
    sqlx::query("update demo.tickets set legal_hold = false, closed_at = timestamptz '2026-08-30' where id = $1")
        .bind(key)
        .execute(&app.pool)
        .await
        .unwrap();
    let h = app
        .get_json(&format!("/policies/ticket-retention/items/{key}"))
        .await;
    assert_eq!(h["present_state"]["held_by"], Value::Null, "{h}");
    assert_eq!(h["present_state"]["old_enough"], false, "{h}");
    let why = h["present_state"]["not_eligible_reason"].as_str().unwrap();
    assert!(
        why.starts_with("younger_than_cutoff: closed_at >= 2026-06-04T02:01:")
            && why.ends_with(", the cutoff of a run starting now"),
        "{h}"
    );
    let h = app
        .get_json("/policies/ticket-retention/items/999999")
        .await;
    assert_eq!(h["present_state"]["present"], false, "{h}");
    assert_eq!(h["unitemized_runs"]["count"], 2, "{h}");
}
