//! Applying the ledger's migrations, with sqlx's bookkeeping table in schema `sweeper`
//! (docs/design.md §7).
//!
//! sqlx names its table `_sqlx_migrations` without a schema, so it lands in the first schema of
//! the connection's `search_path`: `public` for releases before this one, which made running
//! sweeper need `CREATE` on `public`. This release migrates with `search_path = sweeper`. A
//! database an earlier release migrated has its table moved, and a view
//! `public._sqlx_migrations` over the moved table is left until the operator drops it, so an
//! older replica still running during the rollout reads (and its migrator skips creating) the
//! same table instead of creating an empty one in `public` and applying every migration again.

use sqlx::{Acquire, PgConnection, PgPool};

/// Where the migrations are recorded: `sweeper._sqlx_migrations`, or the earlier releases'
/// `public._sqlx_migrations` while a database has not been migrated by this release.
const TABLES: [&str; 2] = ["sweeper._sqlx_migrations", "public._sqlx_migrations"];

/// Why migrating failed, in words an operator can act on.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// Creating schema `sweeper` or moving sqlx's table into it.
    #[error("{0}")]
    Prepare(String),
    /// sqlx's migrator.
    #[error(transparent)]
    Apply(#[from] sqlx::migrate::MigrateError),
}

/// Applies this binary's migrations on `conn` (its own connection: the session's `search_path`
/// is set for the migrator and reset afterwards).
///
/// A database that already holds every migration of this binary is left untouched, so a runtime
/// role that may not create anything (deploy/roles.sql) can start with `migrate_on_start` once
/// the migration owner has migrated.
pub async fn migrate(conn: &mut PgConnection) -> Result<(), MigrateError> {
    if current(conn)
        .await
        .map_err(sqlx::migrate::MigrateError::from)?
    {
        return Ok(());
    }
    prepare(conn).await?;
    sqlx::query("set search_path to sweeper")
        .execute(&mut *conn)
        .await
        .map_err(sqlx::migrate::MigrateError::from)?;
    let applied = super::migrator().run(&mut *conn).await;
    let reset = sqlx::query("reset search_path").execute(&mut *conn).await;
    applied?;
    reset.map_err(sqlx::migrate::MigrateError::from)?;
    Ok(())
}

/// Whether `sweeper._sqlx_migrations` records every migration of this binary as applied, with
/// the same checksum.
async fn current(conn: &mut PgConnection) -> sqlx::Result<bool> {
    let exists: bool =
        sqlx::query_scalar("select to_regclass('sweeper._sqlx_migrations') is not null")
            .fetch_one(&mut *conn)
            .await?;
    if !exists {
        return Ok(false);
    }
    // A checksum that differs is not current: sqlx's migrator then refuses with its reason.
    let applied: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("select version, checksum from sweeper._sqlx_migrations where success")
            .fetch_all(&mut *conn)
            .await?;
    Ok(super::MIGRATOR.iter().all(|m| {
        applied
            .iter()
            .any(|(v, sum)| *v == m.version && sum.as_slice() == &*m.checksum)
    }))
}

/// Schema `sweeper` exists (made here only when missing: `create schema if not exists` needs
/// `CREATE` on the database even when the schema is there, and deploy/roles.sql makes it for a
/// migration owner that lacks it), and sqlx's table of an earlier release is moved into it.
async fn prepare(conn: &mut PgConnection) -> Result<(), MigrateError> {
    let fail = |what: &str, e: sqlx::Error| MigrateError::Prepare(format!("{what}: {e}"));
    let schema: bool = sqlx::query_scalar("select to_regnamespace('sweeper') is not null")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| fail("reading the catalog", e))?;
    if !schema {
        sqlx::query("create schema sweeper")
            .execute(&mut *conn)
            .await
            .map_err(|e| {
                fail(
                    "creating schema sweeper (the role needs CREATE on the database, or run \
                     deploy/roles.sql first, which makes the schema for the migration owner)",
                    e,
                )
            })?;
    }
    let mut tx = conn
        .begin()
        .await
        .map_err(|e| fail("beginning a transaction", e))?;
    // Replicas starting together with `migrate_on_start` move it once.
    sqlx::query("select pg_advisory_xact_lock(hashtext('sweeper:migrations_table'))")
        .execute(&mut *tx)
        .await
        .map_err(|e| fail("taking the migration table's lock", e))?;
    let earlier: bool = sqlx::query_scalar(
        "select to_regclass('sweeper._sqlx_migrations') is null
            and exists (select from pg_class
                         where oid = to_regclass('public._sqlx_migrations') and relkind = 'r')",
    )
    .fetch_one(&mut *tx)
    .await
    .map_err(|e| fail("reading the catalog", e))?;
    if !earlier {
        return Ok(());
    }
    for statement in [
        "alter table public._sqlx_migrations set schema sweeper",
        "create view public._sqlx_migrations as select * from sweeper._sqlx_migrations",
        "comment on view public._sqlx_migrations is
             'sweeper: for replicas of a release before the move of this table to schema sweeper; \
              drop it once no replica of an earlier release runs'",
        // The view is owned by whoever migrates (a superuser, say), and the earlier release's
        // replicas connect as another role; migration versions are not secret. The moved table
        // keeps its owner, who still reads it directly.
        "grant select on public._sqlx_migrations to public",
    ] {
        sqlx::query(statement)
            .execute(&mut *tx)
            .await
            .map_err(|e| {
                fail(
                    "moving sqlx's migration table public._sqlx_migrations to schema sweeper (run \
                 `sweeper migrate` once as the table's owner with CREATE on schema public and on \
                 schema sweeper, or run deploy/roles.sql as the database owner, which moves it)",
                    e,
                )
            })?;
    }
    tx.commit()
        .await
        .map_err(|e| fail("committing the move of sqlx's migration table", e))
}

/// The newest migration applied successfully, read where the table is (readyz).
pub async fn applied_version(pool: &PgPool) -> sqlx::Result<Option<i64>> {
    let mut conn = pool.acquire().await?;
    for table in TABLES {
        let found: bool = sqlx::query_scalar("select to_regclass($1) is not null")
            .bind(table)
            .fetch_one(&mut *conn)
            .await?;
        if found {
            return sqlx::query_scalar(&format!("select max(version) from {table} where success"))
                .fetch_one(&mut *conn)
                .await;
        }
    }
    Ok(None)
}
