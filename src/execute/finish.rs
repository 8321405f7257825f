//! Finishing a command: its result added to the run (and the closure check when it completes
//! the run), item dead letters, and the one step every try that stopped goes through — a hold,
//! or the decision of [`crate::retry::decide`], applied as a quarantine or the next attempt.

use super::*;

/// Records a command's result as its run counts it, in the command's own transaction: its
/// counts on its own row (no run-row lock, so workers of one run do not queue on one row), and
/// what decides whether the run may be complete after the commit ([`complete_after`]).
///
/// `redriven`: the command re-executed one item whose earlier outcome (`failed` or
/// `mismatched`) is superseded.
pub(crate) async fn finish_in_run(
    tx: &mut Transaction<'_, Postgres>,
    state: &AppState,
    policy: &str,
    command_id: &str,
    counts: &Counts,
    quarantined: bool,
    redriven: Option<Outcome>,
) -> sqlx::Result<ledger::runs::Recorded> {
    ledger::runs::record_command(
        tx,
        &ledger::runs::CommandDone {
            command_id,
            quarantined,
            redriven,
            counts,
            others_cap: others_cap(state, policy),
        },
    )
    .await
}

/// How many other pending commands a command that just ended counts before it stops counting:
/// with fewer, it may be the run's last one. At most `max_concurrent_commands - 1` other commands
/// of the policy execute while it does, so the last of a run to commit always counts fewer than
/// this and asks.
pub(crate) fn others_cap(state: &AppState, policy: &str) -> i64 {
    state
        .config
        .policy(policy)
        .map(|p| p.max_concurrent_commands as i64)
        .unwrap_or(1)
        + 1
}

/// After a command's commit: completes its run if it may have been the last one
/// ([`ledger::runs::complete_if_done`], decided once), with the closure check when `rules` are
/// given (not for dry runs, nor for a quarantine, whose rules may not be buildable). Returns the
/// run's status as the caller reports it. A failure here loses nothing: the command is committed,
/// and housekeeping completes a run that is done but open.
pub(crate) async fn complete_after(
    state: &AppState,
    run_id: &str,
    policy: &str,
    recorded: ledger::runs::Recorded,
    rules: Option<&RuleSet>,
) -> String {
    if recorded.others_pending >= others_cap(state, policy) {
        return recorded.status;
    }
    crate::crash_point!("consume_before_completion");
    match crate::completion::complete_run(state, run_id, rules).await {
        Ok(Some(status)) => status,
        Ok(None) => recorded.status,
        Err(e) => {
            warn!(run_id, error = %e, "completing the run failed; housekeeping will complete it");
            recorded.status
        }
    }
}

/// Item-level dead letters for the items that failed in this command (in its transaction). An
/// item re-executed by a redrive reopens its own dead letter instead of adding one.
pub(crate) async fn record_item_dead_letters(
    tx: &mut Transaction<'_, Postgres>,
    loaded: &Loaded,
    command_id: &str,
    failed: &[ledger::dead_letter::ItemDeadLetter],
) -> sqlx::Result<()> {
    match loaded.redrive_of {
        Some(dl) => ledger::dead_letter::reopen_item(tx, dl, command_id, &failed[0]).await,
        None => {
            ledger::dead_letter::record_items(
                tx,
                &loaded.run_id,
                &loaded.policy,
                command_id,
                failed,
            )
            .await
        }
    }
}

