//! Planning across pages, overlapping runs and the run views (the audit trail's guarantees are in
//! `audit.rs`).

use crate::common::*;

#[tokio::test]
async fn a_run_bigger_than_a_planning_page_plans_each_key_once_and_leaves_nothing_eligible() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: ticket_policy(7),
        workers: 2,
        extra_toml: "[planning]\npage_rows = 100".into(),
        ..Default::default()
    })
    .await;
    let eligible = seed_mixed(&app.pool, 1_000, at("2026-09-01T02:00:00Z")).await;
    let (status, run) = app.trigger("ticket-retention", "").await;
    assert_eq!(status, 202);
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let run = app.wait_terminal(&run_id).await;

    let pages: i32 =
        sqlx::query_scalar("select pages_done from sweeper.planning_jobs where run_id = $1")
            .bind(&run_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(pages >= 10, "planned in {pages} pages");
    let per_key: Vec<(String, i64)> = sqlx::query_as(
        "select k, count(*) from sweeper.commands, unnest(item_keys) k where run_id = $1 group by k",
    )
    .bind(&run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(per_key.len(), eligible.len());
    assert!(
        per_key.iter().all(|(_, n)| *n == 1),
        "a key in two commands"
    );
    let sizes: Vec<i32> =
        sqlx::query_scalar("select cardinality(item_keys) from sweeper.commands where run_id = $1")
            .bind(&run_id)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert!(sizes.iter().all(|s| (1..=7).contains(s)));
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    assert_eq!(run["remaining_eligible"], 0);
    assert_eq!(run["status"], "completed");
    let held = &run["held_at_planning"];
    let holds: i64 = sqlx::query_scalar(
        "select count(*) from demo.tickets where legal_hold and closed_at < '2026-06-03T02:00:00Z'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(held["legal_hold"].as_i64().unwrap(), holds, "{held}");
    let left = app.ticket_ids().await;
    assert!(eligible.iter().all(|id| !left.contains(id)));
    assert_eq!(left.len(), 1_000 - eligible.len());
}

/// 2,000 closed tickets, those for which `old` holds a day past the cutoff of the window
/// 2026-09-01T02:00Z (90 days), the rest a day short of it; pages of 100 rows, commands of 25.
async fn sparse_app(old: impl Fn(i64) -> bool) -> TestApp {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: ticket_policy(25),
        extra_toml: "[planning]\npage_rows = 100".into(),
        ..Default::default()
    })
    .await;
    let cutoff = at("2026-06-03T02:00:00Z");
    let rows: Vec<Ticket> = (1..=2_000i64)
        .map(|id| {
            let days = if old(id) { -1 } else { 1 };
            let closed = cutoff + chrono::TimeDelta::days(days);
            (id, Some("closed"), Some(false), Some(closed))
        })
        .collect();
    insert_tickets(&app.pool, &rows).await;
    app
}

