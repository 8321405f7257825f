//! The consume pipeline: one command, executed idempotently, audited, and committed before the
//! caller is answered (DESIGN §2.4, §2.5, §5). `/consume` and the built-in queue both run it.
//!
//! For `delete_rows` a command is one transaction: lock the command row (a concurrent duplicate
//! waits here, then sees the terminal state), lock the candidate rows in key order, re-check
//! eligibility at the run's cutoff with every exclusion, delete, append one audit row per key, mark
//! the command done, update the run under its row lock, commit. On the healthy path that is a
//! constant number of statements whatever the batch size.

pub mod call;
pub mod external;

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Postgres, QueryBuilder, Row, Transaction};
use tracing::{info, warn};

use crate::ledger;
use crate::policy::RuleSet;
use crate::retry::{Decision, Failure, FailureClass, HoldKind};
use crate::state::AppState;

pub use crate::transport::Envelope;

pub use crate::ledger::outcome::{Counts, Outcome};

/// What executing a command ended in. The HTTP layer maps each to DESIGN §5's answer.
#[derive(Debug, Clone)]
pub enum ConsumeOutcome {
    /// The command ran and committed now.
    Executed {
        /// The command.
        command_id: String,
        /// Per-outcome item counts.
        counts: Counts,
        /// The run's status after this command.
        run_status: String,
    },
    /// The command was already terminal: nothing was done (a duplicate delivery).
    Duplicate {
        /// The command.
        command_id: String,
        /// Its terminal state.
        state: String,
    },
    /// A permanent failure or a spent budget quarantined the command (committed).
    Quarantined {
        /// The command.
        command_id: String,
        /// Why.
        error: String,
    },
    /// Not now: retry later. `retry_after_seconds` is the earliest useful retry.
    NotNow {
        /// Why.
        reason: String,
        /// Seconds until a retry can help.
        retry_after_seconds: u64,
    },
    /// The command is unknown but its run is terminal (its commands were purged): nothing to do.
    UnknownOfTerminalRun {
        /// The command id as delivered.
        command_id: String,
    },
    /// No such command, and no terminal run it could belong to.
    Unknown {
        /// The command id as delivered.
        command_id: String,
    },
    /// The built-in queue's claim was overtaken (its attempt is no longer the command's latest).
    Stale,
}

/// Who executes a command: an HTTP delivery, or a built-in worker holding a claim.
#[derive(Debug, Clone, Copy)]
pub enum Executor {
    /// `/consume`: the attempt is counted when it executes.
    Delivery,
    /// A built-in worker that claimed attempt `n` (fences every write).
    Claimed(i32),
}

/// A command loaded for execution, under its run's pinned (and stricter current) rules.
pub(crate) struct Loaded {
    pub(crate) run_id: String,
    pub(crate) policy: String,
    pub(crate) policy_version: String,
    pub(crate) window: DateTime<Utc>,
    pub(crate) dry_run: bool,
    pub(crate) keys: Vec<String>,
    pub(crate) rules: RuleSet,
    pub(crate) redrive_of: Option<i64>,
    /// Another execution holds the command's lease, for this many more seconds (0: none).
    lease_left: f64,
}

/// What one try led to.
enum Attempted {
    /// A decision, committed.
    Done(ConsumeOutcome),
    /// An action with external calls: its command is leased as attempt `n`; the calls run
    /// outside any transaction (see [`crate::effect`]).
    External(Box<Loaded>, i32),
}

enum Step {
    Done(ConsumeOutcome),
    Run(Box<Loaded>),
}

