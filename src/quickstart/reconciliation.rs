//! The reconciliation quick start (`sweeper quickstart --scenario reconciliation`): every night
//! each payment closed three days before is checked against the payment provider's own copy;
//! a match is stamped, a mismatch is left for an operator.
//!
//! In its own database, [`RECONCILIATION_DATABASE`], it seeds `billing.payments` (the table of
//! `deploy/examples/schema.sql`) with payments closed over the four weeks before the window,
//! some still open, some disputed. A local stand-in for the provider ([`super::payments_api`])
//! holds its own copy of them: most equal, about 1 % with another amount, a few it does not
//! know. `payment-reconciliation` (as in `deploy/examples/payment-reconciliation.toml`, three
//! days after closing, recording the provider's status, amount and reference, with the mismatch
//! rule) is triggered for the latest nightly tick; the server is aborted once a third of the
//! eligible payments are matched, as a crash would, and a new one finishes the run. Then the
//! same window is triggered again (the same run, no call), and the report compares the run, the
//! audit, the dead letters, the table and what the provider saw.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use sqlx::PgConnection;

use super::payments_api::PaymentsApi;
use super::{Demo, Options};

/// The database the reconciliation quick start owns: dropped and recreated on every run.
pub const RECONCILIATION_DATABASE: &str = "sweeper_quickstart_reconciliation";

/// Payments seeded.
const PAYMENTS: i64 = 2_000;

/// The policy's nightly schedule.
const CRON: &str = "30 3 * * *";

/// The policy's `retain_for`, in days: a payment is reconciled three days after it closed.
const AFTER_DAYS: i64 = 3;

/// The policy's name.
const POLICY: &str = "payment-reconciliation";

/// Short leases, so the commands the aborted server held are reclaimed within seconds
/// (`claim_batch × command_deadline` must stay below the lease); the provider, whose 429s
/// (`Retry-After: 1`) are waited out in the request and whose 503s are retried within a second
/// or two; and the policy as an operator would write it; `{url}` is the provider.
const CONFIG: &str = r#"
[queue]
workers = 2
lease = "10s"
claim_batch = 1
[consume]
command_deadline = "5s"
statement_timeout = "5s"
[planning]
lease = "10s"

[[dependency]]
name = "payments"
base_url = "{url}"
allow_private_addresses = true
retry_after_cap = "5s"
pause_wait = "1s"
retry = { max_attempts = 10, base = "1s", cap = "2s" }

[[policy]]
name = "payment-reconciliation"
schedule = { cron = "30 3 * * *", timezone = "UTC" }
target = { table = "billing.payments", key = "id", timestamp = "closed_at" }
retain_for = "3d"
exclude = [ { column = "status", in = ["disputed"] } ]
batch_size = 50
[policy.action]
kind = "http"
dependency = "payments"
method = "POST"
path = "/v1/payments/{id}/reconcile"
body = '{"payment_id": "{id}", "amount_cents": "{amount_cents}", "currency": "{currency}"}'
record = ["/status", "/provider_amount", "/provider_ref"]
mismatch = { pointer = "/status", in = ["mismatch", "unknown"] }
then = { set = "reconciled_at" }
"#;

/// One seeded payment.
struct Payment {
    id: String,
    amount_cents: i64,
    /// Whether the policy reconciles it at the cutoff: closed before it, not disputed.
    eligible: bool,
}

impl Payment {
    /// The number in its id (`pay_000123` is 123).
    fn number(&self) -> i64 {
        self.id
            .trim_start_matches("pay_")
            .parse()
            .unwrap_or_default()
    }

    /// The provider's amount for it: `None` when the provider does not know it (one in 331),
    /// another amount for one in 97, ours otherwise.
    fn provider_amount(&self) -> Option<i64> {
        let n = self.number();
        if n % 331 == 17 {
            None
        } else if n % 97 == 13 {
            let delta = 100 * (1 + n % 4);
            Some(if n % 2 == 0 {
                self.amount_cents + delta
            } else {
                self.amount_cents - delta
            })
        } else {
            Some(self.amount_cents)
        }
    }
}

