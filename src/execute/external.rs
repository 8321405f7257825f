//! Executing a command whose action calls a dependency (DESIGN §2.3, §2.4, §2.6).
//!
//! No transaction spans a call. For each item, in key order:
//!
//! 1. one statement re-checks eligibility and every exclusion (including "an effect of this
//!    item is open in another run") and opens the item's effect row as `calling`, remembering a
//!    digest of the row;
//! 2. the call, admitted by the dependency (concurrency, rate limit, shared pause);
//! 3. one statement marks the effect `called` with what it achieved.
//!
//! Then one short transaction closes the called effects: it locks the rows in key order, keeps
//! every row whose digest changed during the call (the item becomes a dead letter, the effect is
//! recorded as done), deletes or stamps the others, writes the audit rows and the command's state.
//! Whoever executes an item later resumes from its effect: `calling` → call again with the same
//! idempotency key; `called` → only the row change.
//!
//! A command finishes its items over one or more attempts: items an earlier attempt audited are
//! skipped, so no item gains a second outcome.

use std::collections::HashMap;
use std::time::Instant;

use sqlx::{Postgres, QueryBuilder, Row};
use tracing::warn;

use super::call::CallResult;
use crate::execute::{
    ConsumeOutcome, Counts, Executor, Loaded, Outcome, finish_in_run, record_failure,
    record_item_dead_letters,
};
use crate::policy::ActionSpec;
use crate::policy::action::Then;
use crate::retry::{Failure, FailureClass};
use crate::state::AppState;

/// What the first statement decided for an item.
enum Decision {
    /// Call, as effect number `n`, with the row's columns.
    Call { n: i32, fields: serde_json::Value },
    /// The call already happened (effect `called` by this run): only the row change is left.
    Called(Outcome),
    /// Final without a call.
    Final(Outcome, Option<String>),
    /// The item's effect is open in this run but the row no longer qualifies: a call may have
    /// been made, so an operator decides (item dead letter; the effect stays open).
    FailedOpen(String),
}

fn db(e: sqlx::Error) -> Failure {
    Failure::from_db(&e)
}

fn parse_outcome(s: Option<&str>) -> Outcome {
    match s {
        Some("deleted") => Outcome::Deleted,
        Some("reconciled") => Outcome::Reconciled,
        _ => Outcome::AlreadyAbsent,
    }
}

/// Re-checks one item and opens its effect (one statement, autocommit).
async fn begin(
    state: &AppState,
    l: &Loaded,
    command_id: &str,
    key: &str,
) -> Result<Decision, Failure> {
    let row = crate::ledger::effects::open(
        &state.pool,
        &l.rules,
        &crate::ledger::effects::Opening {
            policy: &l.policy,
            item_key: key,
            run_id: &l.run_id,
            command_id,
        },
    )
    .await
    .map_err(db)?;

    let found: bool = row.get("found");
    let prior_state: Option<String> = row.get("prior_state");
    let prior_run: Option<String> = row.get("prior_run");
    let own_open = |s: &str| {
        prior_state.as_deref() == Some(s) && prior_run.as_deref() == Some(l.run_id.as_str())
    };
    if own_open("called") {
        return Ok(Decision::Called(parse_outcome(
            row.get::<Option<String>, _>("prior_outcome").as_deref(),
        )));
    }
    if !found {
        // Gone: the desired end state. An effect of ours left `calling` is closed with it.
        return Ok(if own_open("calling") {
            Decision::Called(Outcome::AlreadyAbsent)
        } else {
            Decision::Final(Outcome::AlreadyAbsent, None)
        });
    }
    let reason: Option<String> = row.get("reason");
    let old_enough: bool = row.get::<Option<bool>, _>("old_enough").unwrap_or(false);
    if reason.is_some() || !old_enough {
        if own_open("calling") {
            return Ok(Decision::FailedOpen(format!(
                "the row became {} while its effect was open (a call may have been made); an \
                 operator decides",
                reason
                    .as_deref()
                    .map(|r| format!("excluded ({r})"))
                    .unwrap_or_else(|| "not eligible".into())
            )));
        }
        return Ok(match reason {
            Some(r) => Decision::Final(Outcome::Excluded, Some(r)),
            None => Decision::Final(Outcome::NotEligible, None),
        });
    }
    match row.get::<Option<i32>, _>("opened_n") {
        Some(n) => Ok(Decision::Call {
            n,
            fields: row.get("fields"),
        }),
        // Another run opened it between our snapshot and our insert.
        None => Ok(Decision::Final(
            Outcome::Excluded,
            Some("effect_open".into()),
        )),
    }
}

