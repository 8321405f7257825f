//! An action once per window across a real crash: the digest call made, the process aborted
//! before anything recorded it, restarted — the call is repeated once, with the same key.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::PgPool;

use super::{advance, api};
use crate::common::*;
use crate::kit::process::{Launch, Server};
use crate::standin::{StandIn, ok};

const NOW: &str = "2026-09-07T09:01:00Z";
const WINDOW: &str = "2026-09-07T09:00:00Z";

const SETUP: &str = "
create schema crm;
create table crm.customers (
    id bigint primary key,
    email text not null,
    status text,
    created_at timestamptz not null default '2026-01-01'
);
insert into crm.customers (id, email, status) values
    (1, 'a@example.com', 'active'), (2, 'b@example.com', 'active'),
    (3, 'c@example.com', 'active'), (4, 'd@example.com', 'inactive')";

fn policies(url: &str) -> String {
    crate::kit::digest::digest_policy(url, 10)
}

#[tokio::test]
async fn a_crash_after_the_digest_call_repeats_it_once_with_the_same_key() {
    let api_standin = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(SETUP).execute(&pool).await.unwrap();
    sweeper::ledger::migrations::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    set_clock(&pool, at(NOW)).await;
    let text = config_toml(&db.url, 1, "", &policies(&api_standin.url()));
    let mut crashing = Server::launch(
        &text,
        Launch {
            crash_at: Some("effect_before_called"),
            ..Default::default()
        },
    )
    .await;
    let a = api(&crashing).trigger("support-digest", "").await;
    assert_eq!(a.status, 202);
    let run_id = a.body["run_id"].as_str().unwrap().to_string();
    crashing.wait_crashed().await;
    assert_eq!(api_standin.calls().len(), 1, "crashed after the first call");

    let server = Server::start(&text).await;
    // The command is reclaimed once its lease has expired.
    advance(&pool, 400).await;
    let status =
        crate::kit::ledger::wait_run_terminal(&pool, &run_id, Duration::from_secs(90)).await;
    assert_eq!(status, "completed");
    drop(server);
    let calls = api_standin.calls();
    let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
    for c in &calls {
        *per_key
            .entry(c.idempotency_key.clone().unwrap())
            .or_default() += 1;
    }
    eprintln!("calls by idempotency key: {per_key:?}");
    let key = |i: i64| format!("support-digest:{WINDOW}:{i}");
    assert_eq!(
        per_key,
        BTreeMap::from([(key(1), 2), (key(2), 1), (key(3), 1)]),
        "the crashed call is repeated once with its key; nothing else twice"
    );
    let called: Vec<String> = sqlx::query_scalar(
        "select item_key from sweeper.audit_trail where run_id = $1 and outcome = 'called'
          order by item_key",
    )
    .bind(&run_id)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(called, ["1", "2", "3"]);
    let effects: Vec<(String, String)> =
        sqlx::query_as("select scope, state from sweeper.effects order by item_key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(
        effects.iter().all(|(s, st)| s == WINDOW && st == "closed"),
        "{effects:?}"
    );
}
