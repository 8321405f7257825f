//! Crashes on a table keyed `(tenant_id, id)` (issue 31): the server killed mid-planning (on both
//! walks) and mid-command; after a restart every eligible key is in exactly one command, deleted
//! once and audited once under its JSON item key.

use super::*;

/// `demo.tickets` keyed `(tenant_id, id)` through a primary key listed `(id, tenant_id)`.
const TENANT_TICKETS: &str = "
create schema demo;
create table demo.tickets (tenant_id text not null, id bigint not null, status text,
                           legal_hold boolean, closed_at timestamptz, primary key (id, tenant_id));
create index on demo.tickets (closed_at, id, tenant_id)";

/// The item key text of `(tenant, id)`.
fn item(tenant: &str, id: i64) -> String {
    serde_json::to_string(&[tenant.to_string(), id.to_string()]).unwrap()
}

/// 400 tickets: ids 1..=100 under four tenants, closed before the cutoff unless the id is a
/// multiple of 4, on legal hold when a multiple of 10, several sharing a timestamp; the clock at
/// the window. Returns (db, pool, eligible item keys sorted, every item key sorted).
async fn prepare() -> (TestDb, PgPool, Vec<String>, Vec<String>) {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(TENANT_TICKETS).execute(&pool).await.unwrap();
    set_clock(&pool, at("2026-09-01T02:01:00Z")).await;
    sqlx::query(
        "insert into demo.tickets
         select t, i, 'closed', i % 10 = 0,
                case when i % 4 = 0 then timestamptz '2026-08-30T00:00:00Z'
                     else timestamptz '2026-01-01T00:00:00Z' + (i % 7) * interval '1 day' end
           from unnest(array['acme', 'b\"q', 'c\\d', 'élan']) t, generate_series(1, 100) i",
    )
    .execute(&pool)
    .await
    .unwrap();
    let rows: Vec<(String, i64)> = sqlx::query_as("select tenant_id, id from demo.tickets")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut all: Vec<String> = rows.iter().map(|(t, i)| item(t, *i)).collect();
    let mut eligible: Vec<String> = rows
        .iter()
        .filter(|(_, i)| i % 4 != 0 && i % 10 != 0)
        .map(|(t, i)| item(t, *i))
        .collect();
    all.sort();
    eligible.sort();
    (db, pool, eligible, all)
}

fn config(db_url: &str, workers: usize, path: &str) -> String {
    config_toml(
        db_url,
        workers,
        &format!("[planning]\npage_rows = 50\npath = \"{path}\""),
        &ticket_policy(10).replace(r#"key = "id""#, r#"key = ["tenant_id", "id"]"#),
    )
}

/// Every command succeeded, every eligible key in exactly one command and deleted with one audit
/// row, every other row still there, none eligible left.
async fn assert_end_state(pool: &PgPool, run_id: &str, eligible: &[String], all: &[String]) {
    let states = kit::ledger::command_states(pool, run_id).await;
    assert_eq!(states, vec!["succeeded"], "every planned command terminal");
    let planned: Vec<String> = sqlx::query_scalar(
        "select k from sweeper.commands, unnest(item_keys) k where run_id = $1 order by 1",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap();
    let mut planned_sorted = planned.clone();
    planned_sorted.sort();
    assert_eq!(
        planned_sorted, eligible,
        "every eligible key in exactly one command"
    );
    let mut audited: Vec<(String, String)> =
        sqlx::query_as("select item_key, outcome from sweeper.audit_trail where run_id = $1")
            .bind(run_id)
            .fetch_all(pool)
            .await
            .unwrap();
    audited.sort();
    assert_eq!(
        audited,
        eligible
            .iter()
            .map(|k| (k.clone(), "deleted".to_string()))
            .collect::<Vec<_>>(),
        "one deleted row per eligible key"
    );
    let rows: Vec<(String, i64)> = sqlx::query_as("select tenant_id, id from demo.tickets")
        .fetch_all(pool)
        .await
        .unwrap();
    let mut left: Vec<String> = rows.iter().map(|(t, i)| item(t, *i)).collect();
    left.sort();
    let kept: Vec<String> = all
        .iter()
        .filter(|k| !eligible.contains(k))
        .cloned()
        .collect();
    assert_eq!(left, kept, "held and young rows untouched");
    let remaining: Option<i64> =
        sqlx::query_scalar("select remaining_eligible from sweeper.runs where run_id = $1")
            .bind(run_id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(remaining, Some(0));
}

/// Killed after the first planning page committed, on each walk; a restarted server resumes
/// from the cursor over `(id, tenant_id)` (or `(closed_at, id, tenant_id)`).
#[tokio::test]
async fn a_crash_while_planning_a_composite_key_resumes_from_its_cursor() {
    for path in ["key_order", "timestamp_index"] {
        let (db, pool, eligible, all) = prepare().await;
        let how = Launch {
            crash_at: Some("plan_after_page"),
            ..Default::default()
        };
        let mut server = Server::launch(&config(&db.url, 0, path), how).await;
        let run_id = trigger(&server).await;
        server.wait_crashed().await;
        let (pages, walked): (i32, String) =
            sqlx::query_as("select pages_done, path from sweeper.planning_jobs where run_id = $1")
                .bind(&run_id)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!((pages, walked.as_str()), (1, path));
        let _server = Server::launch(&config(&db.url, 2, path), Launch::default()).await;
        advance(&pool, 61).await; // past the planning lease
        wait_terminal(&pool, &run_id).await;
        assert_end_state(&pool, &run_id, &eligible, &all).await;
    }
}

/// Killed after a command's delete, before its commit: nothing of it stays; a restarted server
/// deletes every eligible key once.
#[tokio::test]
async fn a_crash_mid_command_on_a_composite_key_loses_nothing() {
    let (db, pool, eligible, all) = prepare().await;
    let how = Launch {
        crash_at: Some("consume_before_commit"),
        ..Default::default()
    };
    let mut server = Server::launch(&config(&db.url, 1, "key_order"), how).await;
    let run_id = trigger(&server).await;
    server.wait_crashed().await;
    let (audit, left): (i64, i64) = sqlx::query_as(
        "select (select count(*) from sweeper.audit_trail), (select count(*) from demo.tickets)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (audit, left),
        (0, 400),
        "the aborted transaction left nothing"
    );
    let _server = Server::launch(&config(&db.url, 2, "key_order"), Launch::default()).await;
    advance(&pool, 301).await; // past the queue lease of the claimed command
    wait_terminal(&pool, &run_id).await;
    assert_end_state(&pool, &run_id, &eligible, &all).await;
}
