//! Effects once per window (`once_per = "window"`): a weekly digest to every selected customer,
//! one call per (policy, window, customer) with the key `{policy}:{window}:{customer}`, rows
//! kept (`then = "nothing"`, outcome `called`), against a stand-in that records each call.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::*;
use crate::standin::{StandIn, ok};

/// Monday 2026-09-07 09:01 UTC: the window is 09:00 that day.
const NOW: &str = "2026-09-07T09:01:00Z";
const WEEK1: &str = "2026-09-07T09:00:00Z";
const WEEK2: &str = "2026-09-14T09:00:00Z";

const SETUP: &str = "
create schema crm;
create table crm.customers (
    id bigint primary key,
    email text not null,
    status text,
    note text,
    created_at timestamptz not null default '2026-01-01'
);
insert into crm.customers (id, email, status) values
    (1, 'a@example.com', 'active'), (2, 'b@example.com', 'active'),
    (3, 'c@example.com', 'active'), (4, 'd@example.com', 'inactive'),
    (5, 'e@example.com', null)";

fn digest_policy(url: &str) -> String {
    crate::kit::digest::digest_policy(url, 2)
}

async fn spawn(workers: usize, policies: String) -> TestApp {
    TestApp::spawn(Spawn {
        setup_sql: SETUP,
        now: Some(at(NOW)),
        policies,
        workers,
        ..Default::default()
    })
    .await
}

/// Idempotency key → calls received with it.
fn keys(s: &StandIn) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for c in s.calls() {
        *m.entry(c.idempotency_key.unwrap_or_default()).or_default() += 1;
    }
    m
}

fn expected(window: &str, ids: &[i64]) -> BTreeMap<String, usize> {
    ids.iter()
        .map(|i| (format!("support-digest:{window}:{i}"), 1))
        .collect()
}

#[tokio::test]
async fn each_week_calls_once_per_selected_customer_with_that_weeks_key() {
    let api = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let app = spawn(2, digest_policy(&api.url())).await;
    let (status, run) = app.trigger("support-digest", "").await;
    assert_eq!(status, 202, "{run}");
    let done = app.wait_terminal(run["run_id"].as_str().unwrap()).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["called"], 3, "{done}");
    assert_eq!(done["deleted"], 0, "{done}");
    // Every selected customer was called this window: none is left to call.
    assert_eq!(done["remaining_eligible"], 0, "{done}");
    assert_eq!(keys(&api), expected(WEEK1, &[1, 2, 3]));
    let bodies: Vec<String> = api.calls().iter().map(|c| c.body.clone()).collect();
    assert!(
        bodies.contains(&r#"{"to": "a@example.com"}"#.to_string()),
        "{bodies:?}"
    );
    // Rows are kept; the audit says called.
    let rows: i64 = sqlx::query_scalar("select count(*) from crm.customers")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 5);
    let outcomes: Vec<String> = sqlx::query_scalar(
        "select distinct outcome from sweeper.audit_trail where policy = 'support-digest'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(outcomes, vec!["called".to_string()]);

    // The same week again: the same run, nothing sent.
    let (status, again) = app.trigger("support-digest", "").await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["run_id"], run["run_id"]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(api.calls().len(), 3);

    // Next week: one call per active customer with next week's key (customer 4 became active).
    sqlx::query("update crm.customers set status = 'active' where id = 4")
        .execute(&app.pool)
        .await
        .unwrap();
    set_clock(&app.pool, at("2026-09-14T09:01:00Z")).await;
    let (status, next) = app.trigger("support-digest", "").await;
    assert_eq!(status, 202, "{next}");
    let done = app.wait_terminal(next["run_id"].as_str().unwrap()).await;
    assert_eq!(done["called"], 4, "{done}");
    let mut want = expected(WEEK1, &[1, 2, 3]);
    want.extend(expected(WEEK2, &[1, 2, 3, 4]));
    assert_eq!(keys(&api), want);
}

