//! The digest quick start (`sweeper quickstart --scenario digest`): every week a support desk
//! sends a digest to each active customer, then removes the digest data past its retention.
//!
//! In its own database, [`DIGEST_DATABASE`], it seeds `crm.customers` (active, inactive, some on
//! hold) and six weeks of `crm.digest_items`, starts a local digest API over real HTTP
//! ([`super::digest_api`]), declares `support-digest` (a selection policy, one call per customer
//! and week) and `support-digest-cleanup` (retention, `after = ["support-digest"]`), triggers
//! both for the latest weekly tick, aborts its server once mid-digest as a crash would and
//! starts a new one, waits for both runs and prints a report.

use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::PgConnection;

use super::digest_api::DigestApi;
use super::{Demo, Options};

/// The database the digest quick start owns: dropped and recreated on every run.
pub const DIGEST_DATABASE: &str = "sweeper_quickstart_digest";

/// Customers seeded.
const CUSTOMERS: i64 = 400;

/// The weekly schedule of both policies.
const CRON: &str = "0 9 * * 1";

/// Short leases, so the commands the aborted server held are reclaimed within seconds
/// (`claim_batch × command_deadline` must stay below the lease), and both policies as an
/// operator would write them; `{url}` is the digest API.
const CONFIG: &str = r#"
[queue]
workers = 2
lease = "15s"
claim_batch = 1
[consume]
command_deadline = "10s"
statement_timeout = "5s"
[planning]
lease = "15s"

[[dependency]]
name = "digests"
base_url = "{url}"
allow_private_addresses = true
retry = { base = "1s", cap = "2s" }

[[policy]]
name = "support-digest"
schedule = { cron = "0 9 * * 1", timezone = "UTC" }
target = { table = "crm.customers", key = "id", timestamp = "created_at" }
select = [ { column = "status", equals = "active" } ]
exclude = [ { column = "on_hold", equals = true } ]
batch_size = 20
[policy.action]
kind = "http"
dependency = "digests"
method = "POST"
path = "/v1/digests/{id}"
body = '{"to": "{email}"}'
once_per = "window"
then = "nothing"

[[policy]]
name = "support-digest-cleanup"
schedule = { cron = "0 9 * * 1", timezone = "UTC" }
target = { table = "crm.digest_items", key = "id", timestamp = "created_at" }
retain_for = "14d"
after = ["support-digest"]
batch_size = 500
"#;

