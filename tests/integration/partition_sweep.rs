//! The partition sweep, part 1 (issue 35): a policy with `partitions = "drop"` retires each expired
//! partition of a monthly-partitioned target whose rows are all eligible — detached, its keys
//! exported and verified, a manifest in the audit, dropped — and sweeps the others row by row: one
//! with a held row, the one straddling the cutoff. A dry run reports what it would drop; a
//! dropped key's history names the manifest; `check-config` refuses the shapes a drop would hurt.

use sha2::{Digest, Sha256};
use sqlx::PgPool;
use sweeper::app::worker::{WorkerStep, run_one_command};

use crate::common::*;
use crate::partitioned::{PARTITIONED, PARTITIONED_POLICY, make_months};

pub(crate) fn export_dir() -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("sweeper-partition-export-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Monthly `demo.events` from January 2026, 40 events on the 15th of each of the first 9
/// months, and event 1000 in March under a legal hold; the policy drops partitions.
pub(crate) async fn spawn(dir: &std::path::Path) -> TestApp {
    spawn_with(dir, "").await
}

/// [`spawn`], with `policy_extra` added to the policy.
pub(crate) async fn spawn_with(dir: &std::path::Path, policy_extra: &str) -> TestApp {
    spawn_configured(dir, policy_extra, "").await
}

/// [`spawn`], with `policy_extra` added to the policy and `toml` to the configuration.
pub(crate) async fn spawn_configured(
    dir: &std::path::Path,
    policy_extra: &str,
    toml: &str,
) -> TestApp {
    let app = TestApp::spawn(Spawn {
        setup_sql: PARTITIONED,
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: format!("{PARTITIONED_POLICY}partitions = \"drop\"\n{policy_extra}"),
        extra_toml: format!("{toml}[ledger]\naudit_export_dir = \"{}\"\n", dir.display()),
        workers: 0,
    })
    .await;
    make_months(&app.pool, 10).await;
    sqlx::raw_sql(
        "insert into demo.events (id, created_at, payload)
         select i, timestamptz '2026-01-15' + make_interval(months => m), 'x'
           from generate_series(1, 40) i, generate_series(0, 8) m;
         insert into demo.events values (1000, '2026-03-20', 'held');
         insert into legal.event_holds values (1000, null);",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    app
}

pub(crate) async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

pub(crate) async fn drain(app: &TestApp) {
    while let WorkerStep::Ran(_) = run_one_command(&app.state).await.unwrap() {}
}

/// Triggers a run of `events` (`query`: the trigger's query string), plans it, executes its
/// commands and waits until it is terminal; returns its id and `GET /runs/{id}`.
pub(crate) async fn run_to_end(app: &TestApp, query: &str) -> (String, serde_json::Value) {
    let run_id = app.api.trigger_new("events", query).await;
    app.wait_planned(&run_id).await;
    drain(app).await;
    let run = app.wait_terminal(&run_id).await;
    (run_id, run)
}

/// A run's partitions as `(partition, state)`, in the order `GET /runs/{id}` lists them.
pub(crate) fn states(run: &serde_json::Value) -> Vec<(&str, &str)> {
    run["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["partition"].as_str().unwrap(),
                p["state"].as_str().unwrap(),
            )
        })
        .collect()
}

pub(crate) fn read_export(path: &str) -> Vec<serde_json::Value> {
    use std::io::BufRead;
    let gz = flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap());
    std::io::BufReader::new(gz)
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect()
}

/// Checks a dropped partition's export against `GET /runs/{id}`'s entry `p`: the file's SHA-256,
/// one line per row naming the policy, run and partition, the keys in bytewise order, and the
/// digest of those keys, each followed by a newline.
pub(crate) fn assert_verified_export(p: &serde_json::Value, run_id: &str) {
    let location = p["export_location"].as_str().unwrap();
    let bytes = std::fs::read(location).unwrap();
    assert_eq!(
        hex::encode(Sha256::digest(&bytes)),
        p["export_sha256"],
        "{p}"
    );
    let lines = read_export(location);
    assert_eq!(lines.len() as u64, p["rows"].as_u64().unwrap(), "{p}");
    let mut keys: Vec<String> = lines
        .iter()
        .map(|l| {
            assert_eq!(l["policy"], "events");
            assert_eq!(l["run_id"], run_id);
            assert_eq!(l["partition"], p["partition"]);
            l["item_key"].as_str().unwrap().to_string()
        })
        .collect();
    let sorted = {
        let mut k = keys.clone();
        k.sort();
        k
    };
    assert_eq!(keys, sorted, "the export is in bytewise order");
    let mut digest = Sha256::new();
    for k in keys.drain(..) {
        digest.update(k.as_bytes());
        digest.update(b"\n");
    }
    assert_eq!(hex::encode(digest.finalize()), p["digest"], "{p}");
}

