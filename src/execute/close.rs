//! The closing transaction of an external-effect command (docs/design.md §2.3): after the calls, one
//! short transaction fences the attempt, applies the row change of every called effect whose
//! row did not change during its call, closes the effects, writes the audit rows and item dead
//! letters, and finishes the command in its run.

use std::collections::HashMap;
use std::time::Instant;

use sqlx::{Postgres, QueryBuilder, Row, Transaction};
use tracing::warn;

use super::{Counts, Loaded, Outcome, complete_after, finish_in_run, record_item_dead_letters};
use crate::ledger::dead_letter::ItemDeadLetter;
use crate::policy::ActionSpec;
use crate::policy::action::Then;
use crate::retry::Setback;
use crate::state::AppState;

/// How the closing transaction ended.
pub(super) enum Closed {
    /// Committed.
    Done { counts: Counts, run_status: String },
    /// Another execution took the command over (its lease expired): nothing was written.
    Stale,
}

/// One item's final outcome: (item key, outcome, reason, the answer's recorded fields).
pub(super) type Final = (String, Outcome, Option<String>, Option<String>);

/// One item whose call succeeded: (item key, outcome, the answer's recorded fields).
pub(super) type Called = (String, Outcome, Option<String>);

fn db(e: sqlx::Error) -> Setback {
    Setback::from_db(&e)
}

/// The closing transaction: row changes for called effects, effects closed, audit rows, item
/// dead letters, and the command's state (terminal when `complete`).
#[allow(clippy::too_many_arguments)]
pub(super) async fn close(
    state: &AppState,
    l: &Loaded,
    command_id: &str,
    called: &[Called],
    finals: &[Final],
    complete: bool,
    actor: &str,
    started: Instant,
) -> Result<Closed, Setback> {
    let r = &l.rules;
    let mut tx = state.pool.begin().await.map_err(db)?;
    let ours = l
        .command
        .lock_if_leased(
            &mut tx,
            state.config.consume.lock_timeout.seconds(),
            state.config.consume.statement_timeout.seconds(),
        )
        .await
        .map_err(db)?;
    if !ours {
        return Ok(Closed::Stale);
    }
    let mut outcomes: Vec<Final> = finals.to_vec();
    if !called.is_empty() {
        crate::crash_point!("effect_before_close");
        outcomes.extend(apply_called(&mut tx, l, called).await?);
    }
    let columns = AuditColumns::of(&outcomes);
    if !columns.failed.is_empty() {
        record_item_dead_letters(&mut tx, l, command_id, &columns.failed)
            .await
            .map_err(db)?;
    }
    // The audit rows; when every item is done, in the same statement the command succeeds.
    let audited = crate::ledger::commands::Audited {
        execution: l.execution(actor, started),
        dry_run: false,
        keys: &columns.keys,
        outcomes: &columns.outcomes,
        reasons: &columns.reasons,
        recorded: &columns.recorded,
    };
    if complete {
        l.command.succeed_with_audit(&mut tx, &audited).await
    } else {
        l.command.append_audit(&mut tx, &audited).await
    }
    .map_err(db)?;
    let recorded = finish_in_run(
        &mut tx,
        state,
        &l.policy,
        command_id,
        &columns.counts,
        false,
        if complete { l.redriven } else { None },
    )
    .await
    .map_err(db)?;
    crate::crash_point!("effect_before_commit");
    tx.commit().await.map_err(db)?;
    crate::metrics::items_recorded(&l.policy, &columns.counts);
    let run_status = if complete {
        complete_after(state, &l.run_id, &l.policy, recorded, Some(r)).await
    } else {
        recorded.status
    };
    if !columns.failed.is_empty() {
        warn!(
            command_id,
            items = columns.failed.len(),
            "items failed and became dead letters"
        );
    }
    Ok(Closed::Done {
        counts: columns.counts,
        run_status,
    })
}

/// The called effects' row changes: locks the rows in key order (overlapping runs cannot
/// deadlock), compares each with the digest taken before its call, applies the action's `then`
/// to the unchanged ones, closes the effects; returns each called item's final outcome (a row
/// that changed during its call is kept and its item fails).
async fn apply_called(
    tx: &mut Transaction<'_, Postgres>,
    l: &Loaded,
    called: &[Called],
) -> Result<Vec<Final>, Setback> {
    let r = &l.rules;
    let keys: Vec<String> = called.iter().map(|(k, ..)| k.clone()).collect();
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(format!(
        "select {} as item_key, {} as row_digest from {} where ",
        r.key_text_sql(),
        r.row_digest_sql(),
        r.table_sql()
    ));
    r.push_key_in(&mut q, keys.clone());
    q.push(format!(" order by {} for update", r.key().walk_columns("")));
    let now: HashMap<String, String> = q
        .build()
        .fetch_all(&mut **tx)
        .await
        .map_err(db)?
        .into_iter()
        .map(|row| (row.get("item_key"), row.get("row_digest")))
        .collect();
    let before: HashMap<String, Option<String>> = sqlx::query_as(
        "select item_key, row_digest from sweeper.effects
          where policy = $1 and scope = $4 and item_key = any($2) and run_id = $3
            and state <> 'closed'",
    )
    .bind(&l.policy)
    .bind(&keys)
    .bind(&l.run_id)
    .bind(l.effect_scope())
    .fetch_all(&mut **tx)
    .await
    .map_err(db)?
    .into_iter()
    .collect();
    let (outcomes, change) = compare_rows(called, &now, &before);
    let then = match &r.action {
        ActionSpec::Http(h) => &h.then,
        ActionSpec::ObjectStore(o) => &o.then,
        ActionSpec::DeleteRows => &Then::Nothing,
    };
    if !change.is_empty() && *then != Then::Nothing {
        let mut q: QueryBuilder<Postgres> = match then {
            Then::DeleteRow => QueryBuilder::new(format!("delete from {} where ", r.table_sql())),
            Then::Set { column } => QueryBuilder::new(format!(
                "update {} set {} = now() where ",
                r.table_sql(),
                column.quoted()
            )),
            Then::Nothing => unreachable!("checked above"),
        };
        r.push_key_in(&mut q, change);
        q.build().execute(&mut **tx).await.map_err(db)?;
    }
    let outcome_names: Vec<&str> = called.iter().map(|(_, o, _)| o.as_str()).collect();
    crate::ledger::effects::close(
        tx,
        &l.policy,
        &l.effect_scope(),
        &l.run_id,
        &keys,
        &outcome_names,
    )
    .await
    .map_err(db)?;
    Ok(outcomes)
}

