//! The retention quick start (the default scenario): `demo.tickets` in [`DEMO_DATABASE`],
//! `ticket-retention` triggered over HTTP for the latest tick as a cron would, the run waited
//! for, a report printed.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Context;
use serde_json::json;
use sqlx::PgConnection;

use super::{Demo, Options};

/// The database the retention quick start owns: dropped and recreated on every run.
pub const DEMO_DATABASE: &str = "sweeper_quickstart";

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
    println!("== sweeper quickstart ==");
    println!(
        "creating database {DEMO_DATABASE} with {} support tickets ...",
        opts.rows
    );
    let t_seed = Instant::now();
    let (mut conn, demo_url) = super::recreate_database(DEMO_DATABASE).await?;
    seed(&mut conn, opts.rows).await?;
    let before = counts(&mut conn).await?;
    println!(
        "seeded in {:.1}s: {} tickets, {} on legal hold",
        t_seed.elapsed().as_secs_f64(),
        before.0,
        before.1
    );

    let demo = Demo::start(
        &demo_url,
        opts.port,
        &format!("[queue]\nworkers = 2\n{POLICY}"),
    )
    .await?;
    let (_, window) = super::latest_window("0 2 * * *")?;
    let started = Instant::now();
    let run = demo.trigger("ticket-retention", &window).await?;
    let run_id = run["run_id"].as_str().context("no run_id")?.to_string();
    let run = demo.wait_terminal(&run_id).await?;

    let after = counts(&mut conn).await?;
    let audit_deleted = super::audited(&mut conn, &run_id, "deleted").await?;
    let audit_bytes = crate::ledger::audit::size_bytes(&mut conn).await?;
    let n = |k: &str| run[k].as_i64().unwrap_or(0);
    let held: BTreeMap<String, i64> =
        serde_json::from_value(run["held_at_planning"].clone()).unwrap_or_default();
    let held_total: i64 = held.values().sum();
    // Every ticket is one of: eligible (planned), held at planning, or closed at or after the
    // cutoff (not yet old enough).
    let newer = before.0 - n("eligible_planned") - held_total;
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
    println!(
        "  tickets             {} before, {} after",
        before.0, after.0
    );
    println!("  not yet old enough  {newer}");
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
    println!(
        "  audit               {:.1} MB, {:.0} bytes per deleted row",
        audit_bytes as f64 / 1e6,
        audit_bytes as f64 / audit_deleted.max(1) as f64
    );

    let summary = json!({
        "run_id": run_id,
        "status": run["status"],
        "window": run["window"],
        "cutoff": run["cutoff"],
        "eligible": n("eligible_planned"),
        "not_yet_old_enough": newer,
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
        "audit_bytes": audit_bytes,
        "database_url": super::without_password(&demo_url),
    });

    let q = "-H \"Authorization: Bearer $SWEEPER_TOKEN\"";
    let hints = [
        format!("curl -s {q} \"$SWEEPER_URL/runs/$RUN\" | jq '{{status, progress, held}}'"),
        format!("curl -s {q} \"$SWEEPER_URL/runs/$RUN/items?limit=5\" | jq ."),
        format!("curl -s {q} \"$SWEEPER_URL/runs?status=attention\" | jq ."),
        format!("curl -s -X POST {q} \"$SWEEPER_URL/trigger/ticket-retention?dry_run=true\""),
    ];
    demo.finish(opts.exit, &run_id, &hints).await?;
    println!("{summary}");
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
