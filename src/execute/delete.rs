//! The delete-rows path (docs/design.md §2.3, §2.4): one transaction locks the command row and the
//! candidates in key order, re-checks every predicate in the snapshot that deletes, deletes,
//! appends the audit rows and marks the command done. A permanent error in the bulk delete
//! reruns the command item by item with savepoints. Actions with external calls leave here for
//! [`super::external`] once their command is leased.

use super::*;

/// One attempt of a delete-rows command (or the lease of an external-effect one): `per_item`
/// reruns it item by item with savepoints after a bulk failure; `pace_wait` is the seconds to
/// the start its pace reserved (> 0: the gate holds it until then); `tried`: as in `load::load`.
// Over 80 lines: the steps of one transaction in order (load, classify, delete, audit, finish,
// commit); splitting further would hand the transaction and its locals around.
pub(super) async fn attempt(
    state: &AppState,
    command_id: &str,
    executor: &Executor,
    actor: &str,
    (per_item, pace_wait): (bool, f64),
    started: Instant,
    tried: &mut Option<ledger::commands::CommandTry>,
) -> Result<Attempted, AttemptError> {
    let mut tx = state.pool.begin().await?;
    let loaded =
        match super::load::load(state, &mut tx, command_id, executor, tried, pace_wait).await? {
            Step::Done(outcome) => {
                crate::pause_point!("gate_turned_away", command_id);
                tx.rollback().await?;
                return Ok(Attempted::Done(outcome));
            }
            Step::Hold(h) => {
                let held = super::finish::hold_command(state, tx, command_id, h);
                return Ok(Attempted::Done(held.await.map_err(AttemptError::Failed)?));
            }
            Step::Run(l) => l,
        };
    if loaded.rules.action.dependency().is_some() && !loaded.dry_run {
        return lease_for_calls(state, tx, command_id, loaded, tried).await;
    }
    if !per_item && !loaded.dry_run {
        return delete_in_one_statement(state, tx, command_id, actor, started, loaded).await;
    }
    let rules = &loaded.rules;
    if per_item {
        // Each item's savepoint must see its own constraint violations, deferred ones included.
        sqlx::query("set constraints all immediate")
            .execute(&mut *tx)
            .await?;
    }

    let (mut outcomes, eligible) = classify(&mut tx, &loaded).await?;
    if !loaded.dry_run && !eligible.is_empty() {
        delete_eligible(&mut tx, rules, &eligible, per_item, &mut outcomes).await?;
    }

    // One audit row per key of the command, in key order as stored.
    let AuditRows {
        counts,
        keys: a_keys,
        outcomes: a_outcomes,
        reasons: a_reasons,
        failed,
    } = audit_rows(&loaded.keys, outcomes);
    if !failed.is_empty() {
        record_item_dead_letters(&mut tx, &loaded, command_id, &failed).await?;
    }

    // One statement: the audit rows, the command done, its attempt recorded, a redriven dead
    // letter resolved; its counts recorded next.
    loaded
        .command
        .succeed_with_audit(
            &mut tx,
            &ledger::commands::Audited {
                execution: loaded.execution(actor, started),
                dry_run: loaded.dry_run,
                keys: &a_keys,
                outcomes: &a_outcomes,
                reasons: &a_reasons,
            },
        )
        .await?;
    let recorded = finish_in_run(
        &mut tx,
        state,
        &loaded.policy,
        command_id,
        &counts,
        false,
        loaded.redrive_of.is_some(),
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
    crate::metrics::attempt_committed(&loaded.policy, &counts);
    crate::crash_point!("consume_after_commit");
    let rules = (!loaded.dry_run).then_some(&loaded.rules);
    let run_status = complete_after(state, &loaded.run_id, &loaded.policy, recorded, rules).await;
    Ok(Attempted::Done(ConsumeOutcome::Executed {
        command_id: command_id.to_string(),
        counts,
        run_status,
    }))
}

/// The healthy path of a delete-rows command, in four round trips whatever its size: `BEGIN`,
/// the gate ([`super::load`]), one statement, `COMMIT`. The statement locks the candidate rows in
/// key order, classifies each from that one snapshot, deletes the eligible ones with every
/// predicate repeated, and records the audit rows, the command `succeeded` with its attempt and
/// counts, and a redriven dead letter resolved ([`ledger::commands::push_succeed_after_delete`]).
/// A permanent error (in the statement, or a deferred constraint at the commit) sends the
/// command to the item-by-item path.
async fn delete_in_one_statement(
    state: &AppState,
    mut tx: Transaction<'_, Postgres>,
    command_id: &str,
    actor: &str,
    started: Instant,
    loaded: Box<Loaded>,
) -> Result<Attempted, AttemptError> {
    let rules = &loaded.rules;
    let mut q = loaded.command.delete_in_one(
        rules,
        &loaded.keys,
        &ledger::commands::DeletedInOne {
            execution: loaded.execution(actor, started),
            item_redrive: loaded.redrive_of.is_some(),
            others_cap: super::finish::others_cap(state, &loaded.policy),
        },
    );
    crate::crash_point!("consume_before_delete");
    let row = q.build().fetch_one(&mut *tx).await.map_err(|e| {
        let f = Failure::from_db(&e);
        if f.class == FailureClass::Permanent {
            AttemptError::BulkFailed(f)
        } else {
            AttemptError::Failed(f)
        }
    })?;
    let counts = Counts {
        deleted: row.get("deleted"),
        already_absent: row.get("already_absent"),
        excluded: row.get("excluded"),
        not_eligible: row.get("not_eligible"),
        ..Counts::default()
    };
    let recorded = ledger::runs::Recorded {
        status: row.get("status"),
        others_pending: row.get("others_pending"),
    };
    crate::crash_point!("consume_before_commit");
    if let Err(e) = tx.commit().await {
        // A deferred constraint (a DEFERRABLE foreign key or constraint trigger) is checked
        // here, not at the delete: redo the command item by item, with constraints immediate.
        let f = Failure::from_db(&e);
        return Err(if f.class == FailureClass::Permanent {
            AttemptError::BulkFailed(f)
        } else {
            AttemptError::Failed(f)
        });
    }
    crate::metrics::attempt_committed(&loaded.policy, &counts);
    crate::crash_point!("consume_after_commit");
    let run_status =
        complete_after(state, &loaded.run_id, &loaded.policy, recorded, Some(rules)).await;
    Ok(Attempted::Done(ConsumeOutcome::Executed {
        command_id: command_id.to_string(),
        counts,
        run_status,
    }))
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
    tried: &mut Option<ledger::commands::CommandTry>,
) -> Result<Attempted, AttemptError> {
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
    let calling = ledger::calling_commands(&mut tx, &loaded.policy, command_id).await?;
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
    // No transaction may span the calls: the command is leased instead (docs/design.md §5,
    // concurrent deliveries), and a delivery that finds a live lease is a "not now".
    if let ledger::commands::Attempt::Uncounted { .. } = loaded.command.attempt() {
        if loaded.lease_left > 0.0 {
            tx.rollback().await?;
            return Ok(Attempted::Done(ConsumeOutcome::NotNow {
                reason: "another execution of this command holds its lease (its external calls \
                         may be in flight)"
                    .into(),
                retry_after_seconds: loaded.lease_left.ceil() as u64,
            }));
        }
        // The delivery counts as an attempt before anything is called, so a delivery that
        // crashes the process every time still spends the budget.
        loaded.command = loaded
            .command
            .lease_for_calls(
                &mut tx,
                state.replica_id,
                state.config.queue.lease.seconds() as f64,
            )
            .await?;
        *tried = Some(loaded.command.clone());
    }
    loaded.command.mark_calling(&mut tx).await?;
    tx.commit().await?;
    Ok(Attempted::External(loaded))
}

/// Each item's outcome as the snapshot that deletes sees it, and the keys to delete: the
/// candidates locked in key order (overlapping runs cannot deadlock; a dry run locks nothing),
/// classified by the rules — excluded (which exclusion), not eligible, or to delete (in a dry
/// run, would delete). Keys absent from the result are already gone.
async fn classify(
    tx: &mut Transaction<'_, Postgres>,
    loaded: &Loaded,
) -> Result<(ItemOutcomes, Vec<String>), AttemptError> {
    let rules = &loaded.rules;
    let mut q = rules.classify_select();
    q.push(" where ");
    rules.push_key_in(&mut q, loaded.keys.clone());
    q.push(format!(" order by {}", rules.key_sql()));
    if !loaded.dry_run {
        q.push(" for update");
    }
    let rows = q.build().fetch_all(&mut **tx).await?;
    let mut outcomes: ItemOutcomes = HashMap::new();
    let mut eligible = Vec::new();
    // What an eligible item ends in here: deleted, or in a dry run what it would do.
    let effect = if loaded.dry_run && rules.action.once_per_window() {
        Outcome::WouldCall // it would call, not delete
    } else if loaded.dry_run {
        Outcome::WouldDelete
    } else {
        Outcome::Deleted
    };
    for r in &rows {
        let key: String = r.get("item_key");
        let judged = ledger::outcome::Judgement::of(
            true,
            r.get("reason"),
            r.get("old_enough"),
            r.get("not_eligible_reason"),
        );
        if judged == ledger::outcome::Judgement::Eligible {
            eligible.push(key.clone());
        }
        outcomes.insert(key, judged.outcome(effect));
    }
    Ok((outcomes, eligible))
}

/// Deletes the eligible rows, with every predicate repeated in the delete: in one statement, or
/// (`per_item`, after the bulk statement failed permanently) one savepoint per item, so a bad
/// item is `failed` with its error and its neighbours are deleted. A row the delete did not
/// remove is reported as it is (`not_eligible`), never as deleted.
async fn delete_eligible(
    tx: &mut Transaction<'_, Postgres>,
    rules: &RuleSet,
    eligible: &[String],
    per_item: bool,
    outcomes: &mut ItemOutcomes,
) -> Result<(), AttemptError> {
    if per_item {
        for key in eligible {
            let mut sp = sqlx::Connection::begin(&mut **tx).await?;
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
        let deleted = match delete(tx, rules, eligible.to_vec()).await {
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
        for key in eligible {
            if !deleted.contains(key) {
                outcomes.insert(key.clone(), (Outcome::NotEligible, None));
            }
        }
    }
    Ok(())
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

/// `DELETE … WHERE key = ANY($keys) AND <eligible> RETURNING key`: the predicates are repeated
/// in the delete itself, so nothing ineligible can be removed whatever happened before.
pub(super) async fn delete(
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
