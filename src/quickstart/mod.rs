//! `sweeper quickstart`: the main jobs on real input, end to end.
//!
//! Each scenario owns one database on the PostgreSQL server named by `DATABASE_URL` (default
//! [`DEFAULT_SERVER_URL`]), drops and recreates it (and never touches another), seeds it, starts
//! the real server on a local port, mints a token, triggers its policies over HTTP as a cron
//! would, waits for the runs and prints a report:
//! - `retention` ([`retention`], the default): `ticket-retention` over `demo.tickets` in
//!   `sweeper_quickstart`;
//! - `digest` ([`digest`]): the weekly support digest and its cleanup stage in
//!   `sweeper_quickstart_digest`, against a local digest API over real HTTP;
//! - `uploads` ([`uploads`]): `upload-retention` over `app.uploads` in
//!   `sweeper_quickstart_uploads`, deleting each expired upload's file from a local directory
//!   (the `local` object store) and then its row;
//! - `reconciliation` ([`reconciliation`]): `payment-reconciliation` over `billing.payments` in
//!   `sweeper_quickstart_reconciliation`, against a local payment provider over real HTTP.
//!
//! The digest, uploads and reconciliation scenarios abort their server mid-run as a crash would
//! ([`Demo::restart`]) and let a new one finish.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Connection, PgConnection};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::app::Application;
use crate::settings::Config;

pub mod digest;
mod digest_api;
mod payments_api;
pub mod reconciliation;
pub mod retention;
pub mod uploads;

pub use retention::DEMO_DATABASE;

/// The server used when `DATABASE_URL` is not set.
pub const DEFAULT_SERVER_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Which job the quick start shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Ticket retention: delete closed tickets past 90 days, exclusions held.
    #[default]
    Retention,
    /// The weekly support digest: one call per active customer and week, then the cleanup of
    /// the digest data, a worker restart in the middle.
    Digest,
    /// Expired uploads: delete each one's file from the bucket (a local directory), then its
    /// row; legal hold and uploads in progress kept, a worker restart in the middle.
    Uploads,
    /// Nightly payment reconciliation: each closed payment checked against a payment
    /// provider's copy and stamped on a match; mismatches left for an operator, a worker
    /// restart in the middle.
    Reconciliation,
}

/// Options of `sweeper quickstart`.
#[derive(Debug, Clone)]
pub struct Options {
    /// Which job.
    pub scenario: Scenario,
    /// Stop after the report, printing a JSON summary as the last stdout line.
    pub exit: bool,
    /// Port to serve on; 0 picks a free one.
    pub port: u16,
    /// Tickets to seed (retention scenario).
    pub rows: i64,
}

/// Runs the chosen scenario.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    match opts.scenario {
        Scenario::Retention => retention::run(opts).await,
        Scenario::Digest => digest::run(opts).await,
        Scenario::Uploads => uploads::run(opts).await,
        Scenario::Reconciliation => reconciliation::run(opts).await,
    }
}

/// The latest tick of `cron` (UTC) at or before now, and the same as `?window=` text.
fn latest_window(cron: &str) -> anyhow::Result<(DateTime<Utc>, String)> {
    let schedule = crate::window::Schedule::new(cron, "UTC").map_err(anyhow::Error::msg)?;
    let window = schedule
        .latest_tick_at_or_before(Utc::now())
        .context("no tick yet")?;
    Ok((window, crate::window::format(window)))
}

/// Polls `reached` every 10 ms until it says so or `limit` has passed (where a scenario aborts
/// its server).
async fn wait_until(limit: Duration, mut reached: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !reached().await && started.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `url` without its password, for a report.
fn without_password(url: &url::Url) -> String {
    let mut safe = url.clone();
    let _ = safe.set_password(None);
    safe.to_string()
}

/// The items a run (`GET /runs/{id}`) held at planning, every reason summed.
fn held_total(run: &Value) -> i64 {
    run["held_at_planning"]
        .as_object()
        .map_or(0, |h| h.values().filter_map(Value::as_i64).sum())
}

/// Items of `run_id` audited with `outcome` (`deleted`, `already_absent`, ...).
async fn audited(conn: &mut PgConnection, run_id: &str, outcome: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "select count(*) from sweeper.audit_trail where run_id = $1 and outcome = $2",
    )
    .bind(run_id)
    .bind(outcome)
    .fetch_one(conn)
    .await?)
}

