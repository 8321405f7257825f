//! The state the execution pipeline, planning, the push relay, the background jobs and the
//! HTTP handlers share (one per process): the database pool, the validated configuration, the
//! catalog and spec caches, wake-ups, this replica's identity and the dependencies' clients.
//! Defined below everything that uses it, so none of them imports the application (`app/`).

use std::str::FromStr;
use std::sync::Arc;

use anyhow::Context;
use secrecy::ExposeSecret;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::Notify;

use crate::ledger;
use crate::policy::Catalog;
use crate::settings::Config;

/// State shared by handlers, workers and the planner. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// The ledger's (and the targets') database.
    pub pool: PgPool,
    /// The validated configuration.
    pub config: Arc<Config>,
    /// Column types of target tables.
    pub catalog: Arc<Catalog>,
    /// Per policy, the column types of its table when this replica checked it at start-up
    /// (rules hold work on a column whose type changed since).
    pub checked_types: Arc<std::collections::HashMap<String, crate::policy::CheckedTypes>>,
    /// Policy specs by version.
    pub specs: Arc<ledger::SpecCache<crate::policy::PolicySpec>>,
    /// Wakes idle built-in workers (new commands were planned).
    pub wake_workers: Arc<Notify>,
    /// Wakes the planner (a run was created).
    pub wake_planner: Arc<Notify>,
    /// Wakes the partition retirer (a run's planning is done).
    pub wake_retirer: Arc<Notify>,
    /// This process's identity as a lease owner.
    pub replica_id: uuid::Uuid,
    /// Downstream dependencies: clients, per-replica limits, the shared pause view.
    pub dependencies: Arc<crate::dependency::Dependencies>,
    /// This replica's database-health governor (readings and each policy's verdict).
    pub governor: crate::governor::Governor,
}

/// Opens a pool on `config.database_url` with the configured size and acquire timeout.
///
/// Every connection gets `idle_in_transaction_session_timeout` (a stuck transaction cannot pin
/// locks for ever), `lock_timeout` and `statement_timeout` (`database.*`: no statement waits
/// without bound for what another session holds, so shutdown and the background loops stay
/// bounded too) and `application_name = sweeper`.
pub async fn connect(config: &Config) -> anyhow::Result<PgPool> {
    let lock_timeout = format!("{}s", config.database.lock_timeout.seconds());
    let statement_timeout = format!("{}s", config.database.statement_timeout.seconds());
    let opts = connect_options(config)?.options([
        ("idle_in_transaction_session_timeout", "60s"),
        ("lock_timeout", lock_timeout.as_str()),
        ("statement_timeout", statement_timeout.as_str()),
    ]);
    PgPoolOptions::new()
        .max_connections(config.database.max_connections)
        .acquire_timeout(config.database.acquire_timeout.std())
        .connect_with(opts)
        .await
        .context("cannot connect to the database (database_url)")
}

fn connect_options(config: &Config) -> anyhow::Result<PgConnectOptions> {
    Ok(
        PgConnectOptions::from_str(config.database_url.expose_secret())
            .context("database_url is not a valid PostgreSQL URL")?
            .application_name("sweeper"),
    )
}

/// Applies pending migrations on a connection of its own, without the pool's lock and statement
/// timeouts: a migration may wait for another replica's migration lock, or rewrite a table.
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect_with(&connect_options(config)?)
        .await
        .context("cannot connect to the database (database_url)")?;
    ledger::migrations::migrate(&mut conn)
        .await
        .context("applying migrations")?;
    let _ = conn.close().await;
    Ok(())
}
