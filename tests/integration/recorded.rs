//! Responses as evidence: an `http` action's `record` names fields of its answer by JSON pointer;
//! their values go into the item's audit row (in the action's order, at most 1 KiB, the rest
//! marked truncated) and show in the run's pages and the item's history. An answer that is not
//! JSON, or lacks a named field, fails its item with that reason.

use std::time::Duration;

use crate::common::*;
use crate::ext_common::*;
use crate::standin::{Call, Reply, StandIn};

fn item_of(c: &Call) -> i64 {
    c.path.rsplit('/').next().unwrap().parse().unwrap()
}

const RECORD: &str = r#", record = ["/status", "/provider_amount", "/provider_ref"]"#;

async fn recorded(app: &TestApp, item: &str) -> Vec<(String, Option<String>, Option<String>)> {
    sqlx::query_as(
        "select outcome, reason, recorded::text from sweeper.audit_trail
          where policy = 'reconcile' and item_key = $1 order by audit_id",
    )
    .bind(item)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_answers_fields_are_recorded_with_each_item_and_a_bad_answer_fails_its_item() {
    let provider = StandIn::start(Duration::ZERO, |c: &Call, _: &[Call]| -> Reply {
        let id = item_of(c);
        let body = match id {
            5 => "<html>ok</html>".to_string(),
            6 => r#"{"status": "match", "provider_amount": 600}"#.to_string(),
            7 => format!(
                r#"{{"status": "{}", "provider_amount": 700, "provider_ref": "pi_7"}}"#,
                "x".repeat(2000)
            ),
            _ => format!(
                r#"{{"provider_ref": "pi_{id}", "status": "match", "provider_amount": {}, "other": [1, 2]}}"#,
                id * 100
            ),
        };
        (200, vec![], body)
    })
    .await;
    let config = dependency("payments", &provider.url(), "")
        + &payments_policy("reconcile", "payments", 100, RECORD, "");
    let app = TestApp::spawn(Spawn {
        setup_sql: EXT,
        policies: config,
        workers: 1,
        now: Some(at(NOW)),
        extra_toml: String::new(),
    })
    .await;
    seed_payments(&app, 8).await;
    let (status, run) = app.trigger("reconcile", "?window=2026-09-01").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed_with_dead_letters", "{done}");
    assert_eq!(
        (done["reconciled"].as_i64(), done["failed"].as_i64()),
        (Some(6), Some(2))
    );

    // The action's order, compact, whatever order the answer had.
    assert_eq!(
        recorded(&app, "1").await,
        [(
            "reconciled".to_string(),
            None,
            Some(r#"{"/status":"match","/provider_amount":100,"/provider_ref":"pi_1"}"#.into())
        )]
    );
    // Past 1 KiB: the field that does not fit and every one after it are marked.
    assert_eq!(
        recorded(&app, "7").await[0].2.as_deref(),
        Some(
            r#"{"/status":{"truncated":true},"/provider_amount":{"truncated":true},"/provider_ref":{"truncated":true}}"#
        )
    );
    // Not JSON, or a named field missing: the item fails with the reason; its row is not
    // stamped; the others go on.
    let not_json = recorded(&app, "5").await;
    assert_eq!(not_json[0].0, "failed");
    assert!(
        not_json[0]
            .1
            .as_deref()
            .unwrap()
            .contains("answered 200 with a body that is not JSON"),
        "{not_json:?}"
    );
    let missing = recorded(&app, "6").await;
    assert_eq!(missing[0].0, "failed");
    assert!(
        missing[0]
            .1
            .as_deref()
            .unwrap()
            .ends_with("answered 200 without the field /provider_ref, which the action records"),
        "{missing:?}"
    );
    let unstamped: Vec<i64> =
        sqlx::query_scalar("select id from ext.payments where reconciled_at is null order by id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(unstamped, [5, 6]);
    let dead: Vec<String> = sqlx::query_scalar(
        "select item_key from sweeper.dead_letters where run_id = $1 order by item_key",
    )
    .bind(&run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(dead, ["5", "6"]);
    // The effect kept them from the moment its call returned.
    let kept: Option<String> = sqlx::query_scalar(
        "select recorded::text from sweeper.effects where policy = 'reconcile' and item_key = '2'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        kept.as_deref(),
        Some(r#"{"/status":"match","/provider_amount":200,"/provider_ref":"pi_2"}"#)
    );

    // Over HTTP: the run's page and the item's history carry them; an item without any has none.
    let page = app
        .get_json(&format!("/runs/{run_id}/items?limit=100"))
        .await;
    let items = page["items"].as_array().unwrap();
    let one = items.iter().find(|i| i["item_key"] == "3").unwrap();
    assert_eq!(
        one["recorded"],
        serde_json::json!({"/status": "match", "/provider_amount": 300, "/provider_ref": "pi_3"})
    );
    let failed = items.iter().find(|i| i["item_key"] == "5").unwrap();
    assert!(failed.get("recorded").is_none(), "{failed}");
    let history = app.get_json("/policies/reconcile/items/4").await;
    assert_eq!(history["audit"][0]["recorded"]["/provider_ref"], "pi_4");
}

#[test]
fn record_names_json_pointers_at_most_eight_and_only_on_http_actions() {
    let config = |action_extra: &str| {
        sweeper::settings::Config::from_toml(&config_toml(
            "postgres://x@127.0.0.1/x",
            0,
            &dependency("payments", "http://127.0.0.1:9", ""),
            &payments_policy("reconcile", "payments", 10, action_extra, ""),
        ))
        .map(|_| ())
        .unwrap_err()
        .to_string()
    };
    let nine: Vec<String> = (0..9).map(|i| format!("\"/f{i}\"")).collect();
    let e = config(&format!(", record = [{}]", nine.join(", ")));
    assert!(
        e.contains("record: 9 fields; at most 8 response fields are recorded"),
        "{e}"
    );
    let e = config(r#", record = ["status"]"#);
    assert!(
        e.contains("record[0]: `status` is not a JSON pointer into the answer"),
        "{e}"
    );
    let e = config(r#", record = ["/a", "/a"]"#);
    assert!(e.contains("record[1]: `/a` is named twice"), "{e}");
    let e = sweeper::settings::Config::from_toml(&config_toml(
        "postgres://x@127.0.0.1/x",
        0,
        "",
        &format!(
            "{}action = {{ kind = \"delete_rows\", record = [\"/a\"] }}\n",
            ticket_policy(10)
        ),
    ))
    .map(|_| ())
    .unwrap_err()
    .to_string();
    assert!(e.contains("record: not a field of delete_rows"), "{e}");
}