#[tokio::test]
async fn a_customer_deactivated_after_planning_is_not_called_and_is_audited_with_its_reason() {
    let api = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let app = spawn(0, digest_policy(&api.url())).await;
    let (_, run) = app.trigger("support-digest", "").await;
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    sqlx::query("update crm.customers set status = 'inactive' where id = 2")
        .execute(&app.pool)
        .await
        .unwrap();
    app.drain().await;
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["called"], 2, "{done}");
    assert_eq!(done["not_eligible"], 1, "{done}");
    assert_eq!(keys(&api), expected(WEEK1, &[1, 3]));
    let reason: Option<String> = sqlx::query_scalar(
        "select reason from sweeper.audit_trail where run_id = $1 and item_key = '2'",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(reason.as_deref(), Some("not_selected:status"));
}

#[tokio::test]
async fn a_row_that_moves_only_in_columns_no_rule_reads_during_its_call_is_still_called() {
    let api = StandIn::start(Duration::from_millis(1_500), |_, _| ok()).await;
    let policies = digest_policy(&api.url()).replace("batch_size = 2", "batch_size = 5");
    let app = spawn(1, policies).await;
    let (_, run) = app.trigger("support-digest", "").await;
    let run_id = run["run_id"].as_str().unwrap().to_string();
    // While customer 1's call is in flight its note changes (no rule or template reads it);
    // while customer 2's is, its email (the body reads it) changes.
    let wait_calls = |n: usize| {
        let api = &api;
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while api.calls().len() < n {
                assert!(std::time::Instant::now() < deadline);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_calls(1).await;
    sqlx::query("update crm.customers set note = 'moved' where id = 1")
        .execute(&app.pool)
        .await
        .unwrap();
    wait_calls(2).await;
    sqlx::query("update crm.customers set email = 'z@example.com' where id = 2")
        .execute(&app.pool)
        .await
        .unwrap();
    let done = app.wait_terminal(&run_id).await;
    let audit: BTreeMap<String, String> =
        sqlx::query_as("select item_key, outcome from sweeper.audit_trail where run_id = $1")
            .bind(&run_id)
            .fetch_all(&app.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(audit["1"], "called", "{done}");
    // Its email changed while the call (which read the old one) was in flight: an operator
    // decides (the item fails).
    assert_eq!(audit["2"], "failed", "{done}");
    assert_eq!(audit["3"], "called", "{done}");
    assert_eq!(api.calls().len(), 3);
}

#[test]
fn once_per_is_refused_where_it_means_nothing() {
    let errors = |policies: &str| {
        let text = config_toml("postgres://localhost/x", 0, "", policies);
        sweeper::settings::Config::from_toml(&text)
            .unwrap_err()
            .to_string()
    };
    let base = digest_policy("http://127.0.0.1:9");
    let e = errors(&base.replace(
        "[policy.action]\nkind = \"http\"\ndependency = \"digests\"\nmethod = \"POST\"\npath = \"/digests/{id}\"\nbody = '{\"to\": \"{email}\"}'\nonce_per = \"window\"\nthen = \"nothing\"\n",
        "allow_delete = true\naction = { kind = \"delete_rows\", once_per = \"window\" }\n",
    ));
    assert!(
        e.contains("policy[support-digest].action.once_per: delete_rows makes no external call"),
        "{e}"
    );
    let e = errors(&base.replace("once_per = \"window\"\n", ""));
    assert!(
        e.contains("then: \"nothing\" is allowed only for actions harmless to repeat"),
        "{e}"
    );
    let e = errors(&base.replace("once_per = \"window\"", "once_per = \"week\""));
    assert!(
        e.contains("once_per: `week` is not one of \"item\", \"window\""),
        "{e}"
    );
    let e = errors(&base.replace("method = \"POST\"", "method = \"GET\""));
    assert!(
        e.contains("once_per: \"window\" is for POST, PUT or PATCH calls"),
        "{e}"
    );
}
