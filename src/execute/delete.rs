//! The delete-rows path (docs/design.md §2.3, §2.4): delete first, classify after. In one
//! transaction: the gate locks the command row; one statement deletes the command's keys with
//! every predicate in its WHERE (no row is locked beforehand: under READ COMMITTED PostgreSQL
//! re-checks a row another transaction changed on its newest version); a second statement, in a
//! fresh snapshot, classifies the keys the delete did not remove and writes the audit rows and
//! the command's end. A key still present, old enough and unheld was locked (or changed twice
//! meanwhile): it stays for a later attempt, the others are audited now, and the command waits
//! for it without spending an attempt ([`FailureClass::Locked`]). Actions with external calls
//! leave here for [`super::external`] once their command is leased.

use super::*;
use ledger::commands::DeleteTarget;

/// How an attempt deletes a command's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// One statement, waiting up to `consume.lock_timeout` for a row another transaction holds.
    Bulk,
    /// One statement that leaves the rows another transaction holds locked (`SKIP LOCKED`):
    /// after the bulk delete's lock timeout, or when the command's last attempt waited on one.
    SkipLocked,
    /// One savepoint per item, after a permanent error in one statement: a bad item fails
    /// alone (its error recorded), its neighbours are deleted; locked rows are left, as above.
    PerItem,
}

/// One attempt of a delete-rows command (or the lease of an external-effect one), under
/// `consume.command_deadline`: `mode` says how it deletes; `pace_wait` is the seconds to the
/// start its pace reserved (> 0: the gate holds it until then).
///
/// Each step runs [`within`] the deadline as the try a failure of it would be recorded as: a
/// claim's from the start; a delivery's once the gate lets it run (a delivery turned away — not
/// due, held, a duplicate — tried nothing, so its deadline passing or an error while it rolls
/// back or commits the hold is not a failure of the attempt it saw); a leased delivery's as its
/// lease.
pub(super) async fn attempt(
    state: &AppState,
    command_id: &str,
    executor: &Executor,
    actor: &str,
    (mode, pace_wait): (Mode, f64),
    started: Instant,
) -> Result<Attempted, Stopped> {
    let until = tokio::time::Instant::now() + state.config.consume.command_deadline.std();
    let claim = match executor {
        Executor::Claimed(claim) => Some(claim),
        Executor::Delivery { .. } => None,
    };
    let mut tx = within(state, until, claim, async { Ok(state.pool.begin().await?) }).await?;
    let locked = super::load::lock(state, &mut tx, command_id, executor);
    let (c, command) = match within(state, until, claim, locked).await? {
        Ok(locked) => locked,
        Err(away) => return turned_away(state, tx, command_id, away, (until, claim)).await,
    };
    let judged = super::load::judge(
        state,
        &mut tx,
        c,
        &command,
        (command_id, executor),
        pace_wait,
    );
    let loaded = match within(state, until, Some(&command), judged).await? {
        Step::Run(l) => l,
        Step::TurnedAway(away) => {
            return turned_away(state, tx, command_id, away, (until, claim)).await;
        }
    };
    if loaded.rules.action.dependency().is_some() && !loaded.dry_run {
        return lease_for_calls(state, tx, command_id, loaded, until).await;
    }
    let run = Run {
        state,
        command_id,
        actor,
        started,
        keys: loaded.keys_to_do(),
        loaded,
    };
    let command = run.loaded.command.clone();
    let work = async {
        if run.loaded.dry_run {
            return run.dry_run(tx).await;
        }
        match mode {
            Mode::PerItem => run.item_by_item(tx).await,
            Mode::Bulk if !run.loaded.waiting_on_lock => run.delete_first(tx, false).await,
            Mode::Bulk | Mode::SkipLocked => run.delete_first(tx, true).await,
        }
    };
    within(state, until, Some(&command), work).await
}