/// The server URL from `DATABASE_URL` and the URL of the scenario's own `database` on it.
fn urls(database: &str) -> anyhow::Result<(String, url::Url)> {
    let server_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_SERVER_URL.into());
    let mut demo_url = url::Url::parse(&server_url).context("DATABASE_URL is not a URL")?;
    demo_url.set_path(&format!("/{database}"));
    Ok((server_url, demo_url))
}

/// Drops and recreates `database` (a constant of this module: only a quick start's own database
/// is ever dropped) and connects to it.
async fn recreate_database(database: &'static str) -> anyhow::Result<(PgConnection, url::Url)> {
    let (server_url, demo_url) = urls(database)?;
    let mut admin = PgConnection::connect(&server_url)
        .await
        .with_context(|| "cannot connect to the PostgreSQL server in DATABASE_URL".to_string())?;
    sqlx::query(&format!("drop database if exists {database} with (force)"))
        .execute(&mut admin)
        .await?;
    sqlx::query(&format!("create database {database}"))
        .execute(&mut admin)
        .await?;
    let conn = PgConnection::connect(demo_url.as_str()).await?;
    Ok((conn, demo_url))
}

/// A quick start's running server and a client with an all-scopes token for it.
pub(super) struct Demo {
    /// `http://127.0.0.1:{port}`.
    pub base: String,
    /// Bearer token (1 h) with every scope.
    pub token: String,
    /// The HTTP client.
    pub client: reqwest::Client,
    toml: String,
    shutdown: CancellationToken,
    server: JoinHandle<anyhow::Result<()>>,
}

impl Demo {
    /// Starts the server on `database_url` with `port` and the configuration `rest` (queue,
    /// dependencies, policies), a fresh random HS256 secret for this session only.
    pub async fn start(database_url: &url::Url, port: u16, rest: &str) -> anyhow::Result<Demo> {
        let secret = hex::encode(rand::random::<[u8; 32]>());
        let toml = format!(
            "database_url = \"{database_url}\"\nlisten = \"127.0.0.1:{port}\"\n{rest}\n\
             [[auth.issuer]]\niss = \"sweeper-quickstart\"\naudience = \"sweeper\"\n\
             keys = [ {{ kid = \"quickstart\", secret = \"{secret}\" }} ]\n",
        );
        // From the text alone: a deployment's SWEEPER_* or DATABASE_URL must not redirect it.
        let config = Config::from_toml(&toml).map_err(|e| anyhow::anyhow!("{e}"))?;
        let token = crate::auth::mint(
            &config.credentials.issuers[0],
            "quickstart",
            &[
                "trigger:*".into(),
                "ops:read".into(),
                "ops:write".into(),
                "consume".into(),
            ],
            3_600,
        )?;
        let (base, shutdown, server) = serve(config).await?;
        Ok(Demo {
            base,
            token,
            client: reqwest::Client::new(),
            toml,
            shutdown,
            server,
        })
    }

