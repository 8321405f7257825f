//! Stages (`after`): a cleanup's run for a window executes only once the digest's run of that
//! window completed; while the digest runs, or after it was cancelled, the cleanup waits
//! visibly (held, kind `after`) and deletes nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::common::*;
use crate::ext_common::dependency;
use crate::standin::{StandIn, ok};

const NOW: &str = "2026-09-07T09:01:00Z";

pub(crate) const SETUP: &str = "
create schema crm;
create table crm.customers (
    id bigint primary key,
    email text not null,
    status text not null,
    created_at timestamptz not null default '2026-01-01'
);
create table crm.digest_items (
    id bigint primary key,
    customer_id bigint not null,
    created_at timestamptz not null
);
insert into crm.customers (id, email, status) values
    (1, 'a@example.com', 'active'), (2, 'b@example.com', 'active');
insert into crm.digest_items
    select g, 1 + g % 2, timestamptz '2026-09-07T09:00:00Z' - make_interval(days => g)
      from generate_series(1, 20) g";

pub(crate) fn policies(url: &str, cleanup_extra: &str) -> String {
    dependency("digests", url, "retry = { base = \"1s\", cap = \"2s\" }")
        + &format!(
            r#"
[[policy]]
name = "support-digest"
schedule = {{ cron = "0 9 * * 1", timezone = "UTC" }}
target = {{ table = "crm.customers", key = "id", timestamp = "created_at" }}
select = [ {{ column = "status", equals = "active" }} ]
[policy.action]
kind = "http"
dependency = "digests"
method = "POST"
path = "/digests/{{id}}"
once_per = "window"
then = "nothing"

[[policy]]
name = "support-digest-cleanup"
schedule = {{ cron = "0 9 * * 1", timezone = "UTC" }}
target = {{ table = "crm.digest_items", key = "id", timestamp = "created_at" }}
retain_for = "14d"
after = ["support-digest"]
{cleanup_extra}
"#
        )
}

/// An app at [`NOW`] with the digest, its cleanup stage and `more_policies`, over `SETUP`, two
/// workers, calling `api`.
async fn stages_app(api: &StandIn, more_policies: &str) -> TestApp {
    TestApp::spawn(Spawn {
        setup_sql: SETUP,
        now: Some(at(NOW)),
        policies: policies(&api.url(), "") + more_policies,
        workers: 2,
        ..Default::default()
    })
    .await
}

