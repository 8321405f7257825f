//! The consume pipeline: one command, executed idempotently, audited, and committed before the
//! caller is answered (DESIGN §2.4, §2.5, §5). `/consume` and the built-in queue both run it.
//!
//! For `delete_rows` a command is one transaction: lock the command row (a concurrent duplicate
//! waits here, then sees the terminal state), lock the candidate rows in key order, re-check
//! eligibility at the run's cutoff with every exclusion, delete, append one audit row per key, mark
//! the command done, update the run under its row lock, commit. On the healthy path that is a
//! constant number of statements whatever the batch size.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, Postgres, QueryBuilder, Row, Transaction};
use tracing::{info, warn};

use crate::app::AppState;
use crate::ledger;
use crate::policy::RuleSet;
use crate::retry::{Backoff, Failure, FailureClass};

/// Attempts before a command failing transiently is quarantined.
pub const MAX_ATTEMPTS: i32 = 10;

/// The built-in envelope: identity only, never data (DESIGN §2.12).
///
/// ```json
/// {"command_id": "ticket-retention:2026-11-29T02:00:00Z:0", "publish_generation": 1}
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// `{run_id}:{batch_no}`.
    pub command_id: String,
    /// The run, informational (the ledger is authoritative).
    #[serde(default)]
    pub run_id: Option<String>,
    /// Envelope schema version; 1 if absent.
    #[serde(default)]
    pub schema_version: Option<u32>,
    /// The publish generation, informational.
    #[serde(default)]
    pub publish_generation: Option<i32>,
}

/// One item's final outcome in a command (DESIGN §2.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The row was deleted.
    Deleted,
    /// The row was already gone.
    AlreadyAbsent,
    /// An exclusion held the row (the reason names it).
    Excluded,
    /// The row is no longer older than the cutoff.
    NotEligible,
    /// The action failed for this item (the reason holds the error).
    Failed,
    /// A dry run would have deleted the row.
    WouldDelete,
}

impl Outcome {
    /// The name stored in `sweeper.audit.outcome`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Deleted => "deleted",
            Outcome::AlreadyAbsent => "already_absent",
            Outcome::Excluded => "excluded",
            Outcome::NotEligible => "not_eligible",
            Outcome::Failed => "failed",
            Outcome::WouldDelete => "would_delete",
        }
    }
}

/// Outcome counts of one command.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Counts {
    /// Items deleted.
    pub deleted: i64,
    /// Items already gone.
    pub already_absent: i64,
    /// Items held by an exclusion.
    pub excluded: i64,
    /// Items no longer old enough.
    pub not_eligible: i64,
    /// Items that failed.
    pub failed: i64,
    /// Items a dry run would delete.
    pub would_delete: i64,
}

impl Counts {
    fn add(&mut self, o: Outcome) {
        match o {
            Outcome::Deleted => self.deleted += 1,
            Outcome::AlreadyAbsent => self.already_absent += 1,
            Outcome::Excluded => self.excluded += 1,
            Outcome::NotEligible => self.not_eligible += 1,
            Outcome::Failed => self.failed += 1,
            Outcome::WouldDelete => self.would_delete += 1,
        }
    }
}

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

struct Loaded {
    run_id: String,
    policy: String,
    policy_version: String,
    window: DateTime<Utc>,
    dry_run: bool,
    keys: Vec<String>,
    rules: RuleSet,
}

enum Step {
    Done(ConsumeOutcome),
    Run(Box<Loaded>),
}

