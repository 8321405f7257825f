//! The delete-rows path (DESIGN §2.3, §2.4): one transaction locks the command row and the
//! candidates in key order, re-checks every predicate in the snapshot that deletes, deletes,
//! appends the audit rows and marks the command done. A permanent error in the bulk delete
//! reruns the command item by item with savepoints. Actions with external calls leave here for
//! [`super::external`] once their command is leased.

use super::*;

pub(super) async fn attempt(
    state: &AppState,
    command_id: &str,
    executor: Executor,
    actor: &str,
    per_item: bool,
    started: Instant,
    seen: &mut Option<i32>,
) -> Result<Attempted, AttemptError> {
    let mut tx = state.pool.begin().await?;
    let loaded = match super::load::load(state, &mut tx, command_id, executor, seen).await? {
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
