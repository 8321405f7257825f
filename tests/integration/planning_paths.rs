//! The two planning walks (issue 13): which one a run takes and why, where that is said, and the
//! timestamp-index walk's guarantee — each eligible key in at most one command — while rows'
//! timestamps move under it.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::PgPool;

use crate::common::*;

/// The run's cutoff: the window 2026-09-01T02:00Z minus 90 days.
fn cutoff() -> DateTime<Utc> {
    at("2026-06-03T02:00:00Z")
}

/// `n` closed tickets; ticket `id` is old enough (a day or more before the cutoff, later ids
/// older: timestamp order is the reverse of key order) when `old(id)`, else a day after it.
async fn seed(pool: &PgPool, n: i64, old: impl Fn(i64) -> bool) {
    let rows: Vec<Ticket> = (1..=n)
        .map(|id| {
            let closed = if old(id) {
                cutoff() - TimeDelta::days(1) - TimeDelta::minutes(id)
            } else {
                cutoff() + TimeDelta::days(1)
            };
            (id, Some("closed"), Some(false), Some(closed))
        })
        .collect();
    insert_tickets(pool, &rows).await;
}

/// Every key in the run's commands, with how many commands hold it.
async fn planned(pool: &PgPool, run_id: &str) -> HashMap<i64, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "select k, count(*) from sweeper.commands, unnest(item_keys) k where run_id = $1 group by k",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(k, n)| (k.parse().unwrap(), n))
        .collect()
}

/// Keys put into a command, carried to the next page or recorded planned so far.
async fn seen_so_far(pool: &PgPool, run_id: &str) -> HashSet<i64> {
    let keys: Vec<String> = sqlx::query_scalar(
        "select k from sweeper.commands, unnest(item_keys) k where run_id = $1
         union select k from sweeper.planning_jobs, unnest(carry_keys) k where run_id = $1
         union select item_key from sweeper.seen_keys where run_id = $1",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap();
    keys.iter().map(|k| k.parse().unwrap()).collect()
}

async fn set_closed_at(pool: &PgPool, ids: &[i64], closed: DateTime<Utc>) {
    sqlx::query("update demo.tickets set closed_at = $2 where id = any($1)")
        .bind(ids)
        .bind(closed)
        .execute(pool)
        .await
        .unwrap();
}

/// A non-serving replica over 3,000 tickets (`old(id)`: old enough; `hold(id)`: on legal hold),
/// pages of 50 rows, commands of 25, the timestamp walk forced, with a run created and its
/// planning job claimed by this test: nothing plans but the test.
struct Driven {
    db: TestDb,
    pool: PgPool,
    state: sweeper::app::AppState,
    run_id: String,
    token: uuid::Uuid,
}

async fn driven(old: impl Fn(i64) -> bool, hold: impl Fn(i64) -> bool) -> Driven {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    for stmt in TICKETS.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        sqlx::query(stmt).execute(&pool).await.unwrap();
    }
    set_clock(&pool, at("2026-09-01T02:01:00Z")).await;
    seed(&pool, 3_000, old).await;
    let held: Vec<i64> = (1..=3_000).filter(|id| hold(*id)).collect();
    sqlx::query("update demo.tickets set legal_hold = true where id = any($1)")
        .bind(&held)
        .execute(&pool)
        .await
        .unwrap();
    let extra = "[planning]\npage_rows = 50\npath = \"timestamp_index\"";
    let config = config_toml(&db.url, 0, extra, &ticket_policy(25));
    let app =
        sweeper::app::Application::build(sweeper::settings::Config::from_toml(&config).unwrap())
            .await
            .unwrap();
    let state = app.state();
    let principal = sweeper::auth::Principal {
        subject: "test".into(),
        scopes: ["trigger:*".to_string()].into(),
        credential: sweeper::auth::Credential::Bearer,
    };
    let policy = state.config.policy("ticket-retention").unwrap().clone();
    let run_id =
        match sweeper::trigger::trigger(&state, &policy, Default::default(), false, &principal)
            .await
            .unwrap()
        {
            sweeper::trigger::TriggerOutcome::Created(run) => run.run_id,
            other => panic!("{other:?}"),
        };
    let token = uuid::Uuid::new_v4();
    let claimed = sweeper::ledger::planning::claim(
        &state.pool,
        token,
        600.0,
        &["ticket-retention".to_string()],
    )
    .await
    .unwrap();
    assert_eq!(claimed.as_deref(), Some(run_id.as_str()));
    Driven {
        db,
        pool,
        state,
        run_id,
        token,
    }
}