/// Runs the digest quick start.
// Over 80 lines: a script read top to bottom (database, seed, digest API, serve, trigger,
// restart, wait, report), each step a few lines that share its locals.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    println!("== sweeper quickstart: the weekly support digest ==");
    let (window, window_s) = super::latest_window(CRON)?;
    println!(
        "creating database {DIGEST_DATABASE}: {CUSTOMERS} customers, six weeks of digest data ..."
    );
    let (mut conn, demo_url) = super::recreate_database(DIGEST_DATABASE).await?;
    seed(&mut conn, window).await?;
    let active = active_customers(&mut conn, window).await?;
    let items_before: i64 = sqlx::query_scalar("select count(*) from crm.digest_items")
        .fetch_one(&mut conn)
        .await?;
    println!(
        "{active} customers are active and not on hold at {window_s}; {items_before} digest items"
    );

    let api = DigestApi::start().await?;
    println!("digest API stand-in on {}", api.url);
    let mut demo = Demo::start(&demo_url, opts.port, &CONFIG.replace("{url}", &api.url)).await?;
    let started = Instant::now();
    let digest = demo.trigger("support-digest", &window_s).await?;
    let cleanup = demo.trigger("support-digest-cleanup", &window_s).await?;
    let digest_id = digest["run_id"].as_str().context("no run_id")?.to_string();
    let cleanup_id = cleanup["run_id"].as_str().context("no run_id")?.to_string();

    // A crash in the middle of the digest: the server is aborted with calls in flight.
    let sent = |api: &DigestApi| api.with(|b| b.recorded.len() as i64);
    super::wait_until(Duration::from_secs(120), async || sent(&api) >= active / 3).await;
    let at_abort = sent(&api);
    demo.restart().await?;
    println!(
        "aborted the server after {at_abort} digests and started a new one on {}; the commands \
         the old one held are reclaimed when their 15 s leases expire",
        demo.base
    );
    let digest = demo.wait_terminal(&digest_id).await?;
    let cleanup = demo.wait_terminal(&cleanup_id).await?;
    let seconds = started.elapsed().as_secs_f64();

    let (digests_sent, duplicates, calls, replays, failures) = api.with(|b| {
        let of_week = b.recorded.iter().filter(|((w, _), _)| *w == window_s);
        (
            of_week.clone().count() as i64,
            of_week.filter(|(_, n)| **n > 1).count() as i64,
            b.calls,
            b.replays,
            b.failures,
        )
    });
    let mut missed = 0;
    for p in ["support-digest", "support-digest-cleanup"] {
        let page = demo.get(&format!("/policies/{p}/windows")).await?;
        missed += page["missed"].as_i64().unwrap_or(0);
    }
    let items_after: i64 = sqlx::query_scalar("select count(*) from crm.digest_items")
        .fetch_one(&mut conn)
        .await?;
    let n = |r: &serde_json::Value, k: &str| r[k].as_i64().unwrap_or(0);
    let s = |r: &serde_json::Value, k: &str| r[k].as_str().unwrap_or("?").to_string();

    println!();
    println!("run {digest_id}: {}", s(&digest, "status"));
    println!("  active customers    {active}");
    println!("  called              {}", n(&digest, "called"));
    println!("  held (on hold)      {}", super::held_total(&digest));
    println!("  remaining eligible  {}", n(&digest, "remaining_eligible"));
    println!(
        "digest API: {calls} calls, {failures} answered 503/429, {replays} repeated keys answered from the stored result"
    );
    println!("  digests sent        {digests_sent}");
    println!("  duplicate digests   {duplicates}");
    println!("run {cleanup_id}: {}", s(&cleanup, "status"));
    println!("  cutoff              {}", s(&cleanup, "cutoff"));
    println!(
        "  deleted             {} (of {items_before} items; {items_after} kept)",
        n(&cleanup, "deleted")
    );
    println!(
        "  remaining eligible  {}",
        n(&cleanup, "remaining_eligible")
    );
    println!("missed windows        {missed}");
    println!("seconds               {seconds:.1}");

    let summary = json!({
        "scenario": "digest",
        "window": window_s,
        "active_customers": active,
        "digests_sent": digests_sent,
        "calls": calls,
        "failed_calls": failures,
        "replayed_calls": replays,
        "duplicate_digests": duplicates,
        "digests_at_abort": at_abort,
        "digest_run_id": digest_id,
        "digest_status": digest["status"],
        "called": n(&digest, "called"),
        "cleanup_run_id": cleanup_id,
        "cleanup_status": cleanup["status"],
        "cleanup_cutoff": cleanup["cutoff"],
        "cleanup_deleted": n(&cleanup, "deleted"),
        "remaining_eligible": cleanup["remaining_eligible"],
        "digest_remaining_eligible": digest["remaining_eligible"],
        "missed_windows": missed,
        "seconds": (seconds * 10.0).round() / 10.0,
        "database_url": super::without_password(&demo_url),
    });
    let q = "-H \"Authorization: Bearer $SWEEPER_TOKEN\"";
    let hints = [
        format!("curl -s {q} \"$SWEEPER_URL/runs/$RUN\" | jq '{{status, progress, called}}'"),
        format!("curl -s {q} \"$SWEEPER_URL/runs/$RUN/items?limit=5\" | jq ."),
        format!("curl -s {q} \"$SWEEPER_URL/runs/{cleanup_id}\" | jq '{{status, deleted}}'"),
        format!("curl -s {q} \"$SWEEPER_URL/policies/support-digest/windows\" | jq ."),
    ];
    demo.finish(opts.exit, &digest_id, &hints).await?;
    println!("{summary}");
    Ok(())
}

/// Customers `support-digest` selects at `window`: active, not on hold, created before it.
async fn active_customers(conn: &mut PgConnection, window: DateTime<Utc>) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "select count(*) from crm.customers
          where status = 'active' and not on_hold and created_at < $1",
    )
    .bind(window)
    .fetch_one(conn)
    .await?)
}

/// Seeds `crm.customers` (deterministic: the generator is seeded; ~75 % active, ~8 % on hold)
/// and `crm.digest_items` (15 per customer on average, created over the six weeks before
/// `window`).
async fn seed(conn: &mut PgConnection, window: DateTime<Utc>) -> anyhow::Result<()> {
    sqlx::raw_sql(
        "create schema crm;
         create table crm.customers (
             id         bigint primary key,
             email      text not null,
             status     text not null,
             on_hold    boolean not null,
             created_at timestamptz not null);
         create table crm.digest_items (
             id          bigint primary key,
             customer_id bigint not null,
             kind        text not null,
             created_at  timestamptz not null);
         select setseed(0.17);",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "insert into crm.customers (id, email, status, on_hold, created_at)
         select g, 'customer' || g || '@example.com',
                case when random() < 0.75 then 'active' else 'inactive' end,
                random() < 0.08, $2::timestamptz - interval '400 days' + g * interval '1 hour'
           from generate_series(1, $1::bigint) g",
    )
    .bind(CUSTOMERS)
    .bind(window)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "insert into crm.digest_items (id, customer_id, kind, created_at)
         select g, 1 + (g * 7919) % $1::bigint,
                (array['ticket_update', 'survey', 'article'])[1 + g % 3],
                $2::timestamptz - random() * interval '42 days'
           from generate_series(1, $1::bigint * 15) g",
    )
    .bind(CUSTOMERS)
    .bind(window)
    .execute(&mut *conn)
    .await?;
    sqlx::raw_sql(
        "create index customers_created_at on crm.customers (created_at, id);
         create index digest_items_created_at on crm.digest_items (created_at);
         analyze crm.customers; analyze crm.digest_items;",
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}
