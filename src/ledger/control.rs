//! Operator control: suspend and resume a policy, cancel a run. Each act is attributed and
//! recorded in the append-only operator log.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::ledger::dead_letter::log_operator_act;

/// A policy's operator state.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct PolicyState {
    /// The policy.
    pub policy: String,
    /// Whether it is suspended.
    pub suspended: bool,
    /// When it was suspended (null when active).
    pub suspended_at: Option<DateTime<Utc>>,
    /// When it last changed.
    pub changed_at: DateTime<Utc>,
    /// Who changed it.
    pub changed_by: String,
    /// Why.
    pub reason: String,
}

/// The policy's state, if an operator ever changed it.
pub async fn policy_state(pool: &PgPool, policy: &str) -> sqlx::Result<Option<PolicyState>> {
    sqlx::query_as(
        "select policy, suspended, suspended_at, changed_at, changed_by, reason
           from sweeper.policy_state where policy = $1",
    )
    .bind(policy)
    .fetch_optional(pool)
    .await
}

/// Every policy's state an operator ever changed, by policy name.
pub async fn policy_states(
    pool: &PgPool,
) -> sqlx::Result<std::collections::HashMap<String, PolicyState>> {
    let rows: Vec<PolicyState> = sqlx::query_as(
        "select policy, suspended, suspended_at, changed_at, changed_by, reason
           from sweeper.policy_state",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|s| (s.policy.clone(), s)).collect())
}

/// Suspends `policy`: triggers create no run, and no command of it is claimed or executed until
/// it is resumed. Suspending a suspended policy changes nothing (still logged, `changed: false`).
/// Returns the state and whether this call suspended it.
pub async fn suspend(
    pool: &PgPool,
    policy: &str,
    subject: &str,
    reason: &str,
) -> sqlx::Result<(PolicyState, bool)> {
    let mut tx = pool.begin().await?;
    lock_policy_state(&mut tx, policy).await?;
    let was_suspended: bool = sqlx::query_scalar(
        "select coalesce((select suspended from sweeper.policy_state where policy = $1), false)",
    )
    .bind(policy)
    .fetch_one(&mut *tx)
    .await?;
    let state: PolicyState = sqlx::query_as(
        "insert into sweeper.policy_state (policy, suspended, suspended_at, changed_by, reason)
         values ($1, true, sweeper.now(), $2, $3)
         on conflict (policy) do update
            set suspended = true,
                suspended_at = coalesce(sweeper.policy_state.suspended_at, excluded.suspended_at),
                changed_at = sweeper.now(), changed_by = excluded.changed_by,
                reason = excluded.reason
         returning policy, suspended, suspended_at, changed_at, changed_by, reason",
    )
    .bind(policy)
    .bind(subject)
    .bind(reason)
    .fetch_one(&mut *tx)
    .await?;
    log_operator_act(
        &mut tx,
        subject,
        "suspend",
        &format!("policy:{policy}"),
        reason,
        !was_suspended,
        serde_json::json!({}),
    )
    .await?;
    tx.commit().await?;
    Ok((state, !was_suspended))
}

/// Serializes the suspends and resumes of `policy` for the rest of `tx`: a row lock cannot, on a
/// policy never suspended (it has no `policy_state` row yet), and each of two concurrent first
/// suspends would see it running and log that it acted.
async fn lock_policy_state(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    policy: &str,
) -> sqlx::Result<()> {
    sqlx::query("select pg_advisory_xact_lock(hashtext('sweeper:policy_state:' || $1))")
        .bind(policy)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Resumes `policy`. The time it spent suspended is credited to its unfinished commands, so it
/// does not count against their `max_age`.
pub async fn resume(
    pool: &PgPool,
    policy: &str,
    subject: &str,
    reason: &str,
) -> sqlx::Result<PolicyState> {
    let mut tx = pool.begin().await?;
    lock_policy_state(&mut tx, policy).await?;
    let suspended_for: Option<f64> = sqlx::query_scalar(
        "select extract(epoch from sweeper.now() - suspended_at)::float8
           from sweeper.policy_state where policy = $1 and suspended for update",
    )
    .bind(policy)
    .fetch_optional(&mut *tx)
    .await?
    .flatten();
    if let Some(seconds) = suspended_for {
        sqlx::query(
            "update sweeper.commands c
                set age_credit_seconds = age_credit_seconds + $2
               from sweeper.runs r
              where r.run_id = c.run_id and r.policy = $1 and c.state in ('pending', 'leased')",
        )
        .bind(policy)
        .bind(seconds)
        .execute(&mut *tx)
        .await?;
    }
    let state: PolicyState = sqlx::query_as(
        "insert into sweeper.policy_state (policy, suspended, suspended_at, changed_by, reason)
         values ($1, false, null, $2, $3)
         on conflict (policy) do update
            set suspended = false, suspended_at = null, changed_at = sweeper.now(),
                changed_by = excluded.changed_by, reason = excluded.reason
         returning policy, suspended, suspended_at, changed_at, changed_by, reason",
    )
    .bind(policy)
    .bind(subject)
    .bind(reason)
    .fetch_one(&mut *tx)
    .await?;
    log_operator_act(
        &mut tx,
        subject,
        "resume",
        &format!("policy:{policy}"),
        reason,
        suspended_for.is_some(),
        serde_json::json!({ "suspended_seconds": suspended_for }),
    )
    .await?;
    tx.commit().await?;
    Ok(state)
}

/// What cancelling a run did.
#[derive(Debug, Clone, Serialize)]
pub struct Cancelled {
    /// The run.
    pub run_id: String,
    /// Its status now.
    pub status: String,
    /// Commands cancelled by this act.
    pub commands_cancelled: u64,
}

/// Why a cancel was refused.
#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    /// No such run.
    #[error("no run `{0}`")]
    NotFound(String),
    /// The run already completed; there is nothing left to stop.
    #[error("run `{0}` already completed ({1}); there is nothing left to cancel")]
    Completed(String, String),
    /// The ledger failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Cancels a run: planning stops, every command not yet terminal is cancelled (a command that is
/// executing right now finishes first: its row lock is waited for), the run becomes `cancelled`.
/// Cancelling a cancelled run changes nothing.
///
/// Lock order is planning job → commands → run, the same as planning and consumption take them,
/// so cancel cannot deadlock with either.
pub async fn cancel(
    pool: &PgPool,
    run_id: &str,
    subject: &str,
    reason: &str,
) -> Result<Cancelled, CancelError> {
    let status: Option<String> =
        sqlx::query_scalar("select status from sweeper.runs where run_id = $1")
            .bind(run_id)
            .fetch_optional(pool)
            .await?;
    match status.as_deref() {
        None => return Err(CancelError::NotFound(run_id.into())),
        Some(s @ ("completed" | "completed_with_dead_letters")) => {
            return Err(CancelError::Completed(run_id.into(), s.into()));
        }
        _ => {}
    }
    let mut tx = pool.begin().await?;
    sqlx::query(
        "update sweeper.planning_jobs set done = true, lease_until = null where run_id = $1",
    )
    .bind(run_id)
    .execute(&mut *tx)
    .await?;
    // Planning is over for a cancelled run too: its timestamp walk's seen keys go.
    sqlx::query("delete from sweeper.seen_keys where run_id = $1")
        .bind(run_id)
        .execute(&mut *tx)
        .await?;
    // A partition not yet detached is not retired; one whose detach began is finished.
    super::retirements::keep_not_begun(&mut tx, run_id, "cancelled").await?;
    let n = sqlx::query(
        "update sweeper.commands
            set state = 'cancelled', finished_at = sweeper.now(), lease_until = null, lease_owner = null
          where run_id = $1 and state in ('pending', 'leased')",
    )
    .bind(run_id)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let (status, changed): (String, bool) = sqlx::query_as(
        "with old as (select status from sweeper.runs where run_id = $1 for update)
         update sweeper.runs r
            set status = case when r.status in ('planning', 'running') then 'cancelled'
                              else r.status end,
                completed_at = case when r.status in ('planning', 'running') then sweeper.now()
                                    else r.completed_at end
           from old
          where r.run_id = $1
          returning r.status, old.status in ('planning', 'running')",
    )
    .bind(run_id)
    .fetch_one(&mut *tx)
    .await?;
    if status != "cancelled" {
        return Err(CancelError::Completed(run_id.into(), status));
    }
    log_operator_act(
        &mut tx,
        subject,
        "cancel",
        &format!("run:{run_id}"),
        reason,
        changed,
        serde_json::json!({ "commands_cancelled": n }),
    )
    .await?;
    tx.commit().await?;
    Ok(Cancelled {
        run_id: run_id.into(),
        status,
        commands_cancelled: n,
    })
}

/// Why a run is not waiting for approval, for the 409.
fn not_held_reason(approval: Option<&str>, status: &str, dry_run: bool) -> String {
    match approval {
        _ if super::is_terminal_run_status(status) => format!("the run is {status}"),
        None if dry_run => {
            "a dry run is never held (its live run's verdict is in approval.guard_verdict)".into()
        }
        None => "its policy has no blast-radius guard".into(),
        Some(a) => match super::Approval::parse(a) {
            Some(super::Approval::AwaitingPlan) => {
                "planning is not done; the guard decides then".into()
            }
            Some(super::Approval::NotRequired) => {
                "the run is under every limit of the guard".into()
            }
            _ => format!("approval {a}, status {status}"),
        },
    }
}

/// What approving a run did.
#[derive(Debug, Clone, Serialize)]
pub struct Approved {
    /// The run.
    pub run_id: String,
    /// `approved`.
    pub approval: String,
    /// Who approved it.
    pub approved_by: String,
    /// The guard's verdict that held it.
    pub guard_verdict: Option<serde_json::Value>,
}

/// Why an approval was refused.
#[derive(Debug, thiserror::Error)]
pub enum ApproveError {
    /// No such run.
    #[error("no run `{0}`")]
    NotFound(String),
    /// The run is not waiting for approval (with its approval state, or none).
    #[error("run `{0}` is not waiting for approval ({1})")]
    NotHeld(String, String),
    /// The ledger failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Approves a run the blast-radius guard holds (`approval = 'required'`): it executes from now
/// on, its held commands due at once. Attributed and logged. Approving an approved run that is
/// not terminal changes nothing (answered with its approver, the act logged); a terminal run is
/// refused.
// Over 80 lines: one transaction under the run row's lock — the refusals, the repeat, the act.
pub async fn approve(
    pool: &PgPool,
    run_id: &str,
    subject: &str,
    reason: &str,
) -> Result<Approved, ApproveError> {
    let mut tx = pool.begin().await?;
    type Row = (
        Option<String>,
        String,
        bool,
        Option<serde_json::Value>,
        Option<String>,
    );
    let row: Option<Row> = sqlx::query_as(
        "select approval, status, dry_run, guard_verdict, approved_by from sweeper.runs
          where run_id = $1 for update",
    )
    .bind(run_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((approval, status, dry_run, verdict, approved_by)) = row else {
        return Err(ApproveError::NotFound(run_id.into()));
    };
    if super::is_terminal_run_status(&status)
        || approval.as_deref().and_then(super::Approval::parse) != Some(super::Approval::Required)
    {
        if approval.as_deref().and_then(super::Approval::parse) == Some(super::Approval::Approved)
            && !super::is_terminal_run_status(&status)
        {
            // Nothing changes, but the operator's reason is kept like every act's.
            let detail = serde_json::json!({ "already_approved_by": approved_by });
            log_operator_act(
                &mut tx,
                subject,
                "approve",
                &format!("run:{run_id}"),
                reason,
                false,
                detail,
            )
            .await?;
            tx.commit().await?;
            return Ok(Approved {
                run_id: run_id.into(),
                approval: super::Approval::Approved.as_str().into(),
                approved_by: approved_by.unwrap_or_default(),
                guard_verdict: verdict,
            });
        }
        let why = not_held_reason(approval.as_deref(), &status, dry_run);
        return Err(ApproveError::NotHeld(run_id.into(), why));
    }
    sqlx::query(
        "update sweeper.runs
            set approval = 'approved', approved_by = $2, approval_reason = $3,
                approval_changed_at = sweeper.now()
          where run_id = $1",
    )
    .bind(run_id)
    .bind(subject)
    .bind(reason)
    .execute(&mut *tx)
    .await?;
    let released = sqlx::query(
        "update sweeper.commands set next_attempt_at = least(next_attempt_at, sweeper.now())
          where run_id = $1 and state = 'pending' and held_kind = 'approval'",
    )
    .bind(run_id)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    log_operator_act(
        &mut tx,
        subject,
        "approve",
        &format!("run:{run_id}"),
        reason,
        true,
        serde_json::json!({ "guard_verdict": verdict, "held_commands_released": released }),
    )
    .await?;
    tx.commit().await?;
    Ok(Approved {
        run_id: run_id.into(),
        approval: super::Approval::Approved.as_str().into(),
        approved_by: subject.into(),
        guard_verdict: verdict,
    })
}
