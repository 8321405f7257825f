//! Actions with external calls (issue 4): `http` against stand-in servers on loopback and
//! `object_store` against real local directories; effect rows, statuses, pauses, limits and the
//! address guard. Two-process pauses, S3 (moto) and crash points are in tests/crash.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::ext_common::*;
use crate::standin::{Call, Reply, StandIn, ok};
use serde_json::Value;

async fn spawn(workers: usize, config: String) -> TestApp {
    TestApp::spawn(Spawn {
        setup_sql: EXT,
        policies: config,
        workers,
        now: Some(at(NOW)),
        extra_toml: String::new(),
    })
    .await
}

async fn run(app: &TestApp, policy: &str, window: &str) -> String {
    let (status, run) = app.trigger(policy, &format!("?window={window}")).await;
    assert!(status == 202 || status == 200, "{run}");
    run["run_id"].as_str().unwrap().to_string()
}

fn item_of(c: &Call) -> i64 {
    c.path.rsplit('/').next().unwrap().parse().unwrap()
}

/// Final outcome per item across runs: item → [outcomes].
async fn outcomes(app: &TestApp, policy: &str) -> BTreeMap<String, Vec<String>> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "select item_key, outcome from sweeper.audit_trail where policy = $1 order by audit_id",
    )
    .bind(policy)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, o) in rows {
        m.entry(k).or_default().push(o);
    }
    m
}

