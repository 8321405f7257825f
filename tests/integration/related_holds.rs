//! Holds kept in another table (issue 32): an exclusion whose `exists` tests rows of
//! `legal.holds` related by customer, NULLs on the safe side, selections with `exists` and
//! `not_exists`, what `check-config` says, and what a hold committed while a delete runs does —
//! without a foreign key (it can miss that command), with one (whichever commits second fails),
//! and with an own-column flag set in the hold's transaction.

use std::time::Duration;

use serde_json::Value;
use sqlx::{Connection, PgConnection, PgPool};
use sweeper::app::worker::{WorkerStep, run_one_command};

use crate::common::*;
use crate::kit::process::{sweeper, write_config};

/// Tickets with a customer, holds per customer (released or not, a scope that may be NULL), and
/// holds per ticket whose foreign key references the ticket (NO ACTION).
const SETUP: &str = "
create schema demo;
create schema legal;
create table demo.tickets (
    id bigint primary key,
    customer_id bigint,
    status text,
    legal_hold boolean,
    closed_at timestamptz
);
create index on demo.tickets (closed_at);
create table legal.holds (
    id bigserial primary key,
    customer_id bigint,
    scope text,
    released_at timestamptz
);
create index on legal.holds (customer_id);
create table legal.ticket_holds (
    ticket_id bigint not null references demo.tickets (id),
    placed_at timestamptz not null default now()
);
create index on legal.ticket_holds (ticket_id);
create table legal.deferred_holds (
    ticket_id bigint not null references demo.tickets (id) deferrable initially deferred
);
create index on legal.deferred_holds (ticket_id);
";

/// The hold by customer: an unreleased hold whose scope covers tickets.
const CUSTOMER_HOLD: &str = r#"{ name = "customer_hold", exists = { table = "legal.holds",
      on = [ { related = "customer_id", target = "customer_id" } ],
      where = [ { column = "released_at", is_null = true },
                { column = "scope", in = ["all", "tickets"] } ] } }"#;

/// The hold by ticket, through a foreign key.
const TICKET_HOLD: &str = r#"{ name = "ticket_hold", exists = { table = "legal.ticket_holds",
      on = [ { related = "ticket_id", target = "id" } ] } }"#;

fn policy(batch_size: usize, exclude: &[&str]) -> String {
    format!(
        r#"
[[policy]]
name = "ticket-retention"
schedule = {{ cron = "0 2 * * *", timezone = "UTC" }}
target = {{ table = "demo.tickets", key = "id", timestamp = "closed_at" }}
retain_for = "90d"
exclude = [ {} ]
batch_size = {batch_size}
"#,
        exclude.join(",\n  ")
    )
}

async fn spawn(policies: String, extra_toml: &str) -> TestApp {
    TestApp::spawn(Spawn {
        setup_sql: SETUP,
        now: Some(at("2026-09-01T02:01:00Z")),
        policies,
        extra_toml: extra_toml.into(),
        ..Default::default()
    })
    .await
}

