//! The audit trail partitioned by month (issue 13): append-only on every partition, partitions
//! ready ahead of a moved clock, a missing partition a transient failure that loses nothing, and
//! one item's history found across months through its index; the lean shape (an execution row
//! per command try, a narrow row per item) read together with rows a previous release wrote.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::common::*;

/// The audit's partitions, in range order.
async fn partitions(pool: &PgPool) -> Vec<(String, DateTime<Utc>)> {
    sqlx::query_as("select partition, to_at from sweeper.audit_partitions order by to_at")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// The month (named by its first-shape partition) each audit row of `run_id` lives in.
async fn partitions_of_run(pool: &PgPool, run_id: &str) -> Vec<String> {
    sqlx::query_scalar(
        "select distinct replace(i.tableoid::regclass::text, 'audit_items_', 'audit_')
           from sweeper.audit_items i join sweeper.audit_executions e using (execution_id, recorded_at)
          where e.run_id = $1",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_audit_and_every_partition_refuse_updates_deletes_and_truncation() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        workers: 1,
        ..Default::default()
    })
    .await;
    seed_mixed(&app.pool, 10, at("2026-09-01T02:00:00Z")).await;
    let (_, run) = app.trigger("ticket-retention", "").await;
    app.wait_terminal(run["run_id"].as_str().unwrap()).await;
    let parts = partitions(&app.pool).await;
    assert!(parts.len() >= 3, "{parts:?}");
    assert_eq!(
        parts[0].0, "audit_before",
        "the table that existed is the first partition"
    );
    let before: i64 = sqlx::query_scalar("select count(*) from sweeper.audit_trail")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(before > 0);
    // Both shapes (migration 20261204000022): each parent and each month's table.
    let mut names = Vec::new();
    for parent in [
        "audit",
        "audit_executions",
        "audit_items",
        "audit_manifests",
    ] {
        names.push(parent.to_string());
        for (month, _) in &parts {
            names.push(format!(
                "{parent}_{}",
                month.strip_prefix("audit_").unwrap()
            ));
        }
    }
    for name in names {
        for stmt in [
            format!("update sweeper.{name} set recorded_at = recorded_at"),
            format!("delete from sweeper.{name}"),
            format!("truncate sweeper.{name}"),
        ] {
            let err = sqlx::query(&stmt).execute(&app.pool).await.unwrap_err();
            assert!(err.to_string().contains("append-only"), "{stmt}: {err}");
        }
    }
    let after: i64 = sqlx::query_scalar("select count(*) from sweeper.audit_trail")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(after, before);
}

#[tokio::test]
async fn partitions_are_made_two_months_ahead_of_a_moved_clock() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        ..Default::default()
    })
    .await;
    // Five months on: housekeeping makes the months up to two after the current one.
    set_clock(&app.pool, at("2027-05-20T10:00:00Z")).await;
    sweeper::app::housekeeping::housekeeping_once(&app.state)
        .await
        .unwrap();
    let parts = partitions(&app.pool).await;
    assert_eq!(
        parts.last().unwrap().1,
        at("2027-08-01T00:00:00Z"),
        "{parts:?}"
    );
    let names: Vec<&str> = parts.iter().map(|(n, _)| n.as_str()).collect();
    for month in ["audit_2027_05", "audit_2027_06", "audit_2027_07"] {
        assert!(names.contains(&month), "{names:?}");
    }
    // Again: nothing more to make, and the ranges have no gap.
    assert_eq!(
        sweeper::ledger::audit::ensure_partitions(&app.pool)
            .await
            .unwrap(),
        0
    );
    let gaps: i64 = sqlx::query_scalar(
        "select count(*) from (select from_at, lag(to_at) over (order by to_at) as prev
                                 from sweeper.audit_partitions) p
          where prev is not null and from_at <> prev",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(gaps, 0);
}

