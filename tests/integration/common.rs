//! The test harness: a fresh database per test (cloned from a migrated template), a real server on
//! a random port, real HTTP, real JWTs, and the ledger's clock moved by a test-only offset.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Connection, PgConnection, PgPool};

pub use crate::kit::client::{Answer, Client};
pub use crate::kit::db::{TestDb, at, server_url};
pub use crate::kit::ledger::{set_clock, wait_transient_failure};
pub use crate::kit::process::free_port;
use sweeper::app::{AppState, Application};
use sweeper::auth::Issuer;
use sweeper::settings::Config;
use tokio_util::sync::CancellationToken;

pub const SECRET: &str = "test-secret-test-secret-test-secret-0123456789";
pub const OTHER_SECRET: &str = "another-secret-another-secret-another-secret-99";

/// The standard demo table used by most tests.
pub const TICKETS: &str = "
create schema demo;
create table demo.tickets (
    id bigint primary key,
    status text,
    legal_hold boolean,
    closed_at timestamptz
);
create index on demo.tickets (closed_at);
";

/// [`TICKETS`] with `demo.attachments`, whose foreign key (NO ACTION) refuses the delete of a
/// ticket it references: an item that fails alone, SQLSTATE 23503.
pub const TICKETS_WITH_CHILD: &str = "
create schema demo;
create table demo.tickets (id bigint primary key, status text, legal_hold boolean, closed_at timestamptz);
create index on demo.tickets (closed_at);
create table demo.attachments (id bigint primary key, ticket_id bigint references demo.tickets (id))
";

/// A server at 2026-09-01T02:01Z (a minute after the ticket policy's 02:00 window) with the
/// ticket policy (batch 10) plus `policy_extra`, `extra_toml` and the tables of `setup_sql`.
pub async fn ticket_app(policy_extra: &str, extra_toml: &str, setup_sql: &'static str) -> TestApp {
    TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: format!("{}{policy_extra}\n", ticket_policy(10)),
        extra_toml: extra_toml.into(),
        setup_sql,
        ..Default::default()
    })
    .await
}

/// On a [`TICKETS_WITH_CHILD`] app: references ticket `blocked` from `demo.attachments`, runs
/// the current window to its end (the blocked item fails alone, an item dead letter) and returns
/// the run id and the terminal run.
pub async fn run_with_blocked_item(app: &TestApp, blocked: i64) -> (String, Value) {
    sqlx::query("insert into demo.attachments values (1, $1)")
        .bind(blocked)
        .execute(&app.pool)
        .await
        .unwrap();
    let (run_id, _) = app.planned_run().await;
    app.drain().await;
    let run = app.wait_terminal(&run_id).await;
    (run_id, run)
}

/// A policy over `demo.tickets`, daily at 02:00 UTC, 90 days, excluding legal hold and open or
/// pending-export tickets.
pub fn ticket_policy(batch_size: usize) -> String {
    format!(
        r#"
[[policy]]
name = "ticket-retention"
schedule = {{ cron = "0 2 * * *", timezone = "UTC" }}
target = {{ table = "demo.tickets", key = "id", timestamp = "closed_at" }}
retain_for = "90d"
exclude = [ {{ column = "legal_hold", equals = true }},
            {{ column = "status", in = ["open", "pending_export"] }} ]
batch_size = {batch_size}
"#
    )
}

/// What to start.
pub struct Spawn {
    pub setup_sql: &'static str,
    pub policies: String,
    pub workers: usize,
    pub now: Option<DateTime<Utc>>,
    pub extra_toml: String,
}

impl Default for Spawn {
    fn default() -> Self {
        Spawn {
            setup_sql: TICKETS,
            policies: ticket_policy(10),
            workers: 0,
            now: None,
            extra_toml: String::new(),
        }
    }
}

pub struct TestApp {
    pub base: String,
    /// The API with a token holding every scope.
    pub api: Client,
    pub state: AppState,
    pub pool: PgPool,
    pub client: reqwest::Client,
    pub issuer: Issuer,
    pub shutdown: CancellationToken,
    pub server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    pub db: TestDb,
}

