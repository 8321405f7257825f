//! External actions across real `sweeper serve` processes: a pause shared by two replicas,
//! S3 served by moto, and crash points around the effect row.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use sqlx::PgPool;

use super::{advance, api};
use crate::common::*;
use crate::ext_common::*;
use crate::kit::process::{Launch, Server};
use crate::standin::{Call, StandIn, ok};

async fn prepare() -> (TestDb, PgPool) {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(EXT).execute(&pool).await.unwrap();
    // The schema must exist before the servers start (they check policies against it); the
    // ledger clock needs the ledger, so migrate first.
    sweeper::ledger::migrations::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    set_clock(&pool, at(NOW)).await;
    (db, pool)
}

/// Triggers `policy` for `window` (a new run, or the one the window has); returns its id.
async fn trigger(server: &Server, policy: &str, window: &str) -> String {
    let a = api(server)
        .trigger(policy, &format!("?window={window}"))
        .await;
    assert!(a.status == 202 || a.status == 200, "{}", a.status);
    a.body["run_id"].as_str().unwrap().to_string()
}

/// Waits (up to 90 s) until the run is terminal; returns its status, logging the dead letters'
/// reasons when it did not simply complete.
async fn wait_status(pool: &PgPool, run_id: &str) -> String {
    let status = crate::kit::ledger::wait_run_terminal(pool, run_id, Duration::from_secs(90)).await;
    if status != "completed" {
        let why: Vec<(String, String)> =
            sqlx::query_as("select class, reason from sweeper.dead_letters where run_id = $1")
                .bind(run_id)
                .fetch_all(pool)
                .await
                .unwrap();
        eprintln!("run {run_id} ended {status}: {why:?}");
    }
    status
}

fn item_of(c: &Call) -> i64 {
    c.path.rsplit('/').next().unwrap().parse().unwrap()
}

/// The 11th call is answered 429 with `retry_after(now)`; so is every call until the pause
/// it names ends. Returns the stand-in and the instant and length of the pause.
type PauseAt = Arc<Mutex<Option<(Instant, Duration)>>>;

async fn throttling_provider(
    retry_after: impl Fn() -> (String, Duration) + Send + Sync + 'static,
) -> (StandIn, PauseAt) {
    let pause: PauseAt = Arc::new(Mutex::new(None));
    let p = pause.clone();
    let provider = StandIn::start(
        Duration::from_millis(20),
        move |c: &Call, earlier: &[Call]| {
            let mut p = p.lock().unwrap();
            match *p {
                None if earlier.len() == 10 => {
                    let (header, len) = retry_after();
                    *p = Some((c.at, len));
                    (
                        429,
                        vec![("retry-after".into(), header)],
                        "slow down".into(),
                    )
                }
                Some((at, len)) if c.at < at + len => (429, vec![], "still paused".into()),
                _ => ok(),
            }
        },
    )
    .await;
    (provider, pause)
}

async fn pause_shared_by_two_processes(
    form: &str,
    retry_after: impl Fn() -> (String, Duration) + Send + Sync + 'static,
    quiet_until: Duration,
) {
    let (provider, pause) = throttling_provider(retry_after).await;
    let other = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let (db, pool) = prepare().await;
    seed_payments_in(&pool, 60).await;
    sqlx::query(
        "insert into ext.uploads (id, object_key, expired_at)
         select g, 'u/' || g, timestamptz '2026-08-01' from generate_series(1, 40) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    let policies = dependency(
        "payments",
        &provider.url(),
        "max_concurrent_calls = 2\nrate_limit = { per_second = 25, burst = 2 }\npause_wait = \"0s\"",
    ) + &dependency(
        "ledger-api",
        &other.url(),
        "rate_limit = { per_second = 8 }",
    ) + &payments_policy("reconcile", "payments", 5, "", "")
        + r#"
[[policy]]
name = "other"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "ext.uploads", key = "id", timestamp = "expired_at" }
retain_for = "1d"
batch_size = 5
action = { kind = "http", dependency = "ledger-api", method = "DELETE", path = "/objects/{id}", then = "nothing" }
"#;
    let text = config_toml(&db.url, 3, "[planning]\npage_rows = 50", &policies);
    let a = Server::start(&text).await;
    let b = Server::start(&text).await;
    let r1 = trigger(&a, "reconcile", "2026-09-01").await;
    let r2 = trigger(&b, "other", "2026-09-01").await;
    assert_eq!(wait_status(&pool, &r1).await, "completed");
    assert_eq!(wait_status(&pool, &r2).await, "completed");
    drop((a, b));

    let (paused_at, len) = pause.lock().unwrap().expect("the provider paused us");
    assert!(len >= quiet_until, "{len:?}");
    let calls = provider.calls();
    let offset = |c: &Call| c.at.checked_duration_since(paused_at);
    // Within a second of the pause only already admitted calls (≤ 2 replicas × cap 2) start.
    let early = calls
        .iter()
        .filter(|c| offset(c).is_some_and(|d| !d.is_zero() && d <= Duration::from_millis(1_250)))
        .count();
    assert!(
        early <= 4,
        "{early} calls started in the second after the pause"
    );
    // After that second, none before the pause ends.
    let late: Vec<Duration> = calls
        .iter()
        .filter_map(offset)
        .filter(|d| *d > Duration::from_millis(1_250) && *d < quiet_until)
        .collect();
    assert!(late.is_empty(), "calls during the pause at {late:?}");
    let resumed = calls
        .iter()
        .filter_map(offset)
        .find(|d| *d > Duration::from_millis(1_250));
    eprintln!(
        "Retry-After {form}: {early} calls within 1.25 s, first call after \
         that at {resumed:?} after the 429"
    );
    // The other dependency kept flowing during the pause.
    let flowing = other
        .calls()
        .iter()
        .filter(|c| {
            c.at.checked_duration_since(paused_at)
                .is_some_and(|d| d < quiet_until)
        })
        .count();
    assert!(
        flowing >= 3,
        "only {flowing} calls to the other dependency during the pause"
    );
    // Every item reconciled by exactly one successful call; calls after the pause resumed.
    let mut ok_calls: HashMap<i64, usize> = HashMap::new();
    // The stand-in answered 200 to the first ten calls and to every call after the pause.
    for (_, c) in calls
        .iter()
        .enumerate()
        .filter(|(i, c)| *i < 10 || c.at >= paused_at + len)
    {
        *ok_calls.entry(item_of(c)).or_default() += 1;
    }
    assert_eq!(ok_calls.len(), 60, "{ok_calls:?}");
    assert!(ok_calls.values().all(|n| *n == 1), "{ok_calls:?}");
    let left: i64 =
        sqlx::query_scalar("select count(*) from ext.payments where reconciled_at is null")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(left, 0);
    let stored: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.dependency_pauses where dependency = 'payments'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stored, 1);
}