/// Executes `command_id` to a committed decision.
///
/// Each try runs under `consume.command_deadline`; a try that exceeds it is rolled back and
/// counts as a transient failure. `Err` only when the ledger itself could not record anything
/// (answer 503).
pub async fn execute(
    state: &AppState,
    command_id: &str,
    executor: Executor,
    actor: &str,
) -> Result<ConsumeOutcome, Failure> {
    let started = Instant::now();
    // The attempt count this call saw when it locked the command (deliveries only).
    let mut seen: Option<i32> = None;
    // Fast path for duplicate deliveries: a terminal state is final (a redrive re-queues the
    // command itself), so one indexed read answers without a transaction or a row lock.
    if let Executor::Delivery = executor {
        let terminal: Option<String> = sqlx::query_scalar(
            "select state from sweeper.commands where command_id = $1
               and state in ('succeeded', 'quarantined', 'cancelled')",
        )
        .bind(command_id)
        .fetch_optional(&state.pool)
        .await
        .map_err(|e| Failure::from_db(&e))?;
        if let Some(state) = terminal {
            return Ok(ConsumeOutcome::Duplicate {
                command_id: command_id.to_string(),
                state,
            });
        }
    }
    let deadline = state.config.consume.command_deadline.std();
    let mut per_item = false;
    loop {
        let tried = tokio::time::timeout(
            deadline,
            attempt(
                state, command_id, executor, actor, per_item, started, &mut seen,
            ),
        )
        .await
        .unwrap_or_else(|_| {
            Err(AttemptError::Failed(Failure::transient(format!(
                "the command exceeded its deadline of {}",
                state.config.consume.command_deadline
            ))))
        });
        match tried {
            Ok(Attempted::Done(outcome)) => return Ok(outcome),
            Ok(Attempted::External(loaded, n)) => {
                return crate::execute::external::run(
                    state, command_id, *loaded, n, actor, started,
                )
                .await;
            }
            Err(AttemptError::BulkFailed(f)) if !per_item => {
                info!(command_id, error = %f.message, "bulk delete failed permanently; retrying item by item");
                per_item = true;
            }
            Err(AttemptError::BulkFailed(f)) | Err(AttemptError::Failed(f)) => {
                return record_failure(state, command_id, executor, f, started, seen).await;
            }
        }
    }
}

enum AttemptError {
    /// The bulk delete hit a permanent error: redo the command with per-item savepoints.
    BulkFailed(Failure),
    /// The attempt failed as a whole.
    Failed(Failure),
}

impl From<sqlx::Error> for AttemptError {
    fn from(e: sqlx::Error) -> Self {
        AttemptError::Failed(Failure::from_db(&e))
    }
}

