//! The partition sweep, part 2 (issue 36): an expired partition with a few held rows is retired
//! whole all the same — its held rows carved out into a new partition of the same range that
//! takes its place, name and properties — and what happens around the swap: a held row the
//! application updates while the swap waits keeps its update; a row put on hold between planning
//! and the swap, or after the swap and before the drop, is carried over; a partition whose copy
//! would lose something of its own is swept row by row instead.

use sqlx::PgPool;

use crate::common::*;
use crate::partition_sweep::{
    assert_verified_export, count, export_dir, read_export, spawn, spawn_with, states,
};

/// A role the carve-out tests grant to (roles are the cluster's: made once, kept).
const READER: &str = "carve_out_reader";

async fn make_reader(pool: &PgPool) {
    sqlx::raw_sql(&format!(
        "do $$ begin create role {READER}; exception when duplicate_object then null; end $$"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// Blocks the export of March's retirement by `run_id`: a directory stands where its partial
/// file goes, so the drop fails after the swap. Remove the returned path to unblock it.
fn block_march_export(dir: &std::path::Path, run_id: &str) -> std::path::PathBuf {
    let blocker = dir.join(format!(
        "sweeper-partition-events-{}-demo.events_2026_03.jsonl.gz.partial",
        run_id.replace(':', "_")
    ));
    std::fs::create_dir_all(&blocker).unwrap();
    blocker
}

/// Waits until `run_id` has carved March and its drop is failing; returns the run.
async fn wait_march_carved_and_failing(app: &TestApp, run_id: &str) -> serde_json::Value {
    app.api
        .wait_run(run_id, "March carved, its drop failing", |r| {
            r["partitions"].as_array().is_some_and(|ps| {
                ps.iter().any(|p| {
                    p["partition"] == "demo.events_2026_03"
                        && p["state"] == "carved"
                        && p["last_error"].is_string()
                })
            })
        })
        .await
}

/// The entry of `partition` in a run's `partitions`.
fn partition_of<'a>(run: &'a serde_json::Value, partition: &str) -> &'a serde_json::Value {
    run["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["partition"] == partition)
        .unwrap()
}

/// March's entry in a run's `partitions`.
fn march_of(run: &serde_json::Value) -> &serde_json::Value {
    partition_of(run, "demo.events_2026_03")
}

/// Asserts that `run` kept `partition` (swept it row by row), for a reason that says `because`.
fn assert_kept(run: &serde_json::Value, partition: &str, because: &str) {
    let entry = partition_of(run, partition);
    assert_eq!(entry["state"], "kept", "{run}");
    let reason = entry["reason"].as_str().unwrap_or_default();
    assert!(reason.contains(because), "{run}");
}

/// Triggers a run of `events` and drains it to its end; returns the run, completed.
async fn swept_to_the_end(app: &TestApp) -> serde_json::Value {
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    crate::partition_sweep::drain(app).await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    run
}

/// The test app with March the only expired month, beside a default partition (the swap first
/// proves the default holds none of March's range), under `lock_timeout` (the swap's). An open
/// transaction on any partition holds a lock on the parent (its partition constraint is read
/// through it) that every detach waits for: with March alone, a test's open transaction on
/// March meets March's swap first.
async fn march_alone_beside_a_default(dir: &std::path::Path, lock_timeout: &str) -> TestApp {
    let app = crate::partition_sweep::spawn_configured(
        dir,
        "",
        &format!("[database]\nlock_timeout = \"{lock_timeout}\"\n"),
    )
    .await;
    sqlx::raw_sql(
        "create table demo.events_default partition of demo.events default;
         drop table demo.events_2026_01, demo.events_2026_02, demo.events_2026_04,
                    demo.events_2026_05;",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    app
}

/// Updates a row of March in a transaction left open, triggers a run and waits until March's
/// swap failed on that row's lock (after its CHECK was added to the default partition); returns
/// the open transaction and the run.
async fn swap_failing_on_a_locked_row(
    app: &TestApp,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, String) {
    let mut app_tx = app.pool.begin().await.unwrap();
    sqlx::query("update demo.events_2026_03 set payload = 'y' where id = 5")
        .execute(&mut *app_tx)
        .await
        .unwrap();
    let run_id = app.api.trigger_new("events", "").await;
    app.api
        .wait_run(&run_id, "its swap failing", |r| {
            r["partitions"].as_array().is_some_and(|ps| {
                ps.iter()
                    .any(|p| p["partition"] == "demo.events_2026_03" && p["last_error"].is_string())
            })
        })
        .await;
    (app_tx, run_id)
}

/// What a partition has beyond its rows, read from the catalog by name.
async fn properties(pool: &PgPool, table: &str) -> serde_json::Value {
    sqlx::query_scalar(
        "select jsonb_build_object(
                'owner', pg_get_userbyid(c.relowner),
                'acl', c.relacl::text,
                'column_acl', (select jsonb_object_agg(attname, attacl::text) from pg_attribute
                                where attrelid = c.oid and attacl is not null),
                'rls', c.relrowsecurity, 'force_rls', c.relforcerowsecurity,
                'policies', (select jsonb_agg(jsonb_build_array(policyname, permissive, roles::text,
                                                                cmd, qual, with_check)
                                              order by policyname)
                               from pg_policies where schemaname = 'demo' and tablename = $2),
                'replica_identity', c.relreplident,
                'replica_index', (select ic.relname from pg_index i join pg_class ic
                                    on ic.oid = i.indexrelid
                                   where i.indrelid = c.oid and i.indisreplident),
                'indexes', (select jsonb_agg(indexname order by indexname) from pg_indexes
                             where schemaname = 'demo' and tablename = $2),
                'options', c.reloptions::text,
                'comment', obj_description(c.oid, 'pg_class'),
                'statistics', (select jsonb_object_agg(attname, attstattarget) from pg_attribute
                                where attrelid = c.oid and attnum > 0 and attstattarget >= 0),
                'publications', (select jsonb_agg(jsonb_build_array(pubname, rowfilter)
                                                  order by pubname)
                                   from pg_publication_tables
                                  where schemaname = 'demo' and tablename = $2),
                'attached', c.relispartition)
           from pg_class c where c.oid = to_regclass($1)",
    )
    .bind(format!("demo.{table}"))
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// March holds event 1000 under a legal hold and has, besides its rows, an owner other than the
/// parent's, grants on the table and on a column, row-level security forced with a policy, a replica identity on an index of its
/// own, storage options, a comment, a statistics target and a publication with a row filter. The
/// run drops it all the same: the new March has every one of them, under the same names, and the
/// held event; the old table is gone; the export holds March's 40 other keys.
#[tokio::test]
async fn a_carved_partition_is_replaced_by_one_with_everything_it_had() {
    let dir = export_dir();
    let app = spawn(&dir).await;
    make_reader(&app.pool).await;
    sqlx::raw_sql(&format!(
        "grant select on demo.events_2026_03 to {READER};
         grant update (payload) on demo.events_2026_03 to {READER};
         alter table demo.events_2026_03 enable row level security;
         alter table demo.events_2026_03 force row level security;
         create policy only_plain on demo.events_2026_03 as restrictive for select to {READER}
             using (payload <> 'secret');
         create unique index events_2026_03_by_time on demo.events_2026_03 (created_at, id);
         alter table demo.events_2026_03 replica identity using index events_2026_03_by_time;
         alter table demo.events_2026_03 set (fillfactor = 70, autovacuum_enabled = false);
         comment on table demo.events_2026_03 is 'March, kept for the audit';
         alter table demo.events_2026_03 alter column payload set statistics 500;
         create publication march_feed for table demo.events_2026_03 where (payload <> 'secret');
         alter table demo.events_2026_03 owner to {READER};"
    ))
    .execute(&app.pool)
    .await
    .unwrap();
    let before = properties(&app.pool, "events_2026_03").await;
    let held_before: (i64, String) =
        sqlx::query_as("select id, payload from demo.events where id = 1000")
            .fetch_one(&app.pool)
            .await
            .unwrap();

    let run_id = app.api.trigger_new("events", "").await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 200, "{run}");
    let march = &run["partitions"][2];
    assert_eq!(march["partition"], "demo.events_2026_03", "{run}");
    assert_eq!(march["state"], "dropped", "{run}");
    assert_eq!(march["rows"], 40, "{run}");
    assert_eq!(march["carried_rows"], 1, "{run}");
    assert_verified_export(march, &run_id);
    let exported: Vec<String> = read_export(march["export_location"].as_str().unwrap())
        .iter()
        .map(|l| l["item_key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(exported.len(), 40);
    assert!(!exported.iter().any(|k| k.starts_with(r#"["1000","#)));

    // The held event's history: live in the new March, and the manifest of the old one says
    // its carried rows are not in the export.
    let h = app
        .get_json(&format!(
            "/policies/events/items/{}",
            percent_encoding::utf8_percent_encode(
                r#"["1000","2026-03-20T00:00:00Z"]"#,
                percent_encoding::NON_ALPHANUMERIC
            )
        ))
        .await;
    let m = &h["dropped_partitions"][0];
    assert_eq!(m["carried_rows"], 1, "{h}");
    assert!(
        m["membership"]
            .as_str()
            .unwrap()
            .contains("a carried row is not in it, and is live"),
        "{h}"
    );
    let after = properties(&app.pool, "events_2026_03").await;
    assert_eq!(after, before, "the new March has what the old one had");
    assert_eq!(after["attached"], true);
    assert!(after["acl"].as_str().unwrap().contains(READER), "{after}");
    assert_eq!(after["replica_index"], "events_2026_03_by_time", "{after}");
    assert_eq!(
        sqlx::query_as::<_, (i64, String)>("select id, payload from demo.events where id = 1000")
            .fetch_one(&app.pool)
            .await
            .unwrap(),
        held_before
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_03").await,
        1
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_class where relname like 'sweeper\\_%'"
        )
        .await,
        0,
        "neither the old table nor a constraint or index of the swap's is left"
    );
    // A later run finds March all held: swept row by row, nothing carved again.
    set_clock(&app.pool, at("2026-10-01T02:01:00Z")).await;
    let second = app.api.trigger_new("events", "").await;
    let run = app.wait_terminal(&second).await;
    let march = march_of(&run);
    assert_eq!(march["state"], "kept", "{run}");
    assert!(
        march["reason"]
            .as_str()
            .unwrap()
            .starts_with("all of its 1 rows are kept"),
        "{run}"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from demo.events where id = 1000"
        )
        .await,
        1
    );
}

/// The application updates March's held event in a transaction that stays open while the swap
/// waits for its lock: once it commits, the swap copies the row as updated. The table has a
/// default partition: the CHECK the swap adds to it is gone afterwards.
#[tokio::test]
async fn a_held_row_updated_while_the_swap_waits_keeps_its_update() {
    let dir = export_dir();
    // The pool's lock_timeout is the swap's: long enough for the test to commit in it.
    let app = march_alone_beside_a_default(&dir, "30s").await;
    let mut app_tx = app.pool.begin().await.unwrap();
    sqlx::query(
        "update demo.events_2026_03 set payload = 'updated while the swap waits' where id = 1000",
    )
    .execute(&mut *app_tx)
    .await
    .unwrap();
    let run_id = app.api.trigger_new("events", "").await;
    let waiting = "select count(*) from pg_locks
                    where relation = 'demo.events_2026_03'::regclass and not granted
                      and mode = 'ShareRowExclusiveLock'";
    let started = std::time::Instant::now();
    while count(&app.pool, waiting).await == 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the swap never waited for the application's lock"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    app_tx.commit().await.unwrap();
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(states(&run), [("demo.events_2026_03", "dropped")], "{run}");
    let payload: String =
        sqlx::query_scalar("select payload from demo.events_2026_03 where id = 1000")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(payload, "updated while the swap waits");
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_constraint where conname like 'sweeper\\_%'"
        )
        .await,
        0
    );
}

/// March also has events 3001 and 3002. The guard holds the run after planning; event 3001 goes
/// on hold meanwhile: the swap carries it over with event 1000. The export directory is blocked so
/// the drop fails after the swap; event 3002 — now only in the detached table — goes on hold: the
/// drop's retry carries it over too. None of the three is in the export; March's 40 others are.
#[tokio::test]
async fn rows_held_since_planning_or_since_the_swap_are_carried_over() {
    let dir = export_dir();
    let app = spawn_with(&dir, "guard = { max_items = 30 }\n").await;
    sqlx::query(
        "insert into demo.events values (3001, '2026-03-21', 'x'), (3002, '2026-03-22', 'x')",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let run_id = app.api.trigger_new("events", "").await;
    app.api
        .wait_run(&run_id, "held for approval", |r| {
            r["approval"]["state"] == "required"
        })
        .await;
    sqlx::query("insert into legal.event_holds values (3001, null)")
        .execute(&app.pool)
        .await
        .unwrap();
    // The drop's export cannot be created: a directory stands where its partial file goes.
    let blocker = block_march_export(&dir, &run_id);
    app.api
        .expect(
            200,
            reqwest::Method::POST,
            &format!("/runs/{run_id}/approve"),
            Some(serde_json::json!({"reason": "old months"})),
        )
        .await;
    let run = wait_march_carved_and_failing(&app, &run_id).await;
    let march = march_of(&run).clone();
    assert_eq!(march["carried_rows"], 2, "events 1000 and 3001: {run}");
    assert_eq!(march["held_rows"], 1, "event 1000 at planning: {run}");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_03").await,
        2
    );
    // Event 3002 is held now, while March's old rows wait detached.
    sqlx::query("insert into legal.event_holds values (3002, null)")
        .execute(&app.pool)
        .await
        .unwrap();
    std::fs::remove_dir(&blocker).unwrap();
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let march = march_of(&run);
    assert_eq!(march["state"], "dropped", "{run}");
    assert_eq!(march["carried_rows"], 3, "{run}");
    assert_eq!(march["rows"], 40, "{run}");
    assert_verified_export(march, &run_id);
    let exported: Vec<String> = read_export(march["export_location"].as_str().unwrap())
        .iter()
        .map(|l| l["item_key"].as_str().unwrap().to_string())
        .collect();
    for id in ["3001", "3002", "1000"] {
        assert!(
            !exported
                .iter()
                .any(|k| k.starts_with(&format!("[\"{id}\","))),
            "event {id} is not in the export"
        );
    }
    let live: Vec<i64> = sqlx::query_scalar("select id from demo.events_2026_03 order by id")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(live, [1000, 3001, 3002]);
    // January, February, April and May whole (160), and March's 40.
    assert_eq!(run["deleted"], 200, "{run}");
    assert_eq!(run["eligible_planned"], 200, "{run}");
    assert_eq!(run["remaining_eligible"], 0, "{run}");
}

/// March with a trigger of its own (not its parent's): a copy would not carry it, so March is
/// swept row by row with the reason; the held event stays and the others are deleted one by one.
#[tokio::test]
async fn a_partition_a_copy_would_change_is_swept_row_by_row() {
    let dir = export_dir();
    let app = spawn(&dir).await;
    sqlx::raw_sql(
        "create function demo.noop() returns trigger language plpgsql as
             $$ begin return old; end $$;
         create trigger march_only before delete on demo.events_2026_03
             for each row execute function demo.noop();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let run = swept_to_the_end(&app).await;
    let march = &run["partitions"][2];
    assert_eq!(march["state"], "kept", "{run}");
    assert!(
        march["reason"]
            .as_str()
            .unwrap()
            .contains("a trigger of its own"),
        "{run}"
    );
    assert_eq!(run["deleted"], 200, "{run}");
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from sweeper.audit_trail where outcome = 'deleted'"
        )
        .await,
        40,
        "March's rows are deleted row by row, each audited"
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_03").await,
        1
    );
}

/// The parent's trigger, cloned onto every partition, is disabled on March alone: a new partition
/// would get the clone enabled, as the parent has it, so March is swept row by row with the
/// reason, its trigger still disabled.
#[tokio::test]
async fn a_partition_with_a_cloned_trigger_disabled_is_swept_row_by_row() {
    let dir = export_dir();
    let app = spawn(&dir).await;
    sqlx::raw_sql(
        "create function demo.noop() returns trigger language plpgsql as
             $$ begin return old; end $$;
         create trigger on_delete before delete on demo.events
             for each row execute function demo.noop();
         alter table demo.events_2026_03 disable trigger on_delete;",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let run = swept_to_the_end(&app).await;
    assert_kept(
        &run,
        "demo.events_2026_03",
        "enabled or disabled differently",
    );
    assert_eq!(run["deleted"], 200, "{run}");
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_trigger
              where tgrelid = 'demo.events_2026_03'::regclass and tgenabled = 'D'"
        )
        .await,
        1
    );
}

/// `demo.events` with an identity column `GENERATED ALWAYS` (the parent's own: its partitions
/// have none) and a stored generated column.
const WITH_IDENTITY: &str = "
create schema demo;
create schema legal;
create table demo.events (
    id bigint not null,
    created_at timestamptz not null,
    payload text,
    seq bigint generated always as identity,
    shout text generated always as (upper(payload)) stored,
    primary key (id, created_at)
) partition by range (created_at);
create index on demo.events (created_at);
create table legal.event_holds (
    event_id bigint not null,
    released_at timestamptz
);
create index on legal.event_holds (event_id);
";

/// The parent has an identity column `GENERATED ALWAYS` and a generated one. Event 3002 goes on
/// hold after the swap, while the drop fails: its carry-over writes through the parent, keeping
/// its identity value (the generated column computed again), and the drop's retry completes.
#[tokio::test]
async fn a_row_carried_over_through_a_parent_with_an_identity_keeps_its_values() {
    let dir = export_dir();
    let app = TestApp::spawn(Spawn {
        setup_sql: WITH_IDENTITY,
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: format!(
            "{}partitions = \"drop\"\n",
            crate::partitioned::PARTITIONED_POLICY
        ),
        extra_toml: format!("[ledger]\naudit_export_dir = \"{}\"\n", dir.display()),
        workers: 0,
    })
    .await;
    crate::partitioned::make_months(&app.pool, 10).await;
    sqlx::raw_sql(
        "insert into demo.events (id, created_at, payload)
         select i, timestamptz '2026-01-15' + make_interval(months => m), 'x'
           from generate_series(1, 40) i, generate_series(0, 8) m;
         insert into demo.events (id, created_at, payload)
         values (1000, '2026-03-20', 'held'), (3002, '2026-03-22', 'later');
         insert into legal.event_holds values (1000, null);",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let held = "select id, seq, shout from demo.events where id in (1000, 3002) order by id";
    let before: Vec<(i64, i64, String)> = sqlx::query_as(held).fetch_all(&app.pool).await.unwrap();
    // Blocked before the trigger: the run's id is its window's.
    let run_id = "events:2026-09-01T02:00:00Z";
    let blocker = block_march_export(&dir, run_id);
    assert_eq!(app.api.trigger_new("events", "").await, run_id);
    wait_march_carved_and_failing(&app, run_id).await;
    sqlx::query("insert into legal.event_holds values (3002, null)")
        .execute(&app.pool)
        .await
        .unwrap();
    std::fs::remove_dir(&blocker).unwrap();
    let run = app.wait_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let march = &run["partitions"][2];
    assert_eq!(march["state"], "dropped", "{run}");
    assert_eq!(march["carried_rows"], 2, "{run}");
    assert_eq!(march["rows"], 40, "{run}");
    assert_verified_export(march, run_id);
    let after: Vec<(i64, i64, String)> = sqlx::query_as(held).fetch_all(&app.pool).await.unwrap();
    assert_eq!(after, before);
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_03").await,
        2
    );
}

/// March also has a row without a key an item key names (a NULL id): the swap carries it with
/// event 1000, and it is not exported. With a grace, the old table holds the manifest's 40 rows
/// and both carried ones: it is dropped once the grace has passed, not kept as changed.
#[tokio::test]
async fn with_a_grace_a_table_whose_row_without_a_key_was_carried_is_dropped() {
    let dir = export_dir();
    let app = spawn_with(&dir, "drop_grace = \"1h\"\n").await;
    sqlx::raw_sql(
        "alter table demo.events drop constraint events_pkey;
         alter table demo.events alter column id drop not null;
         create unique index events_key on demo.events (id, created_at);
         insert into demo.events values (null, '2026-03-21', 'no key');",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    crate::partition_sweep::drain(&app).await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let march = &run["partitions"][2];
    assert_eq!(march["partition"], "demo.events_2026_03", "{run}");
    assert_eq!(march["state"], "awaiting_drop", "{run}");
    assert_eq!(march["rows"], 40, "{run}");
    assert_eq!(march["carried_rows"], 2, "{run}");
    assert_verified_export(march, &run_id);
    set_clock(&app.pool, at("2026-09-01T03:05:00Z")).await;
    let run = app
        .api
        .wait_run(&run_id, "past its grace", |r| {
            r["partitions"]
                .as_array()
                .is_some_and(|ps| ps.iter().all(|p| p["state"] != "awaiting_drop"))
        })
        .await;
    assert_eq!(run["partitions"][2]["state"], "dropped", "{run}");
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_class where relname like 'sweeper\\_%'"
        )
        .await,
        0
    );
    let live: Vec<Option<i64>> =
        sqlx::query_scalar("select id from demo.events_2026_03 order by id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(live, [Some(1000), None]);
}

/// Beside a default partition, the swap's first try fails (an application transaction holds
/// March's lock past the lock timeout) after the default got its `CHECK` excluding March's range;
/// March gets a trigger of its own meanwhile, so the retry refuses the carve-out and keeps March.
/// The `CHECK` goes too: once March is dropped by hand, a row of its range lands in the default.
#[tokio::test]
async fn a_carve_out_given_up_leaves_no_check_on_the_default_partition() {
    let dir = export_dir();
    let app = march_alone_beside_a_default(&dir, "1s").await;
    sqlx::raw_sql(
        "create function demo.noop() returns trigger language plpgsql as
             $$ begin return new; end $$;",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (mut app_tx, run_id) = swap_failing_on_a_locked_row(&app).await;
    let checks = "select count(*) from pg_constraint where conname like 'sweeper\\_%'";
    assert_eq!(count(&app.pool, checks).await, 1);
    sqlx::query(
        "create trigger own before insert on demo.events_2026_03
             for each row execute function demo.noop()",
    )
    .execute(&mut *app_tx)
    .await
    .unwrap();
    app_tx.commit().await.unwrap();
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(states(&run), [("demo.events_2026_03", "kept")], "{run}");
    assert_eq!(count(&app.pool, checks).await, 0);
    sqlx::raw_sql(
        "drop table demo.events_2026_03;
         insert into demo.events values (4000, '2026-03-25', 'late');",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_default").await,
        1
    );
}

/// Runs `ddl` on March in a transaction, triggers a run, waits until March's swap waits for the
/// lock that transaction holds (the swap's own `SHARE ROW EXCLUSIVE` one), and commits it: what
/// `ddl` did was committed after the carve-out last looked at March and before its swap was
/// granted the lock. Returns the run.
async fn commit_while_the_swap_waits(app: &TestApp, ddl: &str) -> String {
    commit_while_the_swap_waits_for(app, ddl, "ShareRowExclusiveLock").await
}

/// [`commit_while_the_swap_waits`], the swap waiting for March in lock mode `mode`.
async fn commit_while_the_swap_waits_for(app: &TestApp, ddl: &str, mode: &str) -> String {
    let mut app_tx = app.pool.begin().await.unwrap();
    sqlx::query(ddl).execute(&mut *app_tx).await.unwrap();
    let run_id = app.api.trigger_new("events", "").await;
    let waiting = format!(
        "select count(*) from pg_locks
          where relation = 'demo.events_2026_03'::regclass and not granted and mode = '{mode}'"
    );
    let started = std::time::Instant::now();
    while count(&app.pool, &waiting).await == 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the swap never waited for the lock of `{ddl}`"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    app_tx.commit().await.unwrap();
    run_id
}

/// A view reading March is created while the swap holds March against writes (a view needs only
/// `ACCESS SHARE`) and commits while the swap's detach waits for it: the swap, asking again once
/// the detach holds March, keeps March as it is rather than leave the view reading the old table.
#[tokio::test]
async fn a_view_created_while_the_swap_copies_keeps_the_partition() {
    let dir = export_dir();
    let app = march_alone_beside_a_default(&dir, "30s").await;
    let run_id = commit_while_the_swap_waits_for(
        &app,
        "create view demo.march as select * from demo.events_2026_03",
        "AccessExclusiveLock",
    )
    .await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(states(&run), [("demo.events_2026_03", "kept")], "{run}");
    let reason = march_of(&run)["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("a view or a function reads it"), "{run}");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.march").await,
        count(&app.pool, "select count(*) from demo.events_2026_03").await,
        "the view still reads the partition"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_class where relname like 'sweeper\\_%'"
        )
        .await,
        0
    );
}