/// A configuration for tests. `extra` continues the `[queue]` table and may open others; a
/// `listen = "..."` line of its own replaces the default `127.0.0.1:0` (to keep a port across
/// restarts, or to know a public URL before starting).
pub fn config_toml(db_url: &str, workers: usize, extra: &str, policies: &str) -> String {
    let own_listen = extra
        .lines()
        .find(|l| l.trim_start().starts_with("listen ="))
        .map(str::to_string);
    let extra: String = extra
        .lines()
        .filter(|l| !l.trim_start().starts_with("listen ="))
        .map(|l| format!("{l}\n"))
        .collect();
    let listen = own_listen.unwrap_or_else(|| "listen = \"127.0.0.1:0\"".into());
    // An `extra` with a `[database]` table of its own sets the pool size there.
    let database = if extra.contains("[database]") {
        ""
    } else {
        "[database]\nmax_connections = 8"
    };
    format!(
        r#"
database_url = "{db_url}"
{listen}
migrate_on_start = true
{database}
[queue]
workers = {workers}
poll_interval = "1s"
{extra}
[[auth.issuer]]
iss = "sweeper-test"
audience = "sweeper"
keys = [ {{ kid = "k2", secret = "{SECRET}" }}, {{ kid = "k1", secret = "{OTHER_SECRET}" }} ]
{policies}
"#
    )
}

impl TestApp {
    pub async fn spawn(s: Spawn) -> TestApp {
        let db = TestDb::create().await;
        let pool = PgPool::connect(&db.url).await.unwrap();
        for stmt in s
            .setup_sql
            .split(';')
            .map(str::trim)
            .filter(|x| !x.is_empty())
        {
            sqlx::query(stmt).execute(&pool).await.unwrap();
        }
        if let Some(now) = s.now {
            set_clock(&pool, now).await;
        }
        Self::start(db, pool, s.workers, &s.extra_toml, &s.policies).await
    }

    /// Starts a server on an existing test database (used to restart with another config).
    pub async fn start(
        db: TestDb,
        pool: PgPool,
        workers: usize,
        extra: &str,
        policies: &str,
    ) -> TestApp {
        let config = Config::from_toml(&config_toml(&db.url, workers, extra, policies))
            .unwrap_or_else(|e| panic!("{e}"));
        let issuer = config.credentials.issuers[0].clone();
        let app = Application::build(config).await.unwrap();
        let base = format!("http://127.0.0.1:{}", app.port());
        let state = app.state();
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(app.run_until(shutdown.clone()));
        let api = Client::new(
            &base,
            sweeper::auth::mint(
                &issuer,
                "test-operator",
                &crate::kit::client::ALL_SCOPES.map(String::from),
                600,
            )
            .unwrap(),
        );
        TestApp {
            base,
            api,
            state,
            pool,
            client: reqwest::Client::new(),
            issuer,
            shutdown,
            server: Some(server),
            db,
        }
    }

    pub async fn stop(mut self) -> (TestDb, PgPool) {
        self.shutdown.cancel();
        if let Some(s) = self.server.take() {
            s.await.unwrap().unwrap();
        }
        (self.db, self.pool)
    }

    pub fn token(&self, scopes: &[&str]) -> String {
        let scopes: Vec<String> = scopes.iter().map(|s| s.to_string()).collect();
        sweeper::auth::mint(&self.issuer, "test-operator", &scopes, 600).unwrap()
    }

    pub fn ops_token(&self) -> String {
        self.token(&["ops:read", "ops:write", "trigger:*", "consume"])
    }

    pub async fn post(&self, path: &str, token: Option<&str>) -> reqwest::Response {
        let mut r = self.client.post(format!("{}{path}", self.base));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send().await.unwrap()
    }

    /// `GET path` with every scope, asserting 200.
    pub async fn get_json(&self, path: &str) -> Value {
        self.api.expect(200, reqwest::Method::GET, path, None).await
    }

