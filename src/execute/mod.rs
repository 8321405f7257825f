//! The consume pipeline: one command, executed idempotently, audited, and committed before the
//! caller is answered (docs/design.md §2.4, §2.5, §5). `/consume` and the built-in queue both run it.
//!
//! For `delete_rows` a command is one transaction: lock the command row (a concurrent duplicate
//! waits here, then sees the terminal state), delete the keys with eligibility at the run's cutoff
//! and every exclusion in the delete's own WHERE, classify the keys it left in a fresh snapshot,
//! append one audit row per key, mark the command done, commit. On the healthy path that is a
//! constant number of statements whatever the batch size.

pub mod call;
mod close;
mod delete;
mod envelope;
pub mod external;
mod finish;
mod load;
pub mod present;
mod store;

pub use crate::ledger::commands::slot_lock_key;
pub use envelope::{RAW_BODY_LIMIT, quarantine_envelope};
pub(crate) use finish::{complete_after, finish_in_run, record_failure, record_item_dead_letters};

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use chrono::{DateTime, Utc};
use sqlx::{Postgres, QueryBuilder, Row, Transaction};
use tracing::{info, warn};

use crate::ledger;
use crate::policy::RuleSet;
use crate::retry::{Decision, Failure, FailureClass, HoldKind, Setback};
use crate::state::AppState;

pub use crate::transport::Envelope;

pub use crate::ledger::outcome::{Counts, Outcome};

/// What executing a command ended in. The HTTP layer maps each to docs/design.md §5's answer.
/// `Stale` is the one outcome only a built-in worker's claim can end in: it is uninhabited in a
/// delivery's outcome (the default `Stale = Infallible`), and a claim's is [`Ended`].
#[derive(Debug, Clone)]
pub enum ConsumeOutcome<Stale = std::convert::Infallible> {
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
    Stale(Stale),
}

/// A claim that a newer attempt overtook: nothing it did was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overtaken;

/// What an execution ended in before its executor is answered: a claim may be overtaken.
pub type Ended = ConsumeOutcome<Overtaken>;

/// The "not now" of a delivery whose try a newer attempt overtook (its lease for calls expired
/// and another delivery leased the command): the newer attempt decides.
fn overtaken_delivery<S>() -> ConsumeOutcome<S> {
    ConsumeOutcome::NotNow {
        reason: "a newer attempt of this command took it over; it decides the outcome".into(),
        retry_after_seconds: 1,
    }
}

impl Ended {
    /// This outcome as a delivery's: an overtaken try is a "not now".
    pub fn for_delivery(self) -> ConsumeOutcome {
        match self {
            ConsumeOutcome::Executed {
                command_id,
                counts,
                run_status,
            } => ConsumeOutcome::Executed {
                command_id,
                counts,
                run_status,
            },
            ConsumeOutcome::Duplicate { command_id, state } => {
                ConsumeOutcome::Duplicate { command_id, state }
            }
            ConsumeOutcome::Quarantined { command_id, error } => {
                ConsumeOutcome::Quarantined { command_id, error }
            }
            ConsumeOutcome::NotNow {
                reason,
                retry_after_seconds,
            } => ConsumeOutcome::NotNow {
                reason,
                retry_after_seconds,
            },
            ConsumeOutcome::UnknownOfTerminalRun { command_id } => {
                ConsumeOutcome::UnknownOfTerminalRun { command_id }
            }
            ConsumeOutcome::Unknown { command_id } => ConsumeOutcome::Unknown { command_id },
            ConsumeOutcome::Stale(Overtaken) => overtaken_delivery(),
        }
    }
}