#[tokio::test]
async fn expired_partitions_are_exported_recorded_and_dropped_and_a_held_one_is_carved_out() {
    let dir = export_dir();
    let app = spawn(&dir).await;
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    // Every expired month is dropped; March's held event 1000 is carved out first.
    drain(&app).await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    // The cutoff is 2026-06-03T02:00Z: January to May are old, 5 × 40 rows; event 1000 is held.
    assert_eq!(run["deleted"], 200, "{run}");
    assert_eq!(run["eligible_planned"], 200, "{run}");
    assert_eq!(run["remaining_eligible"], 0, "the closure check: {run}");
    let tables: Vec<String> = sqlx::query_scalar(
        "select c.relname::text from pg_inherits i join pg_class c on c.oid = i.inhrelid
          where i.inhparent = 'demo.events'::regclass order by 1",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        tables,
        ["03", "06", "07", "08", "09", "10"]
            .map(|m| format!("events_2026_{m}"))
            .to_vec()
    );
    assert_eq!(
        count(&app.pool, "select count(*) from pg_class where relname in ('events_2026_01', 'events_2026_02', 'events_2026_04', 'events_2026_05')").await,
        0,
        "the retired partitions are dropped, not left detached"
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_03").await,
        1,
        "March keeps its held event only"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_class where relname like 'sweeper_retired_%'"
        )
        .await,
        0,
        "March's old table is dropped"
    );
    let parts = run["partitions"].as_array().unwrap();
    let states = states(&run);
    assert_eq!(
        states,
        [
            ("demo.events_2026_01", "dropped"),
            ("demo.events_2026_02", "dropped"),
            ("demo.events_2026_03", "dropped"),
            ("demo.events_2026_04", "dropped"),
            ("demo.events_2026_05", "dropped"),
        ],
        "{run}"
    );
    // March: its held event counted as the row path counts it, carried over, not exported.
    assert_eq!(run["held_at_planning"]["event_hold"], 1, "{run}");
    assert_eq!(parts[2]["held_rows"], 1, "{run}");
    assert_eq!(parts[2]["carried_rows"], 1, "{run}");
    assert!(
        parts[2]["detached_as"]
            .as_str()
            .unwrap()
            .starts_with("demo.sweeper_retired_"),
        "{run}"
    );
    assert!(
        !read_export(parts[2]["export_location"].as_str().unwrap())
            .iter()
            .any(|l| l["item_key"] == r#"["1000","2026-03-20T00:00:00Z"]"#),
        "the carried key is not in the export"
    );
    // Each dropped partition: a verified export of its 40 keys, and a manifest whose digest is
    // the SHA-256 of the keys sorted bytewise, each followed by a newline.
    for p in parts.iter().filter(|p| p["state"] == "dropped") {
        assert_eq!(p["rows"], 40, "{p}");
        assert_verified_export(p, &run_id);
        let manifest: serde_json::Value =
            sqlx::query_scalar("select detail from sweeper.audit_manifests where manifest_id = $1")
                .bind(p["manifest_id"].as_i64().unwrap())
                .fetch_one(&app.pool)
                .await
                .unwrap();
        assert_eq!(manifest["rows"], 40, "{manifest}");
        assert_eq!(manifest["digest"], p["digest"], "{manifest}");
        assert_eq!(manifest["export_sha256"], p["export_sha256"], "{manifest}");
        assert_eq!(manifest["run_id"], run_id.as_str(), "{manifest}");
        let carried = (p["partition"] == "demo.events_2026_03").then_some(1);
        assert_eq!(manifest["carried_rows"].as_i64(), carried, "{manifest}");
    }
    // Nothing of the dropped partitions is in the item audit.
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from sweeper.audit_trail where outcome = 'deleted'"
        )
        .await,
        0
    );
    // A dropped key's history: the manifest of the partition whose range holds it.
    let key = r#"["7","2026-02-15T00:00:00Z"]"#;
    let h = app
        .get_json(&format!(
            "/policies/events/items/{}",
            percent_encoding::utf8_percent_encode(key, percent_encoding::NON_ALPHANUMERIC)
        ))
        .await;
    let m = &h["dropped_partitions"][0];
    assert_eq!(m["partition"], "demo.events_2026_02", "{h}");
    assert_eq!(m["run_id"], run_id.as_str(), "{h}");
    assert_eq!(m["rows"], 40, "{h}");
    assert_eq!(m["cutoff"], "2026-06-03T02:00:00Z", "{h}");
    assert_eq!(
        m["membership"], "in the range of a dropped partition; verify with the export",
        "{h}"
    );
    assert_eq!(h["dropped_partitions"].as_array().unwrap().len(), 1, "{h}");
}