#[tokio::test]
async fn a_429_with_delta_seconds_pauses_both_processes() {
    pause_shared_by_two_processes(
        "delta-seconds 2",
        || ("2".into(), Duration::from_secs(2)),
        Duration::from_secs(2),
    )
    .await;
}

#[tokio::test]
async fn a_429_with_an_http_date_pauses_both_processes() {
    // An HTTP-date has whole seconds: "now + 3 s" names a pause of 2 to 3 s.
    pause_shared_by_two_processes(
        "IMF-fixdate now+3s",
        || {
            let at = SystemTime::now() + Duration::from_secs(3);
            (httpdate::fmt_http_date(at), Duration::from_secs(2))
        },
        Duration::from_secs(2),
    )
    .await;
}

/// `moto_server` on a free loopback port, killed on drop.
struct Moto {
    child: Child,
    url: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn moto() -> Moto {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("moto_server")
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("moto_server (PyPI moto[server]) must be installed; .ci/run installs it");
    let url = format!("http://127.0.0.1:{port}");
    let started = Instant::now();
    while reqwest::get(&url).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "moto did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Moto { child, url }
}

#[tokio::test]
async fn objects_in_s3_served_by_moto_are_deleted_and_a_missing_bucket_is_permanent() {
    let s3 = moto().await;
    let http = reqwest::Client::new();
    assert!(
        http.put(format!("{}/uploads", s3.url))
            .send()
            .await
            .unwrap()
            .status()
            .is_success()
    );
    for i in 1..=12 {
        if i % 4 != 0 {
            let r = http
                .put(format!("{}/uploads/u/{i}.bin", s3.url))
                .body("x")
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "{}", r.status());
        }
    }
    let (db, pool) = prepare().await;
    sqlx::query(
        "insert into ext.uploads (id, object_key, expired_at)
         select g, 'u/' || g || '.bin', timestamptz '2026-08-01' from generate_series(1, 12) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    let s3_dep = |name: &str, bucket: &str| {
        format!(
            "[[dependency]]\nname = \"{name}\"\nkind = \"s3\"\nbucket = \"{bucket}\"\n\
             base_url = \"{}\"\nallow_private_addresses = true\n\
             credentials = {{ access_key_id_env = \"TEST_S3_KEY\", secret_access_key_env = \"TEST_S3_SECRET\" }}\n",
            s3.url
        )
    };
    let policy = |name: &str, dep: &str| {
        format!(
            r#"
[[policy]]
name = "{name}"
schedule = {{ cron = "0 2 * * *", timezone = "UTC" }}
target = {{ table = "ext.uploads", key = "id", timestamp = "expired_at" }}
retain_for = "1d"
exclude = [ {{ column = "legal_hold", equals = true }} ]
batch_size = 5
action = {{ kind = "object_store", dependency = "{dep}", column = "object_key", then = "delete_row" }}
"#
        )
    };
    let policies = s3_dep("uploads", "uploads")
        + &s3_dep("nowhere", "no-such-bucket")
        + &policy("uploads", "uploads")
        + &policy("uploads-nowhere", "nowhere");
    let text = config_toml(&db.url, 2, "", &policies);
    let env = [("TEST_S3_KEY", "testing"), ("TEST_S3_SECRET", "testing")];
    let server = Server::launch(
        &text,
        Launch {
            env: &env,
            ..Default::default()
        },
    )
    .await;

    let r = trigger(&server, "uploads-nowhere", "2026-09-01").await;
    assert_eq!(wait_status(&pool, &r).await, "completed_with_dead_letters");
    let (absent, quarantined): (i64, i32) = sqlx::query_as(
        "select already_absent, quarantined_commands from sweeper.run_totals where run_id = $1",
    )
    .bind(&r)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (absent, quarantined),
        (0, 3),
        "a missing bucket is never already_absent"
    );
    let classes: Vec<(String, String)> =
        sqlx::query_as("select class, reason from sweeper.dead_letters where run_id = $1")
            .bind(&r)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(classes.iter().all(|(c, _)| c == "permanent"), "{classes:?}");
    assert!(classes[0].1.contains("bucket"), "{classes:?}");