#[tokio::test]
async fn a_missing_partition_is_a_transient_failure_and_the_command_runs_once_it_exists() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        ..Default::default()
    })
    .await;
    // The clock jumps past every partition made so far (no housekeeping round has run).
    set_clock(&app.pool, at("2027-09-01T02:01:00Z")).await;
    let eligible = seed_mixed(&app.pool, 20, at("2027-09-01T02:00:00Z")).await;
    let (run_id, commands) = app.planned_run().await;
    let answer = app.consume(&commands[0]).await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    let (state, attempts, error, class): (String, i32, String, String) = sqlx::query_as(
        "select state, attempts, last_error, last_error_class from sweeper.commands
          where command_id = $1",
    )
    .bind(&commands[0])
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), attempts, class.as_str()),
        ("pending", 1, "transient")
    );
    assert!(error.starts_with("ledger unavailable"), "{error}");
    let left: i64 = sqlx::query_scalar("select count(*) from demo.tickets")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, 20, "nothing deleted without its audit rows");

    sweeper::app::housekeeping::housekeeping_once(&app.state)
        .await
        .unwrap();
    crate::kit::ledger::advance_clock(&app.pool, 600).await; // past the retry's backoff
    for c in &commands {
        let answer = app.consume(c).await;
        assert_eq!(answer.body["result"], "executed", "{}", answer.body);
    }
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["deleted"].as_i64().unwrap() as usize, eligible.len());
    assert_eq!(
        partitions_of_run(&app.pool, &run_id).await,
        ["sweeper.audit_2027_09"]
    );
}

#[tokio::test]
async fn an_items_history_is_found_across_two_months_through_its_index() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2027-01-31T02:01:00Z")),
        ..Default::default()
    })
    .await;
    sweeper::ledger::audit::ensure_partitions(&app.pool)
        .await
        .unwrap();
    let item = seed_mixed(&app.pool, 20, at("2027-01-31T02:00:00Z")).await[0];
    // January: planned, then put on legal hold before its command runs.
    let (first, commands) = app.planned_run().await;
    sqlx::query("update demo.tickets set legal_hold = true where id = $1")
        .bind(item)
        .execute(&app.pool)
        .await
        .unwrap();
    for c in &commands {
        app.consume(c).await;
    }
    app.wait_terminal(&first).await;
    // February, in the next month's partition: the hold is lifted and the row deleted.
    sqlx::query("update demo.tickets set legal_hold = false where id = $1")
        .bind(item)
        .execute(&app.pool)
        .await
        .unwrap();
    set_clock(&app.pool, at("2027-02-01T02:01:00Z")).await;
    let (second, commands) = app.planned_run().await;
    for c in &commands {
        app.consume(c).await;
    }
    app.wait_terminal(&second).await;

    let lookup = "select e.run_id, i.outcome,
                          replace(i.tableoid::regclass::text, 'audit_items_', 'audit_')
                     from sweeper.audit_items i
                     join sweeper.audit_executions e using (execution_id, recorded_at)
                    where e.policy = 'ticket-retention' and i.item_key = $1
                      and hashtextextended(i.item_key, 0) = hashtextextended($1, 0)
                    order by recorded_at";
    let history: Vec<(String, String, String)> = sqlx::query_as(lookup)
        .bind(item.to_string())
        .fetch_all(&app.pool)
        .await
        .unwrap();
    let expected = vec![
        (
            first,
            "excluded".to_string(),
            "sweeper.audit_2027_01".to_string(),
        ),
        (
            second,
            "deleted".to_string(),
            "sweeper.audit_2027_02".to_string(),
        ),
    ];
    assert_eq!(history, expected);
    // The same history over HTTP, from both months.
    let h = app
        .get_json(&format!("/policies/ticket-retention/items/{item}"))
        .await;
    let over_http: Vec<(String, String)> = h["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["run_id"].as_str().unwrap().to_string(),
                r["outcome"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        over_http,
        expected
            .iter()
            .map(|(r, o, _)| (r.clone(), o.clone()))
            .collect::<Vec<_>>()
    );
    // Every partition answers it from an index (with sequential scans ruled out, a partition
    // without one would show a Seq Scan).
    let mut conn = app.pool.acquire().await.unwrap();
    sqlx::query("set enable_seqscan = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(&format!("explain {lookup}"))
        .bind(item.to_string())
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    let plan = plan.join("\n");
    assert!(!plan.contains("Seq Scan"), "{plan}");
    assert!(
        plan.contains("audit_items_2027_02_hashtextextended_idx"),
        "{plan}"
    );
    sqlx::query("reset enable_seqscan")
        .execute(&mut *conn)
        .await
        .unwrap();
}

/// A fresh directory for exports.
fn export_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sweeper-audit-export-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The lines of a gzip JSON Lines export, parsed.
fn read_export(path: &std::path::Path) -> Vec<serde_json::Value> {
    use std::io::BufRead;
    let gz = flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap());
    std::io::BufReader::new(gz)
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect()
}