/// A step of the gate that turned the command away, finished: rolled back, or the hold
/// committed. Nothing was tried but a claim's attempt.
async fn turned_away(
    state: &AppState,
    tx: Transaction<'_, Postgres>,
    command_id: &str,
    away: TurnedAway,
    (until, claim): (tokio::time::Instant, Option<&ledger::commands::CommandTry>),
) -> Result<Attempted, Stopped> {
    let work = async {
        match away {
            TurnedAway::Hold(h) => {
                let held = super::finish::hold_command(state, tx, command_id, h).await;
                Ok(held.map_err(AttemptError::Failed)?)
            }
            TurnedAway::Done(outcome) => {
                crate::pause_point!("gate_turned_away", command_id);
                tx.rollback().await?;
                Ok(outcome)
            }
        }
    };
    within(state, until, claim, work).await.map(Attempted::Done)
}

/// `work`, a step of a try, by the try's deadline `until`: its error, or the deadline passing
/// (the step dropped, its transaction rolled back), stops the try as `tried`.
async fn within<T>(
    state: &AppState,
    until: tokio::time::Instant,
    tried: Option<&ledger::commands::CommandTry>,
    work: impl std::future::Future<Output = Result<T, AttemptError>>,
) -> Result<T, Stopped> {
    let error = match tokio::time::timeout_at(until, work).await {
        Ok(Ok(done)) => return Ok(done),
        Ok(Err(error)) => error,
        Err(_) => AttemptError::failed(Failure::transient(format!(
            "the command exceeded its deadline of {}",
            state.config.consume.command_deadline
        ))),
    };
    Err(Stopped {
        error,
        tried: tried.cloned(),
    })
}

/// One attempt of a delete-rows command past its gate.
struct Run<'a> {
    state: &'a AppState,
    command_id: &'a str,
    actor: &'a str,
    started: Instant,
    loaded: Box<Loaded>,
    /// The keys this attempt acts on ([`Loaded::keys_to_do`]).
    keys: Vec<String>,
}

