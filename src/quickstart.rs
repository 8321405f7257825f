//! `sweeper quickstart`: the main job on real input, end to end.
//!
//! On the PostgreSQL server named by `DATABASE_URL` (default
//! [`DEFAULT_SERVER_URL`]) it drops and recreates its own database, [`DEMO_DATABASE`] (and never
//! touches another), seeds `demo.tickets` with a support-desk dataset, starts the real server on a
//! local port, mints a token, triggers `ticket-retention` over HTTP for the latest tick as a cron
//! would, waits for the run, and prints a report.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

use crate::app::Application;
use crate::settings::Config;

/// The server used when `DATABASE_URL` is not set.
pub const DEFAULT_SERVER_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// The database quickstart owns: dropped and recreated on every run.
pub const DEMO_DATABASE: &str = "sweeper_quickstart";

/// Options of `sweeper quickstart`.
#[derive(Debug, Clone)]
pub struct Options {
    /// Stop after the report, printing a JSON summary as the last stdout line.
    pub exit: bool,
    /// Port to serve on; 0 picks a free one.
    pub port: u16,
    /// Tickets to seed.
    pub rows: i64,
}

/// The demo policy, as an operator would write it.
const POLICY: &str = r#"
[[policy]]
name = "ticket-retention"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "demo.tickets", key = "id", timestamp = "closed_at" }
retain_for = "90d"
exclude = [ { column = "legal_hold", equals = true },
            { column = "status", in = ["open", "pending_export"] } ]
batch_size = 250
"#;