/// A view reading March alone, there before the run: planning sweeps March row by row, with the
/// reason; the view still reads it.
#[tokio::test]
async fn a_partition_a_view_reads_is_swept_row_by_row() {
    let dir = export_dir();
    let app = spawn(&dir).await;
    sqlx::raw_sql("create view demo.march as select * from demo.events_2026_03")
        .execute(&app.pool)
        .await
        .unwrap();
    let run = swept_to_the_end(&app).await;
    assert_kept(&run, "demo.events_2026_03", "a view or a function reads it");
    assert_eq!(run["deleted"], 200, "{run}");
    assert_eq!(count(&app.pool, "select count(*) from demo.march").await, 1);
}

/// A view reading January, whose rows are all expired and none held: January is not dropped
/// under it (its drop would fail) but swept row by row, with the reason.
#[tokio::test]
async fn a_partition_a_view_reads_is_not_dropped() {
    let dir = export_dir();
    let app = spawn(&dir).await;
    sqlx::raw_sql("create view demo.january as select * from demo.events_2026_01")
        .execute(&app.pool)
        .await
        .unwrap();
    let run = swept_to_the_end(&app).await;
    assert_kept(&run, "demo.events_2026_01", "a view or a function reads it");
    assert_eq!(run["deleted"], 200, "{run}");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.january").await,
        0
    );
}

