//! Crashes on a monthly-partitioned table keyed `(id, created_at)` (issue 33): the server killed
//! mid-planning (its cursor inside a leaf) and mid-command; after a restart every eligible key is
//! in exactly one command, which names the leaf it lies in, deleted once and audited once.

use super::*;

/// `demo.events`, monthly partitions January to October 2026, ids repeating across months.
const EVENTS: &str = "
create schema demo;
create table demo.events (id bigint not null, created_at timestamptz not null, payload text,
                          primary key (id, created_at)) partition by range (created_at);
create table demo.events_2026_01 partition of demo.events for values from ('2026-01-01') to ('2026-02-01');
create table demo.events_2026_02 partition of demo.events for values from ('2026-02-01') to ('2026-03-01');
create table demo.events_2026_03 partition of demo.events for values from ('2026-03-01') to ('2026-04-01');
create table demo.events_2026_04 partition of demo.events for values from ('2026-04-01') to ('2026-05-01');
create table demo.events_2026_05 partition of demo.events for values from ('2026-05-01') to ('2026-06-01');
create table demo.events_2026_06 partition of demo.events for values from ('2026-06-01') to ('2026-07-01');
create table demo.events_2026_07 partition of demo.events for values from ('2026-07-01') to ('2026-08-01');
create table demo.events_2026_08 partition of demo.events for values from ('2026-08-01') to ('2026-09-01');
create table demo.events_2026_09 partition of demo.events for values from ('2026-09-01') to ('2026-10-01');
create table demo.events_2026_10 partition of demo.events for values from ('2026-10-01') to ('2026-11-01');
insert into demo.events
select i, timestamptz '2026-01-10' + make_interval(months => m, hours => i), 'x'
  from generate_series(1, 25) i, generate_series(0, 7) m";

/// Ids 1..=25 on the 10th (plus `id` hours) of January to August; the cutoff (90 days before
/// the 2026-09-01 window) is 2026-06-03T02:00Z: January to May are eligible.
fn eligible() -> Vec<String> {
    let mut keys: Vec<String> = (1..=5)
        .flat_map(|m| {
            (1..=25).map(move |i| {
                let t = chrono::NaiveDate::from_ymd_opt(2026, m, 10)
                    .unwrap()
                    .and_hms_opt(0, 0, 0)
                    .unwrap()
                    .and_utc()
                    + chrono::TimeDelta::hours(i);
                format!(r#"["{i}","{}"]"#, t.format("%Y-%m-%dT%H:%M:%SZ"))
            })
        })
        .collect();
    keys.sort();
    keys
}

async fn prepare() -> (TestDb, PgPool) {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(EVENTS).execute(&pool).await.unwrap();
    set_clock(&pool, at("2026-09-01T02:01:00Z")).await;
    (db, pool)
}

fn config(db_url: &str, workers: usize) -> String {
    config_toml(
        db_url,
        workers,
        "[planning]\npage_rows = 10\npath = \"key_order\"",
        r#"
[[policy]]
name = "ticket-retention"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "demo.events", key = ["id", "created_at"], timestamp = "created_at" }
retain_for = "90d"
batch_size = 7
"#,
    )
}

