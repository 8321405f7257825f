//! Databases for tests and benchmarks: a fresh one per test, cloned from a migrated template made
//! once per process, dropped when its [`TestDb`] drops (even when the test panics).

use std::sync::OnceLock;

use chrono::{DateTime, Utc};
use sqlx::{Connection, PgConnection, PgPool};

/// The PostgreSQL server the tests use (`DATABASE_URL`'s server, default the local one).
pub fn server_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// The URL of database `name` on [`server_url`]'s server.
pub fn database_url(name: &str) -> String {
    let mut u = url::Url::parse(&server_url()).unwrap();
    u.set_path(&format!("/{name}"));
    u.to_string()
}

/// A connection to the server's maintenance database (to create and drop databases).
pub async fn admin() -> PgConnection {
    PgConnection::connect(&server_url())
        .await
        .expect("PostgreSQL answers")
}

/// Drops database `name` if it exists, disconnecting its sessions.
pub async fn drop_database(name: &str) {
    let mut a = admin().await;
    sqlx::query(&format!("drop database if exists {name} with (force)"))
        .execute(&mut a)
        .await
        .unwrap();
}

/// Creates database `name` as a copy of `template` (replacing an earlier `name`).
pub async fn copy_database(template: &str, name: &str) {
    drop_database(name).await;
    let mut a = admin().await;
    sqlx::query(&format!("create database {name} template {template}"))
        .execute(&mut a)
        .await
        .unwrap();
}

/// Creates an empty database `name` (replacing an earlier one) with the ledger migrated.
pub async fn create_migrated(name: &str) -> PgPool {
    drop_database(name).await;
    let mut a = admin().await;
    sqlx::query(&format!("create database {name}"))
        .execute(&mut a)
        .await
        .unwrap();
    let pool = PgPool::connect(&database_url(name)).await.unwrap();
    sweeper::ledger::migrations::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    pool
}

static TEMPLATE: OnceLock<String> = OnceLock::new();

/// Creates (once per test process) a database with the ledger migrated, to clone per test.
fn template() -> &'static str {
    TEMPLATE.get_or_init(|| {
        let name = format!("sweeper_tpl_{}", std::process::id());
        let n = name.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                drop_stale_databases().await;
                create_migrated(&n).await.close().await;
            });
        })
        .join()
        .unwrap();
        name
    })
}

/// Drops the test databases of earlier, killed test processes (their pid suffix names no
/// running process).
async fn drop_stale_databases() {
    let mut admin = admin().await;
    let stale: Vec<String> = sqlx::query_scalar(
        "select datname::text from pg_database
          where datname like 'sweeper_tpl_%' or datname like 'sweeper_t_%'",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    for db in stale {
        let alive = db
            .rsplit('_')
            .next()
            .and_then(|p| p.parse::<u32>().ok())
            .map(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
            .unwrap_or(false);
        if !alive {
            let _ = sqlx::query(&format!("drop database if exists {db} with (force)"))
                .execute(&mut admin)
                .await;
        }
    }
}

/// A test database, dropped when this value drops (even when the test panics).
pub struct TestDb {
    pub name: String,
    pub url: String,
}

impl TestDb {
    /// A fresh copy of the migrated template.
    pub async fn create() -> TestDb {
        let tpl = template();
        // The pid suffix lets a later process tell our leftovers from a live run's databases.
        let name = format!(
            "sweeper_t_{}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12],
            std::process::id()
        );
        let mut admin = admin().await;
        sqlx::query(&format!("create database {name} template {tpl}"))
            .execute(&mut admin)
            .await
            .unwrap();
        TestDb {
            url: database_url(&name),
            name,
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs outside any runtime it could block on: a thread with its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(&server_url()).await {
                    let _ = sqlx::query(&format!("drop database if exists {name} with (force)"))
                        .execute(&mut admin)
                        .await;
                }
            });
        })
        .join();
    }
}

/// An RFC 3339 instant.
pub fn at(s: &str) -> DateTime<Utc> {
    sweeper::window::parse_rfc3339(s).unwrap()
}