/// The sizes of a run's commands, in batch order.
async fn command_sizes(app: &TestApp, run_id: &str) -> Vec<i32> {
    sqlx::query_scalar(
        "select cardinality(item_keys) from sweeper.commands where run_id = $1 order by batch_no",
    )
    .bind(run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

/// A sparse table (one eligible row in ten, pages of 100 rows, commands of 25): every command
/// but the last is full, though no single page holds a command's worth of eligible keys.
#[tokio::test]
async fn commands_are_full_across_planning_pages_on_a_sparse_table() {
    let app = sparse_app(|id| id % 10 == 0).await;
    let (run_id, commands) = app.planned_run().await;
    let sizes = command_sizes(&app, &run_id).await;
    assert_eq!(commands.len(), 8, "{sizes:?}");
    assert!(sizes.iter().all(|s| *s == 25), "{sizes:?}");
    let mut keys = crate::kit::ledger::planned_int_keys(&app.pool, &run_id).await;
    keys.dedup();
    assert_eq!(keys, (1..=200).map(|i| i * 10).collect::<Vec<i64>>());
    let (pages, carry): (i32, Vec<String>) = sqlx::query_as(
        "select pages_done, carry_keys from sweeper.planning_jobs where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(pages >= 20, "planned in {pages} pages");
    assert!(carry.is_empty(), "the last page wrote what was carried");
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["deleted"], 200);
    assert_eq!(run["eligible_planned"], 200);
}

/// 205 eligible among 2,000: eight full commands and the last page's short one of 5.
#[tokio::test]
async fn the_last_planning_page_writes_the_carried_remainder() {
    let app = sparse_app(|id| id % 10 == 0 || (1_991..=1_995).contains(&id)).await;
    let (run_id, _) = app.planned_run().await;
    let sizes = command_sizes(&app, &run_id).await;
    assert_eq!(sizes, [vec![25; 8], vec![5]].concat());
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed");
    assert_eq!(run["deleted"], 205);
    assert_eq!(run["remaining_eligible"], 0);
}

#[tokio::test]
async fn overlapping_runs_over_the_same_rows_do_not_deadlock_or_delete_twice() {
    let hourly = r#"
[[policy]]
name = "ticket-retention"
schedule = { cron = "0 * * * *", timezone = "UTC" }
target = { table = "demo.tickets", key = "id", timestamp = "closed_at" }
retain_for = "90d"
exclude = [ { column = "legal_hold", equals = true } ]
batch_size = 13
"#;
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T11:00:10Z")),
        policies: hourly.into(),
        workers: 4,
        ..Default::default()
    })
    .await;
    // Both runs select the same rows; four workers execute their commands concurrently.
    let eligible = seed_mixed(&app.pool, 600, at("2026-09-01T10:00:00Z")).await;
    let (s1, r1) = app
        .trigger("ticket-retention", "?window=2026-09-01T10:00:00Z")
        .await;
    let (s2, r2) = app
        .trigger("ticket-retention", "?window=2026-09-01T11:00:00Z")
        .await;
    assert_eq!((s1, s2), (202, 202));
    let a = app.wait_terminal(r1["run_id"].as_str().unwrap()).await;
    let b = app.wait_terminal(r2["run_id"].as_str().unwrap()).await;
    assert_eq!(a["status"], "completed");
    assert_eq!(b["status"], "completed");

    let deleted: Vec<(String, i64)> = sqlx::query_as(
        "select item_key, count(*) from sweeper.audit_trail where outcome = 'deleted' group by item_key",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert!(
        deleted.iter().all(|(_, n)| *n == 1),
        "an item deleted twice"
    );
    let left = app.ticket_ids().await;
    assert!(eligible.iter().all(|id| !left.contains(id)));
    assert_eq!(
        a["deleted"].as_i64().unwrap() + b["deleted"].as_i64().unwrap(),
        deleted.len() as i64
    );
}

#[tokio::test]
async fn run_views_filter_and_paginate_the_audit_trail() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        workers: 2,
        ..Default::default()
    })
    .await;
    let eligible = seed_mixed(&app.pool, 120, at("2026-09-01T02:00:00Z")).await;
    let (_, run) = app.trigger("ticket-retention", "").await;
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(
        run["commands"]["succeeded"].as_i64().unwrap() as usize,
        eligible.len().div_ceil(10)
    );
    assert_eq!(run["commands"]["pending"], 0);
    assert_eq!(run["policy_version"].as_str().unwrap().len(), 16);

    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let q = match &cursor {
            Some(c) => format!("/runs/{run_id}/items?limit=25&cursor={c}"),
            None => format!("/runs/{run_id}/items?limit=25"),
        };
        let page = app.get_json(&q).await;
        for item in page["items"].as_array().unwrap() {
            assert_eq!(item["run_id"], run_id.as_str());
            assert_eq!(item["cutoff"], "2026-06-03T02:00:00Z");
            seen.push(item["item_key"].as_str().unwrap().parse::<i64>().unwrap());
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    seen.sort();
    assert_eq!(seen, eligible);

    let runs = app
        .get_json("/runs?policy=ticket-retention&status=completed")
        .await;
    assert_eq!(runs["runs"].as_array().unwrap().len(), 1);
    let none = app.get_json("/runs?status=running").await;
    assert!(none["runs"].as_array().unwrap().is_empty());
    let r = app
        .client
        .get(format!("{}/runs?status=finished", app.base))
        .bearer_auth(app.ops_token())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = app
        .client
        .get(format!("{}/runs/nope:2026-01-01T00:00:00Z", app.base))
        .bearer_auth(app.ops_token())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    let policies = app.get_json("/policies").await;
    let p = &policies["policies"][0];
    assert_eq!(p["name"], "ticket-retention");
    assert_eq!(p["version"], p["current_version"]);
    assert_eq!(p["retain_for"], "90d");
    assert!(!policies.to_string().contains(SECRET));
}

const DOCS: &str = "
create schema demo;
create table demo.tickets (id bigint primary key, status text, legal_hold boolean, closed_at timestamptz);
create table demo.docs (name text primary key, closed_at timestamptz);
create index on demo.docs (closed_at)
";