    /// Triggers `policy` with a `?window=` and returns (status, run json).
    pub async fn trigger(&self, policy: &str, query: &str) -> (u16, Value) {
        let a = self.api.trigger(policy, query).await;
        (a.status, a.body)
    }

    /// `POST /consume` for `command_id` with a `consume`-only token.
    pub async fn consume(&self, command_id: &str) -> Answer {
        self.api
            .with_token(self.token(&["consume"]))
            .consume(command_id)
            .await
    }

    /// Waits until the run's planning is done.
    /// Triggers `ticket-retention` for the current window, waits until it is planned, and returns
    /// the run id and its command ids in batch order.
    pub async fn planned_run(&self) -> (String, Vec<String>) {
        let (status, run) = self.trigger("ticket-retention", "").await;
        assert!(status == 202 || status == 200, "{run}");
        let run_id = run["run_id"].as_str().unwrap().to_string();
        self.wait_planned(&run_id).await;
        let commands = self.command_ids(&run_id).await;
        (run_id, commands)
    }

    pub async fn wait_planned(&self, run_id: &str) {
        self.wait_until(run_id, "planning done", |r| r["planning_done"] == true)
            .await;
    }

    /// Waits until the run is terminal; returns it.
    pub async fn wait_terminal(&self, run_id: &str) -> Value {
        self.api.wait_terminal(run_id).await
    }

    pub async fn wait_until(&self, run_id: &str, what: &str, f: impl Fn(&Value) -> bool) -> Value {
        self.api.wait_run(run_id, what, f).await
    }

    /// Drives the built-in queue until nothing is due.
    pub async fn drain(&self) -> usize {
        let mut n = 0;
        while let sweeper::app::worker::WorkerStep::Ran(_) =
            sweeper::app::worker::run_one_command(&self.state)
                .await
                .unwrap()
        {
            n += 1;
        }
        n
    }

    pub async fn command_ids(&self, run_id: &str) -> Vec<String> {
        crate::kit::ledger::command_ids(&self.pool, run_id).await
    }

    /// (item_key, outcome, reason) of every audit row of a run.
    pub async fn audit(&self, run_id: &str) -> Vec<crate::kit::ledger::AuditRow> {
        crate::kit::ledger::audit(&self.pool, run_id).await
    }

