//! Prometheus metrics for alerting (docs/design.md §11), served at `GET /metrics`.
//!
//! Two kinds: process counters incremented where things happen (attempts by outcome and class),
//! and ledger-wide values read from the database at scrape time, so every replica reports the
//! same numbers and nothing resets on restart: dead letters open and the age of the oldest,
//! quarantined total (dead letters are never purged, so their count only grows), commands by
//! state, the age of the oldest due command, runs by status, planning jobs whose last page
//! failed, last successful run and missed windows per policy.

use std::sync::OnceLock;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;

use crate::retry::FailureClass;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// A metric family's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Goes up and down.
    Gauge,
    /// Only goes up (a restart starts a process counter at 0).
    Counter,
    /// Observations in buckets.
    Histogram,
}

/// Every family `GET /metrics` exports, with its type and HELP text (docs/metrics.md lists the
/// same), each present from start-up: process counters at 0 for every label value known then
/// (attempt outcomes and classes, the configured dependencies), ledger-wide values for every
/// state, status and configured policy. Only `sweeper_held_at_planning` has a series per reason
/// a run actually held.
pub const FAMILIES: &[(&str, Kind, &str)] = &[
    (
        "sweeper_dead_letters_open",
        Kind::Gauge,
        "Dead letters in status open (ledger-wide).",
    ),
    (
        "sweeper_dead_letters_oldest_open_age_seconds",
        Kind::Gauge,
        "Age of the oldest open dead letter, 0 when none (ledger-wide).",
    ),
    (
        "sweeper_quarantined_total",
        Kind::Counter,
        "Dead letters ever created (ledger-wide; never goes down).",
    ),
    (
        "sweeper_attempts_total",
        Kind::Counter,
        "Command attempts by outcome and failure class (this process).",
    ),
    (
        "sweeper_commands",
        Kind::Gauge,
        "Commands per state (ledger-wide).",
    ),
    (
        "sweeper_oldest_due_command_age_seconds",
        Kind::Gauge,
        "How long the oldest due pending command has waited, 0 when none (ledger-wide).",
    ),
    (
        "sweeper_runs",
        Kind::Gauge,
        "Runs per status (ledger-wide).",
    ),
    (
        "sweeper_open_run_age_seconds",
        Kind::Gauge,
        "Seconds the policy's oldest unfinished run has been due: since its window, or since its \
         creation when it was created later (a backfill, a late trigger); dry runs aside, 0 when \
         none (ledger-wide).",
    ),
    (
        "sweeper_planning_jobs_failing",
        Kind::Gauge,
        "Planning jobs whose last page failed (ledger-wide).",
    ),
    (
        "sweeper_last_successful_run_timestamp_seconds",
        Kind::Gauge,
        "Unix time the policy's latest completed run completed, 0 before the first (ledger-wide).",
    ),
    (
        "sweeper_policy_suspended",
        Kind::Gauge,
        "1 while the policy is suspended by an operator, else 0 (ledger-wide).",
    ),
    (
        "sweeper_policy_period_seconds",
        Kind::Gauge,
        "The longest gap between two ticks of the policy's schedule (configuration).",
    ),
    (
        "sweeper_missed_windows",
        Kind::Gauge,
        "Ticks among the policy's latest 1000 with no run (ledger-wide).",
    ),
    (
        "sweeper_held_at_planning",
        Kind::Gauge,
        "Rows the planned run of the policy's latest window held, per reason (ledger-wide).",
    ),
    (
        "sweeper_held",
        Kind::Gauge,
        "Unfinished commands and planning jobs held now, per hold kind (ledger-wide).",
    ),
    (
        "sweeper_held_overdue",
        Kind::Gauge,
        "Held work held longer than ledger.hold_alert_after, per hold kind (ledger-wide).",
    ),
    (
        "sweeper_held_oldest_age_seconds",
        Kind::Gauge,
        "Age of the oldest hold, 0 when none (ledger-wide).",
    ),
    (
        "sweeper_held_runs",
        Kind::Gauge,
        "Runs with held work now, per hold kind (ledger-wide).",
    ),
    (
        "sweeper_dependency_paused",
        Kind::Gauge,
        "1 while calls to the dependency are paused (its API asked to wait), else 0 (ledger-wide).",
    ),
    (
        "sweeper_holds_total",
        Kind::Counter,
        "Holds that began on this process, per hold kind.",
    ),
    (
        "sweeper_consume_shed_total",
        Kind::Counter,
        "/consume requests refused with 503 overloaded at consume.max_in_flight (this process).",
    ),
    (
        "sweeper_consume_unknown_commands_total",
        Kind::Counter,
        "Deliveries of a command the ledger does not know (this process).",
    ),
    (
        "sweeper_dependency_calls_total",
        Kind::Counter,
        "Outbound calls to a dependency by result (this process).",
    ),
    (
        "sweeper_dependency_pauses_total",
        Kind::Counter,
        "Pauses stored for a dependency (this process).",
    ),
    (
        "sweeper_items_total",
        Kind::Counter,
        "Items whose audit rows committed, by policy and outcome (this process).",
    ),
    (
        "sweeper_trigger_lag_seconds",
        Kind::Histogram,
        "Arrival minus window of each live trigger that created its run (this process).",
    ),
    (
        "sweeper_consume_duration_seconds",
        Kind::Histogram,
        "One authenticated /consume request, start to answer (this process).",
    ),
    (
        "sweeper_run_duration_seconds",
        Kind::Histogram,
        "Window to completion of each run this process completed (a backfill counts from its \
         old window; sweeper_run_execution_seconds does not).",
    ),
    (
        "sweeper_run_execution_seconds",
        Kind::Histogram,
        "Creation to completion of each run this process completed, by trigger (live or \
         backfill); a cancelled or superseded run is not observed.",
    ),
];