#[tokio::test]
async fn a_dry_run_reports_the_partitions_it_would_drop_and_drops_nothing() {
    let dir = export_dir();
    let app = spawn(&dir).await;
    let (_, run) = run_to_end(&app, "?dry_run=true").await;
    let states: Vec<(&str, &str, i64)> = run["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["partition"].as_str().unwrap(),
                p["state"].as_str().unwrap(),
                p["rows"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            ("demo.events_2026_01", "would_drop", 40),
            ("demo.events_2026_02", "would_drop", 40),
            ("demo.events_2026_03", "would_drop", 40),
            ("demo.events_2026_04", "would_drop", 40),
            ("demo.events_2026_05", "would_drop", 40),
        ],
        "{run}"
    );
    assert_eq!(run["would_delete"], 200, "{run}");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events").await,
        361
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no export");
}

/// `check-config` on a policy with `partitions = "drop"`: a foreign key into the target, a
/// row-level DELETE trigger and a publication are each refused by name (a drop bypasses the
/// first two and is not replicated); `allow_unreplicated_drop` turns the publication into a
/// warning; a table partitioned otherwise than by range on the timestamp is refused with the
/// reason; the role that drops is said.
#[tokio::test]
async fn check_config_refuses_what_a_drop_would_bypass() {
    use crate::kit::process::{sweeper, write_config};
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(PARTITIONED).execute(&pool).await.unwrap();
    make_months(&pool, 2).await;
    let dir = export_dir();
    let check = |policy: String| {
        let extra = format!("[ledger]\naudit_export_dir = \"{}\"\n", dir.display());
        let path = write_config(&config_toml(&db.url, 0, &extra, &policy));
        let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let drop_policy = format!("{PARTITIONED_POLICY}partitions = \"drop\"\n");
    let (code, text) = check(drop_policy.clone());
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("info: policy[events]: partitions: expired partitions of demo.events are detached and dropped by this role, a member of their owner postgres"),
        "{text}"
    );
    sqlx::raw_sql(
        "create table demo.event_notes (id bigint, created_at timestamptz,
             foreign key (id, created_at) references demo.events);
         create function demo.no_op() returns trigger language plpgsql as 'begin return old; end';
         create trigger keep_history before delete on demo.events
             for each row execute function demo.no_op();
         create publication events_out for table demo.events;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (code, text) = check(drop_policy.clone());
    assert_eq!(code, Some(1), "{text}");
    for expected in [
        "error: policy[events]: partitions: \"drop\" would bypass foreign key event_notes_id_created_at_fkey on demo.event_notes",
        "error: policy[events]: partitions: \"drop\" would bypass trigger keep_history on demo.events",
        "error: policy[events]: partitions: \"drop\" on demo.events, which is in publication events_out",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    sqlx::raw_sql("drop table demo.event_notes; drop trigger keep_history on demo.events;")
        .execute(&pool)
        .await
        .unwrap();
    let (code, text) = check(format!("{drop_policy}allow_unreplicated_drop = true\n"));
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains(
            "warning: policy[events]: partitions: demo.events is in publication events_out"
        ),
        "{text}"
    );
    // Partitioned by list: the bounds say nothing of age.
    sqlx::raw_sql(
        "drop publication events_out;
         create table demo.by_region (id bigint primary key, created_at timestamptz not null,
             region text not null) partition by list (id);
         create table demo.by_region_1 partition of demo.by_region for values in (1);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let listed = drop_policy
        .replace("demo.events", "demo.by_region")
        .replace(r#"key = ["id", "created_at"]"#, r#"key = "id""#);
    let (code, text) = check(listed);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("error: policy[events]: partitions: \"drop\" needs demo.by_region partitioned by range on created_at alone (a partition's bounds then say how old its rows are); it is partitioned by list on id"),
        "{text}"
    );
}

/// `partitions = "drop"` needs an export directory and the default action.
#[test]
fn a_drop_needs_an_export_directory_and_the_delete_action() {
    let config = |extra: &str, policy_extra: &str| {
        sweeper::settings::Config::from_toml(&config_toml(
            "postgres://x/y",
            0,
            extra,
            &format!("{PARTITIONED_POLICY}partitions = \"drop\"\n{policy_extra}"),
        ))
        .map(|_| ())
        .map_err(|e| e.to_string())
    };
    let err = config("", "").unwrap_err();
    assert!(
        err.contains("partitions = \"drop\" needs ledger.audit_export_dir"),
        "{err}"
    );
    let err = config(
        "[ledger]\naudit_export_dir = \"/tmp\"\n",
        "action = { kind = \"http\", dependency = \"payments\", method = \"POST\", path = \"/p/{id}\", then = { set = \"payload\" } }\n",
    )
    .unwrap_err();
    assert!(
        err.contains("partitions: \"drop\" removes rows without calling anything"),
        "{err}"
    );
    config("[ledger]\naudit_export_dir = \"/tmp\"\n", "").unwrap();
    let err = sweeper::settings::Config::from_toml(&config_toml(
        "postgres://x/y",
        0,
        "",
        &format!("{PARTITIONED_POLICY}drop_grace = \"7d\"\n"),
    ))
    .map(|_| ())
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("drop_grace: only means something with partitions = \"drop\""),
        "{err}"
    );
}