    pub async fn ticket_ids(&self) -> Vec<i64> {
        sqlx::query_scalar("select id from demo.tickets order by id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }
}

/// Inserts tickets: (id, status, legal_hold, closed_at).
/// A ticket row: (id, status, legal_hold, closed_at).
pub type Ticket<'a> = (i64, Option<&'a str>, Option<bool>, Option<DateTime<Utc>>);

pub async fn insert_tickets(pool: &PgPool, rows: &[Ticket<'_>]) {
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    let statuses: Vec<Option<String>> = rows.iter().map(|r| r.1.map(str::to_string)).collect();
    let holds: Vec<Option<bool>> = rows.iter().map(|r| r.2).collect();
    let closed: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.3).collect();
    sqlx::query(
        "insert into demo.tickets (id, status, legal_hold, closed_at)
         select * from unnest($1::bigint[], $2::text[], $3::boolean[], $4::timestamptz[])",
    )
    .bind(ids)
    .bind(statuses)
    .bind(holds)
    .bind(closed)
    .execute(pool)
    .await
    .unwrap();
}

/// Seeds `n` tickets with ids 1..=n: every third too young, every seventh on legal hold, every
/// eleventh open; the rest eligible for a window of `window` with 90 days' retention.
/// Returns the eligible ids.
pub async fn seed_mixed(pool: &PgPool, n: i64, window: DateTime<Utc>) -> Vec<i64> {
    let cutoff = window - chrono::TimeDelta::days(90);
    let mut rows = Vec::new();
    let mut eligible = Vec::new();
    for id in 1..=n {
        let young = id % 3 == 0;
        let hold = id % 7 == 0;
        let open = id % 11 == 0;
        let closed = if young {
            cutoff + chrono::TimeDelta::hours(id)
        } else {
            cutoff - chrono::TimeDelta::hours(id)
        };
        if !young && !hold && !open {
            eligible.push(id);
        }
        rows.push((
            id,
            Some(if open { "open" } else { "closed" }),
            Some(hold),
            Some(closed),
        ));
    }
    for chunk in rows.chunks(5_000) {
        insert_tickets(pool, chunk).await;
    }
    eligible
}

/// Locks ticket `id` (`SELECT ... FOR UPDATE`) in a transaction on a connection of its own;
/// [`release_ticket`] commits it. Commands touching the row fail on `lock_timeout` meanwhile.
pub async fn lock_ticket(db_url: &str, id: i64) -> PgConnection {
    let mut c = PgConnection::connect(db_url).await.unwrap();
    sqlx::query("begin").execute(&mut c).await.unwrap();
    sqlx::query("select 1 from demo.tickets where id = $1 for update")
        .bind(id)
        .execute(&mut c)
        .await
        .unwrap();
    c
}

/// Ends [`lock_ticket`]'s transaction.
pub async fn release_ticket(mut c: PgConnection) {
    sqlx::query("commit").execute(&mut c).await.unwrap();
}

/// Makes every delete of ticket `id` fail transiently — SQLSTATE 40001 raised by a trigger on
/// `demo.tickets`, as a serialization failure would — until [`heal_ticket_deletes`]. (A locked row
/// no longer fails a command: it waits without spending attempts, see `locked_rows`.)
pub async fn fail_ticket_deletes(pool: &PgPool, id: i64) {
    sqlx::raw_sql(
        "create table if not exists demo.failing_deletes (id bigint primary key);
         create or replace function demo.fail_delete() returns trigger language plpgsql as $$
         begin
             if exists (select 1 from demo.failing_deletes f where f.id = old.id) then
                 raise exception 'could not serialize access to ticket % (a test trigger)', old.id
                     using errcode = 'serialization_failure';
             end if;
             return old;
         end $$;
         create or replace trigger fail_delete before delete on demo.tickets
             for each row execute function demo.fail_delete();",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("insert into demo.failing_deletes values ($1) on conflict do nothing")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
}

/// Ends [`fail_ticket_deletes`] for ticket `id`.
pub async fn heal_ticket_deletes(pool: &PgPool, id: i64) {
    sqlx::query("delete from demo.failing_deletes where id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
}

/// A served sweeper on any database URL (another cluster's, a clone's), driven like [`TestApp`].
pub struct Served {
    pub state: sweeper::app::AppState,
    pub api: Client,
    shutdown: tokio_util::sync::CancellationToken,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Served {
    pub async fn start(url: &str, policies: &str) -> Served {
        let config =
            sweeper::settings::Config::from_toml(&config_toml(url, 0, "", policies)).unwrap();
        let issuer = config.credentials.issuers[0].clone();
        let app = sweeper::app::Application::build(config).await.unwrap();
        let base = format!("http://127.0.0.1:{}", app.port());
        let state = app.state();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(app.run_until(shutdown.clone()));
        let scopes = crate::kit::client::ALL_SCOPES.map(String::from);
        let token = sweeper::auth::mint(&issuer, "test-operator", &scopes, 600).unwrap();
        Served {
            state,
            api: Client::new(&base, token),
            shutdown,
            server,
        }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        self.server.await.unwrap().unwrap();
        self.state.pool.close().await;
    }

    pub async fn drain(&self) -> usize {
        let mut n = 0;
        while let sweeper::app::worker::WorkerStep::Ran(_) =
            sweeper::app::worker::run_one_command(&self.state)
                .await
                .unwrap()
        {
            n += 1;
        }
        n
    }

    pub async fn governor_until(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let g = self
                .api
                .expect(200, reqwest::Method::GET, "/governor", None)
                .await;
            if done(&g) {
                return g;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "governor never {what}: {g}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    }
}

/// The signal `name` of the first policy in a `GET /governor` answer.
pub fn signal<'a>(g: &'a Value, name: &str) -> &'a Value {
    g["policies"][0]["signals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["signal"] == name)
        .unwrap()
}