/// Describes every family to the recorder in scope, so each is exported with its HELP text (a
/// recorder writes the HELP of the families it has series of, and only those).
fn describe() {
    for (name, kind, help) in FAMILIES {
        match kind {
            Kind::Gauge => metrics::describe_gauge!(*name, *help),
            Kind::Counter => metrics::describe_counter!(*name, *help),
            Kind::Histogram => metrics::describe_histogram!(*name, *help),
        }
    }
}

/// The HELP text of `family`.
fn help_of(family: &str) -> &'static str {
    FAMILIES
        .iter()
        .find(|(n, _, _)| *n == family)
        .map(|(_, _, h)| *h)
        .unwrap_or("")
}

/// Buckets of `sweeper_trigger_lag_seconds` (arrival − window; negative for an early
/// trigger) and `sweeper_run_duration_seconds` (window to completion), in seconds.
const LAG_BUCKETS: &[f64] = &[
    0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
];

/// Buckets of `sweeper_consume_duration_seconds`, in seconds: a delivery is answered within
/// the command deadline (30 s by default).
const CONSUME_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// (outcome, class) of `sweeper_attempts_total` that can occur.
const ATTEMPT_LABELS: &[(&str, &str)] = &[
    ("succeeded", "none"),
    ("failed", "transient"),
    ("failed", "permanent"),
    ("snoozed", "throttled"),
    ("quarantined", "transient"),
    ("quarantined", "throttled"),
    ("quarantined", "permanent"),
];

/// Counts a hold that began on this replica (`sweeper_holds_total{kind}`): a command held, or a
/// policy's work held by the governor or its active hours.
pub fn hold_started(kind: crate::ledger::HoldKind) {
    counter!("sweeper_holds_total", "kind" => kind.as_str()).increment(1);
}

/// Results of `sweeper_dependency_calls_total`.
const CALL_RESULTS: &[&str] = &[
    "done",
    "already_absent",
    "transient",
    "throttled",
    "permanent",
];