/// Every command succeeded and lies in the leaf it names; every eligible key in exactly one
/// command and deleted with one audit row; June to August untouched; none eligible left.
async fn assert_end_state(pool: &PgPool, run_id: &str) {
    let states = kit::ledger::command_states(pool, run_id).await;
    assert_eq!(states, vec!["succeeded"], "every planned command terminal");
    let commands: Vec<(String, Vec<String>)> =
        sqlx::query_as("select partition, item_keys from sweeper.commands where run_id = $1")
            .bind(run_id)
            .fetch_all(pool)
            .await
            .unwrap();
    let mut planned = Vec::new();
    for (leaf, keys) in commands {
        let month = leaf.trim_start_matches("demo.events_2026_").to_string();
        for k in keys {
            assert!(k.contains(&format!("\"2026-{month}-")), "{leaf}: {k}");
            planned.push(k);
        }
    }
    planned.sort();
    assert_eq!(
        planned,
        eligible(),
        "every eligible key in exactly one command"
    );
    let mut audited: Vec<(String, String)> =
        sqlx::query_as("select item_key, outcome from sweeper.audit_trail where run_id = $1")
            .bind(run_id)
            .fetch_all(pool)
            .await
            .unwrap();
    audited.sort();
    assert_eq!(
        audited,
        eligible()
            .into_iter()
            .map(|k| (k, "deleted".to_string()))
            .collect::<Vec<_>>(),
        "one deleted row per eligible key"
    );
    let left: i64 = sqlx::query_scalar("select count(*) from demo.events")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(left, 3 * 25, "June to August kept");
    let remaining: Option<i64> =
        sqlx::query_scalar("select remaining_eligible from sweeper.runs where run_id = $1")
            .bind(run_id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(remaining, Some(0));
}

/// Killed after the first planning page committed (its cursor inside January's leaf); a restarted
/// server resumes from (leaf, key).
#[tokio::test]
async fn a_crash_while_planning_a_partitioned_table_resumes_in_its_leaf() {
    let (db, pool) = prepare().await;
    let how = Launch {
        crash_at: Some("plan_after_page"),
        ..Default::default()
    };
    let mut server = Server::launch(&config(&db.url, 0), how).await;
    let run_id = trigger(&server).await;
    server.wait_crashed().await;
    let (pages, leaf, key): (i32, i32, Option<String>) = sqlx::query_as(
        "select pages_done, cursor_partition, cursor_key from sweeper.planning_jobs where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((pages, leaf), (1, 0));
    assert!(key.is_some());
    let _server = Server::launch(&config(&db.url, 2), Launch::default()).await;
    advance(&pool, 61).await; // past the planning lease
    wait_terminal(&pool, &run_id).await;
    assert_end_state(&pool, &run_id).await;
}

/// Killed after a command's delete, before its commit: nothing of it stays; a restarted server
/// deletes every eligible key once.
#[tokio::test]
async fn a_crash_mid_command_on_a_partitioned_table_loses_nothing() {
    let (db, pool) = prepare().await;
    let how = Launch {
        crash_at: Some("consume_before_commit"),
        ..Default::default()
    };
    let mut server = Server::launch(&config(&db.url, 1), how).await;
    let run_id = trigger(&server).await;
    server.wait_crashed().await;
    let (audit, left): (i64, i64) = sqlx::query_as(
        "select (select count(*) from sweeper.audit_trail), (select count(*) from demo.events)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (audit, left),
        (0, 200),
        "the aborted transaction left nothing"
    );
    let _server = Server::launch(&config(&db.url, 2), Launch::default()).await;
    advance(&pool, 301).await; // past the queue lease of the claimed command
    wait_terminal(&pool, &run_id).await;
    assert_end_state(&pool, &run_id).await;
}

/// The same table under `partitions = "drop"`, exporting to `dir`.
fn drop_config(db_url: &str, workers: usize, dir: &std::path::Path) -> String {
    config(db_url, workers).replace(
        "batch_size = 7\n",
        &format!(
            "batch_size = 7\npartitions = \"drop\"\n\n[ledger]\naudit_export_dir = \"{}\"\n",
            dir.display()
        ),
    )
}

/// Killed at each step of a partition's retirement — after its detach, after its export was
/// written and verified (before the drop's transaction commits), after the drop — a restarted
/// server finishes: January to May each dropped once, each with one manifest whose export
/// verifies and holds its 25 keys, the run's count exact, June to August untouched.
#[tokio::test]
async fn a_crash_at_each_step_of_a_partition_retirement_drops_it_once_with_its_evidence() {
    for point in [
        "retire_after_detach",
        "retire_after_export",
        "retire_after_drop",
    ] {
        let (db, pool) = prepare().await;
        let dir = std::env::temp_dir().join(format!("sweeper-crash-drop-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let how = Launch {
            crash_at: Some(point),
            ..Default::default()
        };
        let mut server = Server::launch(&drop_config(&db.url, 0, &dir), how).await;
        let run_id = trigger(&server).await;
        server.wait_crashed().await;
        let _server = Server::launch(&drop_config(&db.url, 0, &dir), Launch::default()).await;
        advance(&pool, 61).await; // past the retirement's lease
        wait_terminal(&pool, &run_id).await;
        let gone: i64 = sqlx::query_scalar(
            "select count(*) from generate_series(1, 5) m
              where to_regclass(format('demo.events_2026_%s', lpad(m::text, 2, '0'))) is null",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(gone, 5, "{point}: January to May dropped");
        let manifests: Vec<(String, i64, serde_json::Value)> = sqlx::query_as(
            "select partition, rows, detail from sweeper.audit_manifests order by partition",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(
            manifests.len(),
            5,
            "{point}: one manifest per partition: {manifests:?}"
        );
        for (partition, rows, detail) in &manifests {
            assert_eq!(*rows, 25, "{point}: {partition}");
            let location = detail["export_location"].as_str().unwrap();
            let bytes = std::fs::read(location).unwrap();
            use sha2::Digest;
            assert_eq!(
                hex::encode(sha2::Sha256::digest(&bytes)),
                detail["export_sha256"],
                "{point}: {partition}"
            );
            let mut text = String::new();
            std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut text)
                .unwrap();
            assert_eq!(text.lines().count(), 25, "{point}: {partition}");
        }
        let (deleted, left, commands): (i64, i64, i64) = sqlx::query_as(
            "select (select deleted from sweeper.run_totals where run_id = $1),
                    (select count(*) from demo.events),
                    (select count(*) from sweeper.commands where run_id = $1)",
        )
        .bind(&run_id)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((deleted, left, commands), (125, 75, 0), "{point}");
    }
}