/// Who executes a command: an HTTP delivery, or a built-in worker holding a claim.
#[derive(Debug, Clone)]
pub enum Executor {
    /// `/consume`: the attempt is counted when it executes. `push`: a push transport delivered
    /// it (an authenticated push credential, or a Pub/Sub push body), which does not redeliver on
    /// its own schedule: its "not now" is a committed republish.
    Delivery {
        /// Whether a push transport delivered it.
        push: bool,
    },
    /// A built-in worker holding this claim (its attempt fences every write).
    Claimed(ledger::commands::CommandTry),
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
    /// For a redrive, the outcome of the item it re-executes (`failed` or `mismatched`), which
    /// its new outcome supersedes in the run's counts.
    pub(crate) redriven: Option<Outcome>,
    /// The try, as the ledger counts it: its methods are the command's state changes.
    pub(crate) command: ledger::commands::CommandTry,
    /// Another execution holds the command's lease, for this many more seconds (0: none).
    lease_left: f64,
    /// The keys an earlier attempt of this command already audited: skipped, so no item gains
    /// a second outcome.
    pub(crate) finished: Vec<String>,
    /// Its last attempt waited on rows another transaction held locked: this one deletes only
    /// the rows no one holds (`SKIP LOCKED`) instead of waiting `consume.lock_timeout` again.
    waiting_on_lock: bool,
}

impl Loaded {
    /// The keys this attempt acts on: the command's, less those an earlier attempt finished.
    pub(crate) fn keys_to_do(&self) -> Vec<String> {
        if self.finished.is_empty() {
            return self.keys.clone();
        }
        let finished: HashSet<&str> = self.finished.iter().map(String::as_str).collect();
        self.keys
            .iter()
            .filter(|k| !finished.contains(k.as_str()))
            .cloned()
            .collect()
    }

    /// The scope of this command's effects (`sweeper.effects.scope`): the window for an action
    /// once per window, `''` for one once per item.
    pub(crate) fn effect_scope(&self) -> String {
        self.rules.action.effect_scope(self.window)
    }

    /// The idempotency key of `item`'s effect `n`: `{policy}:{window}:{item}` once per window,
    /// `{policy}:{item}:{n}` once per item (docs/design.md §2.4). For a key of several columns,
    /// `{item}` is `sha256:` and the hex SHA-256 of the item key text when the whole key would
    /// exceed 255 bytes with it ([`crate::policy::idempotency_item`]); a one-column key's item
    /// is sent as it always was, so an effect opened before composite keys existed keeps its key.
    pub(crate) fn idempotency_key(&self, item: &str, n: i32) -> String {
        let composite = self.rules.key().is_composite();
        let item = |others: usize| {
            if composite {
                crate::policy::idempotency_item(item, others)
            } else {
                item.to_string()
            }
        };
        if self.rules.action.once_per_window() {
            let window = crate::window::format(self.window);
            let item = item(self.policy.len() + window.len() + 2);
            format!("{}:{window}:{item}", self.policy)
        } else {
            let n = n.to_string();
            let item = item(self.policy.len() + n.len() + 2);
            format!("{}:{item}:{n}", self.policy)
        }
    }

    /// What this command's audit rows say besides their items, for a try that began at
    /// `started`.
    pub(crate) fn execution<'a>(
        &'a self,
        actor: &'a str,
        started: Instant,
    ) -> ledger::commands::Execution<'a> {
        ledger::commands::Execution {
            elapsed_seconds: started.elapsed().as_secs_f64(),
            policy: &self.policy,
            policy_version: &self.policy_version,
            run_id: &self.run_id,
            window: self.window,
            cutoff: self.rules.cutoff,
            pinned_cutoff: self.rules.run_cutoff,
            current_version: self
                .rules
                .stricter_cutoff
                .as_ref()
                .map(|s| s.version.as_str()),
            actor,
        }
    }
}

/// What one try led to.
pub(super) enum Attempted {
    /// A decision, committed.
    Done(Ended),
    /// An action with external calls: its command is leased (`Loaded::attempt` is the lease's
    /// counted attempt); the calls run outside any transaction (see [`external`]).
    External(Box<Loaded>),
}

/// What the gate decided for a locked command.
pub(super) enum Step {
    /// It runs now, loaded under its rules.
    Run(Box<Loaded>),
    /// It does not.
    TurnedAway(TurnedAway),
}