/// Registers every process counter at 0 (see [`SERIES`]), so alerts can be written before the
/// first incident: a counter that appears only when it first moves cannot be told from a
/// scrape that lost it.
pub fn register(dependencies: &[String], policies: &[String]) {
    handle();
    // Registering a histogram makes its series (count 0) appear before the first sample.
    let _ = histogram!("sweeper_trigger_lag_seconds");
    let _ = histogram!("sweeper_consume_duration_seconds");
    for p in policies {
        let _ = histogram!("sweeper_run_duration_seconds", "policy" => p.clone());
        for o in crate::ledger::Outcome::ALL {
            counter!("sweeper_items_total", "policy" => p.clone(), "outcome" => o.as_str())
                .increment(0);
        }
    }
    for (outcome, class) in ATTEMPT_LABELS {
        counter!("sweeper_attempts_total", "outcome" => *outcome, "class" => *class).increment(0);
    }
    counter!("sweeper_consume_shed_total").increment(0);
    for kind in crate::ledger::HoldKind::ALL.map(crate::ledger::HoldKind::as_str) {
        counter!("sweeper_holds_total", "kind" => kind).increment(0);
    }
    counter!("sweeper_consume_unknown_commands_total").increment(0);
    for d in dependencies {
        counter!("sweeper_dependency_pauses_total", "dependency" => d.clone()).increment(0);
        for r in CALL_RESULTS {
            counter!("sweeper_dependency_calls_total", "dependency" => d.clone(), "result" => *r)
                .increment(0);
        }
    }
}

/// Installs the process-wide recorder once and returns its handle.
pub fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let full = |name: &str| Matcher::Full(name.to_string());
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(full("sweeper_trigger_lag_seconds"), LAG_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(full("sweeper_run_duration_seconds"), LAG_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(full("sweeper_consume_duration_seconds"), CONSUME_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(full("sweeper_run_execution_seconds"), LAG_BUCKETS)
            })
            .expect("the bucket lists are not empty")
            .build_recorder();
        let handle = recorder.handle();
        // A second recorder (another Application in the same process) keeps the first.
        let _ = metrics::set_global_recorder(recorder);
        describe();
        handle
    })
}

/// Counts a successful attempt and its items ([`attempt_succeeded`], [`items_recorded`]).
pub fn attempt_committed(policy: &str, counts: &crate::ledger::Counts) {
    attempt_succeeded();
    items_recorded(policy, counts);
}

/// Counts the items of a command whose audit rows just committed, by outcome
/// (`sweeper_items_total{policy, outcome}`).
pub fn items_recorded(policy: &str, counts: &crate::ledger::Counts) {
    for o in crate::ledger::Outcome::ALL {
        let n = counts.get(o);
        if n > 0 {
            counter!("sweeper_items_total", "policy" => policy.to_string(), "outcome" => o.as_str())
                .increment(n as u64);
        }
    }
}

/// Observes a live trigger that created its window's run: arrival − window, in seconds
/// (`sweeper_trigger_lag_seconds`; backfills and dry runs are not observed).
pub fn trigger_lag(seconds: f64) {
    histogram!("sweeper_trigger_lag_seconds").record(seconds);
}

/// Observes one `/consume` request, authenticated, from its start to its answer, in seconds
/// (`sweeper_consume_duration_seconds`).
pub fn consume_finished(seconds: f64) {
    histogram!("sweeper_consume_duration_seconds").record(seconds);
}

/// Observes a run completed by this process: its window to its completion
/// (`sweeper_run_duration_seconds{policy}`) and its creation to its completion
/// (`sweeper_run_execution_seconds{policy, trigger}`, `trigger` `live` or `backfill`), in
/// seconds.
pub fn run_completed(policy: &str, since_window: f64, since_created: f64, backfill: bool) {
    histogram!("sweeper_run_duration_seconds", "policy" => policy.to_string()).record(since_window);
    let trigger = if backfill { "backfill" } else { "live" };
    histogram!("sweeper_run_execution_seconds", "policy" => policy.to_string(), "trigger" => trigger)
        .record(since_created);
}

/// Counts a failed attempt or snooze (`sweeper_attempts_total{outcome, class}`).
pub fn attempt_failed(class: FailureClass) {
    let outcome = if class.is_snooze() {
        "snoozed"
    } else {
        "failed"
    };
    counter!("sweeper_attempts_total", "outcome" => outcome, "class" => class.as_str())
        .increment(1);
}

/// Counts a quarantine by this process (`sweeper_attempts_total{outcome="quarantined"}`).
pub fn quarantined(class: FailureClass) {
    counter!("sweeper_attempts_total", "outcome" => "quarantined", "class" => class.as_str())
        .increment(1);
}

/// Counts a successful attempt.
pub fn attempt_succeeded() {
    counter!("sweeper_attempts_total", "outcome" => "succeeded", "class" => "none").increment(1);
}