/// Runs the reconciliation quick start.
// Over 80 lines: a script read top to bottom (database, seed, provider, serve, trigger, restart,
// wait, trigger again, check, report), each step a few lines that share its locals.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    println!("== sweeper quickstart: nightly payment reconciliation ==");
    let (window, window_s) = super::latest_window(CRON)?;
    let cutoff = window - chrono::Duration::days(AFTER_DAYS);
    println!(
        "creating database {RECONCILIATION_DATABASE}: {PAYMENTS} payments closed over four weeks ..."
    );
    let (mut conn, demo_url) = super::recreate_database(RECONCILIATION_DATABASE).await?;
    let payments = seed(&mut conn, window, cutoff).await?;
    let copy: HashMap<String, i64> = payments
        .iter()
        .filter_map(|p| Some((p.id.clone(), p.provider_amount()?)))
        .collect();
    let eligible = payments.iter().filter(|p| p.eligible).count() as i64;
    let seeded_unknown = payments
        .iter()
        .filter(|p| p.eligible && p.provider_amount().is_none())
        .count() as i64;
    let seeded_differing = payments
        .iter()
        .filter(|p| p.eligible && p.provider_amount().is_some_and(|a| a != p.amount_cents))
        .count() as i64;
    println!(
        "{eligible} payments closed before {} and not disputed; the provider's copy differs in \
         amount for {seeded_differing} of them and lacks {seeded_unknown}",
        crate::window::format(cutoff)
    );

    let api = PaymentsApi::start(copy, (eligible / 2) as u64).await?;
    println!("payment provider stand-in on {}", api.url);
    let mut demo = Demo::start(&demo_url, opts.port, &CONFIG.replace("{url}", &api.url)).await?;
    let started = Instant::now();
    let run = demo.trigger(POLICY, &window_s).await?;
    let run_id = run["run_id"].as_str().context("no run_id")?.to_string();

    // A crash in the middle of the run: the server is aborted with calls in flight.
    let matched = |api: &PaymentsApi| api.with(|b| b.matched.len() as i64);
    super::wait_until(Duration::from_secs(120), async || {
        matched(&api) >= eligible / 3
    })
    .await;
    let at_abort = matched(&api);
    demo.restart().await?;
    println!(
        "aborted the server after {at_abort} matches and started a new one on {}; the commands \
         the old one held are reclaimed when their 10 s leases expire",
        demo.base
    );
    let run = demo.wait_terminal(&run_id).await?;
    let seconds = started.elapsed().as_secs_f64();

    // The same window again, as a cron retrying its tick would: the same run, nothing called.
    let calls_before = api.with(|b| b.calls);
    let (again_status, again) = demo.trigger_status(POLICY, &window_s).await?;
    let again = demo
        .wait_terminal(again["run_id"].as_str().context("no run_id")?)
        .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let calls_after_again = api.with(|b| b.calls) - calls_before;
    let same_run = again["run_id"] == run["run_id"];

    let book = api.with(|b| {
        json!({
            "calls": b.calls,
            "throttled": b.throttled_429 + b.unavailable_503,
            "throttled_429": b.throttled_429,
            "unavailable_503": b.unavailable_503,
            "retried": b.retried,
            "replays": b.replays,
            "reconciled_twice": b.reconciled_twice(),
            "provider_matched": b.matched.len(),
            "answered_mismatch": b.answered("mismatch"),
            "answered_unknown": b.answered("unknown"),
        })
    });
    let check = Check::of(&mut conn, &run_id, cutoff).await?;
    let dead = demo
        .get(&format!("/dead-letters?policy={POLICY}&limit=1000"))
        .await?;
    let dead = dead["dead_letters"].as_array().cloned().unwrap_or_default();
    let open = dead
        .iter()
        .filter(|d| matches!(d["status"].as_str(), Some("open" | "redriven")))
        .count() as i64;
    let mut verdicts: BTreeMap<String, i64> = BTreeMap::new();
    for d in &dead {
        *verdicts.entry(verdict(d)).or_default() += 1;
    }
    let n = |k: &str| run[k].as_i64().unwrap_or(0);
    let b = |k: &str| book[k].as_i64().unwrap_or(0);

    println!();
    println!("run {run_id}: {}", run["status"].as_str().unwrap_or("?"));
    println!(
        "  cutoff              {}",
        run["cutoff"].as_str().unwrap_or("?")
    );
    println!(
        "  payments            {PAYMENTS}, {eligible} closed before the cutoff and not disputed"
    );
    println!("  eligible (planned)  {}", n("eligible_planned"));
    println!(
        "  reconciled          {} (stamped reconciled_at: {} rows)",
        n("reconciled"),
        check.stamped
    );
    println!(
        "  mismatched          {} ({} amounts differ, {} unknown to the provider; not stamped)",
        n("mismatched"),
        b("answered_mismatch"),
        b("answered_unknown")
    );
    if let Some(e) = &check.example {
        println!(
            "    e.g. {}: ours {} vs the provider's {} {} (from the audit)",
            e.payment,
            money(e.ours),
            e.provider.map_or("?".into(), money),
            e.currency
        );
    }
    println!("  held at planning    {}", super::held_total(&run));
    if let Some(reasons) = run["held_at_planning"].as_object() {
        for (reason, count) in reasons {
            println!("    {reason:<18}{count}");
        }
    }
    println!("  failed              {}", n("failed"));
    println!("  remaining eligible  {}", n("remaining_eligible"));
    println!(
        "provider: {} calls, {} throttled ({} answered 429 + Retry-After, {} answered 503), {} \
         retried, {} repeated keys answered from the stored result",
        b("calls"),
        b("throttled"),
        b("throttled_429"),
        b("unavailable_503"),
        b("retried"),
        b("replays")
    );
    println!("  reconciled twice    {}", b("reconciled_twice"));
    println!("dead letters          {} ({open} open)", dead.len());
    for (v, count) in &verdicts {
        println!("    {count} × {v}");
    }
    println!(
        "second trigger of {window_s}: {again_status}, {} run, {calls_after_again} calls",
        if same_run { "the same" } else { "another" }
    );
    println!(
        "check: stamped with another amount than the provider's {}; mismatched but stamped {}; \
         still eligible by SQL {}",
        check.stamped_other_amount, check.mismatched_stamped, check.remaining_rows
    );
    println!("matches at abort      {at_abort}");
    println!("seconds               {seconds:.1}");

    let mut summary = json!({
        "scenario": "reconciliation",
        "run_id": run_id,
        "status": run["status"],
        "window": window_s,
        "cutoff": run["cutoff"],
        "payments": PAYMENTS,
        "eligible": eligible,
        "eligible_planned": n("eligible_planned"),
        "seeded_differing": seeded_differing,
        "seeded_unknown": seeded_unknown,
        "reconciled": n("reconciled"),
        "reconciled_stamped": check.stamped,
        "audit_reconciled": check.audit_reconciled,
        "mismatched": n("mismatched"),
        "audit_mismatched": check.audit_mismatched,
        "mismatch_example": check.example.as_ref().map(|e| json!({
            "payment": e.payment,
            "ours": e.ours,
            "provider": e.provider,
            "currency": e.currency,
        })),
        "held_at_planning": run["held_at_planning"],
        "failed": n("failed"),
        "dead_letters": dead.len(),
        "dead_letters_open": open,
        "dead_letter_verdicts": verdicts,
        "remaining_eligible": run["remaining_eligible"],
        "remaining_eligible_rows": check.remaining_rows,
        "stamped_other_amount": check.stamped_other_amount,
        "mismatched_stamped": check.mismatched_stamped,
        "second_trigger_status": again_status,
        "second_trigger_same_run": same_run,
        "calls_after_second_trigger": calls_after_again,
        "matches_at_abort": at_abort,
        "seconds": (seconds * 10.0).round() / 10.0,
        "database_url": super::without_password(&demo_url),
    });
    if let (Some(s), Some(bk)) = (summary.as_object_mut(), book.as_object()) {
        s.extend(bk.clone());
    }
    let q = "-H \"Authorization: Bearer $SWEEPER_TOKEN\"";
    let hints = [
        format!(
            "curl -s {q} \"$SWEEPER_URL/runs/$RUN\" | jq '{{status, reconciled, mismatched, held_at_planning}}'"
        ),
        format!(
            "curl -s {q} \"$SWEEPER_URL/dead-letters?policy={POLICY}&limit=3\" | jq '.dead_letters[] | {{item_key, reason, replay_safe}}'"
        ),
        format!("curl -s {q} \"$SWEEPER_URL/runs/$RUN/items?limit=5\" | jq ."),
    ];
    demo.finish(opts.exit, &run_id, &hints).await?;
    println!("{summary}");
    Ok(())
}