    let r = trigger(&server, "uploads", "2026-09-01").await;
    assert_eq!(wait_status(&pool, &r).await, "completed");
    let (deleted, absent): (i64, i64) =
        sqlx::query_as("select deleted, already_absent from sweeper.run_totals where run_id = $1")
            .bind(&r)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((deleted, absent), (9, 3));
    let rows: i64 = sqlx::query_scalar("select count(*) from ext.uploads")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
    for i in 1..=12 {
        let r = http
            .get(format!("{}/uploads/u/{i}.bin", s3.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "object {i} is gone");
    }
}

/// Crashes at `point` while reconciling 5 payments, restarts, opens an overlapping run, then
/// moves the ledger clock past the lease. Returns the provider's calls.
async fn crash_around_the_effect(point: &str) -> Vec<Call> {
    let provider = StandIn::start(Duration::ZERO, |_, _| ok()).await;
    let (db, pool) = prepare().await;
    seed_payments_in(&pool, 5).await;
    let policies = dependency("payments", &provider.url(), "")
        + &payments_policy("reconcile", "payments", 5, "", "");
    let text = config_toml(&db.url, 1, "", &policies);
    let mut crashing = Server::launch(
        &text,
        Launch {
            crash_at: Some(point),
            ..Default::default()
        },
    )
    .await;
    let r1 = trigger(&crashing, "reconcile", "2026-09-01").await;
    crashing.wait_crashed().await;
    assert_eq!(provider.calls().len(), 1, "crashed after the first call");

    let server = Server::start(&text).await;
    // An overlapping run: the open effect holds item 1; the others are done by this run.
    let r2 = trigger(&server, "reconcile", "2026-09-02").await;
    assert_eq!(wait_status(&pool, &r2).await, "completed");
    let calls_1: usize = provider.calls().iter().filter(|c| item_of(c) == 1).count();
    assert_eq!(
        calls_1, 1,
        "no other run called item 1 while its effect was open"
    );
    let held: Option<String> =
        sqlx::query_scalar("select held_at_planning::text from sweeper.runs where run_id = $1")
            .bind(&r2)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        held.unwrap_or_default().contains("effect_open"),
        "planning held item 1"
    );

    // The first run's command is reclaimed once its lease has expired.
    advance(&pool, 400).await;
    assert_eq!(wait_status(&pool, &r1).await, "completed");
    drop(server);
    let stamped: i64 =
        sqlx::query_scalar("select count(*) from ext.payments where reconciled_at is not null")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(stamped, 5);
    let reconciled: Vec<(String, String)> = sqlx::query_as(
        "select item_key, run_id from sweeper.audit_trail where outcome = 'reconciled' order by item_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(reconciled.len(), 5, "one outcome per item: {reconciled:?}");
    assert_eq!(reconciled[0], ("1".to_string(), r1.clone()));
    let effects: Vec<(String, i32)> =
        sqlx::query_as("select state, n from sweeper.effects order by item_key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(
        effects.iter().all(|(s, n)| s == "closed" && *n == 1),
        "{effects:?}"
    );
    provider.calls()
}

#[tokio::test]
async fn a_crash_after_called_changes_the_row_once_without_calling_again() {
    let calls = crash_around_the_effect("effect_after_called").await;
    let mut per_item: HashMap<i64, usize> = HashMap::new();
    for c in &calls {
        *per_item.entry(item_of(c)).or_default() += 1;
    }
    assert_eq!(per_item.len(), 5);
    assert!(per_item.values().all(|n| *n == 1), "{per_item:?}");
}

#[tokio::test]
async fn a_crash_between_the_call_and_called_repeats_the_call_once_with_the_same_key() {
    let calls = crash_around_the_effect("effect_before_called").await;
    let item1: Vec<Option<String>> = calls
        .iter()
        .filter(|c| item_of(c) == 1)
        .map(|c| c.idempotency_key.clone())
        .collect();
    assert_eq!(
        item1,
        [
            Some("reconcile:1:1".to_string()),
            Some("reconcile:1:1".to_string())
        ]
    );
    assert!((2..=5).all(|i| calls.iter().filter(|c| item_of(c) == i).count() == 1));
}