/// Executes `command_id` to a committed decision.
///
/// `Err` only when the ledger itself could not record anything (answer 503).
pub async fn execute(
    state: &AppState,
    command_id: &str,
    executor: Executor,
    actor: &str,
) -> Result<ConsumeOutcome, Failure> {
    let mut per_item = false;
    loop {
        match attempt(state, command_id, executor, actor, per_item).await {
            Ok(outcome) => return Ok(outcome),
            Err(AttemptError::BulkFailed(f)) if !per_item => {
                info!(command_id, error = %f.message, "bulk delete failed permanently; retrying item by item");
                per_item = true;
            }
            Err(AttemptError::BulkFailed(f)) | Err(AttemptError::Failed(f)) => {
                return record_failure(state, command_id, executor, f).await;
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
) -> Result<ConsumeOutcome, AttemptError> {
    let mut tx = state.pool.begin().await?;
    sqlx::query(
        "select set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)",
    )
    .bind(format!("{}s", state.config.consume.lock_timeout.seconds()))
    .bind(format!(
        "{}s",
        state.config.consume.statement_timeout.seconds()
    ))
    .execute(&mut *tx)
    .await?;
    let loaded = match load(state, &mut tx, command_id, executor).await? {
        Step::Done(outcome) => {
            tx.rollback().await?;
            return Ok(outcome);
        }
        Step::Run(l) => l,
    };
    let rules = &loaded.rules;

    // Lock the candidates in key order (overlapping runs cannot deadlock) and classify each from
    // the same snapshot that deletes. A dry run locks nothing.
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new("select ");
    q.push(rules.key_sql());
    q.push("::text as item_key, ");
    rules.push_old_enough(&mut q);
    q.push(" as old_enough, ");
    rules.push_excluded_reason(&mut q);
    q.push(" as reason from ");
    q.push(rules.table_sql());
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
    sqlx::query(
        "insert into sweeper.audit
             (policy, policy_version, run_id, window_at, cutoff, command_id, item_key, outcome,
              reason, actor, dry_run)
         select $1, $2, $3, $4, $5, $6, u.item_key, u.outcome, u.reason, $7, $8
           from unnest($9::text[], $10::text[], $11::text[]) as u(item_key, outcome, reason)",
    )
    .bind(&loaded.policy)
    .bind(&loaded.policy_version)
    .bind(&loaded.run_id)
    .bind(loaded.window)
    .bind(rules.cutoff)
    .bind(command_id)
    .bind(actor)
    .bind(loaded.dry_run)
    .bind(&a_keys)
    .bind(&a_outcomes)
    .bind(&a_reasons)
    .execute(&mut *tx)
    .await?;

    let attempts_inc = matches!(executor, Executor::Delivery) as i32;
    sqlx::query(
        "update sweeper.commands
            set state = 'succeeded', attempts = attempts + $2, finished_at = sweeper.now(),
                lease_until = null, last_error = null, last_error_class = null
          where command_id = $1",
    )
    .bind(command_id)
    .bind(attempts_inc)
    .execute(&mut *tx)
    .await?;
    let run_status = finish_in_run(
        &mut tx,
        &loaded.run_id,
        &counts,
        false,
        rules,
        loaded.dry_run,
        state.config.planning.closure_check_cap,
    )
    .await?;
    crate::crash_point!("consume_before_commit");
    tx.commit().await?;
    crate::crash_point!("consume_after_commit");
    Ok(ConsumeOutcome::Executed {
        command_id: command_id.to_string(),
        counts,
        run_status,
    })
}

/// Locks the command row and decides whether to run it.
async fn load(
    state: &AppState,
    tx: &mut Transaction<'_, Postgres>,
    command_id: &str,
    executor: Executor,
) -> Result<Step, AttemptError> {
    let row = sqlx::query(
        "select c.state, c.item_keys, c.attempts, c.run_id,
                greatest(0, extract(epoch from c.next_attempt_at - (select sweeper.now())))::float8
                    as due_in_seconds,
                r.policy, r.policy_version, r.window_at, r.cutoff, r.dry_run
           from sweeper.commands c join sweeper.runs r using (run_id)
          where c.command_id = $1
          for update of c",
    )
    .bind(command_id)
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
    if let Executor::Claimed(n) = executor {
        let attempts: i32 = row.get("attempts");
        if attempts != n {
            return Ok(Step::Done(ConsumeOutcome::Stale));
        }
    }
    let due_in: f64 = row.get("due_in_seconds");
    if due_in > 0.0 {
        return Ok(Step::Done(ConsumeOutcome::NotNow {
            reason: "the command is not due yet (its run's window has not arrived)".into(),
            retry_after_seconds: due_in.ceil() as u64,
        }));
    }
    let policy: String = row.get("policy");
    let policy_version: String = row.get("policy_version");
    let window: DateTime<Utc> = row.get("window_at");
    let cutoff: DateTime<Utc> = row.get("cutoff");
    let (pinned, current_version, current) =
        ledger::run_specs(tx, &policy, &policy_version).await?;
    // A replica must not act under rules older than the newest any replica registered.
    let retry_after = state.config.consume.retry_after.seconds() as u64;
    match state.config.policy(&policy) {
        Some(p) if p.version == current_version => {}
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
    }
    let table = state
        .catalog
        .get(&state.pool, &pinned.target.table)
        .await
        .map_err(AttemptError::Failed)?;
    let rules = match RuleSet::effective(&pinned, current.as_ref(), cutoff, window, &table) {
        Ok(r) => r,
        Err(held) => {
            return Ok(Step::Done(ConsumeOutcome::NotNow {
                reason: format!("held: {held}"),
                retry_after_seconds: 60,
            }));
        }
    };
    Ok(Step::Run(Box::new(Loaded {
        run_id: row.get("run_id"),
        policy,
        policy_version,
        window,
        dry_run: row.get("dry_run"),
        keys: row.get("item_keys"),
        rules,
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
/// counter, and completion when this was the last command of a fully planned run.
async fn finish_in_run(
    tx: &mut Transaction<'_, Postgres>,
    run_id: &str,
    counts: &Counts,
    quarantined: bool,
    rules: &RuleSet,
    rules_dry_run: bool,
    closure_cap: i64,
) -> sqlx::Result<String> {
    let status: String = sqlx::query_scalar(
        "update sweeper.runs
            set pending_commands = pending_commands - 1,
                quarantined_commands = quarantined_commands + $2,
                deleted = deleted + $3, already_absent = already_absent + $4,
                excluded = excluded + $5, not_eligible = not_eligible + $6,
                failed = failed + $7, would_delete = would_delete + $8,
                status = case
                    when status in ('planning', 'running') and planning_done and pending_commands = 1
                    then case when quarantined_commands + $2 > 0 or failed + $7 > 0
                              then 'completed_with_dead_letters' else 'completed' end
                    else status end,
                completed_at = case
                    when status in ('planning', 'running') and planning_done and pending_commands = 1
                    then sweeper.now() else completed_at end
          where run_id = $1
          returning status",
    )
    .bind(run_id)
    .bind(quarantined as i32)
    .bind(counts.deleted)
    .bind(counts.already_absent)
    .bind(counts.excluded)
    .bind(counts.not_eligible)
    .bind(counts.failed)
    .bind(counts.would_delete)
    .fetch_one(&mut **tx)
    .await?;
    if ledger::is_terminal_run_status(&status) {
        // Only the completing command gets here (the status changed under the run-row lock).
        let already: Option<i64> =
            sqlx::query_scalar("select remaining_eligible from sweeper.runs where run_id = $1")
                .bind(run_id)
                .fetch_one(&mut **tx)
                .await?;
        if already.is_none() && !rules_dry_run {
            record_closure_check(tx, run_id, rules, closure_cap).await?;
        }
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
    rules.push_eligible(&mut q);
    q.push(" limit ");
    q.push_bind(cap);
    q.push(") capped");
    let remaining: i64 = q.build_query_scalar().fetch_one(&mut *conn).await?;
    sqlx::query(
        "update sweeper.runs set remaining_eligible = $2, remaining_eligible_cap = $3 where run_id = $1",
    )
    .bind(run_id)
    .bind(remaining)
    .bind(cap)
    .execute(conn)
    .await?;
    Ok(())
}

/// After a failed attempt (rolled back): either schedule the next attempt or, when the failure
/// is permanent or the attempts are spent, quarantine the command — committed either way.
async fn record_failure(
    state: &AppState,
    command_id: &str,
    executor: Executor,
    f: Failure,
) -> Result<ConsumeOutcome, Failure> {
    let db = |e: sqlx::Error| Failure::from_db(&e);
    if let Failure {
        message,
        class: FailureClass::Permanent,
    } = &f
        && message.contains("SQLSTATE 42")
    {
        // A schema error: read the catalog afresh next time.
        state.catalog.forget_all();
    }
    let mut tx = state.pool.begin().await.map_err(db)?;
    let row = sqlx::query(
        "select c.state, c.attempts, c.run_id from sweeper.commands c
          where c.command_id = $1 for update",
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
    let this_attempt = match executor {
        Executor::Delivery => attempts + 1,
        Executor::Claimed(n) => n,
    };
    let quarantine = f.class == FailureClass::Permanent || this_attempt >= MAX_ATTEMPTS;
    if quarantine {
        sqlx::query(
            "update sweeper.commands
                set state = 'quarantined', attempts = $2, finished_at = sweeper.now(),
                    lease_until = null, last_error = $3, last_error_class = $4
              where command_id = $1",
        )
        .bind(command_id)
        .bind(this_attempt)
        .bind(&f.message)
        .bind(f.class.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        // Completion bookkeeping without a rule set: a quarantined last command leaves the run
        // completed with dead letters, and the closure check is skipped (it may be unbuildable).
        sqlx::query(
            "update sweeper.runs
                set pending_commands = pending_commands - 1,
                    quarantined_commands = quarantined_commands + 1,
                    status = case when status in ('planning', 'running') and planning_done
                                        and pending_commands = 1
                                   then 'completed_with_dead_letters' else status end,
                    completed_at = case when status in ('planning', 'running') and planning_done
                                             and pending_commands = 1
                                        then sweeper.now() else completed_at end
              where run_id = $1",
        )
        .bind(&run_id)
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        tx.commit().await.map_err(db)?;
        warn!(command_id, class = f.class.as_str(), error = %f.message, attempts = this_attempt, "command quarantined");
        return Ok(ConsumeOutcome::Quarantined {
            command_id: command_id.to_string(),
            error: f.message,
        });
    }
    let delay = match f.class {
        FailureClass::Throttled { until } => (until - Utc::now()).num_seconds().max(1) as f64,
        _ => Backoff::default()
            .delay_seconds(this_attempt as u32, &mut rand::rng())
            .max(1.0),
    };
    sqlx::query(
        "update sweeper.commands
            set state = 'pending', attempts = $2, lease_until = null,
                next_attempt_at = sweeper.now() + make_interval(secs => $3),
                last_error = $4, last_error_class = $5
          where command_id = $1",
    )
    .bind(command_id)
    .bind(this_attempt)
    .bind(delay)
    .bind(&f.message)
    .bind(f.class.as_str())
    .execute(&mut *tx)
    .await
    .map_err(db)?;
    tx.commit().await.map_err(db)?;
    warn!(command_id, error = %f.message, attempt = this_attempt, retry_in_seconds = delay, "attempt failed; retrying later");
    Ok(ConsumeOutcome::NotNow {
        reason: f.message,
        retry_after_seconds: delay.ceil() as u64,
    })
}