/// Counts a pause stored for a dependency (`sweeper_dependency_pauses_total{dependency}`).
pub fn dependency_paused(dependency: &str) {
    counter!("sweeper_dependency_pauses_total", "dependency" => dependency.to_string())
        .increment(1);
}

/// Counts an outbound call by its result (`sweeper_dependency_calls_total{dependency, result}`;
/// result is `done`, `already_absent`, `transient`, `throttled` or `permanent`).
pub fn dependency_call(dependency: &str, result: &'static str) {
    counter!("sweeper_dependency_calls_total", "dependency" => dependency.to_string(), "result" => result)
        .increment(1);
}

/// Counts a `/consume` request shed because `consume.max_in_flight` were in progress
/// (`sweeper_consume_shed_total`).
pub fn consume_shed() {
    counter!("sweeper_consume_shed_total").increment(1);
}

/// Counts a `/consume` delivery of a command the ledger does not know (and whose run is not
/// terminal): `sweeper_consume_unknown_commands_total`. A push is acknowledged, a generic
/// envelope answered 404; either way an operator may want to know.
pub fn consume_unknown_command() {
    counter!("sweeper_consume_unknown_commands_total").increment(1);
}

/// A configured policy's figures for [`render`].
#[derive(Debug, Clone, Copy)]
pub struct PolicyFigures<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its missed windows among its latest 1,000 ticks.
    pub missed: usize,
    /// The longest gap between two ticks of its schedule, in seconds.
    pub period_seconds: i64,
}

