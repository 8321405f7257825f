//! The one hold precedence (docs/design.md §14), as Rust and as the SQL generated from it, and
//! the holds the ledger records on planning jobs and commands, read back for a run's `held`
//! object. [`HoldKind::ALL`] is the order; every reader — the gate, the built-in queue's claim,
//! the push relay, a run's `held`, the attention list, the `sweeper_held*` gauges — picks a first
//! hold with [`first_hold`] or [`hold_kind_sql`], so adding a kind is a change to `HoldKind` and
//! to [`condition`].

use chrono::{DateTime, Utc};
use sqlx::PgPool;

pub use crate::retry::HoldKind;

use super::states::{Approval, sql_list};

/// The first of `candidates` (each `Some` when its kind holds) in the one precedence; the first
/// given wins among candidates of one kind.
pub fn first_hold<T>(
    candidates: impl IntoIterator<Item = Option<(HoldKind, T)>>,
) -> Option<(HoldKind, T)> {
    candidates
        .into_iter()
        .flatten()
        .min_by_key(|(k, _)| k.precedence())
}

/// The SQL condition under which `kind` holds a command of run `r`: the ledger-wide and run-wide
/// kinds read their tables; a recorded kind reads the marker on `recorded` (a command or planning
/// job alias; `None`: recorded kinds are left out); a live kind is its policy among the `text[]`
/// parameter this replica passes (`active_hours`, `governor`).
fn condition(
    kind: HoldKind,
    recorded: Option<&str>,
    active_hours: &str,
    governor: &str,
) -> Option<String> {
    match kind {
        HoldKind::Identity => Some(
            "exists (select 1 from sweeper.database_identity i where i.held_since is not null)"
                .into(),
        ),
        HoldKind::Suspended => Some(
            // Uncorrelated, so PostgreSQL reads the suspended policies once per statement (a
            // hashed subplan), not once per command.
            "r.policy in (select ps.policy from sweeper.policy_state ps where ps.suspended)".into(),
        ),
        HoldKind::Approval => Some(format!("r.approval in {}", Approval::holding_sql())),
        HoldKind::ActiveHours => Some(format!("r.policy = any({active_hours}::text[])")),
        HoldKind::Governor => Some(format!("r.policy = any({governor}::text[])")),
        HoldKind::Schema | HoldKind::PolicyChanged | HoldKind::After | HoldKind::Pace => recorded
            .map(|c| {
                format!(
                    "({c}.held_since is not null and {c}.held_kind = '{}')",
                    kind.as_str()
                )
            }),
    }
}

/// An SQL expression over `sweeper.runs r` (and `recorded`, see [`condition`]): the first hold
/// kind that applies in the one precedence, or NULL.
pub(crate) fn hold_kind_sql(recorded: Option<&str>, active_hours: &str, governor: &str) -> String {
    let whens: String = HoldKind::ALL
        .into_iter()
        .filter_map(|k| {
            condition(k, recorded, active_hours, governor)
                .map(|c| format!(" when {c} then '{}'", k.as_str()))
        })
        .collect();
    format!("(case{whens} end)")
}

/// An SQL condition over `sweeper.runs r`: no hold decided before a try applies to the run's
/// work — the identity guard, its policy's suspension, the blast-radius guard's approval — nor
/// is its policy among `held_param` (a `text[]` parameter: the policies this replica's governor
/// or active hours hold). The built-in queue's claim and the push relay both use it, so held work
/// is neither claimed nor published until its hold is released.
pub(crate) fn released(held_param: &str) -> String {
    format!("{} is null", hold_kind_sql(None, held_param, held_param))
}

/// The kinds known by their marker ([`HoldKind::is_recorded`]) as an SQL list, for `held_kind
/// in ...`: readers of recorded holds take only those, and every other kind where it is
/// decided (the live ones from [`crate::holds::policy_hold`]), so a run's `held`, the attention
/// list and the gauges describe the present (within one governor tick), never a stale marker.
pub(crate) fn recorded_kinds_sql() -> String {
    sql_list(
        HoldKind::ALL
            .into_iter()
            .filter(|k| k.is_recorded())
            .map(HoldKind::as_str),
    )
}

