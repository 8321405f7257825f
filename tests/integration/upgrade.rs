//! Rolling upgrades: a replica starts against a database that a newer release has migrated
//! further (a migration it does not know), is ready, and completes a run.

use crate::common::*;

/// A migration a later release applied: unknown to this binary.
const NEWER_MIGRATION: &str = "
    create table sweeper.from_a_newer_release (id bigint primary key);
    insert into sweeper._sqlx_migrations (version, description, success, checksum, execution_time)
    values (99991231000001, 'from a newer release', true, '\\x00', 1)";

#[tokio::test]
async fn a_replica_starts_ready_and_completes_a_run_against_a_schema_newer_than_itself() {
    let setup: &'static str = Box::leak(format!("{TICKETS};{NEWER_MIGRATION}").into_boxed_str());
    let app = TestApp::spawn(Spawn {
        setup_sql: setup,
        workers: 1,
        ..Spawn::default()
    })
    .await;
    let ready = app
        .client
        .get(format!("{}/readyz", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    seed_mixed(&app.pool, 30, at("2026-09-01T02:00:00Z")).await;
    let (status, run) = app
        .trigger("ticket-retention", "?window=2026-09-01T02:00:00Z")
        .await;
    assert_eq!(status, 202, "{run}");
    let done = app.wait_terminal(run["run_id"].as_str().unwrap()).await;
    assert_eq!(done["status"], "completed", "{done}");
    // The newer migration is still recorded, and no migration of ours was applied twice.
    let versions: Vec<i64> =
        sqlx::query_scalar("select version from sweeper._sqlx_migrations order by version")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(versions.last(), Some(&99991231000001));
    assert_eq!(versions.len(), sweeper::ledger::MIGRATOR.iter().count() + 1);
}
