//! The gate: lock the command row and decide whether it may run now (terminal, stale, not due,
//! suspended, over its attempts, a replica behind the ledger's version, the concurrency cap),
//! and build the rules it runs under (the stricter of the pinned and the current version).

use super::*;
use ledger::commands::Locked as LockedCommand;

/// Locks the command row (one statement, [`lock_command`]): `Err(step)` when the ledger does
/// not know the command ([`unknown_command`]).
pub(super) async fn lock(
    state: &AppState,
    tx: &mut Transaction<'_, Postgres>,
    command_id: &str,
    executor: &Executor,
) -> Result<Result<(LockedCommand, ledger::commands::CommandTry), TurnedAway>, AttemptError> {
    match lock_command(state, tx, command_id, executor).await? {
        Some(locked) => Ok(Ok(locked)),
        None => Ok(Err(unknown_command(tx, command_id).await?)),
    }
}

/// Decides whether the locked command runs now, as `command` (the try its failure would be
/// recorded as): a step that turns it away (a duplicate, not due, held, …), or the command
/// loaded under the rules it runs by.
pub(super) async fn judge(
    state: &AppState,
    tx: &mut Transaction<'_, Postgres>,
    c: LockedCommand,
    command: &ledger::commands::CommandTry,
    (command_id, executor): (&str, &Executor),
    pace_wait: f64,
) -> Result<Step, AttemptError> {
    if let Some(away) = gate(state, &c, command_id, executor)? {
        return Ok(Step::TurnedAway(away));
    }
    let after = if c.dry_run {
        None
    } else {
        crate::holds::after_hold(state, tx, &c.policy, c.window_at).await?
    };
    if let Some(away) = held(state, &c, command, pace_wait, after) {
        return Ok(Step::TurnedAway(away));
    }
    let rules = rules_for(state, tx, &c)
        .await?
        .in_partition(c.partition_constraint.clone());
    let finished = if c.has_outcomes {
        ledger::commands::finished_keys(tx, command_id, c.redrive_of.is_some()).await?
    } else {
        Vec::new()
    };
    Ok(Step::Run(Box::new(Loaded {
        run_id: c.run_id,
        policy: c.policy,
        policy_version: c.policy_version,
        window: c.window_at,
        dry_run: c.dry_run,
        keys: c.item_keys,
        rules,
        redrive_of: c.redrive_of,
        redriven: c
            .redrive_outcome
            .as_deref()
            .map(|o| Outcome::parse(o).unwrap_or(Outcome::Failed)),
        command: command.clone(),
        lease_left: c.lease_left,
        finished,
        waiting_on_lock: c.last_error_class.as_deref() == Some(FailureClass::LOCKED),
    })))
}

/// One statement ([`ledger::commands::lock`]): the command row locked with what the gate needs,
/// this transaction's lock and statement timeouts set, one of the policy's
/// `max_concurrent_commands` slots taken (the slots as this replica's governor scales them).
async fn lock_command(
    state: &AppState,
    tx: &mut Transaction<'_, Postgres>,
    command_id: &str,
    executor: &Executor,
) -> sqlx::Result<Option<(LockedCommand, ledger::commands::CommandTry)>> {
    let (names, caps): (Vec<&str>, Vec<i32>) = state
        .config
        .policies
        .iter()
        .map(|p| {
            let slots = state
                .governor
                .slots(p.name.as_str(), p.max_concurrent_commands);
            (p.name.as_str(), slots as i32)
        })
        .unzip();
    let targets: Vec<String> = state
        .config
        .policies
        .iter()
        .map(|p| p.spec.target.table.quoted())
        .collect();
    let claim = match executor {
        Executor::Claimed(claim) => Some(claim),
        Executor::Delivery { .. } => None,
    };
    ledger::commands::lock(
        tx,
        command_id,
        claim,
        &ledger::commands::GateLimits {
            lock_timeout_seconds: state.config.consume.lock_timeout.seconds(),
            statement_timeout_seconds: state.config.consume.statement_timeout.seconds(),
            policies: &names,
            slots: &caps,
            targets: &targets,
            partition_constraint: crate::policy::partitions::constraint_sql,
        },
    )
    .await
}

