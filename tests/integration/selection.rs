//! Selection policies: rows chosen by predicates (`select`) instead of a retention cutoff, with
//! the cutoff at the window, the predicates re-checked at the moment of the effect, and the
//! configuration rules that keep a selection from deleting by accident.

use serde_json::Value;

use crate::common::*;

const NOW: &str = "2026-09-07T09:01:00Z";
/// Mondays 09:00 UTC: the window of NOW is 2026-09-07T09:00:00Z.
const WINDOW: &str = "2026-09-07T09:00:00Z";

const SETUP: &str = "
create schema crm;
create table crm.customers (
    id bigint primary key,
    status text,
    last_seen_at timestamptz,
    created_at timestamptz not null
)";

fn policy(extra: &str) -> String {
    format!(
        r#"
[[policy]]
name = "inactive-purge"
schedule = {{ cron = "0 9 * * 1", timezone = "UTC" }}
target = {{ table = "crm.customers", key = "id", timestamp = "created_at" }}
select = [ {{ column = "status", equals = "active" }}, {{ column = "last_seen_at", older_than = "30d" }} ]
exclude = [ {{ column = "id", equals = 7, name = "vip" }} ]
batch_size = 2
{extra}
"#
    )
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

/// Customers: 1–3 active and unseen for 40 days (selected), 4 active and seen last week, 5
/// inactive and unseen, 6 with no status, 7 selected but excluded, 8 selected but created after
/// the window, 9 active with no `last_seen_at`.
async fn seed(app: &TestApp) {
    sqlx::query(
        "insert into crm.customers values
           (1, 'active', $1::timestamptz - interval '40 days', '2026-01-01'),
           (2, 'active', $1::timestamptz - interval '40 days', '2026-01-01'),
           (3, 'active', $1::timestamptz - interval '90 days', '2026-01-01'),
           (4, 'active', $1::timestamptz - interval '7 days',  '2026-01-01'),
           (5, 'closed', $1::timestamptz - interval '40 days', '2026-01-01'),
           (6, null,     $1::timestamptz - interval '40 days', '2026-01-01'),
           (7, 'active', $1::timestamptz - interval '40 days', '2026-01-01'),
           (8, 'active', $1::timestamptz - interval '40 days', $1::timestamptz + interval '1 minute'),
           (9, 'active', null,                                 '2026-01-01')",
    )
    .bind(WINDOW)
    .execute(&app.pool)
    .await
    .unwrap();
}

async fn ids(app: &TestApp) -> Vec<i64> {
    sqlx::query_scalar("select id from crm.customers order by id")
        .fetch_all(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_selection_deletes_what_every_predicate_selects_before_the_window() {
    let app = spawn(2, policy("allow_delete = true")).await;
    seed(&app).await;
    let (status, run) = app.trigger("inactive-purge", "").await;
    assert_eq!(status, 202, "{run}");
    // The cutoff is the window itself.
    assert_eq!(run["cutoff"], WINDOW, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"], 3, "{done}");
    assert_eq!(done["remaining_eligible"], 0, "{done}");
    assert_eq!(ids(&app).await, vec![4, 5, 6, 7, 8, 9]);
    // The policy lists its predicates and no retention.
    let policies: Value = app.api.policies().await;
    let p = &policies["policies"][0];
    assert_eq!(p["retain_for"], Value::Null, "{p}");
    assert_eq!(p["select"][1]["test"]["op"], "older_than", "{p}");
}

#[tokio::test]
async fn a_customer_reactivated_between_planning_and_the_effect_is_kept_with_its_reason() {
    let app = spawn(0, policy("allow_delete = true")).await;
    seed(&app).await;
    let (_, run) = app.trigger("inactive-purge", "").await;
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    // Customer 2 comes back (last seen now), customer 3 is deactivated: both stop matching.
    sqlx::query("update crm.customers set last_seen_at = $1::timestamptz where id = 2")
        .bind(WINDOW)
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("update crm.customers set status = 'closed' where id = 3")
        .execute(&app.pool)
        .await
        .unwrap();
    app.drain().await;
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["deleted"], 1, "{done}");
    assert_eq!(done["not_eligible"], 2, "{done}");
    let audit: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "select item_key, outcome, reason from sweeper.audit_trail where run_id = $1 order by item_key",
    )
    .bind(&run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![
            ("1".into(), "deleted".into(), None),
            (
                "2".into(),
                "not_eligible".into(),
                Some("not_selected:last_seen_at".into())
            ),
            (
                "3".into(),
                "not_eligible".into(),
                Some("not_selected:status".into())
            ),
        ]
    );
    assert_eq!(ids(&app).await, vec![2, 3, 4, 5, 6, 7, 8, 9]);
}

#[test]
fn a_selection_is_refused_without_allow_delete_with_retain_for_or_on_a_wrong_predicate() {
    let errors = |policies: &str| {
        let text = config_toml("postgres://localhost/x", 0, "", policies);
        sweeper::settings::Config::from_toml(&text)
            .unwrap_err()
            .to_string()
    };
    let e = errors(&policy(""));
    assert!(
        e.contains("policy[inactive-purge].action: a selection policy deletes rows only with `allow_delete = true`"),
        "{e}"
    );
    let e = errors(&policy("allow_delete = true\nretain_for = \"30d\""));
    assert!(
        e.contains(
            "policy[inactive-purge].retain_for: a selection policy (`select`) has no retain_for"
        ),
        "{e}"
    );
    let e = errors(&policy("allow_delete = true").replace(
        "older_than = \"30d\"",
        "older_than = \"30d\", equals = \"x\"",
    ));
    assert!(
        e.contains("policy[inactive-purge].select[1]: give exactly one of"),
        "{e}"
    );
    let without_select: String = policy("")
        .lines()
        .filter(|l| !l.starts_with("select"))
        .map(|l| format!("{l}\n"))
        .collect();
    let e = errors(&without_select);
    assert!(
        e.contains("policy[inactive-purge].retain_for: required"),
        "{e}"
    );
}