/// The tables of the pg_partman test: `demo.events` made empty; pg_partman creates its
/// partitions (and a default one).
const PARTMAN_SETUP: &str = "create schema demo;
create schema legal;
create schema partman;
create extension pg_partman schema partman;
create table demo.events (
    id bigint not null,
    created_at timestamptz not null,
    payload text,
    primary key (id, created_at)
) partition by range (created_at);
create index on demo.events (created_at);
create table legal.event_holds (event_id bigint not null, released_at timestamptz);
create index on legal.event_holds (event_id);
select partman.create_parent(p_parent_table => 'demo.events', p_control => 'created_at',
       p_type => 'native', p_interval => 'monthly', p_premake => 1,
       p_start_partition => '2026-01-01');
insert into demo.events (id, created_at, payload)
select i, timestamptz '2026-01-15' + make_interval(months => m), 'x'
  from generate_series(1, 10) i, generate_series(0, 7) m;
insert into demo.events values (1000, '2026-03-20', 'held');
insert into legal.event_holds values (1000, null);";

/// pg_partman 4.7 (Debian's `postgresql-15-partman`) beside the sweep, on the same data: its own
/// retention drops the expired months whole, March's event under a legal hold included; sweeper
/// (partitions = "drop", pg_partman only creating partitions) drops every expired month, March's
/// after carving its held event out into a new partition of March's name, so the held event
/// stays and pg_partman sees the month it made. Beside pg_partman's default partition the detach
/// is a plain one, and the carve-out's CHECK on the default is gone afterwards. `check-config` warns while pg_partman's retention is set.
#[tokio::test]
async fn beside_pg_partman_a_held_row_survives_that_its_retention_drops() {
    // pg_partman alone: retention ending before June.
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    if let Err(e) = sqlx::raw_sql(PARTMAN_SETUP).execute(&pool).await {
        panic!(
            "pg_partman must be installed (Debian package postgresql-15-partman; .ci/run installs it): {e}"
        );
    }
    sqlx::raw_sql(
        "update partman.part_config set retention = (now() - timestamptz '2026-06-02')::text
          where parent_table = 'demo.events';
         select partman.run_maintenance('demo.events');",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        count(&pool, "select count(*) from demo.events where id = 1000").await,
        0,
        "pg_partman's retention dropped the held event with March"
    );
    assert_eq!(
        count(
            &pool,
            "select count(*) from demo.events where created_at < '2026-06-01'"
        )
        .await,
        0
    );

    // Sweeper on the same data, pg_partman creating partitions only.
    let dir = export_dir();
    let app = TestApp::spawn(Spawn {
        setup_sql: PARTMAN_SETUP,
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: format!("{PARTITIONED_POLICY}partitions = \"drop\"\n"),
        extra_toml: format!("[ledger]\naudit_export_dir = \"{}\"\n", dir.display()),
        workers: 0,
    })
    .await;
    sqlx::query("select partman.run_maintenance('demo.events')")
        .execute(&app.pool)
        .await
        .unwrap();
    let (_, run) = run_to_end(&app, "").await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 50, "January to May, 10 events each: {run}");
    let states = states(&run);
    assert_eq!(
        states,
        [
            ("demo.events_p2026_01", "dropped"),
            ("demo.events_p2026_02", "dropped"),
            ("demo.events_p2026_03", "dropped"),
            ("demo.events_p2026_04", "dropped"),
            ("demo.events_p2026_05", "dropped"),
        ],
        "{run}"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from demo.events where id = 1000"
        )
        .await,
        1,
        "the held event stays"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from demo.events_p2026_03 where id = 1000"
        )
        .await,
        1,
        "in the new partition, under March's name"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from partman.show_partitions('demo.events')
              where partition_tablename = 'events_p2026_03'"
        )
        .await,
        1,
        "pg_partman lists the new March as its child"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_constraint c join pg_namespace n on n.oid = c.connamespace
              where n.nspname = 'demo' and c.conname like 'sweeper%'"
        )
        .await,
        0,
        "no constraint or index of the carve-out's is left on the default partition or the new one"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_indexes
              where tablename = 'events_p2026_03' and indexname = 'events_p2026_03_pkey'"
        )
        .await,
        1,
        "the new March's key has the old one's name"
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from demo.events where created_at < '2026-06-03'"
        )
        .await,
        1
    );
    // pg_partman goes on creating partitions beside it.
    sqlx::query("select partman.run_maintenance('demo.events')")
        .execute(&app.pool)
        .await
        .unwrap();

    // check-config warns while pg_partman's retention is set on the table.
    use crate::kit::process::{sweeper, write_config};
    sqlx::query(
        "update partman.part_config set retention = '6 months' where parent_table = 'demo.events'",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let extra = format!("[ledger]\naudit_export_dir = \"{}\"\n", dir.display());
    let path = write_config(&config_toml(
        &app.db.url,
        0,
        &extra,
        &format!("{PARTITIONED_POLICY}partitions = \"drop\"\n"),
    ));
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("warning: policy[events]: partitions: pg_partman's own retention (6 months) is set on demo.events"),
        "{text}"
    );
}