impl Run<'_> {
    /// The healthy path, in five round trips whatever the batch size: `BEGIN`, the gate
    /// ([`super::load`]), the delete, the closing statement
    /// ([`ledger::commands::CommandTry::close_after_delete`]: classification of the keys left,
    /// audit rows, the command `succeeded`, a redriven dead letter resolved), `COMMIT`. A
    /// permanent error (in the delete, or a deferred constraint at the commit) sends the command
    /// to the item-by-item path; a lock timeout to the `SKIP LOCKED` delete.
    async fn delete_first(
        self,
        mut tx: Transaction<'_, Postgres>,
        skip_locked: bool,
    ) -> Result<Attempted, AttemptError> {
        let rules = &self.loaded.rules;
        let mut q = QueryBuilder::new("");
        rules.push_delete_first(&mut q, &self.keys, skip_locked);
        crate::crash_point!("consume_before_delete");
        let deleted: Vec<String> = match q.build_query_scalar().fetch_all(&mut *tx).await {
            Ok(d) => d,
            Err(e) => return Err(self.delete_failed(&e, skip_locked)),
        };
        let mut q = self.loaded.command.close_after_delete(
            rules,
            &self.keys,
            &deleted,
            &ledger::commands::AfterDelete {
                execution: self.loaded.execution(self.actor, self.started),
                item_redrive: self.loaded.redrive_of.is_some(),
                others_cap: super::finish::others_cap(self.state, &self.loaded.policy),
            },
        );
        let row = q.build().fetch_one(&mut *tx).await?;
        let counts = Counts {
            deleted: row.get("deleted"),
            already_absent: row.get("already_absent"),
            excluded: row.get("excluded"),
            not_eligible: row.get("not_eligible"),
            ..Counts::default()
        };
        if !row.get::<bool, _>("closed") {
            let undecided: Vec<String> = row.get("undecided");
            if undecided.is_empty() {
                tx.rollback().await?;
                return Ok(Attempted::Done(ConsumeOutcome::Stale(Overtaken)));
            }
            let keys: Vec<String> = row.get("item_keys");
            let outcomes: Vec<String> = row.get("outcomes");
            let reasons: Vec<Option<String>> = row.get("reasons");
            let decided: ItemOutcomes = keys
                .into_iter()
                .zip(outcomes.iter().zip(reasons))
                .map(|(k, (o, r))| (k, (Outcome::parse(o).unwrap_or(Outcome::AlreadyAbsent), r)))
                .collect();
            return self.undecided(tx, decided, undecided).await;
        }
        let recorded = ledger::runs::Recorded {
            status: row.get("status"),
            others_pending: row.get("others_pending"),
        };
        crate::crash_point!("consume_before_commit");
        if let Err(e) = tx.commit().await {
            return Err(bulk_failed(&e));
        }
        self.executed(counts, recorded).await
    }

    /// What a failed delete statement means: a lock timeout → the same attempt again with `SKIP
    /// LOCKED`; a deadlock (overlapping commands no longer lock in key order) → a wait that spends
    /// no attempt; a permanent error → item by item; the rest fails the attempt.
    fn delete_failed(&self, e: &sqlx::Error, skip_locked: bool) -> AttemptError {
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.to_string());
        match code.as_deref() {
            Some(LOCK_NOT_AVAILABLE) if !skip_locked => AttemptError::Locked,
            Some(FOREIGN_KEY_VIOLATION) => match Setback::from_db(e) {
                Setback::Failed(f) => AttemptError::Referenced(f),
                held => AttemptError::Failed(held),
            },
            // A row of the command moved to another partition by an update the delete waited
            // on (PostgreSQL cannot follow it, even under READ COMMITTED): the moved row has a
            // new key, so the next attempt finds the old one gone. No attempt is spent.
            Some(SERIALIZATION_FAILURE) if moved_to_another_partition(e) => {
                AttemptError::failed(Failure::locked(
                    Utc::now() + chrono::Duration::seconds(1),
                    format!(
                        "a row of the command moved to another partition while the delete waited on \
                     it; the command runs again ({})",
                        Setback::from_db(e).message()
                    ),
                ))
            }
            Some(DEADLOCK_DETECTED) => AttemptError::failed(Failure::locked(
                Utc::now() + chrono::Duration::seconds(1),
                format!(
                    "the delete deadlocked with another transaction and was rolled back ({})",
                    Setback::from_db(e).message()
                ),
            )),
            _ => bulk_failed(e),
        }
    }

    /// Some keys are locked by another transaction: the decided ones are audited and counted now
    /// (with their deletes, in this transaction), the command keeps the others and waits for them
    /// without spending an attempt (the wait counts against `max_age`); the failure names the
    /// session holding the lock and how long its transaction has run.
    async fn wait_for_locked(
        self,
        mut tx: Transaction<'_, Postgres>,
        decided: AuditRows,
        undecided: &[String],
    ) -> Result<Attempted, AttemptError> {
        let l = &self.loaded;
        let mut q = QueryBuilder::new("");
        l.rules.push_lockers(&mut q, undecided);
        // Naming the session reads the rows' xmax, which needs SELECT on the whole table; a role
        // with column grants only (deploy/roles.sql) says "another transaction" instead.
        let mut naming = sqlx::Acquire::begin(&mut *tx).await?;
        let lockers: Vec<(i32, f64)> = match q.build_query_as().fetch_all(&mut *naming).await {
            Ok(lockers) => {
                naming.commit().await?;
                lockers
            }
            Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42501") => {
                naming.rollback().await?;
                Vec::new()
            }
            Err(e) => return Err(e.into()),
        };
        if !decided.failed.is_empty() {
            record_item_dead_letters(&mut tx, l, self.command_id, &dead_letters(&decided.failed))
                .await?;
        }
        l.command
            .append_audit(
                &mut tx,
                &ledger::commands::Audited {
                    execution: l.execution(self.actor, self.started),
                    dry_run: false,
                    keys: &decided.keys,
                    outcomes: &decided.outcomes,
                    reasons: &decided.reasons,
                    recorded: &[],
                },
            )
            .await?;
        finish_in_run(
            &mut tx,
            self.state,
            &l.policy,
            self.command_id,
            &decided.counts,
            false,
            None,
        )
        .await?;
        crate::crash_point!("consume_before_commit");
        if let Err(e) = tx.commit().await {
            // A deferred constraint is checked here: the command is redone item by item.
            return Err(bulk_failed(&e));
        }
        crate::metrics::attempt_committed(&l.policy, &decided.counts);
        let retry_after = self.state.config.consume.retry_after;
        Err(AttemptError::failed(Failure::locked(
            Utc::now() + retry_after.delta(),
            waiting_on_locks(undecided.len(), decided.keys.len(), &lockers),
        )))
    }

    /// The committed command's result, and the run completed if it was its last.
    async fn executed(
        self,
        counts: Counts,
        recorded: ledger::runs::Recorded,
    ) -> Result<Attempted, AttemptError> {
        let l = &self.loaded;
        crate::metrics::attempt_committed(&l.policy, &counts);
        crate::crash_point!("consume_after_commit");
        let rules = (!l.dry_run).then_some(&l.rules);
        let run_status = complete_after(self.state, &l.run_id, &l.policy, recorded, rules).await;
        Ok(Attempted::Done(ConsumeOutcome::Executed {
            command_id: self.command_id.to_string(),
            counts,
            run_status,
        }))
    }

    /// A dry run: each key classified (nothing locked, nothing deleted), what it would do
    /// audited, the command done.
    async fn dry_run(self, mut tx: Transaction<'_, Postgres>) -> Result<Attempted, AttemptError> {
        // What an eligible item would do: call (an action once per window), else delete.
        let effect = if self.loaded.rules.action.once_per_window() {
            Outcome::WouldCall
        } else {
            Outcome::WouldDelete
        };
        let outcomes = classify(&mut tx, &self.loaded.rules, &self.keys)
            .await?
            .into_iter()
            .map(|(k, judged)| (k, judged.outcome(effect)))
            .collect();
        self.succeed(tx, outcomes).await
    }

    /// After a permanent error in one statement: one savepoint per key (constraints checked
    /// immediately, deferred ones included), so a bad item fails alone with its error; locked
    /// rows are left (`SKIP LOCKED`) and waited for as in [`Run::delete_first`]. Then the keys
    /// not deleted are classified in a fresh statement.
    async fn item_by_item(
        self,
        mut tx: Transaction<'_, Postgres>,
    ) -> Result<Attempted, AttemptError> {
        let rules = &self.loaded.rules;
        sqlx::query("set constraints all immediate")
            .execute(&mut *tx)
            .await?;
        let mut outcomes: ItemOutcomes = HashMap::new();
        // Keys whose delete a referencing row refused: judged after, in a fresh snapshot (a
        // hold that references the row is an exclusion that holds it now).
        let mut referenced: HashMap<String, String> = HashMap::new();
        for key in &self.keys {
            let mut sp = sqlx::Connection::begin(&mut *tx).await?;
            let mut q = QueryBuilder::new("");
            rules.push_delete_first(&mut q, std::slice::from_ref(key), true);
            let deleted: sqlx::Result<Vec<String>> =
                q.build_query_scalar().fetch_all(&mut *sp).await;
            match deleted {
                Ok(deleted) => {
                    sp.commit().await?;
                    if !deleted.is_empty() {
                        outcomes.insert(key.clone(), (Outcome::Deleted, None));
                    }
                }
                Err(e) => {
                    sp.rollback().await?;
                    let code = e.as_database_error().and_then(|d| d.code());
                    if code.as_deref() == Some(SERIALIZATION_FAILURE)
                        && moved_to_another_partition(&e)
                    {
                        // Its row moved to another partition (a new key): judged below, gone.
                        continue;
                    }
                    let f = match Setback::from_db(&e) {
                        Setback::Failed(f) if f.class == FailureClass::Permanent => f,
                        other => return Err(AttemptError::Failed(other)),
                    };
                    if code.as_deref() == Some(FOREIGN_KEY_VIOLATION) {
                        referenced.insert(key.clone(), f.message);
                    } else {
                        outcomes.insert(key.clone(), (Outcome::Failed, Some(f.message)));
                    }
                }
            }
        }
        let left: Vec<String> = self
            .keys
            .iter()
            .filter(|k| !outcomes.contains_key(*k))
            .cloned()
            .collect();
        let mut undecided = Vec::new();
        for (key, judged) in classify(&mut tx, rules, &left).await? {
            if judged == ledger::outcome::Judgement::Eligible {
                // Still eligible: a referencing row no exclusion tests keeps it (failed, with
                // the database's reason); any other row the delete left is undecided.
                match referenced.remove(&key) {
                    Some(why) => {
                        outcomes.insert(key, (Outcome::Failed, Some(why)));
                    }
                    None => undecided.push(key),
                }
            } else {
                outcomes.insert(key, judged.outcome(Outcome::Deleted));
            }
        }
        if undecided.is_empty() {
            return self.succeed(tx, outcomes).await;
        }
        self.undecided(tx, outcomes, undecided).await
    }

    /// Keys the delete left though present, old enough and unheld: those another transaction
    /// holds locked wait ([`Run::wait_for_locked`]); one no one else holds was kept by a `BEFORE
    /// DELETE` trigger or a row security policy (or changed twice while the delete ran) and is
    /// `not_eligible`, `not_deleted: …`, as a row the delete did not remove always was.
    async fn undecided(
        self,
        mut tx: Transaction<'_, Postgres>,
        mut outcomes: ItemOutcomes,
        undecided: Vec<String>,
    ) -> Result<Attempted, AttemptError> {
        let mut q = QueryBuilder::new("");
        self.loaded.rules.push_unlocked(&mut q, &undecided);
        let unlocked: HashSet<String> = q
            .build_query_scalar()
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .collect();
        let locked: Vec<String> = undecided
            .into_iter()
            .filter(|k| !unlocked.contains(k))
            .collect();
        if !unlocked.is_empty() {
            self.delete_unlocked(&mut tx, unlocked, &mut outcomes)
                .await?;
        }
        if locked.is_empty() {
            return self.succeed(tx, outcomes).await;
        }
        let locked_set: HashSet<&str> = locked.iter().map(String::as_str).collect();
        let decided_keys: Vec<String> = self
            .keys
            .iter()
            .filter(|k| !locked_set.contains(k.as_str()))
            .cloned()
            .collect();
        let decided = audit_rows(&decided_keys, outcomes);
        self.wait_for_locked(tx, decided, &locked).await
    }

    /// Keys the delete left though present, old enough and unheld, that no other transaction
    /// holds (this transaction locked them): deleted again in a new statement, whose snapshot
    /// sees what committed since — a hold released while the first delete ran, a row changed
    /// twice. A key that one leaves too is judged once more: still eligible, a `BEFORE DELETE`
    /// trigger or a row security policy kept it (`not_eligible`, `not_deleted: …`); otherwise
    /// what it is now.
    async fn delete_unlocked(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        unlocked: HashSet<String>,
        outcomes: &mut ItemOutcomes,
    ) -> Result<(), AttemptError> {
        let rules = &self.loaded.rules;
        let keys: Vec<String> = unlocked.into_iter().collect();
        let mut q = QueryBuilder::new("");
        rules.push_delete_first(&mut q, &keys, true);
        let deleted: HashSet<String> = match q.build_query_scalar().fetch_all(&mut **tx).await {
            Ok(d) => d.into_iter().collect(),
            Err(e) => return Err(self.delete_failed(&e, true)),
        };
        let left: Vec<String> = keys
            .iter()
            .filter(|k| !deleted.contains(*k))
            .cloned()
            .collect();
        for key in deleted {
            outcomes.insert(key, (Outcome::Deleted, None));
        }
        for (key, judged) in classify(tx, rules, &left).await? {
            let outcome = if judged == ledger::outcome::Judgement::Eligible {
                (Outcome::NotEligible, Some(NOT_DELETED.to_string()))
            } else {
                judged.outcome(Outcome::Deleted)
            };
            outcomes.insert(key, outcome);
        }
        Ok(())
    }

    /// Every key has its outcome (`outcomes`; a key without one is `already_absent`): its audit
    /// rows, item dead letters for failed items, the command `succeeded`, its counts, `COMMIT`.
    async fn succeed(
        self,
        mut tx: Transaction<'_, Postgres>,
        outcomes: ItemOutcomes,
    ) -> Result<Attempted, AttemptError> {
        let l = &self.loaded;
        let AuditRows {
            counts,
            keys,
            outcomes,
            reasons,
            failed,
        } = audit_rows(&self.keys, outcomes);
        if !failed.is_empty() {
            record_item_dead_letters(&mut tx, l, self.command_id, &dead_letters(&failed)).await?;
        }
        // One statement: the audit rows, the command done, its attempt recorded, a redriven
        // dead letter resolved; its counts recorded next.
        l.command
            .succeed_with_audit(
                &mut tx,
                &ledger::commands::Audited {
                    execution: l.execution(self.actor, self.started),
                    dry_run: l.dry_run,
                    keys: &keys,
                    outcomes: &outcomes,
                    reasons: &reasons,
                    recorded: &[],
                },
            )
            .await?;
        let recorded = finish_in_run(
            &mut tx,
            self.state,
            &l.policy,
            self.command_id,
            &counts,
            false,
            l.redriven,
        )
        .await?;
        crate::crash_point!("consume_before_commit");
        if let Err(e) = tx.commit().await {
            // A deferred constraint is checked here (a DEFERRABLE foreign key, a constraint
            // trigger): after the bulk delete the command is redone item by item, with
            // constraints immediate; item by item already, it fails the try.
            return Err(bulk_failed(&e));
        }
        self.executed(counts, recorded).await
    }
}