/// What holds a run's work, if anything: its oldest recorded hold (planning job or non-terminal
/// command) of a kind known by its marker ([`HoldKind::is_recorded`]), as `{kind, detail, since, held_commands,
/// planning_held, overdue}`; `overdue` when it is older than `alert_after_seconds`.
pub async fn run_hold(
    pool: &PgPool,
    run_id: &str,
    alert_after_seconds: i64,
) -> sqlx::Result<Option<serde_json::Value>> {
    let recorded = recorded_kinds_sql();
    let sql = format!(
        "with h as (
             select held_kind, held_reason, held_since, false as planning
               from sweeper.commands
              where run_id = $1 and held_since is not null and state in ('pending', 'leased')
                and held_kind in {recorded}
             union all
             select held_kind, held_reason, held_since, true
               from sweeper.planning_jobs
              where run_id = $1 and held_since is not null and not done
                and held_kind in {recorded})
         select held_kind, held_reason, held_since,
                (select count(*) from h where not planning),
                (select bool_or(planning) from h),
                held_since < sweeper.now() - make_interval(secs => $2)
           from h order by held_since limit 1"
    );
    let row: Option<(String, String, DateTime<Utc>, i64, bool, bool)> = sqlx::query_as(&sql)
        .bind(run_id)
        .bind(alert_after_seconds as f64)
        .fetch_optional(pool)
        .await?;
    Ok(
        row.map(|(kind, detail, since, commands, planning, overdue)| {
            serde_json::json!({"kind": kind, "detail": detail, "since": since,
                           "held_commands": commands, "planning_held": planning,
                           "overdue": overdue})
        }),
    )
}

/// Held work of one kind, as the `sweeper_held*` gauges show it.
#[derive(Debug, sqlx::FromRow)]
pub struct HeldWork {
    /// The kind.
    pub kind: String,
    /// Non-terminal commands and planning jobs it holds.
    pub work: i64,
    /// Of those, held longer than the alert threshold (never an expected wait).
    pub overdue: i64,
    /// Seconds since the oldest of them was held.
    pub oldest_seconds: Option<f64>,
    /// The runs they belong to.
    pub runs: i64,
}

/// Held work by kind: each non-terminal command by its first hold in the one precedence (the
/// identity guard and the approval hold every command of their runs; active hours and the
/// governor every command of the policies in `held_policies`, `(active_hours, governor)`,
/// recorded or not), and each planning job by its recorded hold. Overdue past
/// `alert_after_seconds`.
pub async fn held_work(
    pool: &PgPool,
    alert_after_seconds: i64,
    held_policies: (&[String], &[String]),
) -> sqlx::Result<Vec<HeldWork>> {
    let kind = hold_kind_sql(Some("c"), "$2", "$3");
    let recorded = recorded_kinds_sql();
    let expected = sql_list(
        HoldKind::ALL
            .into_iter()
            .filter(|k| k.is_expected())
            .map(HoldKind::as_str),
    );
    let sql = format!(
        "with k as (
             select c.run_id, c.held_since, r.approval_changed_at, r.created_at, r.policy,
                    {kind} as held_kind
               from sweeper.commands c join sweeper.runs r using (run_id)
              where c.state in ('pending', 'leased')),
              h as (
             select k.run_id, k.held_kind,
                    case k.held_kind
                         when 'identity' then (select held_since from sweeper.database_identity)
                         when 'suspended' then (select ps.suspended_at from sweeper.policy_state ps
                                                 where ps.policy = k.policy)
                         when 'approval' then coalesce(k.approval_changed_at, k.created_at)
                         else k.held_since end as held_since
               from k where k.held_kind is not null
             union all
             select p.run_id, p.held_kind, p.held_since
               from sweeper.planning_jobs p join sweeper.runs r using (run_id)
              where p.held_since is not null and not p.done
                and (p.held_kind in {recorded} or r.policy = any($2) or r.policy = any($3)))
         select held_kind as kind, count(*) as work,
                count(*) filter (where held_since < sweeper.now() - make_interval(secs => $1)
                                   and held_kind not in {expected}) as overdue,
                extract(epoch from sweeper.now() - min(held_since))::float8 as oldest_seconds,
                count(distinct run_id) as runs
           from h group by held_kind",
    );
    sqlx::query_as(&sql)
        .bind(alert_after_seconds as f64)
        .bind(held_policies.0)
        .bind(held_policies.1)
        .fetch_all(pool)
        .await
}