/// Runs the quick start.
// Over 80 lines: a script read top to bottom (database, schema, seed, serve, trigger, consume,
// report), each step a few lines that share its locals.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    let server_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_SERVER_URL.into());
    let mut demo_url = url::Url::parse(&server_url).context("DATABASE_URL is not a URL")?;
    demo_url.set_path(&format!("/{DEMO_DATABASE}"));

    println!("== sweeper quickstart ==");
    println!(
        "creating database {DEMO_DATABASE} with {} support tickets ...",
        opts.rows
    );
    let t_seed = Instant::now();
    recreate_database(&server_url).await?;
    let mut conn = PgConnection::connect(demo_url.as_str()).await?;
    seed(&mut conn, opts.rows).await?;
    let before = counts(&mut conn).await?;
    println!(
        "seeded in {:.1}s: {} tickets, {} on legal hold",
        t_seed.elapsed().as_secs_f64(),
        before.0,
        before.1
    );

    // A fresh random HS256 secret for this session only.
    let secret = hex::encode(rand::random::<[u8; 32]>());
    let toml = format!(
        "database_url = \"{demo}\"\nlisten = \"127.0.0.1:{port}\"\n\
         [queue]\nworkers = 2\n\
         [[auth.issuer]]\niss = \"sweeper-quickstart\"\naudience = \"sweeper\"\n\
         keys = [ {{ kid = \"quickstart\", secret = \"{secret}\" }} ]\n{POLICY}",
        demo = demo_url,
        port = opts.port,
    );
    // From the text alone: a deployment's SWEEPER_* or DATABASE_URL must not redirect it.
    let config = Config::from_toml(&toml).map_err(|e| anyhow::anyhow!("{e}"))?;
    let issuer = config.credentials.issuers[0].clone();
    let app = Application::build(config).await?;
    let base = format!("http://127.0.0.1:{}", app.port());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(app.run_until(shutdown.clone()));

    let token = crate::auth::mint(
        &issuer,
        "quickstart",
        &[
            "trigger:*".into(),
            "ops:read".into(),
            "ops:write".into(),
            "consume".into(),
        ],
        3_600,
    )?;
    let client = reqwest::Client::new();
    let schedule = crate::window::Schedule::new("0 2 * * *", "UTC").map_err(anyhow::Error::msg)?;
    let window = schedule
        .latest_tick_at_or_before(chrono::Utc::now())
        .context("no tick yet")?;
    let window_s = crate::window::format(window);
    println!("POST {base}/trigger/ticket-retention?window={window_s}");
    let resp = client
        .post(format!("{base}/trigger/ticket-retention?window={window_s}"))
        .bearer_auth(&token)
        .send()
        .await?;
    let status = resp.status();
    let run: Value = resp.json().await?;
    if !status.is_success() {
        bail!("trigger answered {status}: {run}");
    }
    let run_id = run["run_id"].as_str().context("no run_id")?.to_string();
    println!(
        "-> {status}: run {run_id}, cutoff {}",
        run["cutoff"].as_str().unwrap_or("?")
    );

    let started = Instant::now();
    let run = loop {
        let r: Value = client
            .get(format!("{base}/runs/{run_id}"))
            .bearer_auth(&token)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let s = r["status"].as_str().unwrap_or("");
        if crate::ledger::is_terminal_run_status(s) {
            break r;
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("the run did not finish within 10 minutes: {r}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let after = counts(&mut conn).await?;
    let audit_deleted: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.audit where run_id = $1 and outcome = 'deleted'",
    )
    .bind(&run_id)
    .fetch_one(&mut conn)
    .await?;
    let n = |k: &str| run[k].as_i64().unwrap_or(0);
    let held: BTreeMap<String, i64> =
        serde_json::from_value(run["held_at_planning"].clone()).unwrap_or_default();
    let held_total: i64 = held.values().sum();
    let seconds = match (
        crate::window::parse_rfc3339(run["created_at"].as_str().unwrap_or("")),
        crate::window::parse_rfc3339(run["completed_at"].as_str().unwrap_or("")),
    ) {
        (Some(a), Some(b)) => (b - a).num_milliseconds() as f64 / 1000.0,
        _ => started.elapsed().as_secs_f64(),
    };
    let items_per_second = if seconds > 0.0 {
        n("deleted") as f64 / seconds
    } else {
        0.0
    };

    println!();
    println!("run {run_id}: {}", run["status"].as_str().unwrap_or("?"));
    println!(
        "  window              {}",
        run["window"].as_str().unwrap_or("?")
    );
    println!(
        "  cutoff              {}",
        run["cutoff"].as_str().unwrap_or("?")
    );
    println!("  eligible (planned)  {}", n("eligible_planned"));
    println!("  deleted             {}", n("deleted"));
    println!("  held at planning    {held_total}");
    for (reason, count) in &held {
        println!("    {reason:<18}{count}");
    }
    println!("  excluded at delete  {}", n("excluded"));
    println!("  not eligible        {}", n("not_eligible"));
    println!("  already absent      {}", n("already_absent"));
    println!("  failed              {}", n("failed"));
    println!("  remaining eligible  {}", n("remaining_eligible"));
    println!("  seconds             {seconds:.2}");
    println!("  items/s             {items_per_second:.0}");
    println!(
        "  check: legal-hold rows {} before, {} after; {} audit rows say deleted",
        before.1, after.1, audit_deleted
    );

    let mut safe_url = demo_url.clone();
    let _ = safe_url.set_password(None);
    let summary = json!({
        "run_id": run_id,
        "status": run["status"],
        "window": run["window"],
        "cutoff": run["cutoff"],
        "eligible": n("eligible_planned"),
        "deleted": n("deleted"),
        "held": held_total,
        "held_by_reason": held,
        "excluded": n("excluded"),
        "not_eligible": n("not_eligible"),
        "already_absent": n("already_absent"),
        "failed": n("failed"),
        "remaining_eligible": run["remaining_eligible"],
        "seconds": seconds,
        "items_per_second": items_per_second.round(),
        "legal_hold_before": before.1,
        "legal_hold_after": after.1,
        "audit_deleted_rows": audit_deleted,
        "database_url": safe_url.as_str(),
    });

    if opts.exit {
        shutdown.cancel();
        server.await??;
    } else {
        println!();
        println!("sweeper keeps serving on {base} until Ctrl-C. Try:");
        println!("  export TOKEN={token}");
        println!("  curl -s -H \"Authorization: Bearer $TOKEN\" {base}/runs/{run_id}");
        println!(
            "  curl -s -H \"Authorization: Bearer $TOKEN\" '{base}/runs/{run_id}/items?limit=5'"
        );
        println!("  curl -s -H \"Authorization: Bearer $TOKEN\" {base}/policies");
        println!(
            "  curl -s -X POST -H \"Authorization: Bearer $TOKEN\" '{base}/trigger/ticket-retention?dry_run=true'"
        );
        crate::app::shutdown_on_signal(shutdown.clone()).await;
        server.await??;
    }
    println!("{summary}");
    Ok(())
}

async fn recreate_database(server_url: &str) -> anyhow::Result<()> {
    let mut admin = PgConnection::connect(server_url)
        .await
        .with_context(|| "cannot connect to the PostgreSQL server in DATABASE_URL".to_string())?;
    // The name is a constant: only sweeper's own demo database is ever dropped.
    sqlx::query(&format!(
        "drop database if exists {DEMO_DATABASE} with (force)"
    ))
    .execute(&mut admin)
    .await?;
    sqlx::query(&format!("create database {DEMO_DATABASE}"))
        .execute(&mut admin)
        .await?;
    Ok(())
}

/// Seeds `demo.tickets`: `rows` tickets closed over the last two years (deterministic: the
/// generator is seeded), ~7 % `open` (never closed), ~5 % `pending_export`, ~2 % on legal hold.
async fn seed(conn: &mut PgConnection, rows: i64) -> anyhow::Result<()> {
    sqlx::query("create schema demo")
        .execute(&mut *conn)
        .await?;
    sqlx::query(
        "create table demo.tickets (
             id          bigint primary key,
             customer_id bigint not null,
             status      text not null,
             legal_hold  boolean not null default false,
             closed_at   timestamptz,
             subject     text not null,
             body        text not null)",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query("select setseed(0.42)")
        .execute(&mut *conn)
        .await?;
    sqlx::query(
        "insert into demo.tickets (id, customer_id, status, legal_hold, closed_at, subject, body)
         select g, 1 + (g * 7919) % 5000, s.status, random() < 0.02,
                case when s.status = 'open' then null
                     else now() - random() * interval '730 days' end,
                'Ticket #' || g || ': ' ||
                    (array['Login fails', 'Refund request', 'Invoice question', 'Bug report',
                           'Feature request'])[1 + g % 5],
                repeat('Customer wrote about their account. ', 2 + (g % 4)::int)
           from generate_series(1, $1::bigint) g,
                lateral (select case when r < 0.07 then 'open'
                                     when r < 0.12 then 'pending_export'
                                     when r < 0.22 then 'solved'
                                     else 'closed' end as status
                           from (select random() + g * 0 as r) x) s",
    )
    .bind(rows)
    .execute(&mut *conn)
    .await?;
    sqlx::query("create index tickets_closed_at on demo.tickets (closed_at)")
        .execute(&mut *conn)
        .await?;
    sqlx::query("analyze demo.tickets")
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn counts(conn: &mut PgConnection) -> anyhow::Result<(i64, i64)> {
    Ok(
        sqlx::query_as("select count(*), count(*) filter (where legal_hold) from demo.tickets")
            .fetch_one(conn)
            .await?,
    )
}