/// A dead letter's kind, outcome and replay verdict in words: `replay_safe.safe` (a redrive
/// makes no double effect) and `will_fail_again`.
fn verdict(d: &Value) -> String {
    let v = &d["replay_safe"];
    let again = match &v["will_fail_again"] {
        Value::Bool(b) => b.to_string(),
        Value::String(s) => s.clone(),
        _ => "?".into(),
    };
    format!(
        "{} {} ({}): replay safe {}, will fail again {again}",
        d["kind"].as_str().unwrap_or("?"),
        d["outcome"].as_str().unwrap_or("failed"),
        d["class"].as_str().unwrap_or("?"),
        v["safe"]
    )
}

/// Cents as `12.50`.
fn money(cents: i64) -> String {
    let sign = if cents < 0 { "-" } else { "" };
    format!("{sign}{}.{:02}", cents.abs() / 100, cents.abs() % 100)
}

/// A mismatched payment as the audit recorded it, beside our row.
struct Example {
    payment: String,
    ours: i64,
    provider: Option<i64>,
    currency: String,
}

/// The table and the audit after the run.
struct Check {
    /// Rows with `reconciled_at` set.
    stamped: i64,
    /// Items of the run audited `reconciled`, and `mismatched`.
    audit_reconciled: i64,
    audit_mismatched: i64,
    /// Stamped rows whose `reconciled` audit row recorded another provider amount than ours.
    stamped_other_amount: i64,
    /// Rows audited `mismatched` that carry a stamp.
    mismatched_stamped: i64,
    /// Rows the policy would still select: eligible at the cutoff, unstamped, without an open
    /// item dead letter.
    remaining_rows: i64,
    /// The first mismatch in amount, from the audit.
    example: Option<Example>,
}