/// Reads the ledger-wide values and renders everything in Prometheus text format.
///
/// The ledger-wide values go through a recorder local to this scrape, so concurrent scrapes
/// (or several applications in one test process) cannot mix their numbers.
///
/// `policies` are the configured policies with their missed windows among their latest 1,000
/// ticks (`sweeper_missed_windows`, [`crate::windows`]) and their schedule's period: each has a
/// `sweeper_last_successful_run_timestamp_seconds`, 0 until its first successful run.
/// `dependencies` are the configured dependencies (`sweeper_dependency_paused`).
///
/// `hold_alert_after` (seconds) makes held work overdue (`sweeper_held_overdue`; never an
/// expected wait: active hours, pace). `held_policies` are the policies this replica holds now,
/// `(active_hours, governor)`: their pending commands count as held of that kind even when no
/// claim reached them to record it.
// Over 80 lines: one block per metric family, in the order of the exposition.
pub async fn render(
    pool: &PgPool,
    policies: &[PolicyFigures<'_>],
    dependencies: &[&str],
    hold_alert_after: i64,
    held_policies: (&[String], &[String]),
) -> sqlx::Result<String> {
    let (open, oldest_open, quarantined_total): (i64, Option<f64>, i64) = sqlx::query_as(
        "select count(*) filter (where status = 'open'),
                extract(epoch from sweeper.now() - min(created_at) filter (where status = 'open'))::float8,
                count(*)
           from sweeper.dead_letters",
    )
    .fetch_one(pool)
    .await?;
    let states: Vec<(String, i64)> =
        sqlx::query_as("select state, count(*) from sweeper.commands group by state")
            .fetch_all(pool)
            .await?;
    let oldest_due: Option<f64> = sqlx::query_scalar(
        "select extract(epoch from (select sweeper.now()) - min(next_attempt_at))::float8
           from sweeper.commands
          where state = 'pending' and next_attempt_at <= (select sweeper.now())",
    )
    .fetch_one(pool)
    .await?;
    let runs: Vec<(String, i64)> =
        sqlx::query_as("select status, count(*) from sweeper.runs group by status")
            .fetch_all(pool)
            .await?;
    let planning_failing: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.planning_jobs where not done and failures > 0",
    )
    .fetch_one(pool)
    .await?;
    // What the latest planned run of each policy held, per reason (`null_timestamp`,
    // `null_key`, exclusions): rows that stay, run after run.
    let held: Vec<(String, String, i64)> = sqlx::query_as(
        "select r.policy, h.key, h.value::bigint
           from (select distinct on (policy) policy, held_at_planning from sweeper.runs
                  where planning_done and not dry_run order by policy, window_at desc) r,
                jsonb_each_text(r.held_at_planning) h",
    )
    .fetch_all(pool)
    .await?;
    let held_work = crate::ledger::holds::held_work(pool, hold_alert_after, held_policies).await?;
    // The oldest unfinished run of each policy, due since its window or, created later, since
    // its creation.
    let open_runs: Vec<(String, f64)> = sqlx::query_as(
        "select policy,
                extract(epoch from sweeper.now() - min(greatest(window_at, created_at)))::float8
           from sweeper.runs
          where status in ('planning', 'running') and not dry_run
          group by policy",
    )
    .fetch_all(pool)
    .await?;
    let suspended: Vec<String> =
        sqlx::query_scalar("select policy from sweeper.policy_state where suspended")
            .fetch_all(pool)
            .await?;
    let paused: Vec<String> = sqlx::query_scalar(
        "select dependency from sweeper.dependency_pauses where paused_until > sweeper.now()",
    )
    .fetch_all(pool)
    .await?;
    let last: Vec<(String, f64)> = sqlx::query_as(
        "select policy, extract(epoch from max(completed_at))::float8 from sweeper.runs
          where status = 'completed' and not dry_run group by policy",
    )
    .fetch_all(pool)
    .await?;

    let scrape = PrometheusBuilder::new().build_recorder();
    let scrape_handle = scrape.handle();
    metrics::with_local_recorder(&scrape, || {
        describe();
        gauge!("sweeper_dead_letters_open").set(open as f64);
        gauge!("sweeper_dead_letters_oldest_open_age_seconds").set(oldest_open.unwrap_or(0.0));
        counter!("sweeper_quarantined_total").absolute(quarantined_total as u64);
        for s in crate::ledger::CommandState::ALL.map(crate::ledger::CommandState::as_str) {
            let n = states
                .iter()
                .find(|(k, _)| k == s)
                .map(|(_, n)| *n)
                .unwrap_or(0);
            gauge!("sweeper_commands", "state" => s).set(n as f64);
        }
        gauge!("sweeper_oldest_due_command_age_seconds").set(oldest_due.unwrap_or(0.0));
        gauge!("sweeper_planning_jobs_failing").set(planning_failing as f64);
        for s in crate::ledger::RunStatus::ALL.map(crate::ledger::RunStatus::as_str) {
            let n = runs
                .iter()
                .find(|(k, _)| k == s)
                .map(|(_, n)| *n)
                .unwrap_or(0);
            gauge!("sweeper_runs", "status" => s).set(n as f64);
        }
        let mut oldest_held: f64 = 0.0;
        for k in crate::ledger::HoldKind::ALL.map(crate::ledger::HoldKind::as_str) {
            let row = held_work.iter().find(|h| h.kind == k);
            gauge!("sweeper_held", "kind" => k).set(row.map_or(0, |r| r.work) as f64);
            gauge!("sweeper_held_overdue", "kind" => k).set(row.map_or(0, |r| r.overdue) as f64);
            gauge!("sweeper_held_runs", "kind" => k).set(row.map_or(0, |r| r.runs) as f64);
            oldest_held = oldest_held.max(row.and_then(|r| r.oldest_seconds).unwrap_or(0.0));
        }
        gauge!("sweeper_held_oldest_age_seconds").set(oldest_held);
        for (policy, reason, n) in &held {
            gauge!("sweeper_held_at_planning", "policy" => policy.clone(), "reason" => reason.clone())
                .set(*n as f64);
        }
        for f in policies {
            let policy = f.name.to_string();
            gauge!("sweeper_missed_windows", "policy" => policy.clone()).set(f.missed as f64);
            let figure = |rows: &[(String, f64)]| {
                rows.iter()
                    .find(|(p, _)| *p == policy)
                    .map_or(0.0, |(_, v)| *v)
            };
            gauge!("sweeper_last_successful_run_timestamp_seconds", "policy" => policy.clone())
                .set(figure(&last));
            gauge!("sweeper_open_run_age_seconds", "policy" => policy.clone())
                .set(figure(&open_runs));
            let stopped = suspended.contains(&policy);
            gauge!("sweeper_policy_suspended", "policy" => policy.clone()).set(if stopped {
                1.0
            } else {
                0.0
            });
            gauge!("sweeper_policy_period_seconds", "policy" => policy)
                .set(f.period_seconds as f64);
        }
        for d in dependencies {
            let now = paused.iter().any(|p| p == d);
            gauge!("sweeper_dependency_paused", "dependency" => d.to_string()).set(if now {
                1.0
            } else {
                0.0
            });
        }
    });
    let process = handle();
    process.run_upkeep();
    let mut text = format!("{}{}", scrape_handle.render(), process.render());
    let names: Vec<&str> = policies.iter().map(|f| f.name).collect();
    append_empty_histograms(&mut text, &names);
    Ok(text)
}