/// A command the gate turned away.
pub(super) enum TurnedAway {
    /// Answered without trying it (a duplicate, a stale claim, not due, suspended, unknown, …).
    Done(Ended),
    /// Held (docs/design.md §14): given back without spending its attempt.
    Hold(Hold),
}

/// A hold: its kind and why, the try it gives back, and when to check again (`recheck`
/// seconds; `None`: the usual hold recheck).
pub(super) struct Hold {
    pub(super) kind: HoldKind,
    pub(super) why: String,
    pub(super) command: ledger::commands::CommandTry,
    pub(super) recheck: Option<u64>,
}

/// Executes a delivery of `command_id` (`push`: by a push transport) to a committed decision,
/// answered as a delivery's outcome (never stale).
pub async fn deliver(
    state: &AppState,
    command_id: &str,
    push: bool,
    actor: &str,
) -> Result<ConsumeOutcome, Setback> {
    execute(state, command_id, Executor::Delivery { push }, actor)
        .await
        .map(Ended::for_delivery)
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
) -> Result<Ended, Setback> {
    let started = Instant::now();
    // Fast path for duplicate deliveries: a terminal state is final (a redrive re-queues the
    // command itself), so one indexed read answers without a transaction or a row lock.
    if let Executor::Delivery { .. } = executor {
        let terminal = crate::ledger::terminal_state(&state.pool, command_id)
            .await
            .map_err(|e| Setback::from_db(&e))?;
        if let Some(state) = terminal {
            return Ok(ConsumeOutcome::Duplicate {
                command_id: command_id.to_string(),
                state,
            });
        }
    }
    let pace_wait = pace(state, command_id).await?;
    let mut mode = delete::Mode::Bulk;
    // Whether the delete was already redone after a row it removed was referenced meanwhile.
    let mut redone_after_reference = false;
    loop {
        let attempt = delete::attempt(
            state,
            command_id,
            &executor,
            actor,
            (mode, pace_wait),
            started,
        );
        let Stopped { error, tried } = match attempt.await {
            Ok(Attempted::Done(outcome)) => {
                return settle(state, command_id, &executor, outcome).await;
            }
            Ok(Attempted::External(loaded)) => {
                let outcome =
                    crate::execute::external::run(state, command_id, *loaded, actor, started)
                        .await?;
                return settle(state, command_id, &executor, outcome).await;
            }
            Err(stopped) => stopped,
        };
        let setback = match error {
            // A row the delete removed is referenced by a row committed while it ran (a hold
            // whose foreign key points at it): once, the same delete again, whose fresh snapshot
            // sees the new row and so the exclusion that holds it.
            AttemptError::Referenced(f) if !redone_after_reference => {
                info!(command_id, error = %f.message, "a row the delete removed was referenced meanwhile; deleting again");
                redone_after_reference = true;
                continue;
            }
            AttemptError::BulkFailed(f) | AttemptError::Referenced(f)
                if mode != delete::Mode::PerItem =>
            {
                info!(command_id, error = %f.message, "bulk delete failed permanently; retrying item by item");
                mode = delete::Mode::PerItem;
                continue;
            }
            AttemptError::Locked => {
                info!(
                    command_id,
                    "a row of the command is locked by another transaction; deleting the others"
                );
                mode = delete::Mode::SkipLocked;
                continue;
            }
            AttemptError::BulkFailed(f) | AttemptError::Referenced(f) => Setback::Failed(f),
            AttemptError::Failed(setback) => setback,
        };
        let outcome = record_failure(state, command_id, setback, started, tried).await?;
        return settle(state, command_id, &executor, outcome).await;
    }
}