/// 3,000 tickets, 600 old enough, pages of 50 rows, commands of 25, the timestamp walk forced;
/// planning driven page by page while other sessions move rows: planned rows moved forward past
/// the cursor (met again), unplanned rows moved back behind it (missed: the closure check and
/// the next run), moved forward across the cutoff, or deleted, and held rows moved forward. Every
/// key lands in at most one command, each held row is counted once, the run completes with one
/// outcome per item, and the rows moved back are what the closure check reports.
#[tokio::test]
async fn the_timestamp_walk_plans_each_eligible_key_once_while_timestamps_move() {
    use sweeper::plan::{PlanStep, plan_page};
    // Ids 591..=600, the oldest, are on legal hold: held, met on the first pages.
    let Driven {
        db: _db,
        pool,
        state,
        run_id,
        token,
    } = driven(|id| id <= 600, |id| (591..=600).contains(&id)).await;
    let (mut moved_back, mut moved_across, mut deleted_unplanned) = (vec![], vec![], vec![]);
    let mut moved_forward = vec![];
    let mut pages = 0;
    loop {
        let step = plan_page(&state, &run_id, token).await.unwrap();
        pages += 1;
        if step == PlanStep::Done {
            break;
        }
        assert_eq!(step, PlanStep::Page);
        if pages == 3 {
            // The walk goes from the oldest (id 600) towards the cutoff (id 1).
            let seen = seen_so_far(&pool, &run_id).await;
            assert!(!seen.is_empty() && seen.len() < 600, "{}", seen.len());
            let mut planned_ids: Vec<i64> = seen.iter().copied().collect();
            planned_ids.sort();
            let ahead: Vec<i64> = (1..=600).filter(|id| !seen.contains(id)).collect();
            assert!(ahead.len() > 300);
            // Planned rows touched again, moved forward past the cursor (still eligible).
            moved_forward = planned_ids[..20].to_vec();
            set_closed_at(&pool, &moved_forward, cutoff() - TimeDelta::seconds(1)).await;
            let deleted_planned = planned_ids[20..25].to_vec();
            // Unplanned rows moved back behind the cursor: the walk will not meet them.
            moved_back = ahead[..10].to_vec();
            set_closed_at(&pool, &moved_back, cutoff() - TimeDelta::days(30)).await;
            // Moved across the cutoff: no longer old enough.
            moved_across = ahead[10..20].to_vec();
            set_closed_at(&pool, &moved_across, cutoff() + TimeDelta::hours(1)).await;
            deleted_unplanned = ahead[20..30].to_vec();
            // Held rows already met, moved forward too: met again, counted once.
            assert!((591..=600).all(|id| seen.contains(&id)));
            set_closed_at(&pool, &[591, 592, 593], cutoff() - TimeDelta::seconds(2)).await;
            sqlx::query("delete from demo.tickets where id = any($1)")
                .bind([deleted_planned.clone(), deleted_unplanned.clone()].concat())
                .execute(&pool)
                .await
                .unwrap();
        }
    }
    // About 600 / 50 pages, not 3,000 / 50: the walk costs what the eligible rows cost.
    assert!(pages <= 14, "{pages} pages");
    let keys = planned(&pool, &run_id).await;
    let twice: Vec<_> = keys.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "keys in two commands: {twice:?}");
    let expected: HashSet<i64> = (1..=600)
        .filter(|id| {
            !moved_back.contains(id)
                && !moved_across.contains(id)
                && !deleted_unplanned.contains(id)
                && !(591..=600).contains(id)
        })
        .collect();
    assert_eq!(keys.keys().copied().collect::<HashSet<i64>>(), expected);
    assert!(moved_forward.iter().all(|id| keys.contains_key(id)));
    let (path, left): (Option<String>, i64) = sqlx::query_as(
        "select path, (select count(*) from sweeper.seen_keys where run_id = $1)
           from sweeper.planning_jobs where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(path.as_deref(), Some("timestamp_index"));
    assert_eq!(left, 0, "the last page emptied the run's seen keys");

    while let sweeper::app::worker::WorkerStep::Ran(_) =
        sweeper::app::worker::run_one_command(&state).await.unwrap()
    {}
    let run = sweeper::ledger::get_run(&mut pool.acquire().await.unwrap(), &run_id)
        .await
        .unwrap()
        .unwrap();
    let run = serde_json::to_value(&run).unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], expected.len() as i64 - 5, "{run}");
    assert_eq!(run["already_absent"], 5, "{run}");
    assert_eq!(run["remaining_eligible"], 10, "the rows moved back: {run}");
    assert_eq!(
        run["held_at_planning"],
        serde_json::json!({"legal_hold": 10}),
        "each held row counted once: {run}"
    );
    assert_eq!(
        crate::kit::ledger::items_with_several_outcomes(&pool).await,
        0
    );
    let left: Vec<i64> =
        sqlx::query_scalar("select id from demo.tickets where id <= 600 order by id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut kept = [
        moved_back.clone(),
        moved_across.clone(),
        (591..=600).collect(),
    ]
    .concat();
    kept.sort();
    assert_eq!(left, kept);
}

