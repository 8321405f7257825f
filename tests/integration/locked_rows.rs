//! Delete first (docs/design.md §2.4): a row another transaction holds locked delays only itself
//! — its neighbours are deleted and audited in the same attempt, the command waits for it without
//! spending attempts, only `max_age` makes it a dead letter (naming the session that holds it) —
//! and a deadlock with another transaction spends no attempt either.

use std::time::Duration;

use crate::common::*;
use crate::kit::ledger::advance_clock;
use serde_json::Value;
use sqlx::{Connection, PgConnection};
use sweeper::app::worker::{WorkerStep, run_one_command};
use sweeper::execute::ConsumeOutcome;

const WINDOW: &str = "2026-09-01T02:00:00Z";

/// Seeds 14 tickets (7 eligible: one command at batch 10) and plans the run: the eligible ids,
/// the run, its command and the command's keys.
async fn planned(app: &TestApp) -> (Vec<i64>, String, String, Vec<String>) {
    let eligible = seed_mixed(&app.pool, 14, at(WINDOW)).await;
    let (run_id, mut commands) = app.planned_run().await;
    let command = commands.remove(0);
    let keys = command_keys(app, &command).await;
    (eligible, run_id, command, keys)
}

/// The command's state, attempts, last error and class.
async fn command_row(
    app: &TestApp,
    command: &str,
) -> (String, i32, Option<String>, Option<String>) {
    sqlx::query_as(
        "select state, attempts, last_error, last_error_class from sweeper.commands
          where command_id = $1",
    )
    .bind(command)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// Each of the command's audited keys with how many audit rows it has.
async fn audit_per_key(app: &TestApp, command: &str) -> Vec<(String, i64)> {
    sqlx::query_as(
        "select item_key, count(*) from sweeper.audit_trail where command_id = $1
          group by item_key order by item_key::bigint",
    )
    .bind(command)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

async fn ticket_exists(app: &TestApp, id: i64) -> bool {
    sqlx::query_scalar("select exists (select 1 from demo.tickets where id = $1)")
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn open_dead_letters(app: &TestApp) -> i64 {
    sqlx::query_scalar("select count(*) from sweeper.dead_letters where status = 'open'")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn backend_pid(c: &mut PgConnection) -> i32 {
    sqlx::query_scalar("select pg_backend_pid()")
        .fetch_one(c)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_locked_row_delays_only_itself_and_spends_no_attempt_until_it_is_released() {
    let app = ticket_app(
        r#"retry = { max_attempts = 2, base = "1s", cap = "2s", max_age = "1h" }"#,
        "[consume]\nlock_timeout = \"1s\"",
        TICKETS,
    )
    .await;
    let (eligible, run_id, command, keys) = planned(&app).await;
    let locked = eligible[0];
    assert!(keys.contains(&locked.to_string()), "{keys:?}");
    let mut blocker = lock_ticket(&app.db.url, locked).await;
    let pid = backend_pid(&mut blocker).await;

    // More tries than max_attempts while the lock lasts: each spends nothing, and the first
    // already deletes and audits every other row of the command.
    for _ in 0..4 {
        match run_one_command(&app.state).await.unwrap() {
            WorkerStep::Ran(ConsumeOutcome::NotNow { .. }) => {}
            other => panic!("{other:?}"),
        }
        let (state, attempts, error, class) = command_row(&app, &command).await;
        assert_eq!((state.as_str(), attempts), ("pending", 0), "{error:?}");
        assert_eq!(class.as_deref(), Some("locked"));
        let error = error.unwrap();
        assert!(error.contains("waiting on a lock"), "{error}");
        assert!(error.contains(&format!("pid {pid}")), "{error}");
        let audited = audit_per_key(&app, &command).await;
        assert_eq!(audited.len(), keys.len() - 1, "{audited:?}");
        assert!(
            audited
                .iter()
                .all(|(k, n)| *n == 1 && *k != locked.to_string())
        );
        assert!(ticket_exists(&app, locked).await);
        for id in eligible.iter().filter(|id| keys.contains(&id.to_string())) {
            assert_eq!(ticket_exists(&app, *id).await, *id == locked, "{id}");
        }
        assert_eq!(open_dead_letters(&app).await, 0);
        advance_clock(&app.pool, 6).await;
    }

    // The run shows it waiting on a lock, not failing.
    let run: Value = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["waiting_on_lock"], 1, "{run}");
    assert_eq!(
        run["waiting_on_lock_commands"][0]["command_id"],
        command.as_str()
    );
    assert_eq!(run["retrying"], 0, "{run}");
    let attention = app.get_json("/runs?status=attention").await;
    let entry = attention["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run_id"] == run_id.as_str())
        .unwrap();
    let reason = entry["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("1 command(s) waiting on a lock") && !reason.contains("retrying"),
        "{reason}"
    );
    assert_eq!(
        (
            entry["waiting_on_lock_commands"].as_i64(),
            entry["retrying_commands"].as_i64()
        ),
        (Some(1), Some(0)),
        "{entry}"
    );

    // The lock goes away: the next try deletes the last row, and every key has one audit row.
    release_ticket(blocker).await;
    match run_one_command(&app.state).await.unwrap() {
        WorkerStep::Ran(ConsumeOutcome::Executed { counts, .. }) => {
            assert_eq!(counts.deleted, 1, "{counts:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!ticket_exists(&app, locked).await);
    let audited = audit_per_key(&app, &command).await;
    assert_eq!(audited.len(), keys.len(), "{audited:?}");
    assert!(audited.iter().all(|(_, n)| *n == 1), "{audited:?}");
    let (state, attempts, ..) = command_row(&app, &command).await;
    assert_eq!((state.as_str(), attempts), ("succeeded", 1));
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let deleted: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.audit_trail where run_id = $1 and outcome = 'deleted'",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(run["deleted"], deleted, "{run}");
    assert_eq!(deleted as usize, eligible.len(), "{run}");
}

#[tokio::test]
async fn a_row_locked_past_max_age_becomes_a_dead_letter_naming_the_session_that_holds_it() {
    let app = ticket_app(
        r#"retry = { max_attempts = 2, base = "1s", cap = "2s", max_age = "1m" }"#,
        "[consume]\nlock_timeout = \"1s\"",
        TICKETS,
    )
    .await;
    let (eligible, run_id, command, _keys) = planned(&app).await;
    let mut blocker = lock_ticket(&app.db.url, eligible[0]).await;
    let pid = backend_pid(&mut blocker).await;
    assert!(matches!(
        run_one_command(&app.state).await.unwrap(),
        WorkerStep::Ran(ConsumeOutcome::NotNow { .. })
    ));
    assert_eq!(open_dead_letters(&app).await, 0);
    advance_clock(&app.pool, 61).await;
    match run_one_command(&app.state).await.unwrap() {
        WorkerStep::Ran(ConsumeOutcome::Quarantined { error, .. }) => {
            assert!(error.contains("max_age"), "{error}");
            assert!(error.contains(&format!("pid {pid}")), "{error}");
            assert!(error.contains("whose transaction has run"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    let (class, reason): (String, String) = sqlx::query_as(
        "select class, reason from sweeper.dead_letters where command_id = $1 and status = 'open'",
    )
    .bind(&command)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(class, "locked");
    assert!(reason.contains(&format!("pid {pid}")), "{reason}");

    // Redriven once the lock is gone, it finishes the one row left; nothing is audited twice.
    release_ticket(blocker).await;
    let id: i64 =
        sqlx::query_scalar("select dead_letter_id from sweeper.dead_letters where command_id = $1")
            .bind(&command)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    let r = app
        .client
        .post(format!("{}/dead-letters/{id}/redrive", app.base))
        .bearer_auth(app.ops_token())
        .json(&serde_json::json!({"reason": "lock released"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    app.drain().await;
    assert!(!ticket_exists(&app, eligible[0]).await);
    let audited = audit_per_key(&app, &command).await;
    assert!(audited.iter().all(|(_, n)| *n == 1), "{audited:?}");
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
}

#[tokio::test]
async fn a_delete_that_deadlocks_with_another_transaction_spends_no_attempt_and_finishes_later() {
    let app = ticket_app(
        r#"retry = { max_attempts = 1, base = "1s", cap = "2s", max_age = "1h" }"#,
        "[consume]\nlock_timeout = \"20s\"\nstatement_timeout = \"30s\"\n\
         command_deadline = \"40s\"",
        TICKETS,
    )
    .await;
    let (eligible, run_id, command, keys) = planned(&app).await;
    let in_command: Vec<i64> = eligible
        .iter()
        .copied()
        .filter(|id| keys.contains(&id.to_string()))
        .collect();
    // The application's transaction holds the command's last row; sweeper's delete takes the
    // first rows, then waits for it.
    let (first, last) = (in_command[0], *in_command.last().unwrap());
    let mut app_tx = PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("begin").execute(&mut app_tx).await.unwrap();
    // This session waits longer before it looks for a deadlock: sweeper's statement finds it.
    sqlx::query("set local deadlock_timeout = '30s'")
        .execute(&mut app_tx)
        .await
        .unwrap();
    sqlx::query("select 1 from demo.tickets where id = $1 for update")
        .bind(last)
        .execute(&mut app_tx)
        .await
        .unwrap();
    let state = app.state.clone();
    let worker = tokio::spawn(async move { run_one_command(&state).await });
    // Once the delete waits for the last row, the application asks for the first one.
    wait_for_lock_wait(&app, "delete from%").await;
    sqlx::query("select 1 from demo.tickets where id = $1 for update")
        .bind(first)
        .execute(&mut app_tx)
        .await
        .unwrap();
    match worker.await.unwrap().unwrap() {
        WorkerStep::Ran(ConsumeOutcome::NotNow { .. }) => {}
        other => panic!("{other:?}"),
    }
    let (state, attempts, error, class) = command_row(&app, &command).await;
    assert_eq!((state.as_str(), attempts), ("pending", 0), "{error:?}");
    assert_eq!(class.as_deref(), Some("locked"));
    let error = error.unwrap();
    assert!(error.contains("deadlock"), "{error}");
    assert!(audit_per_key(&app, &command).await.is_empty());
    assert_eq!(open_dead_letters(&app).await, 0);

    sqlx::query("rollback").execute(&mut app_tx).await.unwrap();
    advance_clock(&app.pool, 5).await;
    // The governor saw the application wait on sweeper's lock (`lock_waiters`) and holds the
    // policy until its next readings are quiet.
    for _ in 0..300 {
        if sweeper::holds::held_policies(&app.state).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let audited = audit_per_key(&app, &command).await;
    assert_eq!(audited.len(), keys.len(), "{audited:?}");
    assert!(audited.iter().all(|(_, n)| *n == 1), "{audited:?}");
}

/// The command's keys that are eligible ticket ids, in key order.
async fn command_keys(app: &TestApp, command: &str) -> Vec<String> {
    sqlx::query_scalar("select item_keys from sweeper.commands where command_id = $1")
        .bind(command)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// Each audited key's outcomes in order.
async fn outcomes_per_key(app: &TestApp, command: &str) -> Vec<(String, Vec<String>)> {
    sqlx::query_as(
        "select item_key, array_agg(outcome order by audit_id) from sweeper.audit_trail
          where command_id = $1 group by item_key order by item_key::bigint",
    )
    .bind(command)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

/// Waits until a session of this database waits on a lock running a statement like `like`.
async fn wait_for_lock_wait(app: &TestApp, like: &str) {
    for _ in 0..400 {
        let waiting: bool = sqlx::query_scalar(
            "select exists (select 1 from pg_stat_activity
                             where datname = current_database() and wait_event_type = 'Lock'
                               and query like $1)",
        )
        .bind(like)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        if waiting {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no session waits on a lock running {like}");
}

#[tokio::test]
async fn rows_changed_while_the_delete_waits_are_judged_on_their_newest_version() {
    let app = ticket_app(
        r#"retry = { max_attempts = 2, base = "1s", cap = "2s", max_age = "1h" }"#,
        "[consume]\nlock_timeout = \"10s\"",
        TICKETS,
    )
    .await;
    let (eligible, _run_id, command, keys) = planned(&app).await;
    // The application puts one row on legal hold, makes one younger and deletes a third, and
    // commits only once sweeper's delete waits for them.
    let (held, young, gone) = (eligible[0], eligible[1], eligible[2]);
    let mut tx = PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("begin").execute(&mut tx).await.unwrap();
    for (sql, id) in [
        (
            "update demo.tickets set legal_hold = true where id = $1",
            held,
        ),
        (
            "update demo.tickets set closed_at = '2026-08-31' where id = $1",
            young,
        ),
        ("delete from demo.tickets where id = $1", gone),
    ] {
        sqlx::query(sql).bind(id).execute(&mut tx).await.unwrap();
    }
    let state = app.state.clone();
    let worker = tokio::spawn(async move { run_one_command(&state).await });
    wait_for_lock_wait(&app, "delete from%").await;
    sqlx::query("commit").execute(&mut tx).await.unwrap();
    match worker.await.unwrap().unwrap() {
        WorkerStep::Ran(ConsumeOutcome::Executed { counts, .. }) => {
            assert_eq!(
                (counts.excluded, counts.not_eligible, counts.already_absent),
                (1, 1, 1),
                "{counts:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    let audited = outcomes_per_key(&app, &command).await;
    assert_eq!(audited.len(), keys.len(), "{audited:?}");
    let of = |id: i64| {
        audited
            .iter()
            .find(|(k, _)| *k == id.to_string())
            .map(|(_, o)| o.clone())
            .unwrap()
    };
    assert_eq!(of(held), ["excluded"]);
    assert_eq!(of(young), ["not_eligible"]);
    assert_eq!(of(gone), ["already_absent"]);
    assert!(ticket_exists(&app, held).await && ticket_exists(&app, young).await);
}

#[tokio::test]
async fn concurrent_deliveries_after_a_lock_is_released_audit_each_item_once() {
    let app = ticket_app(
        r#"retry = { max_attempts = 2, base = "1s", cap = "2s", max_age = "1h" }"#,
        "[consume]\nlock_timeout = \"1s\"",
        TICKETS,
    )
    .await;
    let (eligible, run_id, command, keys) = planned(&app).await;
    let in_command: Vec<i64> = eligible
        .iter()
        .copied()
        .filter(|id| keys.contains(&id.to_string()))
        .collect();
    let mut blockers = Vec::new();
    for id in &in_command[..4] {
        blockers.push(lock_ticket(&app.db.url, *id).await);
    }
    let first = run_one_command(&app.state).await;
    assert!(
        matches!(first, Ok(WorkerStep::Ran(ConsumeOutcome::NotNow { .. }))),
        "{first:?}"
    );
    // The partial progress is in the audit's first shape, which a previous release's replica
    // resuming the command during a rollout reads too.
    let partial: i64 =
        sqlx::query_scalar("select count(*) from sweeper.audit where command_id = $1")
            .bind(&command)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(partial as usize, keys.len() - 4);
    // One lock goes at a time, and two deliveries of the command arrive together: the second
    // waits for the command row and must see what the first audited.
    let api = app.api.with_token(app.token(&["consume"]));
    while let Some(b) = blockers.pop() {
        release_ticket(b).await;
        advance_clock(&app.pool, 6).await;
        let (a, b) = tokio::join!(api.consume(&command), api.consume(&command));
        for r in [&a, &b] {
            let not_now = r.body["type"] == "urn:sweeper:problem:not-now";
            assert!(r.status == 200 || not_now, "{} {}", r.status, r.body);
        }
        let audited = outcomes_per_key(&app, &command).await;
        assert!(audited.iter().all(|(_, o)| o.len() == 1), "{audited:?}");
    }
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let audited = outcomes_per_key(&app, &command).await;
    assert_eq!(audited.len(), keys.len(), "{audited:?}");
    assert_eq!(run["deleted"], in_command.len(), "{run}");
    assert_eq!(run["already_absent"], 0, "{run}");
}

#[tokio::test]
async fn a_row_a_trigger_keeps_is_not_eligible_at_once_not_waited_for() {
    let app = ticket_app(
        r#"retry = { max_attempts = 2, base = "1s", cap = "2s", max_age = "1h" }"#,
        "[consume]\nlock_timeout = \"1s\"",
        TICKETS,
    )
    .await;
    let (eligible, _run_id, command, _keys) = planned(&app).await;
    // A soft-delete trigger: the delete of this row does nothing, and no other session holds it.
    sqlx::raw_sql(&format!(
        "create function demo.keep() returns trigger language plpgsql as $$
         begin if old.id = {} then return null; end if; return old; end $$;
         create trigger keep before delete on demo.tickets
             for each row execute function demo.keep();",
        eligible[0]
    ))
    .execute(&app.pool)
    .await
    .unwrap();
    match run_one_command(&app.state).await.unwrap() {
        WorkerStep::Ran(ConsumeOutcome::Executed { counts, .. }) => {
            assert_eq!(counts.not_eligible, 1, "{counts:?}");
        }
        other => panic!("{other:?}"),
    }
    let reason: String = sqlx::query_scalar(
        "select reason from sweeper.audit_trail where command_id = $1 and item_key = $2",
    )
    .bind(&command)
    .bind(eligible[0].to_string())
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(reason.starts_with("not_deleted:"), "{reason}");
    assert!(ticket_exists(&app, eligible[0]).await);
}