/// A command the ledger does not know: nothing to do if its run is terminal (its commands were
/// purged), else unknown.
async fn unknown_command(
    tx: &mut Transaction<'_, Postgres>,
    command_id: &str,
) -> Result<TurnedAway, AttemptError> {
    let run_status: Option<String> = match command_id.rsplit_once(':') {
        Some((run_id, _)) => {
            sqlx::query_scalar("select status from sweeper.runs where run_id = $1")
                .bind(run_id)
                .fetch_optional(&mut **tx)
                .await?
        }
        None => None,
    };
    let command_id = command_id.to_string();
    Ok(TurnedAway::Done(match run_status {
        Some(s) if ledger::is_terminal_run_status(&s) => {
            info!(
                command_id,
                "delivery for an unknown command of a terminal run; acknowledged"
            );
            ConsumeOutcome::UnknownOfTerminalRun { command_id }
        }
        _ => ConsumeOutcome::Unknown { command_id },
    }))
}

/// Whether the locked command may run now: `Some(step)` when it may not (a duplicate, a stale
/// claim, not due, held, suspended, a replica behind the ledger's version), an error for what
/// counts as a failed try (past its attempts, the concurrency cap).
// Over 80 lines: the gate's decisions in docs/design.md §2.3's order, each an early return.
fn gate(
    state: &AppState,
    c: &LockedCommand,
    command_id: &str,
    executor: &Executor,
) -> Result<Option<TurnedAway>, AttemptError> {
    let not_now = |reason: String, retry_after_seconds: u64| {
        Ok(Some(TurnedAway::Done(ConsumeOutcome::NotNow {
            reason,
            retry_after_seconds,
        })))
    };
    if ledger::CommandState::parse(&c.state).is_some_and(ledger::CommandState::is_terminal) {
        return Ok(Some(TurnedAway::Done(ConsumeOutcome::Duplicate {
            command_id: command_id.to_string(),
            state: c.state.clone(),
        })));
    }
    if let Executor::Claimed(claim) = executor
        && c.attempts != claim.attempt().fence()
    {
        return Ok(Some(TurnedAway::Done(ConsumeOutcome::Stale(Overtaken))));
    }
    let due_in = c.due_in_seconds;
    if due_in > 0.0 {
        let reason = match (&c.held_kind, &c.held_reason) {
            (Some(kind), Some(why)) => {
                format!("held ({kind}): {why}; checked again in {}s", due_in.ceil())
            }
            _ => format!(
                "the command's next attempt is due in {}s (its window, or its backoff after a failure)",
                due_in.ceil()
            ),
        };
        return not_now(reason, due_in.ceil() as u64);
    }
    let policy = &c.policy;
    if let (Executor::Claimed(claim), Some(p)) = (executor, state.config.policy(policy))
        && claim.attempt().number() > p.retry.max_attempts as i32
    {
        let n = claim.attempt().number();
        // Claims count attempts even when the worker dies before recording a result, so a
        // command that keeps killing or hanging its workers still ends in quarantine.
        return Err(AttemptError::failed(Failure::transient(format!(
            "attempt {n} is past max_attempts {}: earlier attempts ended without a result \
             (their worker crashed, was killed or hung)",
            p.retry.max_attempts
        ))));
    }
    let retry_after = state.config.consume.retry_after.seconds() as u64;
    if c.identity_held.is_some() {
        // Held below, before the suspension (the identity guard comes first).
    } else if c.suspended {
        return not_now(format!("policy {policy} is suspended"), retry_after.max(60));
    }
    // A replica must not act under rules older than the newest any replica registered.
    let max_concurrent = match state.config.policy(policy) {
        Some(p) if p.version == c.current_version => p.max_concurrent_commands,
        Some(_) => {
            return not_now(
                format!(
                    "this replica's configuration of policy {policy} is older than the ledger's current version {}",
                    c.current_version
                ),
                retry_after,
            );
        }
        None => {
            return not_now(
                format!("this replica's configuration lacks policy {policy}"),
                retry_after,
            );
        }
    };
    if !c.slot_free {
        return Err(AttemptError::failed(Failure::throttled(
            Utc::now() + state.config.consume.retry_after.delta(),
            format!(
                "policy {policy} already runs {max_concurrent} commands (max_concurrent_commands)"
            ),
        )));
    }
    Ok(None)
}