/// The reason of a row the delete left that no other transaction holds.
const NOT_DELETED: &str = "not_deleted: the delete left the row (a BEFORE DELETE trigger or a row security policy kept it)";

/// SQLSTATE 55P03: `lock_timeout` expired.
const LOCK_NOT_AVAILABLE: &str = "55P03";
/// SQLSTATE 40001: under READ COMMITTED, a row moved to another partition by the update the
/// statement waited on.
const SERIALIZATION_FAILURE: &str = "40001";
/// Whether `e` is PostgreSQL's 40001 for a row an update moved to another partition while this
/// statement waited on it ("tuple to be deleted was already moved to another partition due to
/// concurrent update", or "to be locked"). Told from other serialization failures by its message:
/// under a server whose messages are translated it is not recognized, and fails the attempt as
/// any other transient error does (the next attempt finds the old key gone all the same).
fn moved_to_another_partition(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.message().contains("moved to another partition"))
}

/// SQLSTATE 40P01.
const DEADLOCK_DETECTED: &str = "40P01";
/// SQLSTATE 23503: a row the delete removed is still referenced.
const FOREIGN_KEY_VIOLATION: &str = "23503";

/// The item dead letters of failed items `(key, reason)`.
fn dead_letters(failed: &[(String, String)]) -> Vec<ledger::dead_letter::ItemDeadLetter> {
    failed
        .iter()
        .map(|(k, r)| ledger::dead_letter::ItemDeadLetter::failed(k, r))
        .collect()
}