async fn attempt(
    state: &AppState,
    command_id: &str,
    executor: Executor,
    actor: &str,
    per_item: bool,
    started: Instant,
    seen: &mut Option<i32>,
) -> Result<Attempted, AttemptError> {
    let mut tx = state.pool.begin().await?;
    let loaded = match load(state, &mut tx, command_id, executor, seen).await? {
        Step::Done(outcome) => {
            tx.rollback().await?;
            return Ok(Attempted::Done(outcome));
        }
        Step::Run(l) => l,
    };
    if loaded.rules.action.dependency().is_some() && !loaded.dry_run {
        // max_concurrent_commands: the slot taken in `load` ends with this transaction, so
        // the commands calling right now are counted instead, serialized per policy.
        let cap = state
            .config
            .policy(&loaded.policy)
            .map(|p| p.max_concurrent_commands as i64)
            .unwrap_or(1);
        sqlx::query("select pg_advisory_xact_lock(hashtext('sweeper:calling:' || $1))")
            .bind(&loaded.policy)
            .execute(&mut *tx)
            .await?;
        let calling: i64 = sqlx::query_scalar(
            "select count(*) from sweeper.commands c join sweeper.runs r using (run_id)
              where r.policy = $2 and c.command_id <> $1 and c.state = 'leased'
                and c.calling_since is not null and c.lease_until > sweeper.now()",
        )
        .bind(command_id)
        .bind(&loaded.policy)
        .fetch_one(&mut *tx)
        .await?;
        if calling >= cap {
            tx.rollback().await?;
            return Err(AttemptError::Failed(Failure::throttled(
                Utc::now() + state.config.consume.retry_after.delta(),
                format!(
                    "policy {} already has {cap} commands calling (max_concurrent_commands)",
                    loaded.policy
                ),
            )));
        }
        // No transaction may span the calls: the command is leased instead (DESIGN §5,
        // concurrent deliveries), and a delivery that finds a live lease is a "not now".
        let n = match executor {
            Executor::Claimed(n) => n,
            Executor::Delivery => {
                if loaded.lease_left > 0.0 {
                    tx.rollback().await?;
                    return Ok(Attempted::Done(ConsumeOutcome::NotNow {
                        reason: "another execution of this command holds its lease (its \
                                 external calls may be in flight)"
                            .into(),
                        retry_after_seconds: loaded.lease_left.ceil() as u64,
                    }));
                }
                // The delivery counts as an attempt before anything is called, so a delivery
                // that crashes the process every time still spends the budget.
                let n = ledger::commands::lease_for_delivery(
                    &mut tx,
                    command_id,
                    state.replica_id,
                    state.config.queue.lease.seconds() as f64,
                )
                .await?;
                *seen = Some(n);
                n
            }
        };
        ledger::commands::mark_calling(&mut tx, command_id).await?;
        tx.commit().await?;
        return Ok(Attempted::External(loaded, n));
    }
    let rules = &loaded.rules;
    if per_item {
        // Each item's savepoint must see its own constraint violations, deferred ones included.
        sqlx::query("set constraints all immediate")
            .execute(&mut *tx)
            .await?;
    }

    // Lock the candidates in key order (overlapping runs cannot deadlock) and classify each from
    // the same snapshot that deletes. A dry run locks nothing.
    let mut q = rules.classify_select();
    q.push(" where ");
    rules.push_key_in(&mut q, loaded.keys.clone());
    q.push(format!(" order by {}", rules.key_sql()));
    if !loaded.dry_run {
        q.push(" for update");
    }
    let rows = q.build().fetch_all(&mut *tx).await?;

    let mut outcomes: HashMap<String, (Outcome, Option<String>)> = HashMap::new();
    let mut eligible = Vec::new();
    for r in &rows {
        let key: String = r.get("item_key");
        let old_enough: bool = r.get("old_enough");
        let reason: Option<String> = r.get("reason");
        let o = match (reason, old_enough) {
            (Some(reason), _) => (Outcome::Excluded, Some(reason)),
            (None, false) => (Outcome::NotEligible, None),
            (None, true) => {
                eligible.push(key.clone());
                let o = if loaded.dry_run {
                    Outcome::WouldDelete
                } else {
                    Outcome::Deleted
                };
                (o, None)
            }
        };
        outcomes.insert(key, o);
    }

    if !loaded.dry_run && !eligible.is_empty() {
        if per_item {
            for key in &eligible {
                let mut sp = sqlx::Connection::begin(&mut *tx).await?;
                match delete(&mut sp, rules, vec![key.clone()]).await {
                    Ok(deleted) => {
                        sp.commit().await?;
                        if deleted.is_empty() {
                            outcomes.insert(key.clone(), (Outcome::NotEligible, None));
                        }
                    }
                    Err(e) => {
                        sp.rollback().await?;
                        let f = Failure::from_db(&e);
                        if f.class != FailureClass::Permanent {
                            return Err(AttemptError::Failed(f));
                        }
                        outcomes.insert(key.clone(), (Outcome::Failed, Some(f.message)));
                    }
                }
            }
        } else {
            crate::crash_point!("consume_before_delete");
            let deleted = match delete(&mut tx, rules, eligible.clone()).await {
                Ok(d) => d,
                Err(e) => {
                    let f = Failure::from_db(&e);
                    return Err(if f.class == FailureClass::Permanent {
                        AttemptError::BulkFailed(f)
                    } else {
                        AttemptError::Failed(f)
                    });
                }
            };
            // Rows are locked, so the delete removes exactly the eligible set; anything it did
            // not remove is reported as it is, never as deleted.
            let deleted: HashSet<String> = deleted.into_iter().collect();
            for key in &eligible {
                if !deleted.contains(key) {
                    outcomes.insert(key.clone(), (Outcome::NotEligible, None));
                }
            }
        }
    }

    // One audit row per key of the command, in key order as stored.
    let mut counts = Counts::default();
    let mut a_keys = Vec::with_capacity(loaded.keys.len());
    let mut a_outcomes = Vec::with_capacity(loaded.keys.len());
    let mut a_reasons: Vec<Option<String>> = Vec::with_capacity(loaded.keys.len());
    for key in &loaded.keys {
        let (o, reason) = outcomes
            .remove(key)
            .unwrap_or((Outcome::AlreadyAbsent, None));
        counts.add(o);
        a_keys.push(key.clone());
        a_outcomes.push(o.as_str());
        a_reasons.push(reason);
    }
    // A failed item is an item-level dead letter; its neighbours complete.
    let failed: Vec<(String, String)> = a_keys
        .iter()
        .zip(&a_outcomes)
        .zip(&a_reasons)
        .filter(|((_, o), _)| **o == Outcome::Failed.as_str())
        .map(|((k, _), r)| (k.clone(), r.clone().unwrap_or_default()))
        .collect();
    if !failed.is_empty() {
        record_item_dead_letters(&mut tx, &loaded, command_id, &failed).await?;
    }

    // One statement: the audit rows, the command done, its attempt recorded, a redriven dead
    // letter resolved.
    ledger::commands::succeed_with_audit(
        &mut tx,
        &ledger::commands::Audited {
            command_id,
            attempts_inc: matches!(executor, Executor::Delivery) as i32,
            elapsed_seconds: started.elapsed().as_secs_f64(),
            policy: &loaded.policy,
            policy_version: &loaded.policy_version,
            run_id: &loaded.run_id,
            window: loaded.window,
            cutoff: rules.cutoff,
            actor,
            dry_run: loaded.dry_run,
            keys: &a_keys,
            outcomes: &a_outcomes,
            reasons: &a_reasons,
        },
    )
    .await?;
    let run_status = finish_in_run(
        &mut tx,
        &loaded.run_id,
        true,
        &counts,
        false,
        loaded.redrive_of.is_some(),
        (!loaded.dry_run).then_some(rules),
        state.config.planning.closure_check_cap,
    )
    .await?;
    crate::crash_point!("consume_before_commit");
    if let Err(e) = tx.commit().await {
        // A deferred constraint (a DEFERRABLE foreign key or constraint trigger) is checked
        // here, not at the delete: redo the command item by item, with constraints immediate.
        let f = Failure::from_db(&e);
        return Err(if f.class == FailureClass::Permanent && !per_item {
            AttemptError::BulkFailed(f)
        } else {
            AttemptError::Failed(f)
        });
    }
    crate::metrics::attempt_succeeded();
    crate::crash_point!("consume_after_commit");
    Ok(Attempted::Done(ConsumeOutcome::Executed {
        command_id: command_id.to_string(),
        counts,
        run_status,
    }))
}