    /// Aborts the server as a crash would (its workers' calls and transactions in flight are
    /// dropped, their leases left to expire) and starts a new one on the same configuration.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.server.abort();
        let _ = (&mut self.server).await;
        let config = Config::from_toml(&self.toml).map_err(|e| anyhow::anyhow!("{e}"))?;
        let (base, shutdown, server) = serve(config).await?;
        (self.base, self.shutdown, self.server) = (base, shutdown, server);
        Ok(())
    }

    /// `POST /trigger/{policy}?window={window}`: the new (or existing) run.
    pub async fn trigger(&self, policy: &str, window: &str) -> anyhow::Result<Value> {
        Ok(self.trigger_status(policy, window).await?.1)
    }

    /// [`Demo::trigger`] with the answer's status: 202 for a new run, 200 for the window's
    /// existing one.
    pub async fn trigger_status(&self, policy: &str, window: &str) -> anyhow::Result<(u16, Value)> {
        let url = format!("{}/trigger/{policy}?window={window}", self.base);
        let resp = self
            .client
            .post(&url)
            .bearer_auth(&self.token)
            .send()
            .await?;
        let status = resp.status();
        let run: Value = resp.json().await?;
        if !status.is_success() {
            bail!("trigger answered {status}: {run}");
        }
        println!(
            "POST {url}\n-> {status}: run {}, cutoff {}",
            run["run_id"].as_str().unwrap_or("?"),
            run["cutoff"].as_str().unwrap_or("?")
        );
        Ok((status.as_u16(), run))
    }

    /// `GET {path}` as JSON (a non-2xx answer is an error).
    pub async fn get(&self, path: &str) -> anyhow::Result<Value> {
        Ok(self
            .client
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// Polls `GET /runs/{run_id}` until the run is terminal (at most 10 minutes), showing its
    /// `progress` on stderr: a bar redrawn in place on a terminal, a plain line every 2 s
    /// otherwise.
    pub async fn wait_terminal(&self, run_id: &str) -> anyhow::Result<Value> {
        use std::io::{IsTerminal, Write};
        let started = Instant::now();
        let terminal = std::io::stderr().is_terminal();
        let mut last_line = Instant::now();
        loop {
            let r = self.get(&format!("/runs/{run_id}")).await?;
            let done = crate::ledger::is_terminal_run_status(r["status"].as_str().unwrap_or(""));
            if terminal {
                eprint!("\r{}\x1b[K", progress_line(&r, true));
                if done {
                    eprintln!();
                }
                let _ = std::io::stderr().flush();
            } else if done || last_line.elapsed() >= Duration::from_secs(2) {
                eprintln!("{}", progress_line(&r, false));
                last_line = Instant::now();
            }
            if done {
                return Ok(r);
            }
            if started.elapsed() > Duration::from_secs(600) {
                bail!("the run did not finish within 10 minutes: {r}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// With `exit`, stops the server; else prints the variables the on-call runbook (docs/on-call.md)
    /// uses (`SWEEPER_URL`, `SWEEPER_TOKEN`, `RUN` = `run_id`), writes this session's
    /// configuration (its random secret included, mode 0600) so a longer-lived token can be
    /// minted against it, prints `hints` (curl lines) and serves until Ctrl-C.
    pub async fn finish(self, exit: bool, run_id: &str, hints: &[String]) -> anyhow::Result<()> {
        if !exit {
            let config_path = std::env::temp_dir().join(format!(
                "sweeper-quickstart-{}.toml",
                self.base.rsplit(':').next().unwrap_or("0")
            ));
            write_private(&config_path, &self.toml)?;
            println!();
            println!(
                "sweeper keeps serving on {} until Ctrl-C. In another shell, paste:",
                self.base
            );
            println!("  export SWEEPER_URL={}", self.base);
            println!("  export SWEEPER_TOKEN={}", self.token);
            println!("  export RUN={run_id}");
            println!(
                "The token lasts 1 h and this session's signing secret is random; a longer one \
                 (the runbook of docs/on-call.md then works as written):"
            );
            // This very binary, by its absolute path: the line works from any directory.
            let exe = std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "sweeper".into());
            println!(
                "  export SWEEPER_TOKEN=$({exe} token --config {} --scope \"ops:read ops:write trigger:* consume\" --ttl 8h --sub \"${{USER:-oncall}}\")",
                config_path.display()
            );
            println!("Try:");
            for h in hints {
                println!("  {h}");
            }
            crate::app::shutdown_on_signal(self.shutdown.clone()).await;
            let _ = std::fs::remove_file(&config_path);
        }
        self.shutdown.cancel();
        self.server.await??;
        Ok(())
    }
}

/// One line of a run's `progress` (`GET /runs/{id}`): a bar when `bar`, plain words otherwise.
fn progress_line(run: &Value, bar: bool) -> String {
    let p = &run["progress"];
    // While planning, the walk's estimate (when it has one); then the items executed.
    let fraction = match (run["status"].as_str(), p["planned_fraction"].as_f64()) {
        (Some("planning"), Some(planned)) => planned,
        _ => p["executed_fraction"].as_f64().unwrap_or(0.0),
    };
    let eta = p["eta_seconds"]
        .as_f64()
        .map(|s| format!(", ETA {s:.0}s"))
        .unwrap_or_default();
    let words = format!(
        "{} {:>3.0}%: {}/{} items, {} commands of {}, {:.0} items/s{eta}",
        run["status"].as_str().unwrap_or("?"),
        fraction * 100.0,
        p["items_done"],
        p["items_planned"],
        p["commands_done"],
        p["commands"],
        p["items_per_second"].as_f64().unwrap_or(0.0),
    );
    if !bar {
        return format!("progress: {words}");
    }
    let filled = (fraction * 30.0).round() as usize;
    format!(
        "[{}{}] {words}",
        "#".repeat(filled),
        ".".repeat(30 - filled.min(30))
    )
}

/// Writes `text` to `path` readable by its owner only (it holds a signing secret).
fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(text.as_bytes())
}

async fn serve(
    config: Config,
) -> anyhow::Result<(String, CancellationToken, JoinHandle<anyhow::Result<()>>)> {
    let app = Application::build(config).await?;
    let base = format!("http://127.0.0.1:{}", app.port());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(app.run_until(shutdown.clone()));
    Ok((base, shutdown, server))
}