async fn unreconciled(app: &TestApp) -> Vec<i64> {
    sqlx::query_scalar("select id from ext.payments where reconciled_at is null order by id")
        .fetch_all(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn two_overlapping_runs_call_the_provider_once_per_item() {
    let provider = StandIn::start(Duration::from_millis(5), |_, _| ok()).await;
    // Credentials are named by an environment variable (cargo sets this one for tests).
    let config = dependency(
        "payments",
        &provider.url(),
        "max_concurrent_calls = 4\ncredentials = { env = \"CARGO_PKG_NAME\", prefix = \"Bearer \" }",
    ) + &payments_policy("reconcile", "payments", 10, "", "");
    let app = spawn(0, config).await;
    seed_payments(&app, 100).await;
    // Two runs planned before either executes: both hold every item.
    let r1 = run(&app, "reconcile", "2026-09-01").await;
    app.wait_planned(&r1).await;
    let r2 = run(&app, "reconcile", "2026-09-02").await;
    app.wait_planned(&r2).await;
    assert_ne!(r1, r2);
    // Four workers interleave the two runs' commands.
    let mut handles = Vec::new();
    for _ in 0..4 {
        let state = app.state.clone();
        handles.push(tokio::spawn(async move {
            while let sweeper::app::worker::WorkerStep::Ran(_) =
                sweeper::app::worker::run_one_command(&state).await.unwrap()
            {}
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let a = app.wait_terminal(&r1).await;
    let b = app.wait_terminal(&r2).await;
    assert_eq!(a["status"], "completed", "{a}");
    assert_eq!(b["status"], "completed", "{b}");

    let calls = provider.calls();
    let mut per_item: HashMap<i64, Vec<String>> = HashMap::new();
    let expected_auth = format!("Bearer {}", std::env::var("CARGO_PKG_NAME").unwrap());
    for c in &calls {
        assert_eq!(c.method, "POST");
        assert_eq!(c.authorization.as_deref(), Some(expected_auth.as_str()));
        let body: Value = serde_json::from_str(&c.body).unwrap();
        assert_eq!(body["payment_id"], item_of(c).to_string());
        per_item
            .entry(item_of(c))
            .or_default()
            .push(c.idempotency_key.clone().unwrap());
    }
    assert_eq!(per_item.len(), 100, "every item called");
    for (item, keys) in &per_item {
        assert_eq!(
            keys,
            &[format!("reconcile:{item}:1")],
            "item {item} called once"
        );
    }
    assert!(unreconciled(&app).await.is_empty());
    // Exactly one `reconciled` per item across both runs; the other run excluded it.
    let o = outcomes(&app, "reconcile").await;
    assert_eq!(o.len(), 100);
    for (item, list) in &o {
        assert_eq!(
            list.iter().filter(|x| *x == "reconciled").count(),
            1,
            "{item}: {list:?}"
        );
        assert!(
            list.iter().all(|x| x == "reconciled" || x == "excluded"),
            "{item}: {list:?}"
        );
    }
    assert_eq!(
        a["reconciled"].as_i64().unwrap() + b["reconciled"].as_i64().unwrap(),
        100
    );
    // Every effect closed, numbered 1.
    let open: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.effects where state <> 'closed' or n <> 1",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(open, 0);
}

#[tokio::test]
async fn statuses_decide_each_item_and_neighbours_are_done_once() {
    // 7: 404 with the signature; 13: 410 with it; 21: 400; 42: 500 twice, then 200.
    let provider = StandIn::start(Duration::ZERO, |c: &Call, earlier: &[Call]| -> Reply {
        let item = item_of(c);
        let seen = earlier.iter().filter(|e| e.path == c.path).count();
        match item {
            7 => (404, vec![], "{\"error\":\"payment_not_found\"}".into()),
            13 => (410, vec![], "{\"error\":\"payment_not_found\"}".into()),
            21 => (400, vec![], "{\"error\":\"bad amount\"}".into()),
            42 if seen < 2 => (500, vec![], "oops".into()),
            _ => ok(),
        }
    })
    .await;
    let config = dependency("payments", &provider.url(), "")
        + &payments_policy("reconcile", "payments", 100, "", "").replace(
            "then = { set = \"reconciled_at\" }",
            "then = \"delete_row\"",
        );
    let app = spawn(2, config).await;
    seed_payments(&app, 100).await;
    let r = run(&app, "reconcile", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["status"], "completed_with_dead_letters", "{done}");

    let calls = provider.calls();
    let mut count: HashMap<i64, Vec<String>> = HashMap::new();
    for c in &calls {
        count
            .entry(item_of(c))
            .or_default()
            .push(c.idempotency_key.clone().unwrap());
    }
    for i in 1..=100 {
        let n = count.get(&i).map(Vec::len).unwrap_or(0);
        if i == 42 {
            assert_eq!(n, 3, "item 42 retried until it succeeded");
            assert!(
                count[&i].iter().all(|k| k == "reconcile:42:1"),
                "same key each time"
            );
        } else {
            assert_eq!(n, 1, "item {i} called once");
        }
    }
    let o = outcomes(&app, "reconcile").await;
    assert_eq!(o["7"], ["already_absent"]);
    assert_eq!(o["13"], ["already_absent"]);
    assert_eq!(o["21"], ["failed"]);
    assert_eq!(o["42"], ["deleted"]);
    assert!(
        o.values().all(|l| l.len() == 1),
        "one outcome per item: {o:?}"
    );
    assert_eq!(done["deleted"], 97);
    assert_eq!(done["already_absent"], 2);
    assert_eq!(done["failed"], 1);
    // Only the failed item's row is left; it is an item dead letter, its effect left open.
    let left: Vec<i64> = sqlx::query_scalar("select id from ext.payments")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, [21]);
    let dl: (String, String, String) =
        sqlx::query_as("select kind, item_key, reason from sweeper.dead_letters where run_id = $1")
            .bind(&r)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((dl.0.as_str(), dl.1.as_str()), ("item", "21"));
    assert!(dl.2.contains("400"), "{}", dl.2);
    let state: String = sqlx::query_scalar(
        "select state from sweeper.effects where policy = 'reconcile' and item_key = '21'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(state, "calling", "left open for the operator");
    // Abandoning the dead letter is the operator's decision: the effect closes, so later runs
    // are no longer held by it.
    let id: i64 = sqlx::query_scalar("select dead_letter_id from sweeper.dead_letters")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let r = app
        .client
        .post(format!("{}/dead-letters/{id}/abandon", app.base))
        .bearer_auth(app.ops_token())
        .json(&serde_json::json!({"reason": "the provider rejects this payment; handled by hand"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (state, n): (String, i32) = sqlx::query_as(
        "select state, n from sweeper.effects where policy = 'reconcile' and item_key = '21'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((state.as_str(), n), ("closed", 1));
    let logged: Value =
        sqlx::query_scalar("select detail from sweeper.operator_log where action = 'abandon'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(logged["effects_closed"], serde_json::json!(["21"]));
    // Item 42's failures were recorded as transient attempts.
    let transient: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.attempts where outcome = 'failed' and class = 'transient'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(transient, 2);
}

#[tokio::test]
async fn a_bare_404_is_permanent_and_changes_no_row() {
    let provider = StandIn::start(Duration::ZERO, |_, _| (404, vec![], "Not Found".into())).await;
    let config = dependency("payments", &provider.url(), "")
        + &payments_policy("reconcile", "payments", 50, "", "").replace(
            "then = { set = \"reconciled_at\" }",
            "then = \"delete_row\"",
        );
    let app = spawn(1, config).await;
    seed_payments(&app, 50).await;
    let r = run(&app, "reconcile", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["status"], "completed_with_dead_letters");
    assert_eq!(done["quarantined_commands"], 1);
    assert_eq!(
        provider.calls().len(),
        1,
        "the command stops at the first bare 404"
    );
    let rows: i64 = sqlx::query_scalar("select count(*) from ext.payments")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 50, "no row deleted");
    let (class, reason): (String, String) =
        sqlx::query_as("select class, reason from sweeper.dead_letters where kind = 'command'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(class, "permanent");
    assert!(reason.contains("not-found signature"), "{reason}");
    let audited: i64 = sqlx::query_scalar("select count(*) from sweeper.audit_trail")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(audited, 0, "no outcome for anything");
}

#[tokio::test]
async fn ten_429s_snooze_without_spending_attempts_and_max_age_quarantines_as_throttled() {
    let provider = StandIn::start(Duration::ZERO, |_, earlier: &[Call]| {
        if earlier.len() < 10 {
            (
                429,
                vec![("retry-after".into(), "1".into())],
                "slow down".into(),
            )
        } else {
            ok()
        }
    })
    .await;
    let config = dependency("payments", &provider.url(), "pause_wait = \"0s\"")
        + &payments_policy("reconcile", "payments", 5, "", "")
            .replace("max_attempts = 5", "max_attempts = 2");
    let app = spawn(1, config).await;
    seed_payments(&app, 5).await;
    let r = run(&app, "reconcile", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["reconciled"], 5);
    let (attempts, snoozes): (i32, i64) = sqlx::query_as(
        "select c.attempts, (select count(*) from sweeper.attempts a
                              where a.command_id = c.command_id and a.outcome = 'snoozed')
           from sweeper.commands c where c.run_id = $1",
    )
    .bind(&r)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(snoozes, 10);
    assert_eq!(attempts, 1, "snoozes spend no attempt");
    let pauses: i64 = sqlx::query_scalar(
        "select pauses from sweeper.dependency_pauses where dependency = 'payments'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(pauses, 10);
    // Calls never started while paused: each gap after a 429 is at least ~1 s.
    let calls = provider.calls();
    for w in calls.windows(2).take(10) {
        assert!(
            w[1].at - w[0].at >= Duration::from_millis(950),
            "{:?}",
            w[1].at - w[0].at
        );
    }
}

#[tokio::test]
async fn a_command_snoozed_past_max_age_is_quarantined_as_throttled() {
    let provider = StandIn::start(Duration::ZERO, |_, _| {
        (
            429,
            vec![("retry-after".into(), "30".into())],
            "slow down".into(),
        )
    })
    .await;
    let config = dependency("payments", &provider.url(), "")
        + &payments_policy("reconcile", "payments", 5, "", "")
            .replace("max_age = \"1h\"", "max_age = \"1m\"");
    let app = spawn(0, config).await;
    seed_payments(&app, 5).await;
    let r = run(&app, "reconcile", "2026-09-01").await;
    app.wait_planned(&r).await;
    assert_eq!(app.drain().await, 1);
    assert_eq!(provider.calls().len(), 1);
    // The ledger clock passes the snooze and the age budget; the pause ended too.
    set_clock(&app.pool, at(NOW) + chrono::TimeDelta::minutes(3)).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(app.drain().await, 1);
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["quarantined_commands"], 1, "{done}");
    let (class, reason): (String, String) =
        sqlx::query_as("select class, reason from sweeper.dead_letters where kind = 'command'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(class, "throttled");
    assert!(reason.contains("max_age"), "{reason}");
    assert_eq!(unreconciled(&app).await.len(), 5);
}

#[tokio::test]
async fn the_concurrency_cap_and_the_rate_limit_hold_at_the_stand_in() {
    let slow = StandIn::start(Duration::from_millis(150), |_, _| ok()).await;
    let limited = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let config = dependency("slow", &slow.url(), "max_concurrent_calls = 2")
        + &dependency(
            "limited",
            &limited.url(),
            "rate_limit = { per_second = 10, burst = 2 }",
        )
        + &payments_policy("reconcile", "slow", 5, "", "")
        + &payments_policy("reconcile-b", "limited", 5, "", "");
    let app = spawn(6, config).await;
    sqlx::query(
        "insert into ext.payments (id, closed_at)
         select g, timestamptz '2026-08-01' from generate_series(1, 30) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let r = run(&app, "reconcile", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["reconciled"], 30);
    assert_eq!(slow.calls().len(), 30);
    assert!(
        slow.max_in_flight() <= 2,
        "cap 2, saw {}",
        slow.max_in_flight()
    );
    assert_eq!(slow.max_in_flight(), 2, "six workers do fill the cap");

    // The second policy stamps the same column: clear it so every row is eligible again.
    sqlx::query("update ext.payments set reconciled_at = null")
        .execute(&app.pool)
        .await
        .unwrap();
    let started = Instant::now();
    let r = run(&app, "reconcile-b", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["reconciled"], 30);
    let calls = limited.calls();
    assert_eq!(calls.len(), 30);
    // 10/s with a burst of 2: any one-second span holds at most 10 + 2 calls, and 30 calls
    // take at least (30 - 2) / 10 s.
    for (i, c) in calls.iter().enumerate() {
        let within = calls[i..]
            .iter()
            .filter(|d| d.at - c.at < Duration::from_secs(1))
            .count();
        assert!(within <= 12, "{within} calls within one second");
    }
    let span = calls.last().unwrap().at - calls[0].at;
    assert!(
        span >= Duration::from_millis(2_600),
        "30 calls took {span:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test]
async fn a_global_rate_limit_holds_across_two_replicas() {
    let limited = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let config = dependency(
        "limited",
        &limited.url(),
        "rate_limit = { per_second = 10, burst = 2, scope = \"global\" }",
    ) + &payments_policy("reconcile", "limited", 5, "", "");
    let app = spawn(0, config.clone()).await;
    sqlx::query(
        "insert into ext.payments (id, closed_at)
         select g, timestamptz '2026-08-01' from generate_series(1, 40) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let r = run(&app, "reconcile", "2026-09-01").await;
    // Two replicas of four workers each on the same ledger: per replica, 10/s each would let
    // 20 calls through a second.
    let (db, pool) = app.stop().await;
    // A replica stopped mid-planning gives its planning lease back: the next one plans at once.
    let leased: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.planning_jobs where not done and lease_until > sweeper.now()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(leased, 0, "a stopped replica kept its planning lease");
    let a = TestApp::start(db, pool, 4, "", &config).await;
    let b_config =
        sweeper::settings::Config::from_toml(&config_toml(&a.db.url, 4, "", &config)).unwrap();
    let b = sweeper::app::Application::build(b_config).await.unwrap();
    let b_shutdown = tokio_util::sync::CancellationToken::new();
    let b_server = tokio::spawn(b.run_until(b_shutdown.clone()));
    let started = Instant::now();
    let done = a.wait_terminal(&r).await;
    b_shutdown.cancel();
    b_server.await.unwrap().unwrap();
    assert_eq!(done["reconciled"], 40, "{done}");
    let calls = limited.calls();
    assert_eq!(calls.len(), 40);
    // 10/s, 2 at once: any one-second span holds at most 10 + 2 calls (one more for the jitter
    // between a call's reserved start and its arrival here), and 40 calls take at least 3 s.
    // Kept per replica, the two replicas would let about 20 through a second.
    let mut worst = 0;
    for (i, c) in calls.iter().enumerate() {
        let within = calls[i..]
            .iter()
            .filter(|d| d.at - c.at < Duration::from_secs(1))
            .count();
        worst = worst.max(within);
    }
    let span = calls.last().unwrap().at - calls[0].at;
    eprintln!("global 10/s over two replicas: 40 calls in {span:?}, worst second {worst}");
    assert!(worst <= 13, "{worst} calls within one second");
    assert!(
        span >= Duration::from_millis(2_800),
        "40 calls took {span:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    a.stop().await;
}

#[tokio::test]
async fn redirects_elsewhere_and_private_addresses_are_refused_before_any_byte_is_sent() {
    let target = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let port = target.addr.port();
    let redirect_to = format!("http://localhost:{port}/steal");
    let redirector = StandIn::start(Duration::ZERO, move |_, _| {
        (
            307,
            vec![("location".into(), redirect_to.clone())],
            String::new(),
        )
    })
    .await;
    let policies = [
        ("via-redirect", dependency("redirector", &redirector.url(), "")),
        (
            "via-literal",
            format!("[[dependency]]\nname = \"literal\"\nbase_url = \"http://127.0.0.1:{port}\"\n"),
        ),
        (
            "via-name",
            format!("[[dependency]]\nname = \"byname\"\nbase_url = \"http://localhost:{port}\"\n"),
        ),
        (
            "via-metadata",
            "[[dependency]]\nname = \"metadata\"\nbase_url = \"http://169.254.169.254\"\ntimeout = \"2s\"\n".to_string(),
        ),
    ];
    let deps = ["redirector", "literal", "byname", "metadata"];
    let mut config = String::new();
    for ((name, dep), dep_name) in policies.iter().zip(deps) {
        config += dep;
        config += &payments_policy(name, dep_name, 10, "", "");
    }
    let app = spawn(2, config).await;
    seed_payments(&app, 3).await;
    for (name, _) in &policies {
        let r = run(&app, name, "2026-09-01").await;
        let done = app.wait_terminal(&r).await;
        assert_eq!(done["quarantined_commands"], 1, "{name}: {done}");
        let (class, reason): (String, String) = sqlx::query_as(
            "select class, reason from sweeper.dead_letters where run_id = $1 and kind = 'command'",
        )
        .bind(&r)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        assert_eq!(class, "permanent", "{name}");
        assert!(reason.contains("refused"), "{name}: {reason}");
    }
    assert_eq!(
        redirector.calls().len(),
        1,
        "the redirect itself was asked for once"
    );
    assert!(
        target.calls().is_empty(),
        "the target listener received nothing"
    );
    assert_eq!(unreconciled(&app).await.len(), 3, "no row changed");
}

fn upload_policy(name: &str, dep: &str, then: &str) -> String {
    format!(
        r#"
[[policy]]
name = "{name}"
schedule = {{ cron = "0 2 * * *", timezone = "UTC" }}
target = {{ table = "ext.uploads", key = "id", timestamp = "expired_at" }}
retain_for = "1d"
exclude = [ {{ column = "legal_hold", equals = true }} ]
batch_size = 10
action = {{ kind = "object_store", dependency = "{dep}", column = "object_key", then = {then} }}
"#
    )
}

#[tokio::test]
async fn objects_in_a_local_directory_are_deleted_with_their_rows() {
    let dir =
        std::env::temp_dir().join(format!("sweeper-objects-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(dir.join("u")).unwrap();
    for i in 1..=20 {
        if i % 5 != 0 {
            std::fs::write(dir.join(format!("u/{i}.bin")), b"x").unwrap();
        }
    }
    std::fs::write(dir.join("u/held.bin"), b"x").unwrap();
    let missing = dir.join("does-not-exist");
    let config = format!(
        "[[dependency]]\nname = \"files\"\nkind = \"local\"\nroot = \"{}\"\n\
         [[dependency]]\nname = \"nowhere\"\nkind = \"local\"\nroot = \"{}\"\n",
        dir.display(),
        missing.display()
    ) + &upload_policy("uploads", "files", "\"delete_row\"")
        + &upload_policy("uploads-nowhere", "nowhere", "\"delete_row\"");
    let app = spawn(2, config).await;
    sqlx::raw_sql(
        "insert into ext.uploads (id, object_key, expired_at)
         select g, 'u/' || g || '.bin', timestamptz '2026-08-01' from generate_series(1, 20) g;
         insert into ext.uploads values (99, 'u/held.bin', true, '2026-08-01')",
    )
    .execute(&app.pool)
    .await
    .unwrap();

    // A directory that does not exist: permanent, never "already absent".
    let r = run(&app, "uploads-nowhere", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["already_absent"], 0, "{done}");
    assert_eq!(done["quarantined_commands"], 2);
    let classes: Vec<String> =
        sqlx::query_scalar("select class from sweeper.dead_letters where run_id = $1")
            .bind(&r)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(classes, ["permanent", "permanent"]);
    let rows: i64 = sqlx::query_scalar("select count(*) from ext.uploads")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 21);

    let r = run(&app, "uploads", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"], 16);
    assert_eq!(done["already_absent"], 4);
    let left: Vec<i64> = sqlx::query_scalar("select id from ext.uploads")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, [99], "only the held row is left");
    let files: Vec<String> = std::fs::read_dir(dir.join("u"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files, ["held.bin"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A delivery whose lease for calls expired while it called (paused before its closing
/// transaction), so that a second delivery leased the command and finished it, is answered
/// "not now" when it comes back — it was overtaken; before, that outcome reached the answer table
/// as a claim's `Stale` and panicked. Nothing is recorded twice.
#[tokio::test]
async fn a_delivery_overtaken_while_it_called_is_not_now_and_records_nothing_twice() {
    let dir =
        std::env::temp_dir().join(format!("sweeper-objects-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(dir.join("u")).unwrap();
    let config = format!(
        "[[dependency]]\nname = \"files\"\nkind = \"local\"\nroot = \"{}\"\n",
        dir.display()
    ) + &upload_policy("uploads", "files", "\"delete_row\"");
    let app = spawn(0, config).await;
    sqlx::raw_sql(
        "insert into ext.uploads (id, object_key, expired_at)
         select g, 'u/' || g || '.bin', timestamptz '2026-08-01' from generate_series(1, 5) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let run_id = run(&app, "uploads", "2026-09-01").await;
    app.wait_planned(&run_id).await;
    let command = app.command_ids(&run_id).await.remove(0);
    sweeper::failpoints::pause_at("effect_before_close", &command, Duration::from_secs(3));
    let first = {
        let app_client = app.client.clone();
        let url = format!("{}/consume", app.base);
        let token = app.token(&["consume"]);
        let command = command.clone();
        tokio::spawn(async move {
            let r = app_client
                .post(url)
                .bearer_auth(token)
                .json(&serde_json::json!({"command_id": command}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        })
    };
    // The first delivery leased attempt 1 and called; its lease expires while it waits.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let state: String =
            sqlx::query_scalar("select state from sweeper.commands where command_id = $1")
                .bind(&command)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        if state == "leased" {
            break;
        }
        assert!(Instant::now() < deadline, "the first delivery never leased");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query(
        "update sweeper.commands set lease_until = sweeper.now() - interval '1 second'
          where command_id = $1",
    )
    .bind(&command)
    .execute(&app.pool)
    .await
    .unwrap();
    sweeper::failpoints::pause_at("effect_before_close", &command, Duration::ZERO);
    let second = app.consume(&command).await;
    assert_eq!(second.status, 200, "{:?}", second.body);
    assert_eq!(second.body["result"], "executed", "{:?}", second.body);
    let (status, answer) = first.await.unwrap();
    assert_eq!(status, 503, "{answer}");
    assert_eq!(answer["type"], "urn:sweeper:problem:not-now", "{answer}");
    let (state, attempts): (String, i32) =
        sqlx::query_as("select state, attempts from sweeper.commands where command_id = $1")
            .bind(&command)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), attempts), ("succeeded", 2));
    let per_item: Vec<i64> = sqlx::query_scalar(
        "select count(*) from sweeper.audit_trail where command_id = $1 group by item_key",
    )
    .bind(&command)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(per_item, vec![1; 5], "one audit row per item");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_row_changed_during_the_call_is_kept_and_becomes_a_dead_letter() {
    // The provider changes the row (as a concurrent writer would) while answering.
    let db_url = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let url_for_standin = db_url.clone();
    let provider = StandIn::start(Duration::ZERO, move |c: &Call, _| {
        if item_of(c) == 2 {
            let url = url_for_standin.lock().unwrap().clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Runtime::new().unwrap();
                rt.block_on(async {
                    let pool = sqlx::PgPool::connect(&url).await.unwrap();
                    sqlx::query("update ext.payments set status = 'closed-edited' where id = 2")
                        .execute(&pool)
                        .await
                        .unwrap();
                });
            })
            .join()
            .unwrap();
        }
        ok()
    })
    .await;
    let config = dependency("payments", &provider.url(), "")
        + &payments_policy("reconcile", "payments", 10, "", "").replace(
            "then = { set = \"reconciled_at\" }",
            "then = \"delete_row\"",
        );
    let app = spawn(1, config).await;
    *db_url.lock().unwrap() = app.db.url.clone();
    seed_payments(&app, 3).await;
    let r = run(&app, "reconcile", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["status"], "completed_with_dead_letters", "{done}");
    let left: Vec<(i64, String)> = sqlx::query_as("select id, status from ext.payments")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        left,
        [(2, "closed-edited".to_string())],
        "the changed row is kept"
    );
    let o = outcomes(&app, "reconcile").await;
    assert_eq!(o["2"], ["failed"]);
    let (reason, effect): (String, String) = sqlx::query_as(
        "select d.reason, e.state from sweeper.dead_letters d
           join sweeper.effects e on e.item_key = d.item_key and e.policy = d.policy
          where d.kind = 'item'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(reason.starts_with("row_changed_during_call"), "{reason}");
    assert_eq!(effect, "closed", "the effect is recorded as done");
}

#[tokio::test]
async fn short_pauses_are_waited_out_and_timeouts_are_transient() {
    // Item 1: a 429 whose only hint is the documented reset header (1 s). Item 2: the first
    // answer comes after the 1 s timeout.
    let provider = StandIn::start(Duration::ZERO, |c: &Call, earlier: &[Call]| -> Reply {
        let seen = earlier.iter().filter(|e| e.path == c.path).count();
        match (item_of(c), seen) {
            (1, 0) => (
                429,
                vec![("x-ratelimit-reset-after".into(), "1".into())],
                String::new(),
            ),
            (2, 0) => (
                200,
                vec![("x-standin-delay-ms".into(), "2500".into())],
                String::new(),
            ),
            _ => ok(),
        }
    })
    .await;
    let config = dependency(
        "payments",
        &provider.url(),
        "pause_wait = \"2s\"\ntimeout = \"1s\"\nreset_header = \"X-RateLimit-Reset-After\"",
    ) + &payments_policy("reconcile", "payments", 5, "", "");
    let app = spawn(1, config).await;
    seed_payments(&app, 3).await;
    let r = run(&app, "reconcile", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["reconciled"], 3);
    let calls = provider.calls();
    let item1: Vec<&Call> = calls.iter().filter(|c| item_of(c) == 1).collect();
    assert_eq!(item1.len(), 2);
    let gap = item1[1].at - item1[0].at;
    assert!(gap >= Duration::from_millis(950), "waited {gap:?}");
    eprintln!("reset header `1` with pause_wait 2s: called again after {gap:?}");
    assert_eq!(calls.iter().filter(|c| item_of(c) == 2).count(), 2);
    let history: Vec<(String, Option<String>, Option<String>)> =
        sqlx::query_as("select outcome, class, error from sweeper.attempts order by attempt_id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    // No snooze: the short pause was waited out; the timeout was one transient attempt.
    assert_eq!(history.len(), 2, "{history:?}");
    assert_eq!(history[0].0, "failed");
    assert_eq!(history[0].1.as_deref(), Some("transient"));
    assert!(
        history[0].2.as_deref().unwrap().contains("timed out"),
        "{history:?}"
    );
    assert_eq!(history[1].0, "succeeded");
}

#[tokio::test]
async fn a_reset_header_in_unix_time_pauses_until_that_instant_not_for_the_cap() {
    // A provider whose reset header is a Unix time (GitHub's `X-RateLimit-Reset`): seconds for
    // item 1, milliseconds for item 2, each 2 s ahead. Read as delta-seconds either would pause
    // the dependency for retry_after_cap (1 h) and the run would not finish.
    let epoch = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
    };
    for (written, header, value) in [
        (
            "reset_header = \"X-RateLimit-Reset\"",
            "x-ratelimit-reset",
            (|d: Duration| (d.as_secs() + 2).to_string()) as fn(Duration) -> String,
        ),
        (
            "reset_header = { name = \"X-Reset-Ms\", format = \"epoch_ms\" }",
            "x-reset-ms",
            |d: Duration| (d.as_millis() + 2_000).to_string(),
        ),
    ] {
        let provider = StandIn::start(Duration::ZERO, move |c: &Call, earlier: &[Call]| -> Reply {
            let seen = earlier.iter().filter(|e| e.path == c.path).count();
            match (item_of(c), seen) {
                (1, 0) => (429, vec![(header.into(), value(epoch()))], String::new()),
                _ => ok(),
            }
        })
        .await;
        let config = dependency(
            "payments",
            &provider.url(),
            &format!("pause_wait = \"5s\"\n{written}"),
        ) + &payments_policy("reconcile", "payments", 5, "", "");
        let app = spawn(1, config).await;
        seed_payments(&app, 2).await;
        let r = run(&app, "reconcile", "2026-09-01").await;
        let done = app.wait_terminal(&r).await;
        assert_eq!(done["status"], "completed", "{written}: {done}");
        let calls = provider.calls();
        let item1: Vec<&Call> = calls.iter().filter(|c| item_of(c) == 1).collect();
        assert_eq!(item1.len(), 2, "{written}");
        let gap = item1[1].at - item1[0].at;
        assert!(
            gap >= Duration::from_millis(900) && gap < Duration::from_secs(5),
            "{written}: called again after {gap:?}"
        );
    }
}

#[tokio::test]
async fn unusable_item_values_fail_only_their_item_and_nothing_is_sent_for_them() {
    let provider = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let config = dependency("payments", &provider.url(), "")
        + &payments_policy("reconcile", "payments", 10, "", "").replace(
            "path = \"/pay/{id}\"",
            "path = \"/pay/{status}/{id}\", headers = { \"x-status\" = \"{status}\" }",
        );
    let app = spawn(1, config).await;
    sqlx::raw_sql(
        "insert into ext.payments (id, status, closed_at) values
            (1, 'closed', '2026-08-01'), (2, '..', '2026-08-01'), (3, '.', '2026-08-01'),
            (4, '', '2026-08-01'), (5, E'closed\r\nX-Injected: yes', '2026-08-01')",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let r = run(&app, "reconcile", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["status"], "completed_with_dead_letters", "{done}");
    let calls = provider.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].path, "/pay/closed/1");
    let o = outcomes(&app, "reconcile").await;
    assert_eq!(o["1"], ["reconciled"]);
    for k in ["2", "3", "4", "5"] {
        assert_eq!(o[k], ["failed"], "{k}");
    }
    let items: i64 =
        sqlx::query_scalar("select count(*) from sweeper.dead_letters where kind = 'item'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(items, 4);
}

#[tokio::test]
async fn max_concurrent_commands_holds_while_commands_call() {
    let provider = StandIn::start(Duration::from_millis(200), |_, _| ok()).await;
    let config = dependency("payments", &provider.url(), "max_concurrent_calls = 8")
        + &payments_policy(
            "reconcile",
            "payments",
            2,
            "",
            "max_concurrent_commands = 1",
        );
    let app = spawn(4, config).await;
    seed_payments(&app, 8).await;
    let r = run(&app, "reconcile", "2026-09-01").await;
    let done = app.wait_terminal(&r).await;
    assert_eq!(done["reconciled"], 8, "{done}");
    assert_eq!(provider.calls().len(), 8);
    assert_eq!(
        provider.max_in_flight(),
        1,
        "one command calls at a time across workers"
    );
}