impl Check {
    async fn of(
        conn: &mut PgConnection,
        run_id: &str,
        cutoff: DateTime<Utc>,
    ) -> anyhow::Result<Check> {
        let stamped: i64 = sqlx::query_scalar(
            "select count(*) from billing.payments where reconciled_at is not null",
        )
        .fetch_one(&mut *conn)
        .await?;
        let audit_reconciled = super::audited(conn, run_id, "reconciled").await?;
        let audit_mismatched = super::audited(conn, run_id, "mismatched").await?;
        let stamped_other_amount: i64 = sqlx::query_scalar(
            "select count(*) from billing.payments p
               join sweeper.audit_trail a on a.item_key = p.id and a.outcome = 'reconciled'
              where a.run_id = $1 and p.reconciled_at is not null
                and (a.recorded::jsonb ->> '/provider_amount')::bigint
                    is distinct from p.amount_cents",
        )
        .bind(run_id)
        .fetch_one(&mut *conn)
        .await?;
        let mismatched_stamped: i64 = sqlx::query_scalar(
            "select count(*) from billing.payments p
               join sweeper.audit_trail a on a.item_key = p.id and a.outcome = 'mismatched'
              where a.run_id = $1 and p.reconciled_at is not null",
        )
        .bind(run_id)
        .fetch_one(&mut *conn)
        .await?;
        let remaining_rows: i64 = sqlx::query_scalar(
            "select count(*) from billing.payments p
              where p.closed_at < $1 and p.status <> 'disputed' and p.reconciled_at is null
                and not exists (select 1 from sweeper.dead_letters d
                                 where d.kind = 'item' and d.policy = $2 and d.item_key = p.id
                                   and d.status in ('open', 'redriven'))",
        )
        .bind(cutoff)
        .bind(POLICY)
        .fetch_one(&mut *conn)
        .await?;
        let example: Option<(String, i64, Option<i64>, String)> = sqlx::query_as(
            "select p.id, p.amount_cents, (a.recorded::jsonb ->> '/provider_amount')::bigint,
                    p.currency::text
               from sweeper.audit_trail a join billing.payments p on p.id = a.item_key
              where a.run_id = $1 and a.outcome = 'mismatched'
                and a.recorded::jsonb ->> '/status' = 'mismatch'
              order by p.id limit 1",
        )
        .bind(run_id)
        .fetch_optional(&mut *conn)
        .await?;
        Ok(Check {
            stamped,
            audit_reconciled,
            audit_mismatched,
            stamped_other_amount,
            mismatched_stamped,
            remaining_rows,
            example: example.map(|(payment, ours, provider, currency)| Example {
                payment,
                ours,
                provider,
                currency,
            }),
        })
    }
}