/// After a try that stopped (rolled back): hold, snooze, retry later, or quarantine — committed
/// either way, a failure with an attempt row for the history.
///
/// * held: not a failure; given back without spending anything ([`hold_command`]).
/// * `throttled`: a snooze. It spends no attempt but counts against `max_age`.
/// * `transient`: the attempt is spent; retried after full-jitter backoff, or quarantined once
///   `max_attempts` or `max_age` is spent.
/// * `permanent`: quarantined now.
///
/// A quarantined command gets a dead letter (one per command: a later failure of a redriven
/// command reopens it) holding its attempt history.
// Over 80 lines: the fences (busy, terminal, stale, concurrent delivery) before the pure decision,
// each an early return on the locked row.
pub(crate) async fn record_failure(
    state: &AppState,
    command_id: &str,
    setback: Setback,
    started: Instant,
    tried: Option<ledger::commands::CommandTry>,
) -> Result<Ended, Setback> {
    let db = |e: sqlx::Error| Setback::from_db(&e);
    // Only a delivery is without a try: it failed before the gate let it run.
    let Some(command) = tried else {
        return busy(state, command_id, &setback).await;
    };
    if let Setback::Held { kind, .. } = &setback
        && *kind == HoldKind::Schema
        && let Some(p) = state.config.policy_by_command(command_id)
    {
        // The target's schema does not match: read its columns afresh at the next try.
        state.catalog.forget_all(&p.spec);
    }
    let mut tx = state.pool.begin().await.map_err(db)?;
    let Some(row) = command.lock_after_failure(&mut tx).await.map_err(db)? else {
        return Err(setback);
    };
    let ledger::commands::FailedRow {
        state: cmd_state,
        attempts,
        run_id,
        policy,
        age_seconds,
        due_in_seconds: due_in,
    } = row;
    if ledger::CommandState::parse(&cmd_state).is_some_and(ledger::CommandState::is_terminal) {
        return Ok(ConsumeOutcome::Duplicate {
            command_id: command_id.to_string(),
            state: cmd_state,
        });
    }
    let attempt = command.attempt();
    if attempts != attempt.fence() {
        return Ok(match attempt {
            // A newer claim took the command over.
            ledger::commands::Attempt::Counted { .. } => ConsumeOutcome::Stale(Overtaken),
            // A concurrent delivery of the same command already recorded this round's
            // failure: one failure, one attempt; this one just comes back when the next
            // attempt is due.
            ledger::commands::Attempt::Uncounted { .. } => ConsumeOutcome::NotNow {
                reason: "a concurrent delivery of this command just failed; retry when it is due"
                    .into(),
                retry_after_seconds: due_in.ceil() as u64,
            },
        });
    }
    let f = match setback {
        // Held: nothing is spent, never a quarantine.
        Setback::Held { kind, why } => {
            let hold = super::Hold {
                kind,
                why,
                command: command.clone(),
                recheck: None,
            };
            return hold_command(state, tx, command_id, hold).await;
        }
        Setback::Failed(f) => f,
    };
    let budget = state
        .config
        .policy(&policy)
        .map(|p| p.retry)
        .unwrap_or_default()
        .budget();
    let elapsed = started.elapsed().as_secs_f64();
    let decision = crate::retry::decide(
        &f,
        attempt.number(),
        age_seconds,
        &budget,
        Utc::now(),
        &mut rand::rng(),
    );
    let failed = |attempts| Failed {
        command: &command,
        run_id: &run_id,
        policy: &policy,
        attempts,
        elapsed,
    };
    match decision {
        Decision::Quarantine { attempts, reason } => {
            quarantine_command(state, tx, failed(attempts), f.class, reason).await
        }
        Decision::Retry {
            attempts,
            delay_seconds,
            snooze,
        } => schedule_retry(tx, failed(attempts), &f, delay_seconds, snooze).await,
    }
}

/// A delivery that failed before it could lock its command row executed nothing: not an
/// attempt. If the ledger answers, the row was busy (a concurrent delivery executing it, a lock
/// or deadline wait): a "not now", not an unreachable ledger (docs/design.md §5).
async fn busy(state: &AppState, command_id: &str, setback: &Setback) -> Result<Ended, Setback> {
    let answers = sqlx::query("select 1 from sweeper.commands where command_id = $1")
        .bind(command_id)
        .fetch_optional(&state.pool)
        .await
        .is_ok();
    if !answers {
        return Err(setback.clone());
    }
    Ok(ConsumeOutcome::NotNow {
        reason: format!(
            "the command is busy (another delivery may be executing it; {}); nothing was \
             recorded, retry later",
            setback.name()
        ),
        retry_after_seconds: state.config.consume.retry_after.seconds() as u64,
    })
}

/// The command a failed try was of, with the attempt count to record.
struct Failed<'a> {
    command: &'a ledger::commands::CommandTry,
    run_id: &'a str,
    policy: &'a str,
    attempts: i32,
    /// Seconds the try took.
    elapsed: f64,
}