/// The exporter writes a histogram only once it has a sample; until then each one (and each
/// configured policy's run duration) is written here with count 0, so it reads 0 from
/// start-up like the counters. Lines join their family's group (the text format wants each
/// family's lines together).
fn append_empty_histograms(text: &mut String, policies: &[&str]) {
    let mut series: Vec<(&str, &[f64], String)> = vec![
        ("sweeper_trigger_lag_seconds", LAG_BUCKETS, String::new()),
        (
            "sweeper_consume_duration_seconds",
            CONSUME_BUCKETS,
            String::new(),
        ),
    ];
    for p in policies {
        series.push((
            "sweeper_run_duration_seconds",
            LAG_BUCKETS,
            format!("policy=\"{p}\""),
        ));
        for trigger in ["live", "backfill"] {
            series.push((
                "sweeper_run_execution_seconds",
                LAG_BUCKETS,
                format!("policy=\"{p}\",trigger=\"{trigger}\""),
            ));
        }
    }
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    for (name, buckets, labels) in series {
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let count = format!("{name}_count{braces} ");
        if lines.iter().any(|l| l.starts_with(&count)) {
            continue;
        }
        let sep = if labels.is_empty() { "" } else { "," };
        let mut add: Vec<String> = buckets
            .iter()
            .map(|b| b.to_string())
            .chain(["+Inf".to_string()])
            .map(|le| format!("{name}_bucket{{{labels}{sep}le=\"{le}\"}} 0"))
            .collect();
        add.push(format!("{name}_sum{braces} 0"));
        add.push(format!("{name}_count{braces} 0"));
        let type_line = format!("# TYPE {name} histogram");
        match lines.iter().position(|l| *l == type_line) {
            Some(at) => {
                let prefix = format!("{name}_");
                let end = lines[at + 1..]
                    .iter()
                    .position(|l| !l.starts_with(&prefix))
                    .map_or(lines.len(), |n| at + 1 + n);
                lines.splice(end..end, add);
            }
            None => {
                lines.push(format!("# HELP {name} {}", help_of(name)));
                lines.push(type_line);
                lines.extend(add);
            }
        }
    }
    *text = lines.join("\n") + "\n";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_histogram_joins_its_familys_group() {
        let mut text = "# TYPE sweeper_run_duration_seconds histogram\n\
                        sweeper_run_duration_seconds_bucket{policy=\"a\",le=\"+Inf\"} 1\n\
                        sweeper_run_duration_seconds_sum{policy=\"a\"} 3\n\
                        sweeper_run_duration_seconds_count{policy=\"a\"} 1\n\
                        # TYPE sweeper_runs gauge\nsweeper_runs 0\n"
            .to_string();
        append_empty_histograms(&mut text, &["a", "b"]);
        let lines: Vec<&str> = text.lines().collect();
        let family: Vec<usize> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.starts_with("sweeper_run_duration_seconds_"))
            .map(|(i, _)| i)
            .collect();
        // a's three lines and b's 15 buckets, sum and count, in one run of lines.
        assert_eq!(family.len(), 3 + LAG_BUCKETS.len() + 3);
        assert!(family.windows(2).all(|w| w[1] == w[0] + 1), "{text}");
        assert!(text.contains("sweeper_run_duration_seconds_count{policy=\"b\"} 0"));
        assert!(!text.contains("sweeper_run_duration_seconds_count{policy=\"a\"} 0"));
        assert_eq!(
            text.matches("# TYPE sweeper_run_duration_seconds").count(),
            1
        );
        assert!(text.contains("sweeper_trigger_lag_seconds_count 0"));
    }
}