async fn table_exists(pool: &PgPool, name: &str) -> bool {
    sqlx::query_scalar::<_, bool>("select to_regclass($1) is not null")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_expired_month_is_exported_verified_and_dropped_and_an_open_runs_month_is_kept() {
    let dir = export_dir();
    let app = TestApp::spawn(Spawn {
        now: Some(at("2027-01-31T02:01:00Z")),
        policies: ticket_policy(2),
        extra_toml: format!(
            "[ledger]\naudit_retention = \"120d\"\naudit_export_dir = \"{}\"",
            dir.display()
        ),
        ..Default::default()
    })
    .await;
    sweeper::ledger::audit::ensure_partitions(&app.pool)
        .await
        .unwrap();
    seed_mixed(&app.pool, 30, at("2027-01-31T02:00:00Z")).await;
    // January: a completed run.
    let (january, commands) = app.planned_run().await;
    for c in &commands {
        app.consume(c).await;
    }
    app.wait_terminal(&january).await;
    // February: a run left running (one of its commands executed), so February stays.
    set_clock(&app.pool, at("2027-02-01T02:01:00Z")).await;
    let (february, commands) = app.planned_run().await;
    assert!(commands.len() >= 2, "{commands:?}");
    app.consume(&commands[0]).await;
    assert_eq!(
        partitions_of_run(&app.pool, &february).await,
        ["sweeper.audit_2027_02"]
    );
    let january_rows: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.audit_items_2027_01 i
              join sweeper.audit_executions_2027_01 e using (execution_id, recorded_at)
             where e.run_id = $1",
    )
    .bind(&january)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(january_rows > 0);
    let total: i64 = sqlx::query_scalar("select count(*) from sweeper.audit_trail")
        .fetch_one(&app.pool)
        .await
        .unwrap();

    // July: both months ended more than 120 days ago.
    set_clock(&app.pool, at("2027-07-15T00:00:00Z")).await;
    sweeper::ledger::audit::ensure_partitions(&app.pool)
        .await
        .unwrap();
    let lease = sweeper::app::job_lease::HeldJob::take(&app.state, "audit_retention")
        .await
        .unwrap()
        .unwrap();
    let dropped = sweeper::app::audit_retention::audit_retention_pass(&app.state, &lease)
        .await
        .unwrap();
    assert!(dropped >= 1, "{dropped}");
    let file = dir.join("sweeper-audit-audit_2027_01.jsonl.gz");
    let lines = read_export(&file);
    assert_eq!(lines.len() as i64, january_rows);
    assert!(
        lines.iter().all(|l| l["run_id"] == january.as_str()),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .all(|l| l["outcome"].is_string() && l["item_key"].is_string())
    );
    // Each line is self-contained: its execution's fields are in it.
    assert!(
        lines.iter().all(|l| l["attempt"] == 1
            && l["execution_id"].is_i64()
            && l["pinned_cutoff"] == l["cutoff"]
            && l["current_version"].is_null()),
        "{lines:?}"
    );
    let (state, rows, sha256, location): (String, i64, String, String) = sqlx::query_as(
        "select state, rows, sha256, location from sweeper.audit_exports
          where partition = 'audit_2027_01'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    use sha2::Digest;
    let on_disk = hex::encode(sha2::Sha256::digest(std::fs::read(&file).unwrap()));
    assert_eq!(
        (state.as_str(), rows, sha256.as_str(), location.as_str()),
        (
            "dropped",
            january_rows,
            on_disk.as_str(),
            file.to_str().unwrap()
        )
    );
    for t in [
        "audit",
        "audit_executions",
        "audit_items",
        "audit_manifests",
    ] {
        assert!(
            !table_exists(&app.pool, &format!("sweeper.{t}_2027_01")).await,
            "{t}"
        );
    }
    assert!(
        table_exists(&app.pool, "sweeper.audit_2027_02").await,
        "a month with rows of a running run is kept"
    );
    let left: i64 = sqlx::query_scalar("select count(*) from sweeper.audit_trail")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, total - january_rows);
    // A January record's history now says since when it is complete and where the rest went.
    let key = lines[0]["item_key"].as_str().unwrap();
    let h = app
        .get_json(&format!("/policies/ticket-retention/items/{key}"))
        .await;
    assert_eq!(h["history_complete_since"], "2027-02-01T00:00:00Z", "{h}");
    let export = h["exports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["partition"] == "audit_2027_01")
        .unwrap_or_else(|| panic!("{h}"));
    assert_eq!(export["location"], file.to_str().unwrap());
    assert_eq!(export["sha256"], on_disk.as_str());

    // Again: nothing more to drop while February's run is open; the export is untouched.
    assert_eq!(
        sweeper::app::audit_retention::audit_retention_pass(&app.state, &lease)
            .await
            .unwrap(),
        0
    );
    assert_eq!(read_export(&file).len() as i64, january_rows);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_audit_retention_shorter_than_retention_plus_30_days_or_without_a_directory_is_refused() {
    let config = |ledger: &str| {
        sweeper::settings::Config::from_toml(&config_toml(
            "postgres://x@127.0.0.1/x",
            0,
            ledger,
            &ticket_policy(10),
        ))
    };
    let err = config("[ledger]\naudit_retention = \"100d\"\naudit_export_dir = \"/tmp\"")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "ledger.audit_retention (100d) must be at least the longest retain_for plus 30d (120d)"
        ),
        "{err}"
    );
    let err = config("[ledger]\naudit_retention = \"400d\"")
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs ledger.audit_export_dir"), "{err}");
    assert!(config("[ledger]\naudit_retention = \"120d\"\naudit_export_dir = \"/tmp\"").is_ok());
}