/// The holds of docs/design.md §14 on a command the gate let through, the first in the one
/// precedence ([`ledger::first_hold`]): the identity guard, the blast-radius guard's approval, a
/// stage's upstream runs (`after`: why it waits), active hours, the governor, then the pace's
/// later start (`pace_wait` seconds away). (A suspension was answered before; a schema or policy
/// change is found when the rules are built.) `None`: it runs now.
fn held(
    state: &AppState,
    c: &LockedCommand,
    command: &ledger::commands::CommandTry,
    pace_wait: f64,
    after: Option<String>,
) -> Option<TurnedAway> {
    let approval = c
        .approval
        .as_deref()
        .and_then(ledger::Approval::parse)
        .filter(|a| a.holds() && !c.dry_run);
    let live = crate::holds::policy_hold(state, &c.policy);
    let (kind, (why, recheck)) = ledger::first_hold([
        c.identity_held
            .clone()
            .map(|why| (HoldKind::Identity, (why, None))),
        approval.map(|a| {
            let why = match a {
                ledger::Approval::AwaitingPlan => {
                    "the blast-radius guard decides when planning is done; nothing executes before"
                }
                _ => {
                    "the run's planned count crossed the blast-radius guard: approve it with \
                     POST /runs/{id}/approve, or cancel it"
                }
            };
            (HoldKind::Approval, (why.to_string(), None))
        }),
        after.map(|why| (HoldKind::After, (why, None))),
        live.map(|h| {
            let recheck = h
                .until
                .map(|t| (t - Utc::now()).num_seconds().max(1) as u64);
            (h.kind, (h.detail, recheck))
        }),
        (pace_wait > 0.0).then(|| {
            let why = format!(
                "the policy's pace (max_items_per_second) reserved a start in {pace_wait:.1} s"
            );
            (HoldKind::Pace, (why, Some(pace_wait.ceil() as u64)))
        }),
    ])?;
    Some(TurnedAway::Hold(Hold {
        kind,
        why,
        command: command.clone(),
        recheck,
    }))
}

/// The rules the command runs under: the stricter of its run's pinned version and the current
/// one, over the target's columns as this replica checked them (a schema that does not match
/// holds the work).
async fn rules_for(
    state: &AppState,
    tx: &mut Transaction<'_, Postgres>,
    c: &LockedCommand,
) -> Result<RuleSet, AttemptError> {
    let pinned = state.specs.get(tx, &c.policy, &c.policy_version).await?;
    let current = if c.current_version == c.policy_version {
        None
    } else {
        Some(state.specs.get(tx, &c.policy, &c.current_version).await?)
    };
    let specs: Vec<&crate::policy::PolicySpec> = std::iter::once(pinned.as_ref())
        .chain(current.as_deref())
        .collect();
    let table = state
        .catalog
        .tables(&state.pool, &specs)
        .await
        .map_err(AttemptError::Failed)?;
    Ok(RuleSet::effective(
        &pinned,
        current.as_deref().map(|s| (c.current_version.as_str(), s)),
        c.cutoff,
        c.window_at,
        &table,
        state.checked_types.get(&c.policy),
    )
    .map_err(|held| AttemptError::Failed(held.into()))?
    .with_effects(&c.policy, &c.run_id))
}