/// For each called item: gone → its outcome; unchanged since before its call → its outcome and
/// its row is changed (a `mismatched` one is kept as it is); changed → `failed`
/// (`row_changed_during_call`), its row kept. Returns the outcomes and the keys whose rows
/// change.
fn compare_rows(
    called: &[Called],
    now: &HashMap<String, String>,
    before: &HashMap<String, Option<String>>,
) -> (Vec<Final>, Vec<String>) {
    let mut outcomes = Vec::with_capacity(called.len());
    let mut change = Vec::new();
    for (key, outcome, recorded) in called {
        match (now.get(key), before.get(key)) {
            (None, _) => outcomes.push((key.clone(), *outcome, None, recorded.clone())),
            // A mismatch keeps its row as it is: nothing to change.
            (Some(d), Some(Some(b))) if d == b => {
                if *outcome != Outcome::Mismatched {
                    change.push(key.clone());
                }
                outcomes.push((key.clone(), *outcome, None, recorded.clone()));
            }
            _ => outcomes.push((
                key.clone(),
                Outcome::Failed,
                Some(format!(
                    "row_changed_during_call: the {} effect was done, the row was kept",
                    outcome.as_str()
                )),
                recorded.clone(),
            )),
        }
    }
    (outcomes, change)
}

/// The audit statement's columns for a set of final outcomes, their counts, and the failed and
/// mismatched items that become dead letters.
struct AuditColumns<'a> {
    counts: Counts,
    keys: Vec<String>,
    outcomes: Vec<&'a str>,
    reasons: Vec<Option<String>>,
    recorded: Vec<Option<String>>,
    failed: Vec<ItemDeadLetter>,
}

impl AuditColumns<'_> {
    fn of(finals: &[Final]) -> AuditColumns<'static> {
        let mut c = AuditColumns {
            counts: Counts::default(),
            keys: Vec::with_capacity(finals.len()),
            outcomes: Vec::with_capacity(finals.len()),
            reasons: Vec::with_capacity(finals.len()),
            recorded: Vec::with_capacity(finals.len()),
            failed: Vec::new(),
        };
        for (k, o, reason, recorded) in finals {
            c.counts.add(*o);
            c.keys.push(k.clone());
            c.outcomes.push(o.as_str());
            c.reasons.push(reason.clone());
            c.recorded.push(recorded.clone());
            match o {
                Outcome::Failed | Outcome::Mismatched => c.failed.push(ItemDeadLetter {
                    item_key: k.clone(),
                    reason: reason.clone().unwrap_or_else(|| mismatch_reason(recorded)),
                    outcome: *o,
                    recorded: recorded.clone(),
                }),
                _ => {}
            }
        }
        c
    }
}

/// A mismatch's dead letter reason: what the answer said.
fn mismatch_reason(recorded: &Option<String>) -> String {
    format!(
        "mismatched: the answer says the provider's record differs from ours ({}); the row was \
         kept: correct it and redrive (the call is made again with the next idempotency key), \
         or abandon with a reason",
        recorded.as_deref().unwrap_or("no fields recorded")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_changed_during_its_call_is_kept_and_its_item_fails() {
        let called = vec![
            ("1".to_string(), Outcome::Reconciled, None),
            (
                "2".to_string(),
                Outcome::Reconciled,
                Some(r#"{"/s":"ok"}"#.to_string()),
            ),
            ("3".to_string(), Outcome::Reconciled, None),
        ];
        let now: HashMap<String, String> = [("1", "a"), ("2", "b2")]
            .map(|(k, d)| (k.into(), d.into()))
            .into();
        let before: HashMap<String, Option<String>> = [("1", "a"), ("2", "b"), ("3", "c")]
            .map(|(k, d)| (k.into(), Some(d.into())))
            .into();
        let (outcomes, change) = compare_rows(&called, &now, &before);
        assert_eq!(change, ["1"], "only the unchanged row is changed");
        assert_eq!(outcomes[0], ("1".into(), Outcome::Reconciled, None, None));
        assert_eq!(outcomes[1].1, Outcome::Failed);
        assert_eq!(
            outcomes[1].3.as_deref(),
            Some(r#"{"/s":"ok"}"#),
            "the call's answer is kept"
        );
        assert!(
            outcomes[1]
                .2
                .as_deref()
                .unwrap()
                .starts_with("row_changed_during_call")
        );
        assert_eq!(
            outcomes[2],
            ("3".into(), Outcome::Reconciled, None, None),
            "gone: nothing to change"
        );
        let columns = AuditColumns::of(&outcomes);
        assert_eq!(columns.failed.len(), 1);
        assert_eq!(columns.outcomes, ["reconciled", "failed", "reconciled"]);
    }
}