impl<'a> Failed<'a> {
    /// The ledger's record of this failed try, with its error and class.
    fn recorded(&self, error: &'a str, class: &'a str) -> ledger::commands::Failed<'a> {
        ledger::commands::Failed {
            run_id: self.run_id,
            policy: self.policy,
            attempts: self.attempts,
            elapsed_seconds: self.elapsed,
            error,
            class,
        }
    }
}

/// Holds a command (docs/design.md §14): pending again, its attempt given back, checked again after
/// `recheck` seconds (default [`crate::settings::Config::hold_recheck_seconds`]); the time since the last check is
/// credited to its age budget. Commits `tx`.
pub(super) async fn hold_command(
    state: &AppState,
    mut tx: Transaction<'_, Postgres>,
    command_id: &str,
    super::Hold {
        kind,
        why,
        command,
        recheck,
    }: super::Hold,
) -> Result<Ended, Setback> {
    let db = |e: sqlx::Error| Setback::from_db(&e);
    let recheck = recheck
        .unwrap_or_else(|| state.config.hold_recheck_seconds())
        .max(1);
    let began = command
        .hold(&mut tx, recheck as f64, kind.as_str(), &why)
        .await
        .map_err(db)?;
    tx.commit().await.map_err(db)?;
    if began {
        info!(command_id, kind = kind.as_str(), reason = %why, "command held");
        crate::metrics::hold_started(kind);
    }
    Ok(ConsumeOutcome::NotNow {
        reason: format!("held ({}): {why}", kind.as_str()),
        retry_after_seconds: recheck,
    })
}

/// Quarantines a command: its state, the attempt, a dead letter with its history, and the run's
/// counts, in the caller's transaction (whose row lock on the command it relies on).
async fn quarantine_command(
    state: &AppState,
    mut tx: Transaction<'_, Postgres>,
    c: Failed<'_>,
    class: FailureClass,
    reason: String,
) -> Result<Ended, Setback> {
    let db = |e: sqlx::Error| Setback::from_db(&e);
    c.command
        .quarantine(&mut tx, &c.recorded(&reason, class.as_str()))
        .await
        .map_err(db)?;
    let recorded = finish_in_run(
        &mut tx,
        state,
        c.policy,
        c.command.command_id(),
        &Counts::default(),
        true,
        None,
    )
    .await
    .map_err(db)?;
    tx.commit().await.map_err(db)?;
    complete_after(state, c.run_id, c.policy, recorded, None).await;
    crate::metrics::quarantined(class);
    warn!(command_id = c.command.command_id(), class = class.as_str(), error = %reason,
          attempts = c.attempts, "command quarantined");
    Ok(ConsumeOutcome::Quarantined {
        command_id: c.command.command_id().to_string(),
        error: reason,
    })
}

/// Schedules the next attempt of a command after a failed try or a snooze, recording the
/// attempt with its delay, in the caller's transaction.
async fn schedule_retry(
    mut tx: Transaction<'_, Postgres>,
    c: Failed<'_>,
    f: &Failure,
    delay: f64,
    snooze: bool,
) -> Result<Ended, Setback> {
    let db = |e: sqlx::Error| Setback::from_db(&e);
    c.command
        .schedule_retry(
            &mut tx,
            &c.recorded(&f.message, f.class.as_str()),
            delay,
            snooze,
        )
        .await
        .map_err(db)?;
    tx.commit().await.map_err(db)?;
    crate::metrics::attempt_failed(f.class);
    warn!(command_id = c.command.command_id(), class = f.class.as_str(), error = %f.message,
          attempt = c.attempts, retry_in_seconds = delay, "not done; next attempt scheduled");
    // The answer names the class, never the error text (which may quote customer data); the
    // ledger keeps the text for operators.
    Ok(ConsumeOutcome::NotNow {
        reason: if snooze {
            format!(
                "snoozed ({}); the next attempt is due in {}s",
                f.class.as_str(),
                delay.ceil()
            )
        } else {
            format!(
                "attempt {} failed ({}); the next attempt is due in {}s",
                c.attempts,
                f.class.as_str(),
                delay.ceil()
            )
        },
        retry_after_seconds: delay.ceil() as u64,
    })
}