/// A view reading January is created after planning (the guard holds the run for approval):
/// January is detached, then found read by the view before its drop, and attached again, kept
/// with the reason; the view still reads it, and nothing of it was dropped.
#[tokio::test]
async fn a_partition_a_view_reads_since_planning_is_attached_again() {
    let dir = export_dir();
    let app = spawn_with(&dir, "guard = { max_items = 30 }\n").await;
    let january = count(&app.pool, "select count(*) from demo.events_2026_01").await;
    let run_id = app.api.trigger_new("events", "").await;
    app.api
        .wait_run(&run_id, "held for approval", |r| {
            r["approval"]["state"] == "required"
        })
        .await;
    sqlx::raw_sql("create view demo.january as select * from demo.events_2026_01")
        .execute(&app.pool)
        .await
        .unwrap();
    app.api
        .expect(
            200,
            reqwest::Method::POST,
            &format!("/runs/{run_id}/approve"),
            Some(serde_json::json!({"reason": "old months"})),
        )
        .await;
    let run = app.wait_terminal(&run_id).await;
    assert_kept(
        &run,
        "demo.events_2026_01",
        "a view or a function reads it by name since planning",
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.january").await,
        january
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_inherits
              where inhrelid = 'demo.events_2026_01'::regclass
                and inhparent = 'demo.events'::regclass"
        )
        .await,
        1,
        "January is a partition of the table again"
    );
}

