//! A command's state changes against the real ledger, one test per transition: each writes only
//! while the row holds the try's fence ([`Attempt::fence`]) and records the attempt count
//! [`Attempt`] computes; an overtaken try writes nothing, audit rows and dead letters included.
//! A try is a [`CommandTry`]: a delivery's from the gate's lock, a worker's from its claim.

use chrono::Utc;
use sqlx::PgPool;
use sweeper::ledger::commands::{Attempt, Audited, CommandTry, Execution, Failed};

use crate::common::*;

/// A planned command of a fresh app, with its run.
async fn one_command() -> (TestApp, String, String) {
    let app = TestApp::spawn(Spawn::default()).await;
    seed_mixed(&app.pool, 5, at("2026-09-01T02:00:00Z")).await;
    let (run_id, commands) = app.planned_run().await;
    (app, run_id, commands[0].clone())
}

/// The command's (state, attempts).
async fn row(pool: &PgPool, command_id: &str) -> (String, i32) {
    sqlx::query_as("select state, attempts from sweeper.commands where command_id = $1")
        .bind(command_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn set_attempts(pool: &PgPool, command_id: &str, attempts: i32) {
    sqlx::query("update sweeper.commands set attempts = $2 where command_id = $1")
        .bind(command_id)
        .bind(attempts)
        .execute(pool)
        .await
        .unwrap();
}

async fn count(pool: &PgPool, sql: &str, command_id: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(command_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn failed(run_id: &str, attempts: i32) -> Failed<'_> {
    Failed {
        run_id,
        policy: "ticket-retention",
        attempts,
        elapsed_seconds: 0.1,
        error: "boom",
        class: "transient",
    }
}

#[test]
fn an_attempt_counts_a_delivery_when_it_records_and_a_claim_when_it_was_claimed() {
    let delivered = Attempt::Uncounted { seen: 2 };
    assert_eq!(
        (
            delivered.number(),
            delivered.fence(),
            delivered.given_back()
        ),
        (3, 2, 2)
    );
    let claimed = Attempt::Counted { n: 3 };
    assert_eq!(
        (claimed.number(), claimed.fence(), claimed.given_back()),
        (3, 3, 2)
    );
}

#[tokio::test]
async fn a_hold_gives_the_try_back_and_an_overtaken_hold_writes_nothing() {
    let (app, _, c) = one_command().await;
    set_attempts(&app.pool, &c, 2).await;
    let mut conn = app.pool.acquire().await.unwrap();
    // A claim of attempt 1, overtaken by attempt 2: writes nothing.
    let stale = CommandTry::claimed(&c, 1)
        .hold(&mut conn, 5.0, "pace", "x")
        .await;
    assert!(stale.is_err());
    assert_eq!(row(&app.pool, &c).await, ("pending".into(), 2));
    // The claim of attempt 2 is given back: 1 attempt spent.
    let began = CommandTry::claimed(&c, 2)
        .hold(&mut conn, 5.0, "pace", "x")
        .await
        .unwrap();
    assert!(began);
    assert_eq!(row(&app.pool, &c).await, ("pending".into(), 1));
    // A delivery that saw 1 attempt keeps it.
    let again = CommandTry::locked(&c, 1)
        .hold(&mut conn, 5.0, "pace", "x")
        .await
        .unwrap();
    assert!(!again, "the same hold continues");
    assert_eq!(row(&app.pool, &c).await, ("pending".into(), 1));
}

#[tokio::test]
async fn a_retry_or_a_quarantine_of_an_overtaken_try_writes_no_attempt_and_no_dead_letter() {
    let (app, run_id, c) = one_command().await;
    set_attempts(&app.pool, &c, 3).await;
    let mut conn = app.pool.acquire().await.unwrap();
    let overtaken = CommandTry::locked(&c, 2);
    assert!(
        overtaken
            .schedule_retry(&mut conn, &failed(&run_id, 3), 5.0, false)
            .await
            .is_err()
    );
    assert!(
        overtaken
            .quarantine(&mut conn, &failed(&run_id, 3))
            .await
            .is_err()
    );
    let attempts_sql = "select count(*) from sweeper.attempts where command_id = $1";
    let letters_sql = "select count(*) from sweeper.dead_letters where command_id = $1";
    assert_eq!(count(&app.pool, attempts_sql, &c).await, 0);
    assert_eq!(count(&app.pool, letters_sql, &c).await, 0);
    assert_eq!(row(&app.pool, &c).await, ("pending".into(), 3));
    // The try the row holds: the retry records attempt 4, the quarantine its dead letter.
    CommandTry::locked(&c, 3)
        .schedule_retry(&mut conn, &failed(&run_id, 4), 5.0, false)
        .await
        .unwrap();
    assert_eq!(row(&app.pool, &c).await, ("pending".into(), 4));
    CommandTry::locked(&c, 4)
        .quarantine(&mut conn, &failed(&run_id, 5))
        .await
        .unwrap();
    assert_eq!(row(&app.pool, &c).await, ("quarantined".into(), 5));
    assert_eq!(count(&app.pool, attempts_sql, &c).await, 2);
    assert_eq!(count(&app.pool, letters_sql, &c).await, 1);
}

#[tokio::test]
async fn a_success_of_an_overtaken_try_writes_no_audit_row_and_a_lease_counts_the_delivery() {
    let (app, run_id, c) = one_command().await;
    let mut conn = app.pool.acquire().await.unwrap();
    // A delivery leases for calls: counted now, as attempt 1.
    let leased = CommandTry::locked(&c, 0)
        .lease_for_calls(&mut conn, uuid::Uuid::new_v4(), 30.0)
        .await
        .unwrap();
    assert_eq!(leased.attempt(), Attempt::Counted { n: 1 });
    assert_eq!(row(&app.pool, &c).await, ("leased".into(), 1));
    // A second delivery that saw 0 attempts is overtaken.
    let late = CommandTry::locked(&c, 0)
        .lease_for_calls(&mut conn, uuid::Uuid::new_v4(), 30.0)
        .await;
    assert!(late.is_err());
    let keys = vec!["1".to_string()];
    let audited = Audited {
        execution: Execution {
            elapsed_seconds: 0.1,
            policy: "ticket-retention",
            policy_version: "v",
            run_id: &run_id,
            window: Utc::now(),
            cutoff: Utc::now(),
            pinned_cutoff: Utc::now(),
            current_version: None,
            actor: "test",
        },
        dry_run: true,
        keys: &keys,
        outcomes: &["would_delete"],
        reasons: &[None],
        recorded: &[],
    };
    let audit_sql = "select count(*) from sweeper.audit_trail where command_id = $1";
    let stale_claim = sweeper::app::worker::claim(&app.state, 1).await.unwrap();
    assert!(stale_claim.is_empty(), "leased, its lease not expired");
    assert!(
        CommandTry::locked(&c, 0)
            .succeed_with_audit(&mut conn, &audited)
            .await
            .is_err()
    );
    assert_eq!(count(&app.pool, audit_sql, &c).await, 0);
    assert_eq!(row(&app.pool, &c).await, ("leased".into(), 1));
    leased
        .succeed_with_audit(&mut conn, &audited)
        .await
        .unwrap();
    assert_eq!(count(&app.pool, audit_sql, &c).await, 1);
    assert_eq!(row(&app.pool, &c).await, ("succeeded".into(), 1));
}

#[tokio::test]
async fn a_release_gives_the_claim_back_and_a_stale_release_changes_nothing() {
    let (app, _, c) = one_command().await;
    let claimed = sweeper::app::worker::claim(&app.state, 1).await.unwrap();
    let claim = claimed.into_iter().next().unwrap();
    assert_eq!(claim.command_id(), c);
    assert_eq!(claim.attempt(), Attempt::Counted { n: 1 });
    // Another replica claimed it again after its lease expired: this claim is stale.
    sqlx::query("update sweeper.commands set attempts = 2 where command_id = $1")
        .bind(&c)
        .execute(&app.pool)
        .await
        .unwrap();
    claim.release(&app.pool, 1.0, "x").await.unwrap();
    assert_eq!(row(&app.pool, &c).await, ("leased".into(), 2));
    set_attempts(&app.pool, &c, 1).await;
    claim.release(&app.pool, 1.0, "x").await.unwrap();
    assert_eq!(row(&app.pool, &c).await, ("pending".into(), 0));
}
