//! The gate: lock the command row and decide whether it may run now (terminal, stale, not due,
//! suspended, over its attempts, a replica behind the ledger's version, the concurrency cap),
//! and build the rules it runs under (the stricter of the pinned and the current version).

use super::*;

/// Locks the command row and decides whether to run it.
pub(super) async fn load(
    state: &AppState,
    tx: &mut Transaction<'_, Postgres>,
    command_id: &str,
    executor: Executor,
    seen: &mut Option<i32>,
) -> Result<Step, AttemptError> {
    // One statement: lock the command row; read its run, its policy's suspension and current
    // version; set this transaction's lock and statement timeouts; and take one of the policy's
    // `max_concurrent_commands` slots (transaction-scoped advisory locks shared by all
    // replicas, released at commit, rollback or crash).
    let (names, caps): (Vec<&str>, Vec<i32>) = state
        .config
        .policies
        .iter()
        .map(|p| (p.name.as_str(), p.max_concurrent_commands as i32))
        .unzip();
    let row = sqlx::query(
        "select c.state, c.item_keys, c.attempts, c.run_id, c.held_kind, c.held_reason,
                greatest(0, extract(epoch from c.next_attempt_at - (select sweeper.now())))::float8
                    as due_in_seconds,
                c.redrive_of, r.policy, r.policy_version, r.window_at, r.cutoff, r.dry_run,
                case when c.state = 'leased' and c.lease_until > sweeper.now()
                     then extract(epoch from c.lease_until - sweeper.now())::float8
                     else 0 end as lease_left,
                coalesce(ps.suspended, false) as suspended,
                (select v.version from sweeper.policy_versions v where v.policy = r.policy
                  order by v.seq desc limit 1) as current_version,
                set_config('lock_timeout', $2, true) is not null as timeouts_set,
                set_config('statement_timeout', $3, true) is not null as timeouts_set2,
                exists (select 1
                          from generate_series(0, coalesce((select cap from unnest($4::text[], $5::int4[])
                                                                  as caps(policy, cap)
                                                             where caps.policy = r.policy), 1) - 1) s
                         where pg_try_advisory_xact_lock(hashtext('sweeper:' || r.policy), s))
                    as slot_free
           from sweeper.commands c join sweeper.runs r using (run_id)
           left join sweeper.policy_state ps on ps.policy = r.policy
          where c.command_id = $1
          for update of c",
    )
    .bind(command_id)
    .bind(format!("{}s", state.config.consume.lock_timeout.seconds()))
    .bind(format!("{}s", state.config.consume.statement_timeout.seconds()))
    .bind(&names)
    .bind(&caps)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(row) = row else {
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
        return Ok(Step::Done(match run_status {
            Some(s) if ledger::is_terminal_run_status(&s) => {
                info!(
                    command_id,
                    "delivery for an unknown command of a terminal run; acknowledged"
                );
                ConsumeOutcome::UnknownOfTerminalRun { command_id }
            }
            _ => ConsumeOutcome::Unknown { command_id },
        }));
    };
    let cmd_state: String = row.get("state");
    if ledger::CommandState::parse(&cmd_state).is_some_and(ledger::CommandState::is_terminal) {
        return Ok(Step::Done(ConsumeOutcome::Duplicate {
            command_id: command_id.to_string(),
            state: cmd_state,
        }));
    }
    let attempts: i32 = row.get("attempts");
    *seen = Some(attempts);
    if let Executor::Claimed(n) = executor
        && attempts != n
    {
        return Ok(Step::Done(ConsumeOutcome::Stale));
    }
    let due_in: f64 = row.get("due_in_seconds");
    if due_in > 0.0
        && let (Some(kind), Some(why)) = (
            row.get::<Option<String>, _>("held_kind"),
            row.get::<Option<String>, _>("held_reason"),
        )
    {
        return Ok(Step::Done(ConsumeOutcome::NotNow {
            reason: format!("held ({kind}): {why}; checked again in {}s", due_in.ceil()),
            retry_after_seconds: due_in.ceil() as u64,
        }));
    }
    if due_in > 0.0 {
        return Ok(Step::Done(ConsumeOutcome::NotNow {
            reason: format!(
                "the command's next attempt is due in {}s (its window, or its backoff after a failure)",
                due_in.ceil()
            ),
            retry_after_seconds: due_in.ceil() as u64,
        }));
    }
    let policy: String = row.get("policy");
    if let (Executor::Claimed(n), Some(p)) = (executor, state.config.policy(&policy))
        && n > p.retry.max_attempts as i32
    {
        // Claims count attempts even when the worker dies before recording a result, so a
        // command that keeps killing or hanging its workers still ends in quarantine.
        return Err(AttemptError::Failed(Failure::transient(format!(
            "attempt {n} is past max_attempts {}: earlier attempts ended without a result \
             (their worker crashed, was killed or hung)",
            p.retry.max_attempts
        ))));
    }
    let retry_after = state.config.consume.retry_after.seconds() as u64;
    if row.get::<bool, _>("suspended") {
        return Ok(Step::Done(ConsumeOutcome::NotNow {
            reason: format!("policy {policy} is suspended"),
            retry_after_seconds: retry_after.max(60),
        }));
    }
    let policy_version: String = row.get("policy_version");
    let window: DateTime<Utc> = row.get("window_at");
    let cutoff: DateTime<Utc> = row.get("cutoff");
    let current_version: String = row.get("current_version");
    // A replica must not act under rules older than the newest any replica registered.
    let max_concurrent = match state.config.policy(&policy) {
        Some(p) if p.version == current_version => p.max_concurrent_commands,
        Some(_) => {
            return Ok(Step::Done(ConsumeOutcome::NotNow {
                reason: format!(
                    "this replica's configuration of policy {policy} is older than the ledger's current version {current_version}"
                ),
                retry_after_seconds: retry_after,
            }));
        }
        None => {
            return Ok(Step::Done(ConsumeOutcome::NotNow {
                reason: format!("this replica's configuration lacks policy {policy}"),
                retry_after_seconds: retry_after,
            }));
        }
    };
    if !row.get::<bool, _>("slot_free") {
        return Err(AttemptError::Failed(Failure::throttled(
            Utc::now() + state.config.consume.retry_after.delta(),
            format!(
                "policy {policy} already runs {max_concurrent} commands (max_concurrent_commands)"
            ),
        )));
    }
    let pinned = state.specs.get(tx, &policy, &policy_version).await?;
    let current = if current_version == policy_version {
        None
    } else {
        Some(state.specs.get(tx, &policy, &current_version).await?)
    };
    let table = state
        .catalog
        .get(&state.pool, &pinned.target.table)
        .await
        .map_err(AttemptError::Failed)?;
    let run_id: String = row.get("run_id");
    let rules = RuleSet::effective(
        &pinned,
        current.as_deref(),
        cutoff,
        window,
        &table,
        state.checked_types.get(&policy),
    )
    .map_err(|held| AttemptError::Failed(held.into_failure()))?
    .with_effects(&policy, &run_id);
    Ok(Step::Run(Box::new(Loaded {
        run_id,
        policy,
        policy_version,
        window,
        dry_run: row.get("dry_run"),
        keys: row.get("item_keys"),
        rules,
        redrive_of: row.get("redrive_of"),
        lease_left: row.get("lease_left"),
    })))
}