/// A storage option set on March while the swap waits is the one its new table gets: the swap
/// makes the copy from March as it reads it under its lock.
#[tokio::test]
async fn a_setting_changed_while_the_swap_waits_is_the_copys() {
    let dir = export_dir();
    let app = march_alone_beside_a_default(&dir, "30s").await;
    let run_id = commit_while_the_swap_waits(
        &app,
        "alter table demo.events_2026_03 set (fillfactor = 70)",
    )
    .await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(states(&run), [("demo.events_2026_03", "dropped")], "{run}");
    let options: Vec<String> = sqlx::query_scalar(
        "select coalesce(reloptions, '{}') from pg_class
          where oid = 'demo.events_2026_03'::regclass",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(options, ["fillfactor=70"]);
}

/// A trigger of March's own is created in a transaction that is still open when the carve-out
/// looks at March (so it sees none) and commits while the swap waits for March's lock: the swap,
/// judging March again under its lock, finds the trigger and keeps March as it is, trigger and
/// rows, rather than swap in a copy without it. The CHECK it added to the default partition is
/// gone.
#[tokio::test]
async fn a_trigger_created_while_the_swap_waits_keeps_the_partition() {
    let dir = export_dir();
    let app = march_alone_beside_a_default(&dir, "30s").await;
    sqlx::raw_sql(
        "create function demo.noop() returns trigger language plpgsql as
             $$ begin return old; end $$;",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let march_rows = "select count(*) from demo.events_2026_03";
    let before = count(&app.pool, march_rows).await;
    let run_id = commit_while_the_swap_waits(
        &app,
        "create trigger march_only before delete on demo.events_2026_03
             for each row execute function demo.noop()",
    )
    .await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(states(&run), [("demo.events_2026_03", "kept")], "{run}");
    let reason = march_of(&run)["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("a trigger of its own"), "{run}");
    assert_eq!(count(&app.pool, march_rows).await, before);
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_trigger
              where tgrelid = 'demo.events_2026_03'::regclass and tgname = 'march_only'"
        )
        .await,
        1,
        "March is the table it was, with its trigger"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_class where relname like 'sweeper\\_%'"
        )
        .await,
        0,
        "no new partition was made, none detached"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_constraint where conname like 'sweeper\\_%'"
        )
        .await,
        0
    );
}