/// A failed statement of the bulk path: a permanent error (in the delete, or a deferred
/// constraint — a DEFERRABLE foreign key or constraint trigger — at the commit) redoes the
/// command item by item, with constraints immediate; the rest fails the attempt.
fn bulk_failed(e: &sqlx::Error) -> AttemptError {
    match Setback::from_db(e) {
        Setback::Failed(f) if f.class == FailureClass::Permanent => AttemptError::BulkFailed(f),
        other => AttemptError::Failed(other),
    }
}

/// The message of a command waiting for `locked` rows after `done` others were audited: the
/// session that holds them (`lockers`: pid and seconds its transaction has run, longest first).
fn waiting_on_locks(locked: usize, done: usize, lockers: &[(i32, f64)]) -> String {
    let rows = if locked == 1 { "row is" } else { "rows are" };
    let by = match lockers.first() {
        Some((pid, seconds)) => format!(
            "by the session with pid {pid}, whose transaction has run {:.0} s",
            seconds
        ),
        None => "by another transaction".to_string(),
    };
    format!(
        "waiting on a lock: {locked} {rows} locked {by}; {done} other items are done; the \
         command tries the locked rows again without spending an attempt until max_age"
    )
}

/// An action with external calls: no transaction may span them (docs/design.md §2.6), so the command is
/// leased as this attempt — within `max_concurrent_commands` commands calling per policy,
/// serialized by a transaction-scoped advisory lock — and the calls run outside it
/// ([`super::external`]). A delivery that finds a live lease is a "not now".
async fn lease_for_calls(
    state: &AppState,
    mut tx: Transaction<'_, Postgres>,
    command_id: &str,
    mut loaded: Box<Loaded>,
    until: tokio::time::Instant,
) -> Result<Attempted, Stopped> {
    let before = loaded.command.clone();
    let taken = take_lease(state, &mut tx, command_id, &loaded);
    loaded.command = match within(state, until, Some(&before), taken).await? {
        Lease::Taken(command) => command,
        Lease::Refused(answer) => {
            let work = async {
                tx.rollback().await?;
                answer
            };
            return within(state, until, Some(&before), work).await;
        }
    };
    let leased = loaded.command.clone();
    let work = async {
        loaded.command.mark_calling(&mut tx).await?;
        tx.commit().await?;
        Ok(Attempted::External(loaded))
    };
    within(state, until, Some(&leased), work).await
}

