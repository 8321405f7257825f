//! Least privilege (docs/design.md §7): deploy/roles.sql's migration owner migrates, and its
//! runtime role — no CREATE anywhere, column grants on the target — serves a run (including the
//! row-lock fallback), a housekeeping round and an audit retention pass. And sqlx's migration
//! table moves from `public` into `sweeper` with a view left for the previous release.

use sqlx::{Connection, PgConnection, PgPool};
use sweeper::app::worker::{WorkerStep, run_one_command};
use sweeper::execute::ConsumeOutcome;

use crate::common::*;
use crate::kit::db::{admin, database_url};

const ROLES_SQL: &str = include_str!("../../deploy/roles.sql");

/// `url` with its user replaced by `user`.
fn as_user(url: &str, user: &str) -> String {
    let mut u = url::Url::parse(url).unwrap();
    u.set_username(user).unwrap();
    u.to_string()
}

/// An empty database of its own (dropped with the returned [`TestDb`]).
async fn empty_database() -> TestDb {
    let name = format!(
        "sweeper_lp_{}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12],
        std::process::id()
    );
    sqlx::query(&format!("create database {name}"))
        .execute(&mut admin().await)
        .await
        .unwrap();
    TestDb {
        url: database_url(&name),
        name,
    }
}

/// A login role of its own, for a previous release's deployment (the caller drops it after the
/// database).
async fn previous_role() -> String {
    let name = format!(
        "sweeper_lp_old_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    sqlx::query(&format!("create role {name} login"))
        .execute(&mut admin().await)
        .await
        .unwrap();
    name
}

async fn drop_role(name: &str) {
    sqlx::query(&format!("drop role if exists {name}"))
        .execute(&mut admin().await)
        .await
        .unwrap();
}

/// The previous release's migrator: this binary's migrations before least privilege
/// (20261205000025), which it applied with the connection's default search_path.
fn previous_release() -> sqlx::migrate::Migrator {
    let mut m = sweeper::ledger::migrator();
    m.migrations = m
        .migrations
        .iter()
        .filter(|m| m.version < 20261205000025)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    m
}

/// `db` owned by `role`, migrated by the previous release connected as it: the layout of a
/// deployment before least privilege (every object in schema `sweeper` and sqlx's table in
/// `public` owned by the one role sweeper ran as).
async fn previous_layout(db: &TestDb, role: &str) {
    sqlx::query(&format!("alter database {} owner to {role}", db.name))
        .execute(&mut admin().await)
        .await
        .unwrap();
    let pool = PgPool::connect(&as_user(&db.url, role)).await.unwrap();
    previous_release().run(&pool).await.unwrap();
    pool.close().await;
}

async fn scalar_bool(pool: &PgPool, sql: &str) -> bool {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test]
async fn a_run_housekeeping_and_audit_retention_pass_under_the_runtime_role_of_roles_sql() {
    let db = empty_database().await;
    let admin_pool = PgPool::connect(&db.url).await.unwrap();
    // Before the first migration, then after it (it grants on what the migration made).
    sqlx::raw_sql(ROLES_SQL).execute(&admin_pool).await.unwrap();
    let mut owner = PgConnection::connect(&as_user(&db.url, "sweeper_owner"))
        .await
        .unwrap();
    sweeper::ledger::migrations::migrate(&mut owner)
        .await
        .unwrap();
    owner.close().await.unwrap();
    sqlx::raw_sql(ROLES_SQL).execute(&admin_pool).await.unwrap();

    // The runtime role creates nothing: not in the database, not in public, not in sweeper.
    for (what, sql) in [
        (
            "database",
            "select has_database_privilege('sweeper_runtime', current_database(), 'CREATE')",
        ),
        (
            "public",
            "select has_schema_privilege('sweeper_runtime', 'public', 'CREATE')",
        ),
        (
            "sweeper",
            "select has_schema_privilege('sweeper_runtime', 'sweeper', 'CREATE')",
        ),
        (
            "migrations",
            "select has_table_privilege('sweeper_runtime', 'sweeper._sqlx_migrations', 'INSERT')",
        ),
    ] {
        assert!(!scalar_bool(&admin_pool, sql).await, "{what}");
    }
    assert!(
        scalar_bool(
            &admin_pool,
            "select to_regclass('sweeper._sqlx_migrations') is not null
                and to_regclass('public._sqlx_migrations') is null"
        )
        .await
    );

    // The target is the application's; the runtime role gets the grants check-config names.
    sqlx::raw_sql(&format!(
        "{TICKETS};
         grant usage on schema demo to sweeper_runtime;
         grant select (id, status, legal_hold, closed_at), delete on demo.tickets to sweeper_runtime;
         grant update (closed_at) on demo.tickets to sweeper_runtime"
    ))
    .execute(&admin_pool)
    .await
    .unwrap();
    set_clock(&admin_pool, at("2027-01-31T02:01:00Z")).await;
    let dir = std::env::temp_dir().join(format!("sweeper-lp-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let runtime_db = TestDb {
        name: db.name.clone(),
        url: as_user(&db.url, "sweeper_runtime"),
    };
    // migrate_on_start stays on: a schema that holds every migration is left untouched.
    let app = TestApp::start(
        runtime_db,
        admin_pool.clone(),
        0,
        &format!(
            "[consume]\nlock_timeout = \"1s\"\n[ledger]\naudit_retention = \"120d\"\naudit_export_dir = \"{}\"",
            dir.display()
        ),
        &ticket_policy(10),
    )
    .await;
    let role: String = sqlx::query_scalar("select current_user::text")
        .fetch_one(&app.state.pool)
        .await
        .unwrap();
    assert_eq!(role, "sweeper_runtime");

    // A run, with one row locked by the application: the command deletes its neighbours under
    // FOR UPDATE SKIP LOCKED, which the column's UPDATE grant allows.
    let eligible = seed_mixed(&admin_pool, 14, at("2027-01-31T02:00:00Z")).await;
    let (run_id, commands) = app.planned_run().await;
    assert_eq!(commands.len(), 1);
    let blocker = lock_ticket(&db.url, eligible[0]).await;
    match run_one_command(&app.state).await.unwrap() {
        WorkerStep::Ran(ConsumeOutcome::NotNow { .. }) => {}
        other => panic!("{other:?}"),
    }
    let (class, error): (Option<String>, Option<String>) = sqlx::query_as(
        "select last_error_class, last_error from sweeper.commands where command_id = $1",
    )
    .bind(&commands[0])
    .fetch_one(&admin_pool)
    .await
    .unwrap();
    assert_eq!(class.as_deref(), Some("locked"), "{error:?}");
    let deleted: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.audit_trail where run_id = $1 and outcome = 'deleted'",
    )
    .bind(&run_id)
    .fetch_one(&admin_pool)
    .await
    .unwrap();
    assert_eq!(deleted as usize, eligible.len() - 1);
    release_ticket(blocker).await;
    crate::kit::ledger::advance_clock(&admin_pool, 6).await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["deleted"], eligible.len(), "{run}");

    // A housekeeping round, which makes the audit's months ahead through the owner's function.
    sweeper::app::housekeeping::housekeeping_once(&app.state)
        .await
        .unwrap();
    // Audit retention: January ended more than 120 days before July.
    set_clock(&admin_pool, at("2027-07-15T00:00:00Z")).await;
    // (The server's own housekeeping may have made them first: either way, as the owner.)
    sweeper::ledger::audit::ensure_partitions(&app.state.pool)
        .await
        .unwrap();
    let owners: Vec<String> = sqlx::query_scalar(
        "select distinct pg_get_userbyid(relowner)::text from pg_class
          where relnamespace = 'sweeper'::regnamespace and relname like 'audit%2027_09'",
    )
    .fetch_all(&admin_pool)
    .await
    .unwrap();
    assert_eq!(owners, ["sweeper_owner"]);
    let lease = sweeper::app::job_lease::HeldJob::take(&app.state, "audit_retention")
        .await
        .unwrap()
        .unwrap();
    let dropped = sweeper::app::audit_retention::audit_retention_pass(&app.state, &lease)
        .await
        .unwrap();
    assert!(dropped >= 1, "{dropped}");
    let (state, rows): (String, i64) = sqlx::query_as(
        "select state, rows from sweeper.audit_exports where partition = 'audit_2027_01'",
    )
    .fetch_one(&admin_pool)
    .await
    .unwrap();
    assert_eq!((state.as_str(), rows > 0), ("dropped", true));
    assert!(
        scalar_bool(
            &admin_pool,
            "select to_regclass('sweeper.audit_2027_01') is null
                and to_regclass('sweeper.audit_items_2027_01') is null
                and not exists (select from sweeper.audit_partitions
                                 where partition = 'audit_2027_01')"
        )
        .await
    );
    assert!(dir.join("sweeper-audit-audit_2027_01.jsonl.gz").exists());

    // The owner's functions refuse a month without a recorded export.
    let refused = sqlx::query("select sweeper.drop_audit_month('audit_2027_08')")
        .execute(&app.state.pool)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("has no recorded export"),
        "{refused}"
    );
    // Nor a month that has not ended, export or not, and nor more than 24 months ahead.
    sqlx::query(
        "insert into sweeper.audit_exports (partition, from_at, to_at, state, rows, sha256, location)
         select partition, from_at, to_at, 'exported', 0, '', 'test'
           from sweeper.audit_partitions where partition = 'audit_2027_07'",
    )
    .execute(&admin_pool)
    .await
    .unwrap();
    for f in ["detach_audit_month", "drop_audit_month"] {
        let refused = sqlx::query(&format!("select sweeper.{f}('audit_2027_07')"))
            .execute(&app.state.pool)
            .await
            .unwrap_err();
        assert!(
            refused.to_string().contains("has not ended"),
            "{f}: {refused}"
        );
    }
    let refused = sqlx::query("select sweeper.ensure_audit_partitions(25)")
        .execute(&app.state.pool)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("at most 24 months"),
        "{refused}"
    );
    assert!(
        scalar_bool(
            &admin_pool,
            "select to_regclass('sweeper.audit_2027_07') is not null
                and to_regclass('sweeper.audit_2029_07') is null"
        )
        .await
    );
    let (db, _) = app.stop().await;
    drop(db);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A database an earlier release migrated (sqlx's table in `public`), as the role it ran as: this
/// release, migrated by a superuser, moves the table into `sweeper` and leaves a view in `public`,
/// through which the earlier release's migrator (default search_path, its own role) finds every
/// migration applied and creates nothing. The owner's functions are the audit owner's, and that
/// role (a runtime that owns the audit) makes, detaches and drops months.
#[tokio::test]
async fn the_migration_table_moves_to_schema_sweeper_and_the_previous_release_reads_it() {
    let db = empty_database().await;
    let old = previous_role().await;
    // The previous release: sqlx's migrator with the default search_path, as its own role.
    previous_layout(&db, &old).await;
    let pool = PgPool::connect(&db.url).await.unwrap();
    assert!(
        scalar_bool(
            &pool,
            "select to_regclass('public._sqlx_migrations') is not null
                and to_regclass('sweeper._sqlx_migrations') is null"
        )
        .await
    );

    // This release, migrated by a superuser.
    sweeper::ledger::migrations::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    let kinds: Vec<(String, String)> = sqlx::query_as(
        "select n.nspname::text, c.relkind::text from pg_class c
           join pg_namespace n on n.oid = c.relnamespace
          where c.relname = '_sqlx_migrations' order by 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        kinds,
        [
            ("public".into(), "v".into()),
            ("sweeper".into(), "r".into())
        ]
    );
    let owners: Vec<String> = sqlx::query_scalar(
        "select distinct pg_get_userbyid(proowner)::text from pg_proc
          where pronamespace = 'sweeper'::regnamespace
            and proname in ('ensure_audit_partitions', 'make_audit_month', 'audit_month_tables',
                            'detach_audit_month', 'drop_audit_month')",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(owners, std::slice::from_ref(&old));

    // The previous release's replica, started again during the rollout, as its role.
    let previous = PgPool::connect(&as_user(&db.url, &old)).await.unwrap();
    previous_release().run(&previous).await.unwrap();
    let after: i64 = sqlx::query_scalar("select count(*) from sweeper._sqlx_migrations")
        .fetch_one(&previous)
        .await
        .unwrap();
    assert_eq!(after as usize, sweeper::ledger::MIGRATOR.iter().count());
    let through_view: i64 = sqlx::query_scalar("select count(*) from public._sqlx_migrations")
        .fetch_one(&previous)
        .await
        .unwrap();
    assert_eq!(through_view, after);
    assert!(
        scalar_bool(
            &pool,
            "select relkind = 'v' from pg_class where oid = 'public._sqlx_migrations'::regclass"
        )
        .await
    );
    let newest = sweeper::ledger::MIGRATOR.iter().map(|m| m.version).max();
    for p in [&pool, &previous] {
        assert_eq!(
            sweeper::ledger::migrations::applied_version(p)
                .await
                .unwrap(),
            newest
        );
    }

    // This release running as that role (it owns the audit): months made, one detached and
    // dropped.
    set_clock(&pool, at("2031-06-15T00:00:00Z")).await;
    let made = sweeper::ledger::audit::ensure_partitions(&previous)
        .await
        .unwrap();
    assert!(made > 0, "{made}");
    let (partition, from_at, to_at) = sqlx::query_as(
        "select partition, from_at, to_at from sweeper.audit_partitions order by to_at limit 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let month = sweeper::ledger::audit::Partition {
        partition,
        from_at,
        to_at,
    };
    sqlx::query(
        "insert into sweeper.audit_exports (partition, from_at, to_at, state, rows, sha256, location)
         values ($1, $2, $3, 'exported', 0, '', 'test')",
    )
    .bind(&month.partition)
    .bind(month.from_at)
    .bind(month.to_at)
    .execute(&pool)
    .await
    .unwrap();
    sweeper::ledger::audit::detach(&previous, &month)
        .await
        .unwrap();
    sweeper::ledger::audit::drop_partition(&previous, &month)
        .await
        .unwrap();
    assert!(
        scalar_bool(
            &pool,
            &format!("select to_regclass('sweeper.{}') is null", month.partition)
        )
        .await
    );

    // And this release again: nothing to do.
    sweeper::ledger::migrations::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    previous.close().await;
    pool.close().await;
    drop(db);
    drop_role(&old).await;
}

/// roles.sql takes over a previous release's layout whole: the audit's partitioned tables and
/// their partitions too, so the owner's functions make the audit's months for the runtime role.
#[tokio::test]
async fn roles_sql_takes_over_every_table_of_a_previous_release_partitions_included() {
    let db = empty_database().await;
    let old = previous_role().await;
    previous_layout(&db, &old).await;
    let admin_pool = PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(ROLES_SQL).execute(&admin_pool).await.unwrap();
    let mut owner = PgConnection::connect(&as_user(&db.url, "sweeper_owner"))
        .await
        .unwrap();
    sweeper::ledger::migrations::migrate(&mut owner)
        .await
        .unwrap();
    owner.close().await.unwrap();
    sqlx::raw_sql(ROLES_SQL).execute(&admin_pool).await.unwrap();
    let others: Vec<String> = sqlx::query_scalar(
        "select c.oid::regclass::text || ' ' || pg_get_userbyid(c.relowner) from pg_class c
          where c.relnamespace = 'sweeper'::regnamespace
            and c.relkind in ('r', 'p', 'v', 'm', 'S')
            and c.relowner <> 'sweeper_owner'::regrole
          order by 1",
    )
    .fetch_all(&admin_pool)
    .await
    .unwrap();
    assert!(others.is_empty(), "{others:?}");
    // The role that ran sweeper until now is a member of sweeper_owner: its replicas still work.
    let previous = PgPool::connect(&as_user(&db.url, &old)).await.unwrap();
    let months: i64 = sqlx::query_scalar("select count(*) from sweeper.audit_partitions")
        .fetch_one(&previous)
        .await
        .unwrap();
    assert!(months > 0);
    previous.close().await;

    sqlx::raw_sql(&format!(
        "{TICKETS};
         grant usage on schema demo to sweeper_runtime;
         grant select (id, status, legal_hold, closed_at), delete on demo.tickets to sweeper_runtime;
         grant update (closed_at) on demo.tickets to sweeper_runtime"
    ))
    .execute(&admin_pool)
    .await
    .unwrap();
    let runtime_db = TestDb {
        name: db.name.clone(),
        url: as_user(&db.url, "sweeper_runtime"),
    };
    let app = TestApp::start(runtime_db, admin_pool.clone(), 0, "", &ticket_policy(10)).await;
    // Months past every one made so far: the runtime role has them made by the owner.
    set_clock(&admin_pool, at("2031-06-15T00:00:00Z")).await;
    let made = sweeper::ledger::audit::ensure_partitions(&app.state.pool)
        .await
        .unwrap();
    assert!(made > 0, "{made}");
    assert!(
        scalar_bool(
            &admin_pool,
            "select pg_get_userbyid(relowner) = 'sweeper_owner' from pg_class
              where oid = 'sweeper.audit_items_2031_08'::regclass"
        )
        .await
    );
    let (db, _) = app.stop().await;
    admin_pool.close().await;
    drop(db);
    drop_role(&old).await;
}