/// While a carve-out's old table waits for its drop (here its export is blocked), a later run
/// does not retire the new partition of that name (the drop may still carry rows into it): it
/// is swept row by row, the reason naming the run. Once unblocked, the drop finishes.
#[tokio::test]
async fn a_partition_whose_carve_out_is_not_finished_is_not_retired_again() {
    let dir = export_dir();
    let app = spawn(&dir).await;
    let run_id = "events:2026-09-01T02:00:00Z";
    let blocker = block_march_export(&dir, run_id);
    assert_eq!(app.api.trigger_new("events", "").await, run_id);
    wait_march_carved_and_failing(&app, run_id).await;
    let (_, later) = crate::partition_sweep::run_to_end(&app, "?dry_run=true").await;
    let march = march_of(&later);
    assert_eq!(march["state"], "kept", "{later}");
    assert!(
        march["reason"]
            .as_str()
            .unwrap()
            .contains(&format!("run {run_id} carved its held rows out")),
        "{later}"
    );
    std::fs::remove_dir(&blocker).unwrap();
    let run = app.wait_terminal(run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_03").await,
        1
    );
}

/// Beside a default partition, March's swap keeps failing on a lock (an application transaction
/// holds it) after the default got its `CHECK` excluding March's range, and the run is cancelled
/// meanwhile: the carve-out has begun, so it is finished like a detach begun — March carved and
/// its old table dropped — and the `CHECK` does not stay on the default partition.
#[tokio::test]
async fn a_run_cancelled_once_its_carve_out_began_leaves_no_check_on_the_default_partition() {
    let dir = export_dir();
    let app = march_alone_beside_a_default(&dir, "1s").await;
    let (app_tx, run_id) = swap_failing_on_a_locked_row(&app).await;
    let checks = "select count(*) from pg_constraint where conname like 'sweeper\\_%'";
    assert_eq!(count(&app.pool, checks).await, 1);
    app.api
        .expect(
            200,
            reqwest::Method::POST,
            &format!("/runs/{run_id}/cancel"),
            Some(serde_json::json!({"reason": "not today"})),
        )
        .await;
    app_tx.commit().await.unwrap();
    let retirement = "select state from sweeper.partition_retirements where run_id = $1";
    let mut state = String::new();
    for _ in 0..150 {
        state = sqlx::query_scalar(retirement)
            .bind(&run_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
        if state == "dropped" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert_eq!(state, "dropped");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_03").await,
        1,
        "the held event, carved out"
    );
    assert_eq!(count(&app.pool, checks).await, 0);
    sqlx::raw_sql(
        "drop table demo.events_2026_03;
         insert into demo.events values (4000, '2026-03-25', 'late');",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_default").await,
        1
    );
}