/// Executes `l` (leased as attempt `n`) to a committed decision.
pub(crate) async fn run(
    state: &AppState,
    command_id: &str,
    l: Loaded,
    n: i32,
    actor: &str,
    started: Instant,
) -> Result<ConsumeOutcome, Failure> {
    let executor = Executor::Claimed(n);
    let dep = l.rules.action.dependency().unwrap_or_default().to_string();
    let Some(rt) = state.dependencies.get(&dep) else {
        let f = Failure::permanent(format!(
            "dependency {dep} is not configured on this replica"
        ));
        return record_failure(state, command_id, executor, f, started, Some(n)).await;
    };
    // Items an earlier attempt of this command already finished.
    let finished: Vec<String> =
        sqlx::query_scalar("select distinct item_key from sweeper.audit where command_id = $1")
            .bind(command_id)
            .fetch_all(&state.pool)
            .await
            .map_err(db)?;
    let retry = state
        .config
        .policy(&l.policy)
        .map(|p| p.retry)
        .unwrap_or_default();

    let mut finals: Vec<(String, Outcome, Option<String>)> = Vec::new();
    let mut called: Vec<(String, Outcome)> = Vec::new();
    let mut transient: Option<Failure> = None;
    let mut stop: Option<Failure> = None;
    let work = async {
        for key in l.keys.iter().filter(|k| !finished.contains(k)) {
            let decision = match begin(state, &l, command_id, key).await {
                Ok(d) => d,
                Err(f) => {
                    stop = Some(f);
                    break;
                }
            };
            let (effect_n, fields) = match decision {
                Decision::Called(o) => {
                    called.push((key.clone(), o));
                    continue;
                }
                Decision::Final(o, reason) => {
                    finals.push((key.clone(), o, reason));
                    continue;
                }
                Decision::FailedOpen(reason) => {
                    finals.push((key.clone(), Outcome::Failed, Some(reason)));
                    continue;
                }
                Decision::Call { n, fields } => (n, fields),
            };
            let call = Call {
                state,
                rt: &rt,
                l: &l,
                dep: &dep,
                retry: &retry,
                attempt: n,
            };
            match call.item(key, effect_n, &fields).await {
                ItemStep::Called(o) => called.push((key.clone(), o)),
                ItemStep::Failed(reason) => {
                    finals.push((key.clone(), Outcome::Failed, Some(reason)))
                }
                ItemStep::Transient(f) => transient = Some(f),
                ItemStep::Stop(f) => {
                    stop = Some(f);
                    break;
                }
            }
        }
    };
    let deadline = state.config.consume.command_deadline;
    let timed_out = tokio::time::timeout(deadline.std(), work).await.is_err();
    let unfinished = stop.or(transient).or_else(|| {
        timed_out.then(|| {
            Failure::transient(format!(
                "the command exceeded its deadline of {deadline}; finished items are kept"
            ))
        })
    });

    let closed = close(
        state,
        &l,
        command_id,
        n,
        &called,
        &finals,
        unfinished.is_none(),
        actor,
        started,
    )
    .await;
    match (closed, unfinished) {
        (Ok(Closed::Stale), _) => Ok(ConsumeOutcome::Stale),
        (Ok(Closed::Done { counts, run_status }), None) => {
            crate::metrics::attempt_succeeded();
            Ok(ConsumeOutcome::Executed {
                command_id: command_id.to_string(),
                counts,
                run_status,
            })
        }
        (Ok(Closed::Done { .. }), Some(f)) | (Err(f), _) => {
            record_failure(state, command_id, executor, f, started, Some(n)).await
        }
    }
}

/// What one item's call came to.
enum ItemStep {
    /// The call succeeded and its effect is marked `called`.
    Called(Outcome),
    /// The dependency refused this item for good (an item dead letter; its neighbours go on).
    Failed(String),
    /// This item is retried later; its neighbours go on.
    Transient(Failure),
    /// The command stops here (throttled, a permanent failure, the ledger).
    Stop(Failure),
}

/// One item's call, with what every call of the command shares.
struct Call<'a> {
    state: &'a AppState,
    rt: &'a std::sync::Arc<crate::dependency::Runtime>,
    l: &'a Loaded,
    dep: &'a str,
    retry: &'a crate::policy::RetryPolicy,
    /// The attempt the command runs as (scales the backoff of a throttle without Retry-After).
    attempt: i32,
}