pub(crate) async fn items(app: &TestApp) -> i64 {
    sqlx::query_scalar("select count(*) from crm.digest_items")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_cleanup_waits_for_the_digest_of_its_window_and_never_deletes_early() {
    let failing = Arc::new(AtomicBool::new(true));
    let f = failing.clone();
    let api = StandIn::start(Duration::ZERO, move |_, _| {
        if f.load(Ordering::SeqCst) {
            (503, vec![], "busy".into())
        } else {
            ok()
        }
    })
    .await;
    let app = stages_app(&api, "").await;
    // The cleanup is triggered first: its upstream's run does not exist yet.
    let (_, cleanup) = app.trigger("support-digest-cleanup", "").await;
    let cleanup = cleanup["run_id"].as_str().unwrap().to_string();
    let held = app
        .api
        .wait_run(&cleanup, "held after", |r| r["held"]["kind"] == "after")
        .await;
    assert!(
        held["held"]["detail"]
            .as_str()
            .unwrap()
            .contains("support-digest:2026-09-07T09:00:00Z, not created yet"),
        "{held}"
    );
    let (_, digest) = app.trigger("support-digest", "").await;
    let digest = digest["run_id"].as_str().unwrap().to_string();
    // The digest keeps failing (503): the cleanup stays held, nothing deleted.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while api.calls().len() < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "the digest was called"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let run = app.api.run(&cleanup).await;
    assert_eq!(run["held"]["kind"], "after", "{run}");
    assert!(
        run["held"]["detail"]
            .as_str()
            .unwrap()
            .contains("which is running"),
        "{run}"
    );
    assert_eq!(items(&app).await, 20);
    // Cancelled, the digest never completes this window: the cleanup waits visibly.
    app.api
        .cancel_run(&digest, "the provider is down this week")
        .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let run = app.api.run(&cleanup).await;
    assert_eq!(run["status"], "running", "{run}");
    assert!(
        run["held"]["detail"]
            .as_str()
            .unwrap()
            .contains("which is cancelled"),
        "{run}"
    );
    assert_eq!(run["deleted"], 0, "{run}");
    assert_eq!(items(&app).await, 20);
    let metrics = app.api.metrics().await;
    assert!(
        metrics.contains("sweeper_held{kind=\"after\"}"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("held"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    app.api
        .cancel_run(&cleanup, "next week's cleanup covers it")
        .await;

    // Next week the provider answers: the digest completes, then the cleanup runs with its own
    // cutoff (window − 14d).
    failing.store(false, Ordering::SeqCst);
    set_clock(&app.pool, at("2026-09-14T09:01:00Z")).await;
    let (_, cleanup) = app.trigger("support-digest-cleanup", "").await;
    let (_, digest) = app.trigger("support-digest", "").await;
    let d = app.wait_terminal(digest["run_id"].as_str().unwrap()).await;
    assert_eq!(d["status"], "completed", "{d}");
    let c = app.wait_terminal(cleanup["run_id"].as_str().unwrap()).await;
    assert_eq!(c["status"], "completed", "{c}");
    assert_eq!(c["cutoff"], "2026-08-31T09:00:00Z", "{c}");
    // Items older than 2026-08-31T09:00: created 8..=20 days before 2026-09-07.
    assert_eq!(c["deleted"], 13, "{c}");
    assert!(
        c["completed_at"].as_str().unwrap() >= d["completed_at"].as_str().unwrap(),
        "the cleanup completed after the digest: {c} {d}"
    );
    let first_delete: String = sqlx::query_scalar(
        "select min(recorded_at)::text from sweeper.audit_trail where run_id = $1",
    )
    .bind(c["run_id"].as_str().unwrap())
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let digest_done: String =
        sqlx::query_scalar("select completed_at::text from sweeper.runs where run_id = $1")
            .bind(d["run_id"].as_str().unwrap())
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(
        first_delete >= digest_done,
        "{first_delete} < {digest_done}"
    );
}

#[test]
fn after_refuses_unknown_names_itself_and_cycles() {
    let errors = |policies: &str| {
        let text = config_toml("postgres://localhost/x", 0, "", policies);
        sweeper::settings::Config::from_toml(&text)
            .unwrap_err()
            .to_string()
    };
    let base = policies("http://127.0.0.1:9", "");
    let e = errors(&base.replace(
        "after = [\"support-digest\"]",
        "after = [\"support-digets\"]",
    ));
    assert!(
        e.contains("policy[support-digest-cleanup].after: no policy is named `support-digets`"),
        "{e}"
    );
    let e = errors(&base.replace(
        "after = [\"support-digest\"]",
        "after = [\"support-digest-cleanup\"]",
    ));
    assert!(e.contains("a policy cannot wait for itself"), "{e}");
    let e = errors(&base.replacen(
        "select = [ { column = \"status\", equals = \"active\" } ]\n",
        "select = [ { column = \"status\", equals = \"active\" } ]\nafter = [\"support-digest-cleanup\"]\n",
        1,
    ));
    assert!(
        e.contains(
            "policy[support-digest].after: a cycle: support-digest -> support-digest-cleanup -> support-digest"
        ),
        "{e}"
    );
}

/// A second selection policy that waits for the digest (a follow-up mail per window).
const FOLLOW_UP: &str = r#"
[[policy]]
name = "support-follow-up"
schedule = { cron = "0 9 * * 1", timezone = "UTC" }
target = { table = "crm.customers", key = "id", timestamp = "created_at" }
select = [ { column = "status", equals = "active" } ]
after = ["support-digest"]
[policy.action]
kind = "http"
dependency = "digests"
method = "POST"
path = "/follow-ups/{id}"
once_per = "window"
then = "nothing"
"#;

#[tokio::test]
async fn a_held_cleanup_a_later_completed_week_covers_is_superseded_and_a_selection_never_is() {
    let api = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let app = stages_app(&api, FOLLOW_UP).await;
    const W1: &str = "2026-09-07T09:00:00Z";
    // Week 1: the digest is cancelled before it runs; the cleanup and the follow-up wait.
    app.api.suspend("support-digest", "hold the digest").await;
    app.api.resume("support-digest", "go").await;
    let digest = app.api.trigger_new("support-digest", "").await;
    app.api
        .cancel_run(&digest, "the provider is down this week")
        .await;
    let cleanup = app.api.trigger_new("support-digest-cleanup", "").await;
    let follow_up = app.api.trigger_new("support-follow-up", "").await;
    for run in [&cleanup, &follow_up] {
        app.api
            .wait_run(run, "held after", |r| r["held"]["kind"] == "after")
            .await;
    }
    // Week 2 completes for all three: the cleanup's later cutoff covers week 1's, so week 1's
    // cleanup is superseded in the transaction that completes week 2's; the follow-up's week 1
    // has its own mails and stays held.
    set_clock(&app.pool, at("2026-09-14T09:01:00Z")).await;
    for p in [
        "support-digest",
        "support-digest-cleanup",
        "support-follow-up",
    ] {
        let run = app.api.trigger_new(p, "").await;
        let done = app.wait_terminal(&run).await;
        assert_eq!(done["status"], "completed", "{done}");
    }
    let run = app.api.run(&cleanup).await;
    assert_eq!(run["status"], "superseded", "{run}");
    assert_eq!(run["commands"]["pending"], 0, "{run}");
    assert_eq!(run["deleted"], 0, "{run}");
    assert!(run["held"].is_null(), "{run}");
    let log = app
        .get_json(&format!(
            "/operator-log?action=supersede&target=run:{cleanup}"
        ))
        .await;
    let entry = &log["entries"][0];
    assert_eq!(entry["subject"], "sweeper", "{log}");
    assert!(
        entry["reason"]
            .as_str()
            .unwrap()
            .contains("superseded by support-digest-cleanup:2026-09-14T09:00:00Z"),
        "{log}"
    );
    let follow = app.api.run(&follow_up).await;
    assert_eq!(follow["status"], "running", "{follow}");
    assert_eq!(follow["held"]["kind"], "after", "{follow}");
    let attention = app.get_json("/runs?status=attention").await;
    let listed: Vec<&str> = attention["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run_id"].as_str().unwrap())
        .collect();
    assert!(listed.contains(&follow_up.as_str()), "{attention}");
    assert!(!listed.contains(&cleanup.as_str()), "{attention}");
    let windows = app.api.windows("support-digest-cleanup", "").await;
    assert_eq!(windows["windows"][0]["window"], W1, "{windows}");
    assert_eq!(windows["windows"][0]["status"], "superseded", "{windows}");
    let metrics = app.api.metrics().await;
    assert!(
        metrics.contains("sweeper_runs{status=\"superseded\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn housekeeping_supersedes_a_held_run_created_after_the_later_week_completed() {
    let api = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let app = stages_app(&api, "").await;
    let digest = app.api.trigger_new("support-digest", "").await;
    app.api
        .cancel_run(&digest, "the provider is down this week")
        .await;
    set_clock(&app.pool, at("2026-09-14T09:01:00Z")).await;
    for p in ["support-digest", "support-digest-cleanup"] {
        let run = app.api.trigger_new(p, "").await;
        assert_eq!(app.wait_terminal(&run).await["status"], "completed");
    }
    // Rows arrive late with old timestamps; week 1's cleanup is created late (a backfill), after
    // week 2's completed: held by its cancelled digest, and nothing completes after it;
    // housekeeping supersedes it (week 3's cleanup will take the rows).
    sqlx::query(
        "insert into crm.digest_items
             select 100 + g, 1, timestamptz '2026-08-01' from generate_series(1, 5) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let a = app
        .api
        .backfill(
            "support-digest-cleanup",
            serde_json::json!({ "windows": ["2026-09-07T09:00:00Z"] }),
        )
        .await;
    assert_eq!(a.status, 202, "{}", a.body);
    let late = "support-digest-cleanup:2026-09-07T09:00:00Z";
    app.api
        .wait_run(late, "planned and held", |r| {
            r["planning_done"] == true && r["held"]["kind"] == "after"
        })
        .await;
    sweeper::app::housekeeping::housekeeping_once(&app.state)
        .await
        .unwrap();
    let run = app.api.run(late).await;
    assert_eq!(run["status"], "superseded", "{run}");
    assert!(run["commands"]["cancelled"].as_i64().unwrap() >= 1, "{run}");
    assert_eq!(
        items(&app).await,
        20 - 13 + 5,
        "only week 2's cleanup deleted"
    );
}
