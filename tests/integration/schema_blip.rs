//! A schema blip holds work instead of quarantining it, and the work proceeds on its own once
//! the schema is right again: no restart, no redrive, no budget spent.

use serde_json::Value;

use crate::common::*;

const TABLE: &str = "create schema app;
create table app.t (id bigint primary key, at timestamptz not null, keep boolean)";

const POLICY: &str = r#"
[[policy]]
name = "t"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "app.t", key = "id", timestamp = "at" }
retain_for = "1d"
exclude = [ { column = "keep", equals = true } ]
batch_size = 10
"#;

async fn advance(app: &TestApp, seconds: i64) {
    crate::kit::ledger::advance_clock(&app.pool, seconds).await;
}

async fn deliver(app: &TestApp, command_id: &str) -> (u16, Value) {
    let r = app.consume(command_id).await;
    (r.status, r.body)
}

#[tokio::test]
async fn a_renamed_column_holds_commands_and_planning_until_it_is_back() {
    let app = TestApp::spawn(Spawn {
        setup_sql: TABLE,
        policies: POLICY.into(),
        now: Some(at("2026-09-01T02:01:00Z")),
        extra_toml: "[ledger]\nhold_alert_after = \"1m\"".into(),
        ..Default::default()
    })
    .await;
    sqlx::query("insert into app.t select g, '2026-01-01Z', g = 1 from generate_series(1, 31) g")
        .execute(&app.pool)
        .await
        .unwrap();
    let (status, run) = app.trigger("t", "").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    let commands = app.command_ids(&run_id).await;
    assert_eq!(commands.len(), 3);

    sqlx::query("alter table app.t rename column keep to keep_x")
        .execute(&app.pool)
        .await
        .unwrap();
    // The first delivery meets the error in SQL, the second the catalog read afresh: both
    // held, neither quarantined, no attempt spent.
    for c in &commands[..2] {
        let (status, body) = deliver(&app, c).await;
        assert_eq!(status, 503, "{body}");
        assert!(
            body["detail"]
                .as_str()
                .unwrap()
                .starts_with("held (schema):")
                && body["detail"].as_str().unwrap().contains("keep"),
            "{body}"
        );
    }
    // Delivered again before its next check: still says why it waits.
    let (status, body) = deliver(&app, &commands[0]).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .starts_with("held (schema):"),
        "{body}"
    );
    // Planning of another run meets the same blip: held too, not failing.
    let (status, second) = app.trigger("t", "?window=2026-08-31").await;
    assert_eq!(status, 202, "{second}");
    let second_id = second["run_id"].as_str().unwrap().to_string();
    let view = app
        .wait_until(&second_id, "held at planning", |r| {
            r["held"]["planning_held"] == true
        })
        .await;
    assert_eq!(view["held"]["kind"], "schema", "{view}");
    assert_eq!(view["planning"]["consecutive_failures"], 0, "{view}");
    let view = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(view["held"]["kind"], "schema", "{view}");
    assert_eq!(view["held"]["held_commands"], 2, "{view}");
    assert_eq!(view["held"]["overdue"], false, "{view}");
    let (dead, attempts): (i64, i64) = sqlx::query_as(
        "select (select count(*) from sweeper.dead_letters),
                (select coalesce(sum(attempts), 0) from sweeper.commands)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((dead, attempts), (0, 0));

    // Held past hold_alert_after: overdue on the run and in the metric.
    advance(&app, 120).await;
    let view = app.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(view["held"]["overdue"], true, "{view}");
    let metrics = reqwest::get(format!("{}/metrics", app.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sweeper_held_overdue{kind=\"schema\"}") && !l.ends_with(" 0")),
        "{metrics}"
    );

    // The schema is right again: everything proceeds on its own, with no redrive.
    sqlx::query("alter table app.t rename column keep_x to keep")
        .execute(&app.pool)
        .await
        .unwrap();
    advance(&app, 10).await;
    for c in &commands {
        let (status, body) = deliver(&app, c).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["result"], "executed", "{body}");
    }
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"], 30, "{done}");
    assert_eq!(done["held"], Value::Null, "{done}");
    app.wait_planned(&second_id).await;
    let view = app.get_json(&format!("/runs/{second_id}")).await;
    assert_eq!(view["held"], Value::Null, "{view}");
    let kept: Vec<i64> = sqlx::query_scalar("select id from app.t")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(kept, vec![1], "the excluded row stays");
}

#[tokio::test]
async fn a_dropped_column_holds_planning_and_the_background_loops_resume_on_their_own() {
    let app = TestApp::spawn(Spawn {
        setup_sql: TABLE,
        policies: POLICY.into(),
        now: Some(at("2026-09-01T02:01:00Z")),
        workers: 1,
        ..Default::default()
    })
    .await;
    sqlx::query("insert into app.t select g, '2026-01-01Z', false from generate_series(1, 30) g")
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("alter table app.t drop column keep")
        .execute(&app.pool)
        .await
        .unwrap();
    let (status, run) = app.trigger("t", "").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let view = app
        .wait_until(&run_id, "held", |r| r["held"]["kind"] == "schema")
        .await;
    assert!(
        view["held"]["detail"].as_str().unwrap().contains("keep"),
        "{view}"
    );
    sqlx::query("alter table app.t add column keep boolean not null default false")
        .execute(&app.pool)
        .await
        .unwrap();
    advance(&app, 10).await;
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"], 30, "{done}");
}

/// A retyped exclusion column could change what the exclusion matches (`true` cast to text is
/// 'true', never 't'): it holds the work, whatever the new type, until the type is back.
#[tokio::test]
async fn a_retyped_exclusion_column_holds_the_work_and_deletes_nothing_it_protected() {
    let app = TestApp::spawn(Spawn {
        setup_sql: TABLE,
        policies: POLICY.into(),
        now: Some(at("2026-09-01T02:01:00Z")),
        ..Default::default()
    })
    .await;
    sqlx::query(
        "insert into app.t select g, '2026-01-01Z', g in (1, 2, 12) from generate_series(1, 30) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (status, run) = app.trigger("t", "").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    let commands = app.command_ids(&run_id).await;
    // Rows put on hold after planning, then the column retyped under the policy.
    sqlx::query("update app.t set keep = true where id in (3, 4)")
        .execute(&app.pool)
        .await
        .unwrap();
    for retype in [
        "alter table app.t alter column keep type text using case when keep then 't' else 'f' end",
        "alter table app.t alter column keep type integer using case when keep = 't' then 1 else 0 end",
    ] {
        sqlx::query(retype).execute(&app.pool).await.unwrap();
        for _ in 0..2 {
            for c in &commands {
                let (status, body) = deliver(&app, c).await;
                assert_eq!(status, 503, "{retype}: {body}");
                assert!(
                    body["detail"]
                        .as_str()
                        .unwrap()
                        .starts_with("held (schema):"),
                    "{retype}: {body}"
                );
            }
            advance(&app, 10).await;
        }
    }
    let (left, dead): (i64, i64) = sqlx::query_as(
        "select (select count(*) from app.t), (select count(*) from sweeper.dead_letters)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (left, dead),
        (30, 0),
        "nothing deleted, nothing quarantined"
    );
    sqlx::query("alter table app.t alter column keep type boolean using keep = 1")
        .execute(&app.pool)
        .await
        .unwrap();
    advance(&app, 10).await;
    for c in &commands {
        let (status, body) = deliver(&app, c).await;
        assert_eq!(status, 200, "{body}");
    }
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    let kept: Vec<i64> = sqlx::query_scalar("select id from app.t order by id")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(kept, vec![1, 2, 3, 4, 12]);
}