impl Call<'_> {
    /// Calls the dependency for `key` (effect `effect_n`, so idempotency key
    /// `{policy}:{item}:{n}`), admitted by the dependency's limits and pause; a short pause (at
    /// most `pause_wait`) is stored for every replica and waited out once; then classifies the
    /// result and, on success, marks the effect `called`.
    async fn item(&self, key: &str, effect_n: i32, fields: &serde_json::Value) -> ItemStep {
        let (state, l, dep) = (self.state, self.l, self.dep);
        let idempotency_key = format!("{}:{}:{}", l.policy, key, effect_n);
        let mut waited = false;
        let result = loop {
            let admitted = match state.dependencies.admit(&state.pool, self.rt).await {
                Ok(a) => a,
                Err(f) => return ItemStep::Stop(f),
            };
            let result = match &l.rules.action {
                ActionSpec::Http(h) => {
                    crate::execute::call::call_http(self.rt, h, fields, &idempotency_key).await
                }
                ActionSpec::ObjectStore(o) => {
                    crate::execute::call::delete_object(self.rt, o, fields).await
                }
                ActionSpec::DeleteRows => unreachable!("delete_rows has no external call"),
            };
            drop(admitted);
            if let CallResult::Throttled {
                pause: Some(p),
                reason,
            } = &result
                && !waited
                && !p.is_zero()
                && *p <= self.rt.spec.pause_wait
            {
                // A short pause (at most `pause_wait`): stored for every replica, waited out
                // here by the next admission (outside any transaction), then the item is
                // called again once.
                crate::metrics::dependency_call(dep, "throttled");
                if let Err(f) = state.dependencies.pause(&state.pool, dep, *p, reason).await {
                    return ItemStep::Stop(f);
                }
                waited = true;
                continue;
            }
            break result;
        };
        match result {
            CallResult::Done(outcome) => {
                crate::metrics::dependency_call(
                    dep,
                    if outcome == Outcome::AlreadyAbsent {
                        "already_absent"
                    } else {
                        "done"
                    },
                );
                crate::crash_point!("effect_before_called");
                let marked = crate::ledger::effects::mark_called(
                    &state.pool,
                    &l.policy,
                    key,
                    &l.run_id,
                    outcome.as_str(),
                )
                .await;
                if let Err(e) = marked {
                    // Left `calling`: the next attempt calls again with the same key.
                    return ItemStep::Stop(db(e));
                }
                crate::crash_point!("effect_after_called");
                ItemStep::Called(outcome)
            }
            CallResult::ItemFailed(reason) => {
                crate::metrics::dependency_call(dep, "permanent");
                ItemStep::Failed(reason)
            }
            CallResult::Throttled { pause, reason } => {
                crate::metrics::dependency_call(dep, "throttled");
                let pause = pause.filter(|p| !p.is_zero()).unwrap_or_else(|| {
                    std::time::Duration::from_secs_f64(
                        self.retry
                            .backoff()
                            .delay_seconds(self.attempt.max(1) as u32, &mut rand::rng())
                            .max(1.0),
                    )
                });
                let pause = pause.max(std::time::Duration::from_secs(1));
                if let Err(f) = state
                    .dependencies
                    .pause(&state.pool, dep, pause, &reason)
                    .await
                {
                    return ItemStep::Stop(f);
                }
                ItemStep::Stop(Failure::throttled(
                    chrono::Utc::now() + chrono::TimeDelta::milliseconds(pause.as_millis() as i64),
                    format!("{reason}; paused for {:.1}s", pause.as_secs_f64()),
                ))
            }
            CallResult::Failed(f) if f.class == FailureClass::Permanent => {
                crate::metrics::dependency_call(dep, "permanent");
                ItemStep::Stop(f)
            }
            CallResult::Failed(f) => {
                crate::metrics::dependency_call(dep, "transient");
                ItemStep::Transient(f)
            }
        }
    }
}

enum Closed {
    /// Committed.
    Done { counts: Counts, run_status: String },
    /// Another execution took the command over (its lease expired): nothing was written.
    Stale,
}