/// `auto` on a sparse table (1 % old enough, statistics fresh): the timestamp walk, said by
/// `GET /policies` and `GET /runs/{id}`; the run plans in a page or two and deletes exactly the
/// eligible rows. The same table made dense, then without its index: the key walk, with why.
#[tokio::test]
async fn auto_takes_the_timestamp_walk_on_a_sparse_run_and_the_key_walk_otherwise() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: ticket_policy(25),
        workers: 2,
        extra_toml: "[planning]\npage_rows = 100".into(),
        ..Default::default()
    })
    .await;
    seed(&app.pool, 5_000, |id| id % 100 == 0).await;
    sqlx::query("analyze demo.tickets")
        .execute(&app.pool)
        .await
        .unwrap();
    let planning = |policies: serde_json::Value| policies["policies"][0]["planning"].clone();
    let p = planning(app.api.policies().await);
    assert_eq!(p["path"], "timestamp_index", "{p}");
    let reason = p["reason"].as_str().unwrap();
    assert!(
        reason.contains("of rows are older than the cutoff"),
        "{reason}"
    );
    assert!(reason.contains("tickets_closed_at_idx"), "{reason}");
    assert!(p["estimated_fraction"].as_f64().unwrap() < 0.05, "{p}");

    let run_id = app.api.trigger_new("ticket-retention", "").await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 50, "{run}");
    assert_eq!(run["remaining_eligible"], 0, "{run}");
    assert_eq!(run["planning"]["path"], "timestamp_index", "{run}");
    assert!(
        run["planning"]["path_reason"]
            .as_str()
            .unwrap()
            .contains("tickets_closed_at_idx"),
        "{run}"
    );
    assert!(
        run["planning"]["pages_done"].as_i64().unwrap() <= 2,
        "{run}"
    );
    let left = app.ticket_ids().await;
    assert_eq!(left.len(), 4_950);
    assert!(left.iter().all(|id| id % 100 != 0));

    // Dense: nine rows in ten old enough.
    sqlx::query("update demo.tickets set closed_at = $1 where id % 10 <> 0")
        .bind(cutoff() - TimeDelta::days(3))
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("analyze demo.tickets")
        .execute(&app.pool)
        .await
        .unwrap();
    let p = planning(app.api.policies().await);
    assert_eq!(p["path"], "key_order", "{p}");
    assert!(
        p["reason"]
            .as_str()
            .unwrap()
            .contains("key-order walk reads fewer pages"),
        "{p}"
    );
    // No index that leads with the timestamp: the key walk, and what index would help.
    sqlx::query("drop index demo.tickets_closed_at_idx")
        .execute(&app.pool)
        .await
        .unwrap();
    let p = planning(app.api.policies().await);
    assert_eq!(p["path"], "key_order", "{p}");
    assert_eq!(
        p["reason"],
        "no index leads with closed_at (create index on demo.tickets (closed_at, id))"
    );
    let findings = sweeper::policy::check::check_policies(
        &app.pool,
        &app.state.config.policies,
        sweeper::config::PathSetting::Auto,
    )
    .await
    .unwrap();
    let said: Vec<String> = findings.iter().map(|f| f.to_string()).collect();
    assert!(
        said.iter().any(|f| f
            == "info: policy[ticket-retention]: planning: a run triggered now plans along the \
                key_order path: no index leads with closed_at (create index on demo.tickets \
                (closed_at, id))"),
        "{said:?}"
    );
    // Forced, but impossible: a warning that says the setting was overridden.
    let findings = sweeper::policy::check::check_policies(
        &app.pool,
        &app.state.config.policies,
        sweeper::config::PathSetting::TimestampIndex,
    )
    .await
    .unwrap();
    let said: Vec<String> = findings.iter().map(|f| f.to_string()).collect();
    assert!(
        said.iter().any(|f| f.starts_with(
            "warning: policy[ticket-retention]: planning: a run triggered now plans along the \
             key_order path: planning.path = \"timestamp_index\", but no index leads with closed_at"
        )),
        "{said:?}"
    );
    // The table gone: the endpoint says it cannot tell, and why.
    sqlx::query("drop table demo.tickets")
        .execute(&app.pool)
        .await
        .unwrap();
    let p = planning(app.api.policies().await);
    assert_eq!(
        p,
        serde_json::json!({"path": null, "reason": "table demo.tickets does not exist"})
    );
}