/// A rolling upgrade: a replica of the previous release audited part of a command in the audit's
/// first shape (one wide row per item, `sweeper.audit`), then this release finished it. Every
/// reader sees both shapes as one trail: no item is audited twice, the run's pages hold each row
/// once across both, and an item's history shows its first-shape row.
#[tokio::test]
async fn rows_of_the_previous_shape_and_the_lean_one_read_as_one_trail() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        ..Default::default()
    })
    .await;
    seed_mixed(&app.pool, 40, at("2026-09-01T02:00:00Z")).await;
    let (run_id, commands) = app.planned_run().await;
    let keys: Vec<String> =
        sqlx::query_scalar("select unnest(item_keys) from sweeper.commands where command_id = $1")
            .bind(&commands[0])
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert!(keys.len() >= 4, "{keys:?}");
    // The previous release's statement for the items it decided (here: the first two keys,
    // deleted), the command left pending for the rest.
    let old: Vec<String> = keys[..2].to_vec();
    for k in &old {
        sqlx::query("delete from demo.tickets where id = $1::bigint")
            .bind(k)
            .execute(&app.pool)
            .await
            .unwrap();
    }
    sqlx::query(
        "insert into sweeper.audit
             (policy, policy_version, run_id, window_at, cutoff, command_id, item_key, outcome,
              reason, actor, dry_run, recorded_at)
         select r.policy, r.policy_version, r.run_id, r.window_at, r.cutoff, $2, k, 'deleted',
                null, 'builtin', false, sweeper.now()
           from sweeper.runs r, unnest($3::text[]) k where r.run_id = $1",
    )
    .bind(&run_id)
    .bind(&commands[0])
    .bind(&old)
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query("update sweeper.commands set deleted = 2 where command_id = $1")
        .bind(&commands[0])
        .execute(&app.pool)
        .await
        .unwrap();
    for c in &commands {
        app.consume(c).await;
    }
    app.wait_terminal(&run_id).await;
    // Each key of the command once, its first two in the first shape.
    let rows: Vec<(String, String, bool)> = sqlx::query_as(
        "select item_key, outcome, execution_id = audit_id from sweeper.audit_trail
          where command_id = $1 order by item_key",
    )
    .bind(&commands[0])
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), keys.len(), "{rows:?}");
    for (k, outcome, first_shape) in &rows {
        assert_eq!(*first_shape, old.contains(k), "{k}: {rows:?}");
        assert!(
            outcome == "deleted" || outcome == "excluded" || outcome == "not_eligible",
            "{rows:?}"
        );
    }
    // The run's pages, 3 rows at a time, hold every row of the trail exactly once.
    let total: i64 =
        sqlx::query_scalar("select count(*) from sweeper.audit_trail where run_id = $1")
            .bind(&run_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    let mut seen = Vec::new();
    let mut cursor = String::new();
    loop {
        let page = app
            .get_json(&format!("/runs/{run_id}/items?limit=3{cursor}"))
            .await;
        for i in page["items"].as_array().unwrap() {
            seen.push(i["audit_id"].as_i64().unwrap());
            assert!(i.get("execution_id").is_none(), "{i}");
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = format!("&cursor={c}"),
            None => break,
        }
    }
    let mut unique = seen.clone();
    unique.sort();
    unique.dedup();
    assert_eq!((seen.len() as i64, unique.len() as i64), (total, total));
    // Only a cursor as `next_cursor` writes one: digits, no sign.
    for bad in ["%2B1.2", "-0.0", "1.", ".1", "1.2.3"] {
        let path = format!("/runs/{run_id}/items?cursor={bad}");
        let r = app.api.send(reqwest::Method::GET, &path, None).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
    // A bare id, as cursors were before, still pages on from a first-shape row.
    let first_old: i64 = sqlx::query_scalar("select min(audit_id) from sweeper.audit")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let page = app
        .get_json(&format!(
            "/runs/{run_id}/items?limit=1000&cursor={first_old}"
        ))
        .await;
    assert_eq!(page["items"].as_array().unwrap().len() as i64, total - 1);
    // An item's history shows its first-shape row.
    let h = app
        .get_json(&format!("/policies/ticket-retention/items/{}", old[0]))
        .await;
    let audit = h["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 1, "{h}");
    assert_eq!(audit[0]["outcome"], "deleted");
    assert_eq!(audit[0]["run_id"], run_id.as_str());
}

/// The lean shape's rows: one execution per command try with the run's fields, narrow item
/// rows that carry its id and month, and only the indexes its readers use.
#[tokio::test]
async fn a_command_writes_one_execution_row_and_narrow_item_rows() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        ..Default::default()
    })
    .await;
    seed_mixed(&app.pool, 30, at("2026-09-01T02:00:00Z")).await;
    let (run_id, commands) = app.planned_run().await;
    for c in &commands {
        app.consume(c).await;
    }
    app.wait_terminal(&run_id).await;
    let (executions, commands_seen, bad): (i64, i64, i64) = sqlx::query_as(
        "select count(*), count(distinct command_id),
                count(*) filter (where attempt <> 1 or pinned_cutoff <> cutoff
                                 or current_version is not null or dry_run)
           from sweeper.audit_executions where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (executions, commands_seen, bad),
        (commands.len() as i64, commands.len() as i64, 0)
    );
    let (items, apart): (i64, i64) = sqlx::query_as(
        "select count(*), count(*) filter (where e.execution_id is null)
           from sweeper.audit_items i
           left join sweeper.audit_executions e using (execution_id, recorded_at)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(items > 0);
    assert_eq!(
        apart, 0,
        "every item row has its execution, in the same month"
    );
    let old: i64 = sqlx::query_scalar("select count(*) from sweeper.audit")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(old, 0, "this release writes the lean shape only");
    let indexes: Vec<String> = sqlx::query_scalar(
        "select indexrelid::regclass::text from pg_index
          where indrelid in ('sweeper.audit_items'::regclass, 'sweeper.audit_executions'::regclass)
          order by 1",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        indexes,
        [
            "sweeper.audit_executions_by_command",
            "sweeper.audit_executions_by_id",
            "sweeper.audit_executions_by_run",
            "sweeper.audit_items_by_execution",
            "sweeper.audit_items_by_item_hash"
        ]
    );
}

/// The previous release's audit retention drops only a month's first-shape table and then its
/// row in `sweeper.audit_partitions`: during a rollout that would leave the month's lean tables
/// attached and unexported. Its statement fails, and rolls its drop back.
#[tokio::test]
async fn a_previous_release_cannot_drop_a_month_without_its_lean_tables() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        ..Default::default()
    })
    .await;
    let month = partitions(&app.pool).await.pop().unwrap().0;
    let lean = format!(
        "sweeper.audit_items_{}",
        month.strip_prefix("audit_").unwrap()
    );
    let mut tx = app.pool.begin().await.unwrap();
    for stmt in [
        format!("alter table sweeper.audit detach partition sweeper.{month}"),
        format!("drop table if exists sweeper.{month}"),
    ] {
        sqlx::query(&stmt).execute(&mut *tx).await.unwrap();
    }
    let err = sqlx::query("delete from sweeper.audit_partitions where partition = $1")
        .bind(&month)
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("lean tables"), "{err}");
    drop(tx);
    assert!(table_exists(&app.pool, &format!("sweeper.{month}")).await);
    assert!(table_exists(&app.pool, &lean).await);
    assert!(partitions(&app.pool).await.iter().any(|(p, _)| *p == month));
}
