//! Time-partitioned targets (issue 33): a monthly-partitioned table keyed `(id, created_at)` whose
//! ids repeat across months, with holds kept in another table, planned one leaf at a time in bound
//! order (the leaves newer than the cutoff skipped), each command within one leaf and each of its
//! statements pruned to it; a leaf detached mid-run; a row moved to another partition while its
//! delete waits; and what `check-config` says of a partitioned table.

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};
use sweeper::app::worker::{WorkerStep, run_one_command};

use crate::common::*;
use crate::kit::process::{sweeper, write_config};

/// `demo.events`, range partitioned by month on `created_at`, keyed `(id, created_at)`; holds per
/// event id in `legal.event_holds`. The partitions are made by [`make_months`].
pub const PARTITIONED: &str = "
create schema demo;
create schema legal;
create table demo.events (
    id bigint not null,
    created_at timestamptz not null,
    payload text,
    primary key (id, created_at)
) partition by range (created_at);
create index on demo.events (created_at);
create table legal.event_holds (
    event_id bigint not null,
    released_at timestamptz
);
create index on legal.event_holds (event_id);
";

pub const PARTITIONED_POLICY: &str = r#"
[[policy]]
name = "events"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "demo.events", key = ["id", "created_at"], timestamp = "created_at" }
retain_for = "90d"
batch_size = 7
exclude = [ { name = "event_hold", exists = { table = "legal.event_holds",
      on = [ { related = "event_id", target = "id" } ],
      where = [ { column = "released_at", is_null = true } ] } } ]
"#;

/// Monthly partitions `demo.events_2026_01` .. for `months` months from January 2026.
pub async fn make_months(pool: &PgPool, months: u32) {
    for m in 0..months {
        let from = chrono::NaiveDate::from_ymd_opt(2026, 1, 1)
            .unwrap()
            .checked_add_months(chrono::Months::new(m))
            .unwrap();
        let to = from.checked_add_months(chrono::Months::new(1)).unwrap();
        sqlx::query(&format!(
            "create table demo.events_{} partition of demo.events for values from ('{from}') to ('{to}')",
            from.format("%Y_%m")
        ))
        .execute(pool)
        .await
        .unwrap();
    }
}

/// Ids `1..=ids` on the 15th of each of the first `months` months of 2026 (ids repeat across
/// months).
async fn seed(pool: &PgPool, ids: i64, months: i32) {
    sqlx::query(
        "insert into demo.events (id, created_at, payload)
         select i, timestamptz '2026-01-15' + make_interval(months => m), 'x'
           from generate_series(1, $1::bigint) i, generate_series(0, $2 - 1) m",
    )
    .bind(ids)
    .bind(months)
    .execute(pool)
    .await
    .unwrap();
}