/// A run cancelled while its timestamp walk is under way: planning stops and its seen keys go
/// (nothing else would ever empty them).
#[tokio::test]
async fn cancelling_a_run_mid_walk_empties_its_seen_keys() {
    let d = driven(|id| id <= 600, |_| false).await;
    for _ in 0..3 {
        let step = sweeper::plan::plan_page(&d.state, &d.run_id, d.token)
            .await
            .unwrap();
        assert_eq!(step, sweeper::plan::PlanStep::Page);
    }
    let seen = || async {
        sqlx::query_scalar::<_, i64>("select count(*) from sweeper.seen_keys where run_id = $1")
            .bind(&d.run_id)
            .fetch_one(&d.pool)
            .await
            .unwrap()
    };
    assert_eq!(seen().await, 150);
    sweeper::ledger::control::cancel(&d.pool, &d.run_id, "test", "stop")
        .await
        .unwrap();
    assert_eq!(seen().await, 0);
    let step = sweeper::plan::plan_page(&d.state, &d.run_id, d.token)
        .await
        .unwrap();
    assert_eq!(step, sweeper::plan::PlanStep::LostLease, "planning stopped");
}

/// `infinity` and `-infinity` timestamps (a common "never" marker) on both walks, with pages of 3
/// rows so such a row ends a page: planning does not trip over them, `-infinity` rows are
/// eligible and deleted, `infinity` rows kept.
#[tokio::test]
async fn infinite_timestamps_plan_on_both_walks() {
    for path in ["key_order", "timestamp_index"] {
        let app = TestApp::spawn(Spawn {
            now: Some(at("2026-09-01T02:01:00Z")),
            policies: ticket_policy(4),
            workers: 1,
            extra_toml: format!("[planning]\npage_rows = 3\npath = \"{path}\""),
            ..Default::default()
        })
        .await;
        sqlx::query(
            "insert into demo.tickets (id, status, legal_hold, closed_at)
             select g, 'closed', false,
                    case when g <= 4 then '-infinity'::timestamptz
                         when g <= 8 then '2026-01-01'::timestamptz
                         else 'infinity'::timestamptz end
               from generate_series(1, 12) g",
        )
        .execute(&app.pool)
        .await
        .unwrap();
        let run_id = app.api.trigger_new("ticket-retention", "").await;
        let run = app.wait_terminal(&run_id).await;
        assert_eq!(run["status"], "completed", "{path}: {run}");
        assert_eq!(run["deleted"], 8, "{path}: {run}");
        assert_eq!(run["planning"]["path"], path, "{run}");
        assert_eq!(
            app.ticket_ids().await,
            (9..=12).collect::<Vec<i64>>(),
            "{path}"
        );
    }
}