/// Tickets `from..=to` of customer `id % customers`, closed long before the cutoff.
async fn seed_old(pool: &PgPool, from: i64, to: i64, customers: i64) {
    sqlx::query(
        "insert into demo.tickets (id, customer_id, status, legal_hold, closed_at)
         select i, i % $3, 'closed', false, timestamptz '2026-01-01' + i * interval '1 second'
           from generate_series($1::bigint, $2::bigint) i",
    )
    .bind(from)
    .bind(to)
    .bind(customers)
    .execute(pool)
    .await
    .unwrap();
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Each outcome and reason of the run's audit, with how many rows have it.
async fn outcomes(pool: &PgPool, run_id: &str) -> Vec<(String, Option<String>, i64)> {
    sqlx::query_as(
        "select outcome, reason, count(*) from sweeper.audit_trail where run_id = $1
          group by 1, 2 order by 1, 2",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Runs every due command in the background, as a worker would.
fn drain_in_background(app: &TestApp) -> tokio::task::JoinHandle<()> {
    let state = app.state.clone();
    tokio::spawn(
        async move { while let WorkerStep::Ran(_) = run_one_command(&state).await.unwrap() {} },
    )
}

/// Waits until a session of sweeper's is in a delete that waits (`wait`: `Lock`, or `PgSleep`
/// for a test trigger's sleep).
async fn wait_for_delete(pool: &PgPool, wait: &str) {
    for _ in 0..400 {
        let waiting: i64 = sqlx::query_scalar(
            "select count(*) from pg_stat_activity
              where query ilike 'delete from%' and (wait_event_type = $1 or wait_event = $1)",
        )
        .bind(wait)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no delete waited on {wait}");
}

async fn session(app: &TestApp) -> PgConnection {
    PgConnection::connect(&app.db.url).await.unwrap()
}

/// 150,000 tickets of 1,000 customers, every fifth one young. Customers 1–50 have an active
/// hold; 51–100 a released one; 101–110 an unreleased one whose scope is NULL (unknown: kept);
/// 111–120 one scoped to billing (not a ticket hold); a hold without a customer relates to no
/// ticket. Exactly the old tickets without an active hold go, the closure check finds none left,
/// and a kept ticket's history says which exclusion holds it now.
#[tokio::test]
async fn holds_by_customer_keep_exactly_the_held_rows_of_150_000() {
    let app = spawn(policy(1_000, &[CUSTOMER_HOLD]), "").await;
    sqlx::raw_sql(
        "insert into demo.tickets (id, customer_id, status, legal_hold, closed_at)
         select i, i % 1000, 'closed', false,
                case when i % 5 = 0 then timestamptz '2026-08-30' else timestamptz '2026-01-01' end
           from generate_series(1, 150000) i;
         insert into legal.holds (customer_id, scope, released_at)
         select c, 'all', null from generate_series(1, 50) c
         union all select c, 'tickets', timestamptz '2026-02-01' from generate_series(51, 100) c
         union all select c, null, null from generate_series(101, 110) c
         union all select c, 'billing', null from generate_series(111, 120) c
         union all select null, 'all', null;
         analyze demo.tickets; analyze legal.holds;",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let old = "i % 5 <> 0";
    let held = |c: &str| {
        format!(
            "(select count(*) from generate_series(1, 150000) i where {old} and i % 1000 {c})::bigint"
        )
    };
    let (on_hold, unknown) = (
        count(&app.pool, &format!("select {}", held("between 1 and 50"))).await,
        count(
            &app.pool,
            &format!("select {}", held("between 101 and 110")),
        )
        .await,
    );
    let (run_id, _) = app.planned_run().await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["remaining_eligible"], 0, "{run}");
    let eligible = 120_000 - on_hold - unknown;
    assert_eq!(run["deleted"], eligible, "{run}");
    // Planning counted the held rows under the exclusion's name and the unknown reason.
    let planning: Value =
        sqlx::query_scalar("select held_at_planning from sweeper.runs where run_id = $1")
            .bind(&run_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(planning["customer_hold"], on_hold, "{planning}");
    assert_eq!(planning["unknown:legal.holds.scope"], unknown, "{planning}");
    // Exactly the old tickets without an active hold are gone; every young one is kept.
    let left_old = count(
        &app.pool,
        "select count(*) from demo.tickets where id % 5 <> 0",
    )
    .await;
    assert_eq!(left_old, on_hold + unknown);
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from demo.tickets where id % 5 <> 0
              and not (customer_id between 1 and 50 or customer_id between 101 and 110)"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from demo.tickets where id % 5 = 0"
        )
        .await,
        30_000
    );
    // A kept ticket's history says which exclusion holds it now.
    let kept = app.get_json("/policies/ticket-retention/items/1001").await;
    assert_eq!(kept["present_state"]["held_by"], "customer_hold", "{kept}");
    let unknown_one = app.get_json("/policies/ticket-retention/items/1101").await;
    assert_eq!(
        unknown_one["present_state"]["held_by"], "unknown:legal.holds.scope",
        "{unknown_one}"
    );
    // Releasing the hold makes the rows eligible for the next run.
    sqlx::query("update legal.holds set released_at = now() where customer_id = 1")
        .execute(&app.pool)
        .await
        .unwrap();
    let released = app.get_json("/policies/ticket-retention/items/1001").await;
    assert_eq!(released["present_state"]["eligible"], true, "{released}");
}

/// Without a foreign key, a hold committed while a command's delete statement runs does not
/// stop that statement (it reads `legal.holds` as of its start); every later command honours
/// it. Shown on a 1,000-row command: the delete waits on a row an application transaction holds,
/// the hold for its customer commits meanwhile, and the customer's tickets of that command go.
#[tokio::test]
async fn a_hold_committed_while_a_delete_runs_misses_that_command_without_a_foreign_key() {
    let app = spawn(
        policy(1_000, &[CUSTOMER_HOLD]),
        "[consume]\nlock_timeout = \"30s\"",
    )
    .await;
    seed_old(&app.pool, 1, 1_000, 10).await;
    let (run_id, commands) = app.planned_run().await;
    assert_eq!(commands.len(), 1);
    let blocker = lock_ticket(&app.db.url, 500).await;
    let worker = drain_in_background(&app);
    wait_for_delete(&app.pool, "Lock").await;
    sqlx::query("insert into legal.holds (customer_id, scope) values (0, 'all')")
        .execute(&app.pool)
        .await
        .unwrap();
    release_ticket(blocker).await;
    worker.await.unwrap();
    assert_eq!(app.wait_terminal(&run_id).await["status"], "completed");
    // Customer 0's hold committed before the command ended, yet its 100 tickets went.
    assert_eq!(
        count(&app.pool, "select count(*) from demo.tickets").await,
        0
    );
    assert_eq!(
        outcomes(&app.pool, &run_id).await,
        vec![("deleted".into(), None, 1_000)]
    );
    // The next command honours it.
    seed_old(&app.pool, 1_001, 1_100, 10).await;
    crate::kit::ledger::advance_clock(&app.pool, 86_400).await;
    let (status, next) = app.trigger("ticket-retention", "").await;
    assert_eq!(status, 202, "{next}");
    let next_id = next["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&next_id).await;
    app.drain().await;
    assert_eq!(app.wait_terminal(&next_id).await["status"], "completed");
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from demo.tickets where customer_id = 0"
        )
        .await,
        10
    );
}

/// The application sets an own-column flag on the customer's tickets in the hold's transaction:
/// the delete, waiting on those rows, re-reads them at their newest version and keeps them.
#[tokio::test]
async fn an_own_column_set_with_the_hold_closes_the_gap() {
    let own = r#"{ column = "legal_hold", equals = true }"#;
    let app = spawn(
        policy(1_000, &[own, CUSTOMER_HOLD]),
        "[consume]\nlock_timeout = \"30s\"",
    )
    .await;
    seed_old(&app.pool, 1, 1_000, 10).await;
    let (run_id, _) = app.planned_run().await;
    let mut hold = session(&app).await;
    sqlx::query("begin").execute(&mut hold).await.unwrap();
    sqlx::query("update demo.tickets set legal_hold = true where customer_id = 0")
        .execute(&mut hold)
        .await
        .unwrap();
    let worker = drain_in_background(&app);
    wait_for_delete(&app.pool, "Lock").await;
    sqlx::query("insert into legal.holds (customer_id, scope) values (0, 'all')")
        .execute(&mut hold)
        .await
        .unwrap();
    sqlx::query("commit").execute(&mut hold).await.unwrap();
    worker.await.unwrap();
    assert_eq!(app.wait_terminal(&run_id).await["status"], "completed");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.tickets").await,
        100
    );
    assert_eq!(
        outcomes(&app.pool, &run_id).await,
        vec![
            ("deleted".into(), None, 900),
            ("excluded".into(), Some("legal_hold".into()), 100)
        ]
    );
}

/// With a foreign key from the hold to the ticket, the hold committed first: the delete, which
/// waited on the hold's key lock, fails with 23503 at its end, is redone, and the ticket is
/// kept and audited `excluded` as the hold — no failed item, no dead letter.
#[tokio::test]
async fn with_a_foreign_key_a_hold_committed_first_keeps_the_row() {
    let app = spawn(
        policy(1_000, &[TICKET_HOLD]),
        "[consume]\nlock_timeout = \"30s\"",
    )
    .await;
    seed_old(&app.pool, 1, 1_000, 10).await;
    let (run_id, _) = app.planned_run().await;
    let mut hold = session(&app).await;
    sqlx::query("begin").execute(&mut hold).await.unwrap();
    sqlx::query("insert into legal.ticket_holds (ticket_id) values (500)")
        .execute(&mut hold)
        .await
        .unwrap();
    let worker = drain_in_background(&app);
    wait_for_delete(&app.pool, "Lock").await;
    sqlx::query("commit").execute(&mut hold).await.unwrap();
    worker.await.unwrap();
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(
        count(&app.pool, "select count(*) from demo.tickets").await,
        1
    );
    assert_eq!(
        outcomes(&app.pool, &run_id).await,
        vec![
            ("deleted".into(), None, 999),
            ("excluded".into(), Some("ticket_hold".into()), 1)
        ]
    );
    assert_eq!(
        count(&app.pool, "select count(*) from sweeper.dead_letters").await,
        0
    );
}

/// With the foreign key, the delete committed first: the hold's insert, which waited on the
/// deleted row, fails with 23503, and the ticket is audited `deleted`. Never a deleted row
/// whose hold committed.
#[tokio::test]
async fn with_a_foreign_key_a_delete_committed_first_refuses_the_hold() {
    let app = spawn(policy(1_000, &[TICKET_HOLD]), "").await;
    seed_old(&app.pool, 1, 1_000, 10).await;
    // The delete of ticket 500 sleeps a second, holding the row, before the command commits.
    sqlx::raw_sql(
        "create function demo.slow_delete() returns trigger language plpgsql as $$
         begin perform pg_sleep(1); return old; end $$;
         create trigger slow_delete after delete on demo.tickets
             for each row when (old.id = 500) execute function demo.slow_delete();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (run_id, _) = app.planned_run().await;
    let worker = drain_in_background(&app);
    wait_for_delete(&app.pool, "PgSleep").await;
    let mut hold = session(&app).await;
    let refused = sqlx::query("insert into legal.ticket_holds (ticket_id) values (500)")
        .execute(&mut hold)
        .await
        .unwrap_err();
    assert_eq!(
        refused
            .as_database_error()
            .and_then(|d| d.code())
            .as_deref(),
        Some("23503"),
        "{refused}"
    );
    worker.await.unwrap();
    assert_eq!(app.wait_terminal(&run_id).await["status"], "completed");
    assert_eq!(
        outcomes(&app.pool, &run_id).await,
        vec![("deleted".into(), None, 1_000)]
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from legal.ticket_holds h
              where not exists (select 1 from demo.tickets t where t.id = h.ticket_id)"
        )
        .await,
        0
    );
}

/// Selections on rows of another table: `exists` (a NULL in a compared column does not match)
/// and `not_exists` (a NULL does match, so the row is not selected); a row that stops matching
/// is `not_eligible` with `not_selected:exists:{table}`.
#[tokio::test]
async fn selections_test_related_rows_with_nulls_on_the_safe_side() {
    let policies = r#"
[[policy]]
name = "ticket-retention"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "demo.tickets", key = "id", timestamp = "closed_at" }
select = [ { exists = { table = "legal.holds", on = [ { related = "customer_id", target = "customer_id" } ],
                        where = [ { column = "scope", equals = "closed_account" } ] } },
           { not_exists = { table = "legal.ticket_holds", on = [ { related = "ticket_id", target = "id" } ] } },
           { not_exists = { table = "legal.holds", on = [ { related = "customer_id", target = "customer_id" } ],
                            where = [ { column = "scope", equals = "all" } ] } } ]
allow_delete = true
batch_size = 10
"#;
    let app = spawn(policies.into(), "").await;
    seed_old(&app.pool, 1, 40, 10).await;
    sqlx::raw_sql(
        "insert into legal.holds (customer_id, scope) values
            (1, 'closed_account'), (2, 'closed_account'), (3, 'closed_account'), (4, null),
            (3, 'all'), (2, null);
         insert into legal.ticket_holds (ticket_id) values (11);",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (run_id, _) = app.planned_run().await;
    app.drain().await;
    assert_eq!(app.wait_terminal(&run_id).await["status"], "completed");
    // Customer 1's tickets but 11 (a ticket hold) go; customer 2's stay (a NULL scope may be
    // `all`); customer 3 has `all`; customer 4's NULL scope is not `closed_account`.
    let left: Vec<i64> = sqlx::query_scalar(
        "select id from demo.tickets where customer_id in (1, 2, 3, 4) order by id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(left, vec![2, 3, 4, 11, 12, 13, 14, 22, 23, 24, 32, 33, 34]);
    assert_eq!(
        count(&app.pool, "select count(*) from demo.tickets").await,
        40 - 3
    );
    let item = app.get_json("/policies/ticket-retention/items/4").await;
    assert_eq!(
        item["present_state"]["not_eligible_reason"], "not_selected:exists:legal.holds",
        "{item}"
    );
    let item = app.get_json("/policies/ticket-retention/items/2").await;
    assert_eq!(
        item["present_state"]["not_eligible_reason"], "not_selected:not_exists:legal.holds",
        "{item}"
    );
}

/// What `check-config` says about rows of another table, in our words.
#[tokio::test]
async fn check_config_says_what_a_hold_in_another_table_needs_and_guarantees() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(SETUP).execute(&pool).await.unwrap();
    sqlx::raw_sql(
        "create table legal.cascading (ticket_id bigint references demo.tickets (id) on delete cascade);
         create table legal.unindexed (customer_id integer, scope text);
",
    )
    .execute(&pool)
    .await
    .unwrap();
    let with = |name: &str, exclude: &str| {
        format!(
            "[[policy]]\nname = \"{name}\"\nschedule = {{ cron = \"0 2 * * *\" }}\n\
             target = {{ table = \"demo.tickets\", key = \"id\", timestamp = \"closed_at\" }}\n\
             retain_for = \"90d\"\nexclude = [ {exclude} ]\n"
        )
    };
    let rel = |table: &str, on: &str, wh: &str| {
        format!("{{ exists = {{ table = \"{table}\", on = [ {on} ], where = [ {wh} ] }} }}")
    };
    let by_customer = r#"{ related = "customer_id", target = "customer_id" }"#;
    let by_ticket = r#"{ related = "ticket_id", target = "id" }"#;
    let policies = [
        with("customer", CUSTOMER_HOLD),
        with("ticket", TICKET_HOLD),
        with(
            "released",
            &rel(
                "legal.ticket_holds",
                by_ticket,
                r#"{ column = "placed_at", is_not_null = true }"#,
            ),
        ),
        with("cascading", &rel("legal.cascading", by_ticket, "")),
        with("missing", &rel("legal.nothing", by_customer, "")),
        with(
            "columns",
            &rel(
                "legal.holds",
                r#"{ related = "client", target = "customer_id" }, { related = "customer_id", target = "owner" }"#,
                r#"{ column = "nope", is_null = true }"#,
            ),
        ),
        with(
            "typed",
            &rel(
                "legal.unindexed",
                by_customer,
                r#"{ column = "scope", equals = true }"#,
            ),
        ),
        with(
            "values",
            &rel(
                "legal.holds",
                by_customer,
                r#"{ column = "released_at", equals = "not a time" }"#,
            ),
        ),
    ]
    .join("\n");
    let path = write_config(&config_toml(&db.url, 0, "", &policies));
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    for expected in [
        "warning: policy[customer]: exclude[0].exists (customer_hold): a hold committed while a delete statement runs can miss it",
        "warning: policy[released]: exclude[0].exists (legal.ticket_holds): a row of legal.ticket_holds that no longer matches `where` (a released hold) still references its row through foreign key ticket_holds_ticket_id_fkey",
        "info: policy[ticket]: exclude[0].exists (ticket_hold): a hold committed while a command deletes is safe: foreign key ticket_holds_ticket_id_fkey on legal.ticket_holds references demo.tickets on exactly the `on` columns with ON DELETE NO ACTION",
        "error: policy[cascading]: exclude[0].exists (legal.cascading): foreign key cascading_ticket_id_fkey on legal.cascading references demo.tickets with ON DELETE CASCADE: deleting a row would delete the hold itself",
        "warning: policy[cascading]: exclude[0].exists: no index of legal.cascading leads with ticket_id; every row the rule tests scans it (create index on legal.cascading (ticket_id))",
        "error: policy[missing]: exclude[0].exists.table: table legal.nothing does not exist",
        "error: policy[columns]: exclude[0].exists.on[0].related: column client does not exist in legal.holds",
        "error: policy[columns]: exclude[0].exists.on[1].target: column owner does not exist in demo.tickets",
        "error: policy[columns]: exclude[0].exists.where[0]: column nope does not exist in legal.holds",
        "error: policy[typed]: exclude[0].exists.on[0]: legal.unindexed.customer_id is integer but demo.tickets.customer_id is bigint; the columns of a pair must have one type",
        "error: policy[typed]: exclude[0].exists.where[0]: a boolean value is given for column scope, which is text",
        "error: policy[values]: exclude[0].exists.where[0]: value `not a time` is not a valid timestamp with time zone for column released_at",
    ] {
        assert!(
            stdout.contains(expected),
            "missing `{expected}` in:\n{stdout}"
        );
    }
    // The hold's foreign key is spoken for by its exclusion, not reported as one that fails
    // deletes.
    assert!(
        !stdout.contains("policy[ticket]: foreign key ticket_holds_ticket_id_fkey"),
        "{stdout}"
    );

    // Shapes refused before any database is read.
    for (exclude, expected) in [
        (
            r#"{ column = "status", exists = { table = "legal.holds", on = [ { related = "customer_id", target = "customer_id" } ] } }"#,
            "exclude[0]: give either `column` with its test or `exists`, not both",
        ),
        (
            r#"{ exists = { table = "legal.holds", on = [] } }"#,
            "exclude[0]: exists.on: pair 1-4 columns of legal.holds",
        ),
        (
            r#"{ exists = { table = "legal.holds", on = [ { related = "customer_id", target = "customer_id" } ], where = [ { column = "scope" } ] } }"#,
            "exclude[0]: exists.where[0]: give exactly one of equals, in, is_null, is_not_null (found 0)",
        ),
        (
            r#"{ exists = { table = "legal.holds", on = [ { related = "customer_id", target = "customer_id", extra = 1 } ] } }"#,
            "extra",
        ),
    ] {
        let path = write_config(&config_toml(&db.url, 0, "", &with("shape", exclude)));
        let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
            .output()
            .unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_ne!(out.status.code(), Some(0), "{all}");
        assert!(all.contains(expected), "missing `{expected}` in:\n{all}");
    }
}

/// The related table dropped while the server runs: the work is held (kind `schema`), nothing
/// is deleted under rules that can no longer be checked.
#[tokio::test]
async fn a_related_table_dropped_at_run_time_holds_the_work() {
    let app = spawn(policy(10, &[CUSTOMER_HOLD]), "").await;
    seed_old(&app.pool, 1, 20, 10).await;
    sqlx::query("insert into legal.holds (customer_id, scope) values (1, 'all')")
        .execute(&app.pool)
        .await
        .unwrap();
    let (run_id, _) = app.planned_run().await;
    sqlx::raw_sql("drop table legal.holds")
        .execute(&app.pool)
        .await
        .unwrap();
    app.drain().await;
    assert_eq!(
        count(&app.pool, "select count(*) from demo.tickets").await,
        20
    );
    let held: Vec<(String, Option<String>)> = sqlx::query_as(
        "select coalesce(held_kind, state), last_error from sweeper.commands where run_id = $1",
    )
    .bind(&run_id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert!(
        held.iter().all(|(kind, why)| kind == "schema"
            && why.as_deref().is_some_and(|w| w.contains("legal.holds"))),
        "{held:?}"
    );
}

/// The state of each command of the run: state, hold kind, last error.
async fn command_rows(
    pool: &PgPool,
    run_id: &str,
) -> Vec<(String, Option<String>, Option<String>)> {
    sqlx::query_as(
        "select state, held_kind, last_error from sweeper.commands where run_id = $1 order by 1",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A hold whose foreign key is `DEFERRABLE INITIALLY DEFERRED` commits while the delete runs, in
/// a command that also has a row the delete leaves (a `BEFORE DELETE` trigger keeps it): the
/// conflict comes at the commit, the command is redone item by item — not quarantined — and the
/// held ticket is `excluded`.
#[tokio::test]
async fn a_deferred_foreign_key_met_at_the_commit_redoes_the_command_item_by_item() {
    let hold = r#"{ name = "ticket_hold", exists = { table = "legal.deferred_holds",
      on = [ { related = "ticket_id", target = "id" } ] } }"#;
    let app = spawn(policy(1_000, &[hold]), "").await;
    seed_old(&app.pool, 1, 1_000, 10).await;
    sqlx::raw_sql(
        "create function demo.keep_and_slow() returns trigger language plpgsql as $$
         begin
           if old.id = 10 then return null; end if;
           if old.id = 400 then perform pg_sleep(1.5); end if;
           return old;
         end $$;
         create trigger keep_and_slow before delete on demo.tickets
             for each row execute function demo.keep_and_slow();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (run_id, _) = app.planned_run().await;
    let worker = drain_in_background(&app);
    wait_for_delete(&app.pool, "PgSleep").await;
    sqlx::query("insert into legal.deferred_holds (ticket_id) values (500), (600)")
        .execute(&app.pool)
        .await
        .unwrap();
    worker.await.unwrap();
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(
        run["status"],
        "completed",
        "{run} {:?}",
        command_rows(&app.pool, &run_id).await
    );
    assert_eq!(
        outcomes(&app.pool, &run_id).await,
        vec![
            ("deleted".into(), None, 997),
            ("excluded".into(), Some("ticket_hold".into()), 2),
            (
                "not_eligible".into(),
                Some(
                    "not_deleted: the delete left the row (a BEFORE DELETE trigger or a row \
                     security policy kept it)"
                        .into()
                ),
                1
            ),
        ]
    );
    assert_eq!(
        count(&app.pool, "select count(*) from sweeper.dead_letters").await,
        0
    );
}

/// A hold released while the delete runs: the delete, which read it as of its start, leaves
/// the customer's rows; they are deleted again in a new statement, which sees the release — not
/// blamed on a trigger or a row security policy.
#[tokio::test]
async fn a_hold_released_while_the_delete_runs_lets_the_rows_go_in_the_same_command() {
    let app = spawn(policy(1_000, &[CUSTOMER_HOLD]), "").await;
    seed_old(&app.pool, 1, 1_000, 10).await;
    sqlx::raw_sql(
        "create function demo.slow_delete() returns trigger language plpgsql as $$
         begin perform pg_sleep(1); return old; end $$;
         create trigger slow_delete after delete on demo.tickets
             for each row when (old.id = 500) execute function demo.slow_delete();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (run_id, _) = app.planned_run().await;
    sqlx::query("insert into legal.holds (customer_id, scope) values (3, 'all')")
        .execute(&app.pool)
        .await
        .unwrap();
    let worker = drain_in_background(&app);
    wait_for_delete(&app.pool, "PgSleep").await;
    sqlx::query("update legal.holds set released_at = now() where customer_id = 3")
        .execute(&app.pool)
        .await
        .unwrap();
    worker.await.unwrap();
    assert_eq!(app.wait_terminal(&run_id).await["status"], "completed");
    assert_eq!(
        outcomes(&app.pool, &run_id).await,
        vec![("deleted".into(), None, 1_000)]
    );
}

/// Row security on the related table would hide holds from sweeper's role: `check-config`
/// refuses it, and a policy that meets it at run time (enabled after start) is held, deleting
/// nothing.
#[tokio::test]
async fn row_security_on_a_hold_table_is_refused_and_holds_the_work() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    let role = format!(
        "sweeper_rls_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    sqlx::raw_sql(SETUP).execute(&pool).await.unwrap();
    // The role owns the database and every table (as sweeper's role owns its ledger): only
    // FORCE ROW LEVEL SECURITY makes a policy apply to it.
    sqlx::raw_sql(&format!(
        "create role {role} login;
         alter database {db} owner to {role};
         do $$ declare r record; begin
           for r in select c.oid::regclass::text as n from pg_class c
                      join pg_namespace s on s.oid = c.relnamespace
                     where s.nspname in ('sweeper', 'demo', 'legal', 'public')
                       and c.relkind in ('r', 'p', 'v', 'm')
           loop execute format('alter table %s owner to {role}', r.n); end loop;
           for r in select p.oid::regprocedure::text as n from pg_proc p
                      join pg_namespace s on s.oid = p.pronamespace
                     where s.nspname in ('sweeper', 'demo', 'legal')
           loop execute format('alter routine %s owner to {role}', r.n); end loop;
         end $$;
         alter schema sweeper owner to {role};
         alter schema demo owner to {role};
         alter schema legal owner to {role};",
        db = db.name
    ))
    .execute(&pool)
    .await
    .unwrap();
    let url = {
        let mut u = url::Url::parse(&db.url).unwrap();
        u.set_username(&role).unwrap();
        u.to_string()
    };
    seed_old(&pool, 1, 100, 10).await;
    sqlx::query("insert into legal.holds (customer_id, scope) values (3, 'all')")
        .execute(&pool)
        .await
        .unwrap();
    let policies = policy(1_000, &[CUSTOMER_HOLD]);
    let served = Served::start(&url, &policies).await;
    crate::kit::ledger::set_clock(&pool, at("2026-09-01T02:01:00Z")).await;
    // Holds per tenant; sweeper's role sets no tenant, so it would see none.
    sqlx::raw_sql(
        "alter table legal.holds enable row level security;
         alter table legal.holds force row level security;
         create policy tenant on legal.holds using (scope = current_setting('app.tenant', true));",
    )
    .execute(&pool)
    .await
    .unwrap();
    let path = write_config(&config_toml(&url, 0, "", &policies));
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(
            "error: policy[ticket-retention]: exclude[0].exists.table: row security is active on \
             legal.holds for this database role"
        ),
        "{stdout}"
    );
    let run_id = served.api.trigger_new("ticket-retention", "").await;
    let mut held = None;
    for _ in 0..200 {
        held = sqlx::query_as::<_, (String, String)>(
            "select held_kind, held_reason from sweeper.planning_jobs
              where run_id = $1 and held_kind is not null",
        )
        .bind(&run_id)
        .fetch_optional(&pool)
        .await
        .unwrap();
        if held.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    served.stop().await;
    let (kind, reason) = held.expect("planning is held");
    assert_eq!(kind, "schema");
    assert!(
        reason.contains("row security is active on legal.holds"),
        "{reason}"
    );
    assert_eq!(count(&pool, "select count(*) from demo.tickets").await, 100);
    pool.close().await;
    drop(db);
    // The role owns nothing once its database is gone.
    let mut admin = crate::kit::db::admin().await;
    let _ = sqlx::query(&format!("drop role if exists {role}"))
        .execute(&mut admin)
        .await;
}

/// `check-config` on `on` pairs that cannot compare (no `=`, two collations), foreign keys that
/// would delete or blank a hold whichever columns they use, keys of the same name on two
/// tables, and a `not_exists` selection over a key that cascades.
#[tokio::test]
async fn check_config_refuses_pairs_that_cannot_compare_and_keys_that_destroy_holds() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(SETUP).execute(&pool).await.unwrap();
    sqlx::raw_sql(
        r#"alter table demo.tickets add column doc json, add column ref text collate "C";
         create table legal.jsonholds (doc json);
         create table legal.collholds (ref text collate "POSIX");
         create index on legal.collholds (ref);
         create table legal.same (ticket_id bigint, constraint samename foreign key (ticket_id) references demo.tickets (id));
         create index on legal.same (ticket_id);
         create table legal.other (ticket_id bigint, constraint samename foreign key (ticket_id) references demo.tickets (id) on delete cascade);
         create index on legal.other (ticket_id);
         create table legal.subset (ticket_id bigint references demo.tickets (id) on delete set null, customer_id bigint);
         create index on legal.subset (ticket_id, customer_id);"#,
    )
    .execute(&pool)
    .await
    .unwrap();
    let with = |name: &str, exclude: &str| {
        format!(
            "[[policy]]\nname = \"{name}\"\nschedule = {{ cron = \"0 2 * * *\" }}\n\
             target = {{ table = \"demo.tickets\", key = \"id\", timestamp = \"closed_at\" }}\n\
             retain_for = \"90d\"\nexclude = [ {exclude} ]\n"
        )
    };
    let policies = [
        with("json", r#"{ exists = { table = "legal.jsonholds", on = [ { related = "doc", target = "doc" } ] } }"#),
        with("collation", r#"{ exists = { table = "legal.collholds", on = [ { related = "ref", target = "ref" } ] } }"#),
        with("samename", r#"{ exists = { table = "legal.same", on = [ { related = "ticket_id", target = "id" } ] } }"#),
        with(
            "subset",
            r#"{ exists = { table = "legal.subset", on = [ { related = "ticket_id", target = "id" }, { related = "customer_id", target = "customer_id" } ] } }"#,
        ),
        r#"[[policy]]
name = "notexists"
schedule = { cron = "0 2 * * *" }
target = { table = "demo.tickets", key = "id", timestamp = "closed_at" }
select = [ { not_exists = { table = "legal.other", on = [ { related = "ticket_id", target = "id" } ] } } ]
allow_delete = true
"#
        .to_string(),
    ]
    .join("\n");
    let path = write_config(&config_toml(&db.url, 0, "", &policies));
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    for expected in [
        "error: policy[json]: exclude[0].exists.on[0]: legal.jsonholds.doc and demo.tickets.doc are json, which has no equality operator",
        "error: policy[collation]: exclude[0].exists.on[0]: legal.collholds.ref is collated \"POSIX\" but demo.tickets.ref is collated \"C\"",
        "info: policy[samename]: exclude[0].exists (legal.same): a hold committed while a command deletes is safe: foreign key samename on legal.same",
        "warning: policy[samename]: foreign key samename on legal.other references demo.tickets with ON DELETE CASCADE",
        "error: policy[subset]: exclude[0].exists (legal.subset): foreign key subset_ticket_id_fkey on legal.subset references demo.tickets with ON DELETE SET NULL: deleting a row would rewrite the hold itself",
        "error: policy[notexists]: select[0].not_exists (not_exists): foreign key samename on legal.other references demo.tickets with ON DELETE CASCADE",
    ] {
        assert!(
            stdout.contains(expected),
            "missing `{expected}` in:\n{stdout}"
        );
    }
}