#[tokio::test]
async fn huge_keys_are_planned_in_byte_bounded_pages_and_commands() {
    let docs = r#"
[[policy]]
name = "doc-retention"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "demo.docs", key = "name", timestamp = "closed_at" }
retain_for = "90d"
batch_size = 250
"#;
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: docs.into(),
        setup_sql: DOCS,
        workers: 2,
        ..Default::default()
    })
    .await;
    // 100 keys of ~200 KB (compressible, so the primary key can index them): 20 MB of keys.
    sqlx::query(
        "insert into demo.docs
         select lpad(g::text, 6, '0') || repeat('k', 200000), '2026-01-01T00:00:00Z'
           from generate_series(1, 100) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (status, run) = app.trigger("doc-retention", "").await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["deleted"], 100, "{run}");
    assert_eq!(run["remaining_eligible"], 0);
    let (pages, max_keys, max_bytes): (i32, i32, i64) = sqlx::query_as(
        "select (select pages_done from sweeper.planning_jobs where run_id = $1),
                max(cardinality(item_keys)),
                max((select sum(octet_length(k)) from unnest(item_keys) k))::bigint
           from sweeper.commands where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(pages >= 2, "a 20 MB page is split: {pages} pages");
    assert!(
        max_keys <= 5,
        "commands stay within 1 MiB of keys: {max_keys} keys"
    );
    assert!(max_bytes <= 1024 * 1024, "{max_bytes}");
    let per_key: i64 = sqlx::query_scalar(
        "select count(*) from (select k from sweeper.commands, unnest(item_keys) k
                                where run_id = $1 group by k having count(*) > 1) d",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(per_key, 0);
}

#[tokio::test]
async fn a_replica_without_the_policy_leaves_its_planning_job_and_says_so_on_the_run() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    for stmt in TICKETS.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        sqlx::query(stmt).execute(&pool).await.unwrap();
    }
    seed_mixed(&pool, 40, at("2026-09-01T02:00:00Z")).await;
    let build = |policies: String| {
        let url = db.url.clone();
        async move {
            sweeper::app::Application::build(
                sweeper::settings::Config::from_toml(&config_toml(&url, 0, "", &policies)).unwrap(),
            )
            .await
            .unwrap()
        }
    };
    // Replica a has the policy (with a blast-radius guard); replica b's configuration lacks it.
    let a = build(ticket_policy(10).replace(
        "batch_size = 10",
        "batch_size = 10\nguard = { max_items = 1000 }",
    ))
    .await;
    let b = build(
        ticket_policy(10).replace("name = \"ticket-retention\"", "name = \"other-retention\""),
    )
    .await;
    let (a, b) = (a.state(), b.state());
    let principal = sweeper::auth::Principal {
        subject: "test".into(),
        scopes: ["trigger:*".to_string()].into(),
        credential: sweeper::auth::Credential::Bearer,
    };
    let policy = a.config.policy("ticket-retention").unwrap().clone();
    let run_id = match sweeper::trigger::trigger(&a, &policy, Default::default(), false, &principal)
        .await
        .unwrap()
    {
        sweeper::trigger::TriggerOutcome::Created(run) => run.run_id,
        other => panic!("{other:?}"),
    };
    // b leaves the job: nothing planned with defaults, the run held and saying why.
    let step = sweeper::plan::plan_next_job(&b).await.unwrap();
    assert!(matches!(step, sweeper::plan::PlanStep::Idle), "{step:?}");
    let commands: i64 = sqlx::query_scalar("select count(*) from sweeper.commands")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(commands, 0);
    let mut conn = pool.acquire().await.unwrap();
    let run = sweeper::ledger::get_run(&mut conn, &run_id)
        .await
        .unwrap()
        .unwrap();
    drop(conn);
    let (held, _) = sweeper::holds::run_held(&a, &run).await.unwrap();
    let held = held.unwrap();
    assert_eq!(held["kind"], "policy_changed", "{held}");
    let detail = held["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!(
            "the policy is missing from the configuration of replica {}",
            b.replica_id
        )),
        "{detail}"
    );
    let facts = sweeper::ledger::attention::facts(&pool, &[run_id.as_str()])
        .await
        .unwrap();
    assert_eq!(facts[&run_id].held_kind.as_deref(), Some("policy_changed"));
    // a, which has the policy, plans it with the policy's batch size and guard; the hold is gone.
    loop {
        match sweeper::plan::plan_next_job(&a).await.unwrap() {
            sweeper::plan::PlanStep::Idle => break,
            _ => continue,
        }
    }
    let mut conn = pool.acquire().await.unwrap();
    let run = sweeper::ledger::get_run(&mut conn, &run_id)
        .await
        .unwrap()
        .unwrap();
    drop(conn);
    assert!(run.planning_done);
    let (held, approval) = sweeper::holds::run_held(&a, &run).await.unwrap();
    assert!(held.is_none(), "{held:?}");
    assert_eq!(approval["state"], "not_required", "{approval}");
    let sizes: Vec<i32> =
        sqlx::query_scalar("select cardinality(item_keys) from sweeper.commands order by batch_no")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(sizes.iter().all(|n| *n <= 10), "{sizes:?}");
}