/// The closing transaction: row changes for called effects, effects closed, audit rows, item
/// dead letters, and the command's state (terminal when `complete`).
#[allow(clippy::too_many_arguments)]
async fn close(
    state: &AppState,
    l: &Loaded,
    command_id: &str,
    n: i32,
    called: &[(String, Outcome)],
    finals: &[(String, Outcome, Option<String>)],
    complete: bool,
    actor: &str,
    started: Instant,
) -> Result<Closed, Failure> {
    let r = &l.rules;
    let mut tx = state.pool.begin().await.map_err(db)?;
    let fence: Option<(i32, String)> = sqlx::query_as(
        "select attempts, state from sweeper.commands
          where command_id = $1
            and set_config('lock_timeout', $2, true) is not null
            and set_config('statement_timeout', $3, true) is not null
          for update",
    )
    .bind(command_id)
    .bind(format!("{}s", state.config.consume.lock_timeout.seconds()))
    .bind(format!(
        "{}s",
        state.config.consume.statement_timeout.seconds()
    ))
    .fetch_optional(&mut *tx)
    .await
    .map_err(db)?;
    if fence
        .as_ref()
        .is_none_or(|(a, s)| *a != n || s != crate::ledger::CommandState::Leased.as_str())
    {
        return Ok(Closed::Stale);
    }

    let mut outcomes: Vec<(String, Outcome, Option<String>)> = finals.to_vec();
    if !called.is_empty() {
        crate::crash_point!("effect_before_close");
        let keys: Vec<String> = called.iter().map(|(k, _)| k.clone()).collect();
        // The rows, locked in key order (overlapping runs cannot deadlock), as they are now.
        let mut q: QueryBuilder<Postgres> = QueryBuilder::new(format!(
            "select {}::text as item_key, md5({}.*::text) as row_digest from {} where ",
            r.key_sql(),
            r.table_sql(),
            r.table_sql()
        ));
        r.push_key_in(&mut q, keys.clone());
        q.push(format!(" order by {} for update", r.key_sql()));
        let now: HashMap<String, String> = q
            .build()
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?
            .into_iter()
            .map(|row| (row.get("item_key"), row.get("row_digest")))
            .collect();
        let before: HashMap<String, Option<String>> = sqlx::query_as(
            "select item_key, row_digest from sweeper.effects
              where policy = $1 and item_key = any($2) and run_id = $3 and state <> 'closed'",
        )
        .bind(&l.policy)
        .bind(&keys)
        .bind(&l.run_id)
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?
        .into_iter()
        .collect();
        let mut change = Vec::new();
        for (key, outcome) in called {
            match (now.get(key), before.get(key)) {
                // The row is gone: nothing to change.
                (None, _) => outcomes.push((key.clone(), *outcome, None)),
                (Some(d), Some(Some(b))) if d == b => {
                    change.push(key.clone());
                    outcomes.push((key.clone(), *outcome, None));
                }
                _ => outcomes.push((
                    key.clone(),
                    Outcome::Failed,
                    Some(format!(
                        "row_changed_during_call: the {} effect was done, the row was kept",
                        outcome.as_str()
                    )),
                )),
            }
        }
        let then = match &r.action {
            ActionSpec::Http(h) => &h.then,
            ActionSpec::ObjectStore(o) => &o.then,
            ActionSpec::DeleteRows => &Then::Nothing,
        };
        if !change.is_empty() {
            let mut q: QueryBuilder<Postgres> = match then {
                Then::DeleteRow => {
                    QueryBuilder::new(format!("delete from {} where ", r.table_sql()))
                }
                Then::Set { column } => QueryBuilder::new(format!(
                    "update {} set {} = now() where ",
                    r.table_sql(),
                    column.quoted()
                )),
                Then::Nothing => QueryBuilder::new("select where false and "),
            };
            if *then != Then::Nothing {
                r.push_key_in(&mut q, change);
                q.build().execute(&mut *tx).await.map_err(db)?;
            }
        }
        let outcome_names: Vec<&str> = called.iter().map(|(_, o)| o.as_str()).collect();
        crate::ledger::effects::close(&mut tx, &l.policy, &l.run_id, &keys, &outcome_names)
            .await
            .map_err(db)?;
    }

    let mut counts = Counts::default();
    let mut a_keys = Vec::with_capacity(outcomes.len());
    let mut a_outcomes = Vec::with_capacity(outcomes.len());
    let mut a_reasons = Vec::with_capacity(outcomes.len());
    let mut failed = Vec::new();
    for (k, o, reason) in &outcomes {
        counts.add(*o);
        a_keys.push(k.clone());
        a_outcomes.push(o.as_str());
        a_reasons.push(reason.clone());
        if *o == Outcome::Failed {
            failed.push((k.clone(), reason.clone().unwrap_or_default()));
        }
    }
    if !failed.is_empty() {
        record_item_dead_letters(&mut tx, l, command_id, &failed)
            .await
            .map_err(db)?;
    }
    // The audit rows; when every item is done, in the same statement the command succeeds.
    let audited = crate::ledger::commands::Audited {
        command_id,
        attempts_inc: 0,
        elapsed_seconds: started.elapsed().as_secs_f64(),
        policy: &l.policy,
        policy_version: &l.policy_version,
        run_id: &l.run_id,
        window: l.window,
        cutoff: r.cutoff,
        actor,
        dry_run: false,
        keys: &a_keys,
        outcomes: &a_outcomes,
        reasons: &a_reasons,
    };
    if complete {
        crate::ledger::commands::succeed_with_audit(&mut tx, &audited).await
    } else {
        crate::ledger::commands::append_audit(&mut tx, &audited).await
    }
    .map_err(db)?;
    let run_status = finish_in_run(
        &mut tx,
        &l.run_id,
        complete,
        &counts,
        false,
        complete && l.redrive_of.is_some(),
        complete.then_some(r),
        state.config.planning.closure_check_cap,
    )
    .await
    .map_err(db)?;
    crate::crash_point!("effect_before_commit");
    tx.commit().await.map_err(db)?;
    if !failed.is_empty() {
        warn!(
            command_id,
            items = failed.len(),
            "items failed and became dead letters"
        );
    }
    Ok(Closed::Done { counts, run_status })
}
