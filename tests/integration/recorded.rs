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

/// A server at [`NOW`] reconciling `payments` payments through `provider` with `action_extra`
/// on the action; runs the 2026-09-01 window to its end and returns the app, the run id and the
/// terminal run.
async fn reconcile_once(
    provider: &StandIn,
    action_extra: &str,
    payments: i64,
) -> (TestApp, String, serde_json::Value) {
    let config = dependency("payments", &provider.url(), "")
        + &payments_policy("reconcile", "payments", 100, action_extra, "");
    let app = TestApp::spawn(Spawn {
        setup_sql: EXT,
        policies: config,
        workers: 1,
        now: Some(at(NOW)),
        extra_toml: String::new(),
    })
    .await;
    seed_payments(&app, payments).await;
    let (status, run) = app.trigger("reconcile", "?window=2026-09-01").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let done = app.wait_terminal(&run_id).await;
    (app, run_id, done)
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
    let (app, run_id, done) = reconcile_once(&provider, RECORD, 8).await;
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

/// A mismatch (`mismatch = { pointer, in }`): its own outcome, counted on the run; the row is not
/// stamped; the effect is closed; an item dead letter carries the recorded fields; later runs
/// hold the item (`dead_letter_open`) and call nothing for it; a redrive after the data is
/// corrected calls again with the next idempotency key and supersedes the mismatch in the counts.
#[tokio::test]
async fn a_mismatch_keeps_its_row_opens_a_dead_letter_and_holds_the_item_until_redriven() {
    // Item 3: the provider's amount differs until the second key; item 4: unknown to it.
    let provider = StandIn::start(Duration::ZERO, |c: &Call, _: &[Call]| -> Reply {
        let id = item_of(c);
        let key = c.idempotency_key.clone().unwrap_or_default();
        let body = match id {
            3 if key.ends_with(":1") => {
                r#"{"status": "mismatch", "provider_amount": 999, "provider_ref": "pi_3"}"#
                    .to_string()
            }
            4 => r#"{"status": "unknown", "provider_amount": null, "provider_ref": null}"#
                .to_string(),
            _ => format!(
                r#"{{"status": "match", "provider_amount": {}, "provider_ref": "pi_{id}"}}"#,
                id * 100
            ),
        };
        (200, vec![], body)
    })
    .await;
    let mismatch = r#"{ pointer = "/status", in = ["mismatch", "unknown"] }"#;
    let (app, first, done) =
        reconcile_once(&provider, &format!("{RECORD}, mismatch = {mismatch}"), 6).await;
    assert_eq!(done["status"], "completed_with_dead_letters", "{done}");
    assert_eq!(
        (done["reconciled"].as_i64(), done["mismatched"].as_i64()),
        (Some(4), Some(2)),
        "{done}"
    );
    assert_eq!(
        recorded(&app, "3").await,
        [(
            "mismatched".to_string(),
            None,
            Some(r#"{"/status":"mismatch","/provider_amount":999,"/provider_ref":"pi_3"}"#.into())
        )]
    );
    let unstamped: Vec<i64> =
        sqlx::query_scalar("select id from ext.payments where reconciled_at is null order by id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(unstamped, [3, 4]);
    let effect: (String, i32) = sqlx::query_as(
        "select state, n from sweeper.effects where policy = 'reconcile' and item_key = '3'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(effect, ("closed".to_string(), 1));
    let dead = app.get_json("/dead-letters?status=open").await;
    let letters = dead["dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 2, "{dead}");
    let three = letters.iter().find(|d| d["item_key"] == "3").unwrap();
    assert_eq!(three["outcome"], "mismatched", "{three}");
    assert_eq!(three["recorded"]["/provider_amount"], 999, "{three}");
    assert!(
        three["reason"].as_str().unwrap().starts_with("mismatched:"),
        "{three}"
    );
    assert!(
        three["replay_safe"]["cause"]
            .as_str()
            .unwrap()
            .starts_with("the provider's answer said its record differs"),
        "{three}"
    );
    let history = app.get_json("/policies/reconcile/items/3").await;
    assert_eq!(history["audit"][0]["outcome"], "mismatched", "{history}");
    assert_eq!(
        history["dead_letters"][0]["outcome"], "mismatched",
        "{history}"
    );

    // The next night: both held at planning, nothing called for them.
    let calls_before = provider.calls().len();
    let (status, run) = app.trigger("reconcile", "?window=2026-09-02").await;
    assert_eq!(status, 202, "{run}");
    let second = run["run_id"].as_str().unwrap().to_string();
    let done = app.wait_terminal(&second).await;
    assert_eq!(done["held_at_planning"]["dead_letter_open"], 2, "{done}");
    assert_eq!(
        provider.calls().len(),
        calls_before,
        "no call for a held item"
    );

    // The data is corrected: a redrive calls again with the next key and reconciles.
    let id = three["dead_letter_id"].as_i64().unwrap();
    app.api
        .redrive(id, "amount corrected with the provider")
        .await;
    let mut waited = 0;
    loop {
        let status: String =
            sqlx::query_scalar("select status from sweeper.dead_letters where dead_letter_id = $1")
                .bind(id)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        if status == "resolved" {
            break;
        }
        waited += 1;
        assert!(waited < 100, "the redrive did not resolve: {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let keys: Vec<String> = provider
        .calls()
        .iter()
        .filter(|c| item_of(c) == 3)
        .map(|c| c.idempotency_key.clone().unwrap())
        .collect();
    assert_eq!(keys, ["reconcile:3:1", "reconcile:3:2"]);
    let stamped: bool =
        sqlx::query_scalar("select reconciled_at is not null from ext.payments where id = 3")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(stamped);
    let run = app.get_json(&format!("/runs/{first}")).await;
    assert_eq!(
        (run["reconciled"].as_i64(), run["mismatched"].as_i64()),
        (Some(5), Some(1)),
        "{run}"
    );
}