async fn spawn(extra_toml: &str, months: u32) -> TestApp {
    let app = TestApp::spawn(Spawn {
        setup_sql: PARTITIONED,
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: PARTITIONED_POLICY.into(),
        extra_toml: extra_toml.into(),
        workers: 0,
    })
    .await;
    make_months(&app.pool, months).await;
    app
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// The item key text of event `(id, day)`.
fn item(id: i64, month: u32) -> String {
    format!(r#"["{id}","2026-{month:02}-15T00:00:00Z"]"#)
}

/// Runs every due command, as a worker would.
async fn drain(app: &TestApp) {
    while let WorkerStep::Ran(_) = run_one_command(&app.state).await.unwrap() {}
}

/// The done-when scenario: exactly the old, un-held rows deleted, held and young rows kept, the
/// closure check 0; the leaves newer than the cutoff never walked; each command within one leaf,
/// naming it; a deleted key's history names its run, window and cutoff.
#[tokio::test]
async fn a_monthly_partitioned_table_with_holds_elsewhere_is_swept_one_leaf_at_a_time() {
    let app = spawn("[planning]\npage_rows = 10\n", 10).await;
    seed(&app.pool, 40, 9).await;
    sqlx::query(
        "insert into legal.event_holds (event_id, released_at)
         values (3, null), (17, null), (21, '2026-08-01')",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    drain(&app).await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    // The cutoff is 2026-06-03T02:00Z: January to May are old (5 × 40 rows); ids 3 and 17 are held.
    assert_eq!(run["deleted"], 5 * 38, "{run}");
    assert_eq!(run["remaining_eligible"], 0, "the closure check: {run}");
    let left: Vec<(i64, i32)> = sqlx::query_as(
        "select id, extract(month from created_at at time zone 'UTC')::int from demo.events
          order by 2, 1",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let mut want: Vec<(i64, i32)> = (1..=5)
        .flat_map(|m| [(3, m), (17, m)])
        .chain((6..=9).flat_map(|m| (1..=40).map(move |i| (i, m))))
        .collect();
    want.sort_by_key(|(i, m)| (*m, *i));
    assert_eq!(left, want, "exactly the old un-held rows deleted");

    // Leaves walked: January to June (June starts before the cutoff); July on skipped.
    let walked: Vec<String> = sqlx::query_scalar(
        "select unnest(partitions) from sweeper.planning_jobs where run_id = $1",
    )
    .bind(&run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        walked,
        (1..=6)
            .map(|m| format!("demo.events_2026_{m:02}"))
            .collect::<Vec<_>>()
    );
    // Each command's keys lie in the one leaf it names; commands are full within a leaf.
    let commands: Vec<(String, Vec<String>)> = sqlx::query_as(
        "select partition, item_keys from sweeper.commands where run_id = $1 order by batch_no",
    )
    .bind(&run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let mut per_leaf: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
    for (leaf, keys) in &commands {
        let month = &leaf["demo.events_2026_".len()..];
        for k in keys {
            assert!(k.contains(&format!("2026-{month}-15")), "{leaf}: {k}");
        }
        per_leaf.entry(leaf.clone()).or_default().push(keys.len());
    }
    assert_eq!(per_leaf.len(), 5, "{per_leaf:?}");
    for sizes in per_leaf.values() {
        // 38 eligible keys per month, commands of 7: five full ones and a remainder of 3.
        assert_eq!(sizes, &vec![7, 7, 7, 7, 7, 3], "{per_leaf:?}");
    }
    // The history of a deleted key names its run, window and cutoff.
    let h = app
        .get_json(&format!(
            "/policies/events/items/{}",
            percent_encoding::utf8_percent_encode(&item(5, 2), percent_encoding::NON_ALPHANUMERIC)
        ))
        .await;
    let a = &h["audit"][0];
    assert_eq!(a["outcome"], "deleted", "{h}");
    assert_eq!(a["run_id"], run_id.as_str(), "{h}");
    assert_eq!(a["window"], "2026-09-01T02:00:00Z", "{h}");
    assert_eq!(a["cutoff"], "2026-06-03T02:00:00Z", "{h}");
    let held: i64 = count(
        &app.pool,
        "select count(*) from sweeper.audit_trail where outcome = 'excluded'",
    )
    .await;
    assert!(held <= 10, "{held}");
}

/// The statements of a command planned in one leaf scan that leaf only: EXPLAIN of the delete,
/// of the `SKIP LOCKED` delete and of the classification, as sweeper writes them, each with the
/// leaf's constraint read in the gate's way; a leaf no longer attached gives no constraint.
#[tokio::test]
async fn a_commands_statements_are_pruned_to_its_leaf() {
    use sweeper::ledger::commands::DeleteTarget;
    let app = spawn("", 10).await;
    seed(&app.pool, 20, 9).await;
    // Planning only: no worker runs the commands.
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    let (leaf, keys): (String, Vec<String>) = sqlx::query_as(
        "select partition, item_keys from sweeper.commands where run_id = $1 and batch_no = 3",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let mut conn = app.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let all: Vec<String> = sqlx::query_scalar(
        "select unnest(partitions) from sweeper.planning_jobs where run_id = $1",
    )
    .bind(&run_id)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    let at = all.iter().position(|l| *l == leaf).unwrap();
    let (found, constraint) = sweeper::policy::partitions::next_attached(
        &mut tx,
        &sweeper::policy::TableName::parse("demo.events").unwrap(),
        &all,
        at,
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(found, at);
    // Only that leaf's constraint was read: one leaf locked, not every one after it.
    let locked: i64 = sqlx::query_scalar(
        "select count(*) from pg_locks l join pg_class c on c.oid = l.relation
          where l.pid = pg_backend_pid() and c.relname like 'events_2026_%' and c.relkind = 'r'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(locked, 1);
    tx.rollback().await.unwrap();
    let (window, cutoff, version): (
        chrono::DateTime<chrono::Utc>,
        chrono::DateTime<chrono::Utc>,
        String,
    ) = sqlx::query_as(
        "select window_at, cutoff, policy_version from sweeper.runs where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let run = sweeper::plan::RunRef {
        run_id: &run_id,
        policy: "events",
        pinned_version: &version,
        cutoff,
        window,
    };
    let rules = sweeper::plan::run_rules(&app.state, &mut conn, &run)
        .await
        .unwrap()
        .in_partition(Some(constraint));
    let leaves_in = |plan: &str| -> Vec<String> {
        let mut seen: Vec<String> = plan
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("events_2026_") && w.len() == "events_2026_01".len())
            .map(str::to_string)
            .collect();
        seen.sort();
        seen.dedup();
        seen
    };
    for (what, skip_locked) in [("delete", false), ("skip-locked delete", true)] {
        let mut q = sqlx::QueryBuilder::new("explain (costs off) ");
        rules.push_delete_first(&mut q, &keys, skip_locked);
        let mut tx = conn.begin().await.unwrap();
        let plan: Vec<String> = q.build_query_scalar().fetch_all(&mut *tx).await.unwrap();
        tx.rollback().await.unwrap();
        let plan = plan.join("\n");
        assert_eq!(leaves_in(&plan), vec![leaf_name(&leaf)], "{what}:\n{plan}");
    }
    let mut q = sqlx::QueryBuilder::new("explain (costs off) ");
    rules.push_classify(&mut q, &keys);
    let plan: Vec<String> = q.build_query_scalar().fetch_all(&mut *conn).await.unwrap();
    let plan = plan.join("\n");
    assert_eq!(
        leaves_in(&plan),
        vec![leaf_name(&leaf)],
        "classify:\n{plan}"
    );

    // Detached: the leaf gives no constraint, and the command addresses the whole table.
    sqlx::query(&format!("alter table demo.events detach partition {leaf}"))
        .execute(&app.pool)
        .await
        .unwrap();
    let gone = sweeper::policy::partitions::next_attached(
        &mut conn,
        &sweeper::policy::TableName::parse("demo.events").unwrap(),
        std::slice::from_ref(&leaf),
        0,
    )
    .await
    .unwrap();
    assert_eq!(gone, None);
}

fn leaf_name(qualified: &str) -> String {
    qualified.rsplit('.').next().unwrap().to_string()
}

/// A leaf detached (and kept as a table) after planning, before its commands run: its keys are
/// `already_absent`, the detached table is untouched, every other leaf is swept.
#[tokio::test]
async fn a_leaf_detached_mid_run_leaves_its_keys_already_absent() {
    let app = spawn("", 10).await;
    seed(&app.pool, 20, 9).await;
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    sqlx::query("alter table demo.events detach partition demo.events_2026_02")
        .execute(&app.pool)
        .await
        .unwrap();
    drain(&app).await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 4 * 20, "{run}");
    assert_eq!(run["already_absent"], 20, "{run}");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_02").await,
        20,
        "the detached table is not the target's: untouched"
    );
    let absent: Vec<String> = sqlx::query_scalar(
        "select distinct c.partition from sweeper.audit_trail a join sweeper.commands c using (command_id)
          where a.run_id = $1 and a.outcome = 'already_absent'",
    )
    .bind(&run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(absent, vec!["demo.events_2026_02".to_string()]);
}

/// An application update moves a row to another partition while sweeper's delete waits on it:
/// the delete fails with SQLSTATE 40001, which spends no attempt; the next attempt finds the old
/// key gone (`already_absent`), deletes its neighbours, and the moved row (a new key) is kept.
#[tokio::test]
async fn a_row_moved_to_another_partition_under_the_delete_is_already_absent() {
    let app = spawn("[consume]\nlock_timeout = \"30s\"\n", 10).await;
    seed(&app.pool, 5, 2).await;
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    // Another session moves event 2 of January to August and holds its transaction open.
    let mut mover = PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("begin").execute(&mut mover).await.unwrap();
    sqlx::query(
        "update demo.events set created_at = '2026-08-20' where id = 2 and created_at = '2026-01-15'",
    )
    .execute(&mut mover)
    .await
    .unwrap();
    let state = app.state.clone();
    let worker = tokio::spawn(async move { run_one_command(&state).await.unwrap() });
    wait_for_lock_wait(&app.pool).await;
    sqlx::query("commit").execute(&mut mover).await.unwrap();
    worker.await.unwrap();
    let (class, attempts): (Option<String>, i32) = sqlx::query_as(
        "select last_error_class, attempts from sweeper.commands where run_id = $1 order by batch_no limit 1",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(class.as_deref(), Some("locked"), "spends no attempt");
    assert_eq!(attempts, 0);
    crate::kit::ledger::advance_clock(&app.pool, 5).await;
    drain(&app).await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let outcome: String = sqlx::query_scalar(
        "select outcome from sweeper.audit_trail where run_id = $1 and item_key = $2",
    )
    .bind(&run_id)
    .bind(item(2, 1))
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(outcome, "already_absent");
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from demo.events where id = 2 and created_at = '2026-08-20'"
        )
        .await,
        1,
        "the moved row, under its new key, is young and kept"
    );
    assert_eq!(run["deleted"], 9, "{run}");
}

/// `check-config` lists a partitioned target's leaves with their bounds, says which index each
/// planning walk uses, and warns about a default partition.
#[tokio::test]
async fn check_config_lists_the_partitions_and_warns_about_a_default_one() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    for stmt in PARTITIONED
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        sqlx::query(stmt).execute(&pool).await.unwrap();
    }
    make_months(&pool, 3).await;
    sqlx::query("create table demo.events_other partition of demo.events default")
        .execute(&pool)
        .await
        .unwrap();
    let path = write_config(&config_toml(&db.url, 0, "", PARTITIONED_POLICY));
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for expected in [
        "info: policy[events]: target: demo.events is partitioned (4 leaf partitions); planning walks them one at a time in this order, each command within one",
        "info: policy[events]: target: partition demo.events_2026_01 FOR VALUES FROM ('2026-01-01 00:00:00+00') TO ('2026-02-01 00:00:00+00')",
        "warning: policy[events]: target: demo.events_other is a default partition",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}

/// Waits until a session of this database waits on a lock.
async fn wait_for_lock_wait(pool: &PgPool) {
    for _ in 0..400 {
        let waiting: bool = sqlx::query_scalar(
            "select exists (select 1 from pg_stat_activity
                             where datname = current_database() and wait_event_type = 'Lock'
                               and query like 'delete from%')",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no delete waits on a lock");
}

/// pg_partman (Debian's `postgresql-15-partman`, 4.7) manages the table: after a run planned,
/// `run_maintenance()` detaches the oldest partition under its retention (keeping the table); the
/// run completes, that partition's keys `already_absent`, the kept table untouched, the rest swept.
#[tokio::test]
async fn pg_partman_detaching_a_partition_mid_run() {
    let app = TestApp::spawn(Spawn {
        setup_sql: "create schema demo;
create schema legal;
create table demo.events (
    id bigint not null,
    created_at timestamptz not null,
    payload text,
    primary key (id, created_at)
) partition by range (created_at);
create table legal.event_holds (event_id bigint not null, released_at timestamptz)",
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: PARTITIONED_POLICY.into(),
        extra_toml: String::new(),
        workers: 0,
    })
    .await;
    let installed = sqlx::raw_sql(
        "create schema partman;
         create extension pg_partman schema partman;",
    )
    .execute(&app.pool)
    .await;
    if let Err(e) = installed {
        panic!(
            "pg_partman must be installed (Debian package postgresql-15-partman; .ci/run installs it): {e}"
        );
    }
    sqlx::query(
        "select partman.create_parent(p_parent_table => 'demo.events', p_control => 'created_at',
                 p_type => 'native', p_interval => 'monthly', p_premake => 1,
                 p_start_partition => '2026-01-01')",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    seed(&app.pool, 10, 8).await;
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    let planned: Vec<String> = sqlx::query_scalar(
        "select unnest(partitions) from sweeper.planning_jobs where run_id = $1",
    )
    .bind(&run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(planned[0], "demo.events_p2026_01", "{planned:?}");
    // Retention by the database's own clock, set so that January alone has ended before now()
    // minus it; the table is kept, detached.
    sqlx::query(
        "update partman.part_config
            set retention = (now() - timestamptz '2026-02-15')::text,
                retention_keep_table = true
          where parent_table = 'demo.events'",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query("select partman.run_maintenance('demo.events')")
        .execute(&app.pool)
        .await
        .unwrap();
    let attached: bool = sqlx::query_scalar(
        "select exists (select 1 from pg_inherits where inhrelid = 'demo.events_p2026_01'::regclass)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(!attached, "pg_partman detached January");
    drain(&app).await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["already_absent"], 10, "January's keys: {run}");
    assert_eq!(run["deleted"], 4 * 10, "February to May: {run}");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_p2026_01").await,
        10,
        "the detached table is kept as it was"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from demo.events where created_at < '2026-06-03'"
        )
        .await,
        0
    );
}

/// Other layouts: a policy whose target is itself a partition (sub-partitioned by month), a table
/// whose only partition is a default one (no constraint at all), and a hash-partitioned table
/// (walked through its parent: a hash bound prunes nothing). Each run deletes exactly the old rows.
#[tokio::test]
async fn an_intermediate_partition_a_lone_default_and_a_hash_layout_are_swept() {
    let months: String = (1..=12)
        .map(|m| {
            let to = if m == 12 {
                "2027-01-01".to_string()
            } else {
                format!("2026-{:02}-01", m + 1)
            };
            format!(
                "create table demo.events_2026_{m:02} partition of demo.events_2026 \
                 for values from ('2026-{m:02}-01') to ('{to}');"
            )
        })
        .collect();
    let layouts: [(&str, String, &str); 3] = [
        (
            "intermediate",
            format!(
                "create table demo.events_2026 partition of demo.events
                     for values from ('2026-01-01') to ('2027-01-01') partition by range (created_at);
                 {months}"
            ),
            "demo.events_2026",
        ),
        (
            "lone default",
            "create table demo.events_default partition of demo.events default".into(),
            "demo.events",
        ),
        (
            "hash",
            "create table demo.events_h0 partition of demo.events for values with (modulus 2, remainder 0);
             create table demo.events_h1 partition of demo.events for values with (modulus 2, remainder 1)"
                .into(),
            "demo.events",
        ),
    ];
    for (what, partitions, target) in layouts {
        let by = if what == "hash" {
            "hash (id)"
        } else {
            "range (created_at)"
        };
        let setup: &'static str = Box::leak(
            format!(
                "create schema demo; create schema legal;
                 create table legal.event_holds (event_id bigint not null, released_at timestamptz);
                 create table demo.events (id bigint not null, created_at timestamptz not null,
                     payload text, primary key (id, created_at)) partition by {by};
                 {partitions}"
            )
            .into_boxed_str(),
        );
        let app = TestApp::spawn(Spawn {
            setup_sql: setup,
            now: Some(at("2026-09-01T02:01:00Z")),
            policies: PARTITIONED_POLICY.replace("\"demo.events\"", &format!("\"{target}\"")),
            extra_toml: String::new(),
            workers: 0,
        })
        .await;
        seed(&app.pool, 10, 9).await;
        let run_id = app.api.trigger_new("events", "").await;
        app.wait_planned(&run_id).await;
        drain(&app).await;
        let run = app.wait_terminal(&run_id).await;
        assert_eq!(run["status"], "completed", "{what}: {run}");
        assert_eq!(run["deleted"], 50, "{what}: {run}");
        assert_eq!(
            count(&app.pool, "select count(*) from demo.events").await,
            40,
            "{what}: June to September kept"
        );
        let walked: Option<Vec<String>> =
            sqlx::query_scalar("select partitions from sweeper.planning_jobs where run_id = $1")
                .bind(&run_id)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        assert_eq!(walked.is_none(), what == "hash", "{what}: {walked:?}");
    }
}

/// A DETACH that holds its lock, then commits while a command's gate waits to read the leaf's
/// bound: PostgreSQL fails the read with an internal error, which is transient (not the
/// command's fault, never a dead letter); the next attempt finds the leaf detached and its keys
/// `already_absent`.
#[tokio::test]
async fn a_detach_committed_while_a_command_waits_for_its_leaf_is_tried_again() {
    let app = spawn("[consume]\nlock_timeout = \"30s\"\n", 3).await;
    seed(&app.pool, 5, 3).await;
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    let mut detacher = PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("begin").execute(&mut detacher).await.unwrap();
    sqlx::query("alter table demo.events detach partition demo.events_2026_01")
        .execute(&mut detacher)
        .await
        .unwrap();
    let state = app.state.clone();
    let worker = tokio::spawn(async move { run_one_command(&state).await });
    for _ in 0..400 {
        let waiting: bool = sqlx::query_scalar(
            "select exists (select 1 from pg_stat_activity
                             where datname = current_database() and wait_event_type = 'Lock'
                               and query like 'select c.state, c.item_keys%')",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap();
        if waiting {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    sqlx::query("commit").execute(&mut detacher).await.unwrap();
    let _ = worker.await.unwrap();
    let (state, class): (String, Option<String>) = sqlx::query_as(
        "select state, last_error_class from sweeper.commands where run_id = $1 and batch_no = 0",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), class.as_deref()),
        ("pending", Some("transient"))
    );
    crate::kit::ledger::advance_clock(&app.pool, 600).await;
    drain(&app).await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["already_absent"], 5, "{run}");
    assert_eq!(run["deleted"], 10, "{run}");
}