/// Whether a command with external calls may call now.
enum Lease {
    /// Yes, as this try (a delivery's: its lease, counted as an attempt).
    Taken(ledger::commands::CommandTry),
    /// No: what the try ends in once its transaction is rolled back.
    Refused(Result<Attempted, AttemptError>),
}

/// The lease of [`lease_for_calls`], in `tx`.
async fn take_lease(
    state: &AppState,
    tx: &mut Transaction<'_, Postgres>,
    command_id: &str,
    loaded: &Loaded,
) -> Result<Lease, AttemptError> {
    // max_concurrent_commands: the slot taken in `load` ends with this transaction, so
    // the commands calling right now are counted instead, serialized per policy.
    let cap = state
        .config
        .policy(&loaded.policy)
        .map(|p| p.max_concurrent_commands as i64)
        .unwrap_or(1);
    sqlx::query("select pg_advisory_xact_lock(hashtext('sweeper:calling:' || $1))")
        .bind(&loaded.policy)
        .execute(&mut **tx)
        .await?;
    let calling = ledger::calling_commands(tx, &loaded.policy, command_id).await?;
    if calling >= cap {
        return Ok(Lease::Refused(Err(AttemptError::failed(
            Failure::throttled(
                Utc::now() + state.config.consume.retry_after.delta(),
                format!(
                    "policy {} already has {cap} commands calling (max_concurrent_commands)",
                    loaded.policy
                ),
            ),
        ))));
    }
    // No transaction may span the calls: the command is leased instead (docs/design.md §5,
    // concurrent deliveries), and a delivery that finds a live lease is a "not now".
    let ledger::commands::Attempt::Uncounted { .. } = loaded.command.attempt() else {
        return Ok(Lease::Taken(loaded.command.clone()));
    };
    if loaded.lease_left > 0.0 {
        return Ok(Lease::Refused(Ok(Attempted::Done(
            ConsumeOutcome::NotNow {
                reason: "another execution of this command holds its lease (its external calls \
                     may be in flight)"
                    .into(),
                retry_after_seconds: loaded.lease_left.ceil() as u64,
            },
        ))));
    }
    // The delivery counts as an attempt before anything is called, so a delivery that
    // crashes the process every time still spends the budget.
    let leased = loaded
        .command
        .lease_for_calls(
            tx,
            state.replica_id,
            state.config.queue.lease.seconds() as f64,
        )
        .await?;
    Ok(Lease::Taken(leased))
}