/// Seeds `billing.payments` (deterministic: the generator is seeded; ~5 % still open, closed
/// ones over the 28 days before `window`, ~2 % of them disputed, ~8 % refunded) and returns
/// every payment, with whether the policy reconciles it at `cutoff`.
async fn seed(
    conn: &mut PgConnection,
    window: DateTime<Utc>,
    cutoff: DateTime<Utc>,
) -> anyhow::Result<Vec<Payment>> {
    sqlx::raw_sql(
        "create schema billing;
         create table billing.payments (
             -- The provider's id of the payment; sent in the call's path and body.
             id            text primary key,
             customer_id   bigint not null,
             amount_cents  bigint not null,
             currency      char(3) not null,
             -- 'pending' while open, then 'settled', 'refunded' or 'disputed'; disputed
             -- payments are never reconciled.
             status        text not null,
             -- When the payment was closed; NULL while it is open (never eligible).
             closed_at     timestamptz,
             -- Stamped by sweeper (database clock) once the provider confirmed the amount.
             reconciled_at timestamptz null);
         select setseed(0.47);",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "with r as (select g, random() as a, random() as b, random() as c, random() as d
                      from generate_series(1, $1::bigint) g)
         insert into billing.payments (id, customer_id, amount_cents, currency, status, closed_at)
         select 'pay_' || lpad(g::text, 6, '0'), 1 + (g * 7919) % 500,
                500 + floor(b * 49500)::bigint,
                (array['EUR', 'USD', 'GBP'])[1 + g % 3],
                case when a < 0.05 then 'pending' when c < 0.02 then 'disputed'
                     when c < 0.10 then 'refunded' else 'settled' end,
                case when a < 0.05 then null else $2::timestamptz - d * interval '28 days' end
           from r",
    )
    .bind(PAYMENTS)
    .bind(window)
    .execute(&mut *conn)
    .await?;
    sqlx::raw_sql(
        "create index payments_closed_at on billing.payments (closed_at);
         analyze billing.payments;",
    )
    .execute(&mut *conn)
    .await?;
    let rows: Vec<(String, i64, bool)> = sqlx::query_as(
        "select id, amount_cents, coalesce(closed_at < $1 and status <> 'disputed', false)
           from billing.payments order by id",
    )
    .bind(cutoff)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, amount_cents, eligible)| Payment {
            id,
            amount_cents,
            eligible,
        })
        .collect())
}