/// Locks the command row and decides whether to run it.
async fn load(
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
    if matches!(
        cmd_state.as_str(),
        "succeeded" | "quarantined" | "cancelled"
    ) {
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

/// `DELETE … WHERE key = ANY($keys) AND <eligible> RETURNING key`: the predicates are repeated
/// in the delete itself, so nothing ineligible can be removed whatever happened before.
async fn delete(
    conn: &mut PgConnection,
    rules: &RuleSet,
    keys: Vec<String>,
) -> sqlx::Result<Vec<String>> {
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new("delete from ");
    q.push(rules.table_sql());
    q.push(" where ");
    rules.push_key_in(&mut q, keys);
    q.push(" and ");
    rules.push_eligible(&mut q);
    q.push(format!(" returning {}::text", rules.key_sql()));
    q.build_query_scalar().fetch_all(conn).await
}

/// Records a command's terminal state in its run, under the run-row lock: counts, the pending
/// counter, and completion when this was the last command of a fully planned run. With
/// `terminal` false only the counts are added (a command that finished some of its items). A run with a
/// dead letter that is not resolved completes as `completed_with_dead_letters`.
///
/// `item_redrive`: the command re-executed one item whose earlier outcome was `failed`, so that
/// outcome is superseded. `rules`: run the closure check on completion (None for dry runs and
/// for quarantined commands, whose rules may not be buildable).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn finish_in_run(
    tx: &mut Transaction<'_, Postgres>,
    run_id: &str,
    terminal: bool,
    counts: &Counts,
    quarantined: bool,
    item_redrive: bool,
    rules: Option<&RuleSet>,
    closure_cap: i64,
) -> sqlx::Result<String> {
    let status = ledger::runs::record_command(
        tx,
        run_id,
        &ledger::runs::CommandDone {
            terminal,
            quarantined,
            item_redrive,
            counts,
        },
    )
    .await?;
    let completed = matches!(status.as_str(), "completed" | "completed_with_dead_letters");
    if let (true, Some(rules)) = (completed, rules) {
        record_closure_check(tx, run_id, rules, closure_cap).await?;
    }
    Ok(status)
}

/// The closure check: how many rows are still eligible under the run's rules, counted up to
/// `cap` so the statement stays bounded on huge tables. Expected 0 for a completed real run;
/// dry runs skip it (`remaining_eligible` stays null: they change nothing to check).
pub async fn record_closure_check(
    conn: &mut PgConnection,
    run_id: &str,
    rules: &RuleSet,
    cap: i64,
) -> sqlx::Result<()> {
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new("select count(*) from (select 1 from ");
    q.push(rules.table_sql());
    q.push(" where ");
    // Rows without a key are held (`null_key`, counted at planning), not remaining.
    rules.push_has_key(&mut q);
    q.push(" and ");
    rules.push_eligible(&mut q);
    q.push(" limit ");
    q.push_bind(cap);
    q.push(") capped");
    let remaining: i64 = q.build_query_scalar().fetch_one(&mut *conn).await?;
    ledger::runs::set_remaining_eligible(conn, run_id, remaining, cap).await
}

/// Item-level dead letters for the items that failed in this command (in its transaction). An
/// item re-executed by a redrive reopens its own dead letter instead of adding one.
pub(crate) async fn record_item_dead_letters(
    tx: &mut Transaction<'_, Postgres>,
    loaded: &Loaded,
    command_id: &str,
    failed: &[(String, String)],
) -> sqlx::Result<()> {
    match loaded.redrive_of {
        Some(dl) => ledger::dead_letter::reopen_item(tx, dl, &failed[0].1).await,
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

/// After a failed try (rolled back): snooze, retry later, or quarantine — committed either way,
/// with an attempt row for the history.
///
/// * `throttled`: a snooze. It spends no attempt but counts against `max_age`.
/// * `transient`: the attempt is spent; retried after full-jitter backoff, or quarantined once
///   `max_attempts` or `max_age` is spent.
/// * `permanent`: quarantined now.
///
/// A quarantined command gets a dead letter (one per command: a later failure of a redriven
/// command reopens it) holding its attempt history.
pub(crate) async fn record_failure(
    state: &AppState,
    command_id: &str,
    executor: Executor,
    f: Failure,
    started: Instant,
    seen: Option<i32>,
) -> Result<ConsumeOutcome, Failure> {
    let db = |e: sqlx::Error| Failure::from_db(&e);
    if matches!(executor, Executor::Delivery) && seen.is_none() {
        // Nothing was executed (the command row was never locked): not an attempt. If the
        // ledger answers, the row was busy (a concurrent delivery executing it, a lock or
        // deadline wait): a "not now", not an unreachable ledger (DESIGN §5).
        let answers = sqlx::query("select 1 from sweeper.commands where command_id = $1")
            .bind(command_id)
            .fetch_optional(&state.pool)
            .await
            .is_ok();
        if !answers {
            return Err(f);
        }
        return Ok(ConsumeOutcome::NotNow {
            reason: format!(
                "the command is busy (another delivery may be executing it; {}); nothing was \
                 recorded, retry later",
                f.class.as_str()
            ),
            retry_after_seconds: state.config.consume.retry_after.seconds() as u64,
        });
    }
    if f.class == FailureClass::Held(HoldKind::Schema)
        && let Some(p) = state.config.policy_by_command(command_id)
    {
        // The target's schema does not match: read its columns afresh at the next try.
        state.catalog.forget(&p.spec.target.table);
    }
    let mut tx = state.pool.begin().await.map_err(db)?;
    let row = sqlx::query(
        "select c.state, c.attempts, c.run_id, r.policy,
                extract(epoch from sweeper.now() - c.due_since)::float8 - c.age_credit_seconds
                    as age_seconds,
                greatest(1, extract(epoch from c.next_attempt_at - sweeper.now()))::float8
                    as due_in_seconds
           from sweeper.commands c join sweeper.runs r using (run_id)
          where c.command_id = $1 for update of c",
    )
    .bind(command_id)
    .fetch_optional(&mut *tx)
    .await
    .map_err(db)?;
    let Some(row) = row else {
        return Err(f);
    };
    let cmd_state: String = row.get("state");
    let attempts: i32 = row.get("attempts");
    let run_id: String = row.get("run_id");
    let policy: String = row.get("policy");
    let age_seconds: f64 = row.get("age_seconds");
    if matches!(
        cmd_state.as_str(),
        "succeeded" | "quarantined" | "cancelled"
    ) {
        return Ok(ConsumeOutcome::Duplicate {
            command_id: command_id.to_string(),
            state: cmd_state,
        });
    }
    if let Executor::Claimed(n) = executor
        && attempts != n
    {
        return Ok(ConsumeOutcome::Stale);
    }
    if matches!(executor, Executor::Delivery) && seen != Some(attempts) {
        // A concurrent delivery of the same command already recorded this round's failure:
        // one failure, one attempt; this one just comes back when the next attempt is due.
        let due_in: f64 = row.get("due_in_seconds");
        return Ok(ConsumeOutcome::NotNow {
            reason: "a concurrent delivery of this command just failed; retry when it is due"
                .into(),
            retry_after_seconds: due_in.ceil() as u64,
        });
    }
    let budget = state
        .config
        .policy(&policy)
        .map(|p| p.retry)
        .unwrap_or_default()
        .budget();
    // The attempt number this try ran as (a snooze or a hold gives it back).
    let this_attempt = match executor {
        Executor::Delivery => attempts + 1,
        Executor::Claimed(n) => n,
    };
    let elapsed = started.elapsed().as_secs_f64();
    let decision = crate::retry::decide(
        &f,
        this_attempt,
        age_seconds,
        &budget,
        Utc::now(),
        &mut rand::rng(),
    );
    match decision {
        Decision::Hold { kind, attempts } => {
            hold_command(state, tx, command_id, kind, attempts, &f.message).await
        }
        Decision::Quarantine { attempts, reason } => {
            let failed = Failed {
                command_id,
                run_id: &run_id,
                policy: &policy,
                attempts,
                elapsed,
            };
            quarantine_command(state, tx, failed, f.class, reason).await
        }
        Decision::Retry {
            attempts,
            delay_seconds,
            snooze,
        } => {
            let failed = Failed {
                command_id,
                run_id: &run_id,
                policy: &policy,
                attempts,
                elapsed,
            };
            schedule_retry(tx, failed, &f, delay_seconds, snooze).await
        }
    }
}

/// The command a failed try was of, with the attempt count to record.
struct Failed<'a> {
    command_id: &'a str,
    run_id: &'a str,
    policy: &'a str,
    attempts: i32,
    /// Seconds the try took.
    elapsed: f64,
}

/// Holds a command (DESIGN §14): pending again, its attempt given back, checked again after
/// [`hold_recheck_seconds`]; the time since the last check is credited to its age budget.
async fn hold_command(
    state: &AppState,
    mut tx: Transaction<'_, Postgres>,
    command_id: &str,
    kind: HoldKind,
    attempts: i32,
    why: &str,
) -> Result<ConsumeOutcome, Failure> {
    let db = |e: sqlx::Error| Failure::from_db(&e);
    let recheck = hold_recheck_seconds(state);
    ledger::commands::hold(
        &mut tx,
        command_id,
        attempts,
        recheck as f64,
        kind.as_str(),
        why,
    )
    .await
    .map_err(db)?;
    tx.commit().await.map_err(db)?;
    info!(command_id, kind = kind.as_str(), reason = %why, "command held");
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
) -> Result<ConsumeOutcome, Failure> {
    let db = |e: sqlx::Error| Failure::from_db(&e);
    ledger::commands::quarantine(
        &mut tx,
        &ledger::commands::Failed {
            command_id: c.command_id,
            run_id: c.run_id,
            policy: c.policy,
            attempts: c.attempts,
            elapsed_seconds: c.elapsed,
            error: &reason,
            class: class.as_str(),
        },
    )
    .await
    .map_err(db)?;
    finish_in_run(
        &mut tx,
        c.run_id,
        true,
        &Counts::default(),
        true,
        false,
        None,
        state.config.planning.closure_check_cap,
    )
    .await
    .map_err(db)?;
    tx.commit().await.map_err(db)?;
    crate::metrics::quarantined(class);
    warn!(command_id = c.command_id, class = class.as_str(), error = %reason,
          attempts = c.attempts, "command quarantined");
    Ok(ConsumeOutcome::Quarantined {
        command_id: c.command_id.to_string(),
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
) -> Result<ConsumeOutcome, Failure> {
    let db = |e: sqlx::Error| Failure::from_db(&e);
    ledger::commands::schedule_retry(
        &mut tx,
        &ledger::commands::Failed {
            command_id: c.command_id,
            run_id: c.run_id,
            policy: c.policy,
            attempts: c.attempts,
            elapsed_seconds: c.elapsed,
            error: &f.message,
            class: f.class.as_str(),
        },
        delay,
        snooze,
    )
    .await
    .map_err(db)?;
    tx.commit().await.map_err(db)?;
    crate::metrics::attempt_failed(f.class);
    warn!(command_id = c.command_id, class = f.class.as_str(), error = %f.message,
          attempt = c.attempts, retry_in_seconds = delay, "not done; next attempt scheduled");
    // The answer names the class, never the error text (which may quote customer data); the
    // ledger keeps the text for operators.
    Ok(ConsumeOutcome::NotNow {
        reason: if snooze {
            format!(
                "snoozed (throttled); the next attempt is due in {}s",
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

/// Seconds between two checks of held work: `consume.retry_after`, at least 5 s (every check
/// is a claim, a catalog read and a rollback; a push command is republished each time).
pub fn hold_recheck_seconds(state: &AppState) -> u64 {
    (state.config.consume.retry_after.seconds() as u64).max(5)
}

/// The most of an unparseable body kept in its dead letter, in bytes.
pub const RAW_BODY_LIMIT: usize = 8 * 1024;

/// Quarantines an envelope that could not be parsed (from an authenticated sender): its bounded
/// raw body and the SHA-256 of the whole body become a dead letter, so the queue can be
/// acknowledged instead of redelivering a poison message for ever. The same body delivered again
/// counts on the same open dead letter. Returns its id.
///
/// `body` is the body as read (only its first [`RAW_BODY_LIMIT`] bytes are kept), `size` and
/// `sha256` (hex) those of the whole body.
pub async fn quarantine_envelope(
    state: &AppState,
    body: &[u8],
    size: usize,
    sha256: &str,
    error: &str,
    subject: &str,
) -> Result<i64, Failure> {
    let hash = sha256.to_string();
    let cut = &body[..body.len().min(RAW_BODY_LIMIT)];
    let raw = String::from_utf8_lossy(cut).replace('\0', "\u{FFFD}");
    let reason = crate::ledger::printable(
        &format!("invalid_payload: {error} (from {subject})"),
        crate::retry::MAX_ERROR_CHARS,
    );
    let id =
        ledger::dead_letter::quarantine_envelope(&state.pool, &reason, &raw, &hash, size as i64)
            .await
            .map_err(|e| Failure::from_db(&e))?;
    crate::metrics::quarantined(FailureClass::Permanent);
    Ok(id)
}