/// The blast-radius guard counts the rows of the partitions a run retires and holds their
/// retirement like any command until approved. A legal hold set while the run waits is found in
/// the detached table: that partition is attached again, `kept`, its rows all there; the others
/// are dropped. A cancelled run's retirements not begun are `kept`, nothing detached.
#[tokio::test]
async fn the_guard_holds_a_retirement_and_a_hold_set_since_planning_keeps_the_partition() {
    let dir = export_dir();
    let app = TestApp::spawn(Spawn {
        setup_sql: PARTITIONED,
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: format!(
            "{PARTITIONED_POLICY}partitions = \"drop\"\nguard = {{ max_items = 30 }}\n"
        ),
        extra_toml: format!("[ledger]\naudit_export_dir = \"{}\"\n", dir.display()),
        workers: 0,
    })
    .await;
    make_months(&app.pool, 10).await;
    sqlx::raw_sql(
        "insert into demo.events (id, created_at, payload)
         select i, timestamptz '2026-01-15' + make_interval(months => m), 'x'
           from generate_series(1, 40) i, generate_series(0, 8) m;
         insert into demo.events values (2000, '2026-02-20', 'held later');",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let run_id = app.api.trigger_new("events", "").await;
    let run = app
        .api
        .wait_run(&run_id, "held for approval", |r| {
            r["approval"]["state"] == "required"
        })
        .await;
    assert_eq!(
        run["eligible_planned"], 201,
        "the retiring rows are planned: {run}"
    );
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let states: Vec<String> = sqlx::query_scalar(
        "select distinct state from sweeper.partition_retirements where run_id = $1",
    )
    .bind(&run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(states, ["planned"], "nothing detached before the approval");
    // A legal hold on event 2000, in February, set while the run waits.
    sqlx::query("insert into legal.event_holds values (2000, null)")
        .execute(&app.pool)
        .await
        .unwrap();
    app.api
        .expect(
            200,
            reqwest::Method::POST,
            &format!("/runs/{run_id}/approve"),
            Some(serde_json::json!({"reason": "the first sweep of old months"})),
        )
        .await;
    let run = app.wait_terminal(&run_id).await;
    let parts = run["partitions"].as_array().unwrap();
    let february = parts
        .iter()
        .find(|p| p["partition"] == "demo.events_2026_02")
        .unwrap();
    assert_eq!(february["state"], "kept", "{run}");
    assert!(
        february["reason"]
            .as_str()
            .unwrap()
            .contains("1 of its rows are kept since planning"),
        "{run}"
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events where created_at >= '2026-02-01' and created_at < '2026-03-01'").await,
        41,
        "February attached again with every row"
    );
    assert_eq!(
        parts.iter().filter(|p| p["state"] == "dropped").count(),
        4,
        "{run}"
    );
    assert_eq!(run["deleted"], 160, "{run}");
    assert_eq!(
        run["eligible_planned"], 160,
        "February's rows left the planned count when it was kept: {run}"
    );

    // A cancelled run: its retirements not begun are kept.
    // A month later June has expired whole.
    set_clock(&app.pool, at("2026-10-01T02:01:00Z")).await;
    let second = app.api.trigger_new("events", "").await;
    app.api
        .wait_run(&second, "held for approval", |r| {
            r["approval"]["state"] == "required"
        })
        .await;
    app.api
        .expect(
            200,
            reqwest::Method::POST,
            &format!("/runs/{second}/cancel"),
            Some(serde_json::json!({"reason": "not today"})),
        )
        .await;
    let kept: Vec<(String, String, String)> = sqlx::query_as(
        "select partition, state, reason from sweeper.partition_retirements where run_id = $1
          order by partition",
    )
    .bind(&second)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(kept.len(), 2, "{kept:?}");
    assert_eq!(
        (kept[0].0.as_str(), kept[0].1.as_str()),
        ("demo.events_2026_02", "kept")
    );
    assert_eq!(
        (kept[1].0.as_str(), kept[1].1.as_str()),
        ("demo.events_2026_06", "kept")
    );
    assert_eq!(
        kept[1].2, "the run was cancelled before the partition was detached",
        "{kept:?}"
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_06").await,
        40
    );
    let second_run = app.api.run(&second).await;
    assert_eq!(
        second_run["eligible_planned"], 0,
        "February's 40 rows (its held event carved out) and June's 40 left the planned count \
         with the cancel: {second_run}"
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_02").await,
        41
    );
}

/// A partition of more keys than one fetch of the export reads (10,000): every key is exported,
/// in bytewise order across the fetches, and the digest covers them all.
#[tokio::test]
async fn a_partition_larger_than_one_fetch_is_exported_whole_and_in_order() {
    let dir = export_dir();
    let app = spawn(&dir).await;
    sqlx::raw_sql(
        "insert into demo.events (id, created_at, payload)
         select i, timestamptz '2026-02-01' + i * interval '1 second', 'x'
           from generate_series(100000, 124999) i;",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (run_id, run) = run_to_end(&app, "").await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 25_200, "{run}");
    let february = run["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["partition"] == "demo.events_2026_02")
        .unwrap();
    assert_eq!(february["state"], "dropped", "{run}");
    assert_eq!(february["rows"], 25_040, "{run}");
    assert_verified_export(february, &run_id);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A key's history entry for `key` (an item key's JSON text) among `dropped_partitions`.
async fn dropped_entry(app: &TestApp, key: &str) -> serde_json::Value {
    let h = app
        .get_json(&format!(
            "/policies/events/items/{}",
            percent_encoding::utf8_percent_encode(key, percent_encoding::NON_ALPHANUMERIC)
        ))
        .await;
    assert_eq!(h["dropped_partitions"].as_array().unwrap().len(), 1, "{h}");
    h["dropped_partitions"][0].clone()
}

/// A view is created on January's detached table during its drop grace: when the grace has
/// passed January is not dropped (its drop would fail on every try) but kept, the reason naming
/// the view and what to do; the other months are dropped.
#[tokio::test]
async fn a_view_created_during_the_grace_keeps_the_detached_table() {
    let dir = export_dir();
    let app = spawn_with(&dir, "drop_grace = \"1h\"\n").await;
    let (run_id, run) = run_to_end(&app, "").await;
    assert_eq!(run["status"], "completed", "{run}");
    sqlx::raw_sql("create view demo.january as select * from demo.events_2026_01")
        .execute(&app.pool)
        .await
        .unwrap();
    set_clock(&app.pool, at("2026-09-01T03:05:00Z")).await;
    let run = app
        .api
        .wait_run(&run_id, "past its grace", |r| {
            r["partitions"]
                .as_array()
                .is_some_and(|ps| ps.iter().all(|p| p["state"] != "awaiting_drop"))
        })
        .await;
    let january = run["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["partition"] == "demo.events_2026_01")
        .unwrap();
    assert_eq!(january["state"], "kept", "{run}");
    assert!(
        january["reason"]
            .as_str()
            .unwrap()
            .contains("a view or a function reads it by name, since its detach"),
        "{run}"
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.january").await,
        40
    );
    assert_eq!(
        states(&run)
            .iter()
            .filter(|(p, s)| *p != "demo.events_2026_01" && *s == "dropped")
            .count(),
        4,
        "{run}"
    );
}

/// With `drop_grace`, a retired partition stays detached, its export and manifest recorded, and
/// its run completes; once the grace has passed it is dropped, unless it is no longer what the
/// manifest describes: attached again (an operator's undo, here still validating when the grace
/// ends), changed, or holding a row put on hold meanwhile. Those are left `kept` with the
/// reason; the run's counts and manifests stand, and a key's history says which is which.
#[tokio::test]
async fn with_a_grace_period_the_partitions_wait_detached_and_are_dropped_after_it() {
    let dir = export_dir();
    let app = spawn_with(&dir, "drop_grace = \"1h\"\n").await;
    // Event 2000 exists in May only.
    sqlx::query("insert into demo.events values (2000, '2026-05-10', 'x')")
        .execute(&app.pool)
        .await
        .unwrap();
    let (run_id, run) = run_to_end(&app, "").await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 201, "{run}");
    assert_eq!(run["remaining_eligible"], 0, "{run}");
    assert_eq!(
        states(&run),
        [
            ("demo.events_2026_01", "awaiting_drop"),
            ("demo.events_2026_02", "awaiting_drop"),
            ("demo.events_2026_03", "awaiting_drop"),
            ("demo.events_2026_04", "awaiting_drop"),
            ("demo.events_2026_05", "awaiting_drop"),
        ],
        "{run}"
    );
    let parts = run["partitions"].as_array().unwrap().clone();
    for p in parts.iter().filter(|p| p["state"] == "awaiting_drop") {
        // An hour after its evidence was recorded (the test's clock runs on from 02:01).
        let drop_after: chrono::DateTime<chrono::Utc> =
            p["drop_after"].as_str().unwrap().parse().unwrap();
        assert!(
            drop_after >= at("2026-09-01T03:01:00Z") && drop_after < at("2026-09-01T03:02:00Z"),
            "{p}"
        );
        assert_verified_export(p, &run_id);
    }
    let detached = "select count(*) from pg_class c where c.relname in
                        ('events_2026_01', 'events_2026_02', 'events_2026_04', 'events_2026_05')
                      and not c.relispartition";
    assert_eq!(count(&app.pool, detached).await, 4, "detached, not dropped");
    let jan = dropped_entry(&app, r#"["7","2026-01-15T00:00:00Z"]"#).await;
    assert_eq!(jan["state"], "awaiting_drop", "{jan}");
    assert!(
        jan["membership"]
            .as_str()
            .unwrap()
            .contains("awaiting its drop"),
        "{jan}"
    );
    // A dry run that planned after this run (here made by hand, dated after it) reports
    // January as `would_drop`: it retires nothing, so it does not keep January from its drop.
    sqlx::raw_sql(&format!(
        "create temp table dry as select * from sweeper.runs where run_id = '{run_id}';
         update dry set run_id = 'events:dry', dry_run = true, dry_run_no = 1;
         insert into sweeper.runs select * from dry;
         insert into sweeper.partition_retirements
             (run_id, partition, parent, bound, timestamp_to, rows, state, created_at, finished_at)
         select 'events:dry', partition, parent, bound, timestamp_to, rows, 'would_drop',
                created_at + interval '1 second', created_at + interval '1 second'
           from sweeper.partition_retirements
          where run_id = '{run_id}' and partition = 'demo.events_2026_01';"
    ))
    .execute(&app.pool)
    .await
    .unwrap();
    // Not dropped before the grace has passed, however often the retirer looks.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(count(&app.pool, detached).await, 4);
    // Someone writes into April's detached table; event 2000 goes on hold.
    sqlx::raw_sql(
        "insert into demo.events_2026_04 values (5000, '2026-04-20', 'late');
         insert into legal.event_holds values (2000, null);",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    // The operator takes February back, and the attach is still validating when the grace
    // ends: the retirer waits for its lock, then sees it attached.
    let bound = parts[1]["bound"].as_str().unwrap();
    let mut attach = app.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "alter table demo.events attach partition demo.events_2026_02 {bound}"
    ))
    .execute(&mut *attach)
    .await
    .unwrap();
    set_clock(&app.pool, at("2026-09-01T03:05:00Z")).await;
    let waiting = "select count(*) from pg_locks
                    where relation = 'demo.events_2026_02'::regclass and not granted";
    let started = std::time::Instant::now();
    while count(&app.pool, waiting).await == 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the retirer never waited"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    attach.commit().await.unwrap();
    let run = app
        .api
        .wait_run(&run_id, "past its grace", |r| {
            r["partitions"]
                .as_array()
                .is_some_and(|ps| ps.iter().all(|p| p["state"] != "awaiting_drop"))
        })
        .await;
    assert_eq!(
        states(&run),
        [
            ("demo.events_2026_01", "dropped"),
            ("demo.events_2026_02", "kept"),
            ("demo.events_2026_03", "dropped"),
            ("demo.events_2026_04", "kept"),
            ("demo.events_2026_05", "kept"),
        ],
        "{run}"
    );
    let parts = run["partitions"].as_array().unwrap();
    let reason = |i: usize| parts[i]["reason"].as_str().unwrap().to_string();
    assert!(
        reason(1).contains("attached again during its grace"),
        "{run}"
    );
    assert!(
        reason(3).contains("its rows changed during its grace (41 rows; its manifest names 40)"),
        "{run}"
    );
    assert!(
        reason(4).contains("1 of its rows became held during its grace"),
        "{run}"
    );
    assert!(!reason(4).contains("  "), "{run}");
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_class where relname = 'events_2026_01'"
        )
        .await,
        0
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_04").await,
        41
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_05").await,
        41
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events where created_at >= '2026-02-01' and created_at < '2026-03-01'").await,
        40,
        "February is back in the table"
    );
    // March's old table (its held event carried over) is dropped after the grace like the rest.
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from pg_class where relname like 'sweeper_retired_%'"
        )
        .await,
        0
    );
    assert_eq!(
        count(&app.pool, "select count(*) from demo.events_2026_03").await,
        1
    );
    // The run and its evidence stand: five manifests, 201 rows deleted; a key's history says
    // which partitions went and which did not.
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], 201, "{run}");
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from sweeper.audit_manifests where detail ->> 'policy' = 'events'"
        )
        .await,
        5
    );
    let jan = dropped_entry(&app, r#"["7","2026-01-15T00:00:00Z"]"#).await;
    assert_eq!(jan["state"], "dropped", "{jan}");
    let feb = dropped_entry(&app, r#"["7","2026-02-15T00:00:00Z"]"#).await;
    assert_eq!(feb["state"], "kept", "{feb}");
    assert!(
        feb["membership"]
            .as_str()
            .unwrap()
            .contains("the row may be live"),
        "{feb}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `DETACH … CONCURRENTLY` waits for every transaction that began before it and could see the
/// partition, however long; the retirement's lease is renewed meanwhile, so no other replica
/// takes the retirement over while its detach still runs.
#[tokio::test]
async fn a_detach_waiting_on_an_old_transaction_keeps_its_lease() {
    let dir = export_dir();
    let app = spawn_configured(&dir, "", "[planning]\nlease = \"2s\"\n").await;
    // An application transaction that read the table and stays open.
    let mut reader = app.pool.begin().await.unwrap();
    sqlx::query("select count(*) from demo.events")
        .execute(&mut *reader)
        .await
        .unwrap();
    let run_id = app.api.trigger_new("events", "").await;
    app.wait_planned(&run_id).await;
    let run = app
        .api
        .wait_run(&run_id, "detaching", |r| {
            r["partitions"]
                .as_array()
                .is_some_and(|ps| ps.iter().any(|p| p["state"] == "detaching"))
        })
        .await;
    assert_eq!(run["status"], "running", "{run}");
    // Two and a half leases later the detach still waits, and its lease is current.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let (state, attempts, current): (String, i32, bool) = sqlx::query_as(
        "select state, attempts, lease_until > sweeper.now()
           from sweeper.partition_retirements
          where run_id = $1 and partition = 'demo.events_2026_01'",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), attempts, current),
        ("detaching", 1, true),
        "the waiting detach's lease is renewed"
    );
    reader.commit().await.unwrap();
    drain(&app).await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(states(&run)[0], ("demo.events_2026_01", "dropped"), "{run}");
    let attempts: i32 = sqlx::query_scalar(
        "select attempts from sweeper.partition_retirements
          where run_id = $1 and partition = 'demo.events_2026_01'",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 1, "taken through by one claim");
    std::fs::remove_dir_all(&dir).unwrap();
}