/// Each key's judgement in this statement's snapshot, locking nothing; keys absent from the
/// result are already gone.
async fn classify(
    tx: &mut Transaction<'_, Postgres>,
    rules: &RuleSet,
    keys: &[String],
) -> Result<Vec<(String, ledger::outcome::Judgement)>, AttemptError> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let mut q = QueryBuilder::new("");
    rules.push_classify(&mut q, keys);
    let rows = q.build().fetch_all(&mut **tx).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let judged = ledger::outcome::Judgement::of(
                true,
                r.get("reason"),
                r.get("old_enough"),
                r.get("not_eligible_reason"),
            );
            (r.get("item_key"), judged)
        })
        .collect())
}

/// The audit rows of a command, and what they add up to.
#[derive(Debug, PartialEq)]
pub(super) struct AuditRows {
    pub(super) counts: Counts,
    pub(super) keys: Vec<String>,
    pub(super) outcomes: Vec<&'static str>,
    pub(super) reasons: Vec<Option<String>>,
    /// The failed items, `(key, reason)`: each becomes an item dead letter; its neighbours
    /// complete.
    pub(super) failed: Vec<(String, String)>,
}

/// One audit row per key of the command, in the command's key order; a key with no outcome is
/// `already_absent` (its row was gone).
pub(super) fn audit_rows(keys: &[String], mut outcomes: ItemOutcomes) -> AuditRows {
    let mut rows = AuditRows {
        counts: Counts::default(),
        keys: Vec::with_capacity(keys.len()),
        outcomes: Vec::with_capacity(keys.len()),
        reasons: Vec::with_capacity(keys.len()),
        failed: Vec::new(),
    };
    for key in keys {
        let (o, reason) = outcomes
            .remove(key)
            .unwrap_or((Outcome::AlreadyAbsent, None));
        rows.counts.add(o);
        if o == Outcome::Failed {
            rows.failed
                .push((key.clone(), reason.clone().unwrap_or_default()));
        }
        rows.keys.push(key.clone());
        rows.outcomes.push(o.as_str());
        rows.reasons.push(reason);
    }
    rows
}

/// Each item's outcome and reason, by key.
type ItemOutcomes = HashMap<String, (Outcome, Option<String>)>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_gets_one_audit_row_and_missing_rows_are_already_absent() {
        let keys: Vec<String> = ["3", "1", "2", "4"].map(String::from).to_vec();
        let outcomes: ItemOutcomes = [
            ("1".to_string(), (Outcome::Deleted, None)),
            (
                "2".to_string(),
                (Outcome::Excluded, Some("legal_hold".to_string())),
            ),
            ("4".to_string(), (Outcome::Failed, Some("fk".to_string()))),
        ]
        .into_iter()
        .collect();
        let rows = audit_rows(&keys, outcomes);
        assert_eq!(rows.keys, keys);
        assert_eq!(
            rows.outcomes,
            ["already_absent", "deleted", "excluded", "failed"]
        );
        assert_eq!(rows.reasons[2].as_deref(), Some("legal_hold"));
        assert_eq!(rows.failed, vec![("4".to_string(), "fk".to_string())]);
        assert_eq!(
            (
                rows.counts.deleted,
                rows.counts.already_absent,
                rows.counts.excluded,
                rows.counts.failed
            ),
            (1, 1, 1, 1)
        );
    }
}