/// Commits what a "not now" means for the executor, so its caller only answers: a claim is
/// given back without spending its attempt; a push delivery's command is due for publishing
/// again (the push transport is then acknowledged); a generic envelope's sender retries on its
/// own. A delivery is never answered [`ConsumeOutcome::Stale`] (only a claim can be overtaken
/// as such): a delivery whose try a newer attempt overtook is a "not now" — the newer attempt
/// decides. `Err` when the ledger could not record it.
async fn settle(
    state: &AppState,
    command_id: &str,
    executor: &Executor,
    outcome: Ended,
) -> Result<Ended, Setback> {
    let outcome = match (executor, outcome) {
        (Executor::Delivery { .. }, ConsumeOutcome::Stale(Overtaken)) => overtaken_delivery(),
        (_, outcome) => outcome,
    };
    let ConsumeOutcome::NotNow {
        reason,
        retry_after_seconds,
    } = &outcome
    else {
        return Ok(outcome);
    };
    let committed = match executor {
        Executor::Claimed(claim) => {
            claim
                .release(&state.pool, *retry_after_seconds as f64, reason)
                .await
        }
        // Pub/Sub ignores Retry-After and slows the whole subscription after nacks; QStash
        // spends one of its few retries on every non-2xx: publish again when due instead.
        Executor::Delivery { push: true } => {
            ledger::outbox::request_republish(&state.pool, command_id, *retry_after_seconds)
                .await
                .map(|_| ())
        }
        Executor::Delivery { push: false } => Ok(()),
    };
    committed.map_err(|e| Setback::from_db(&e))?;
    Ok(outcome)
}

/// Longest a command waits in-process for its pace's start; a later start holds it (kind
/// `pace`) and gives it back until then.
const PACE_WAIT_IN_PROCESS_SECONDS: f64 = 2.0;

/// The pace (docs/design.md §14): reserves the command's key count of its policy's
/// `max_items_per_second` before the effect's transaction begins (a reservation kept from an
/// earlier try is reused). Waits here for a start at most
/// [`PACE_WAIT_IN_PROCESS_SECONDS`] away; returns the seconds to a later one (the gate then
/// holds the command until it), else 0. Skipped while another hold applies to the policy, so a
/// held policy does not spend its budget.
async fn pace(state: &AppState, command_id: &str) -> Result<f64, Setback> {
    let Some(policy) = state.config.policy_by_command(command_id) else {
        return Ok(0.0);
    };
    let Some(rate) = policy.safety.max_items_per_second else {
        return Ok(0.0);
    };
    if crate::holds::policy_hold(state, policy.name.as_str()).is_some() {
        return Ok(0.0);
    }
    let reserved = ledger::queue::reserve_pace(&state.pool, command_id, policy.name.as_str(), rate)
        .await
        .map_err(|e| Setback::from_db(&e))?;
    match reserved {
        Some((_, wait)) if wait > PACE_WAIT_IN_PROCESS_SECONDS => Ok(wait),
        Some((_, wait)) if wait > 0.0 => {
            tokio::time::sleep(std::time::Duration::from_secs_f64(wait)).await;
            Ok(0.0)
        }
        _ => Ok(0.0),
    }
}

pub(super) enum AttemptError {
    /// The bulk delete hit a permanent error: redo the command with per-item savepoints.
    BulkFailed(Failure),
    /// The bulk delete removed a row that a row committed meanwhile references (SQLSTATE
    /// 23503): redo it once as it was (its new snapshot sees the referencing row, and an
    /// exclusion that tests it), then item by item.
    Referenced(Failure),
    /// The bulk delete waited `consume.lock_timeout` for a row another transaction holds: redo
    /// the command deleting only the rows no one holds.
    Locked,
    /// The attempt failed as a whole, or is held.
    Failed(Setback),
}

/// A try that stopped: why, and the try it is recorded as (`None`: a delivery the gate had
/// not let run, which tried nothing).
pub(super) struct Stopped {
    pub(super) error: AttemptError,
    pub(super) tried: Option<ledger::commands::CommandTry>,
}

impl AttemptError {
    /// The attempt failed as a whole.
    pub(super) fn failed(f: Failure) -> Self {
        AttemptError::Failed(f.into())
    }
}

impl From<sqlx::Error> for AttemptError {
    fn from(e: sqlx::Error) -> Self {
        AttemptError::Failed(Setback::from_db(&e))
    }
}
