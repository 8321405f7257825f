//! Executing a command whose action calls a dependency (docs/design.md §2.3, §2.4, §2.6).
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

use std::time::Instant;

use sqlx::Row;

use super::call::CallResult;
use super::close::{Called, Closed, Final, close};
use crate::execute::{ConsumeOutcome, Ended, Loaded, Outcome, Overtaken, record_failure};
use crate::ledger::outcome::Judgement;
use crate::policy::ActionSpec;
use crate::retry::{Failure, FailureClass, Setback};
use crate::state::AppState;

/// What the first statement decided for an item.
enum Decision {
    /// Call, as effect number `n`, with the row's columns.
    Call { n: i32, fields: serde_json::Value },
    /// The call already happened (effect `called` by this run, with the answer's recorded
    /// fields): only the row change is left.
    Called(Outcome, Option<String>),
    /// Final without a call.
    Final(Outcome, Option<String>),
    /// The item's effect is open in this run but the row no longer qualifies: a call may have
    /// been made, so an operator decides (item dead letter; the effect stays open).
    FailedOpen(String),
}

fn db(e: sqlx::Error) -> Setback {
    Setback::from_db(&e)
}

fn parse_outcome(s: Option<&str>) -> Outcome {
    match s.and_then(Outcome::parse) {
        Some(
            o @ (Outcome::Deleted | Outcome::Reconciled | Outcome::Called | Outcome::Mismatched),
        ) => o,
        _ => Outcome::AlreadyAbsent,
    }
}

/// Re-checks one item and opens its effect (one statement, autocommit).
async fn begin(
    state: &AppState,
    l: &Loaded,
    command_id: &str,
    key: &str,
) -> Result<Decision, Setback> {
    let row = crate::ledger::effects::open(
        &state.pool,
        &l.rules,
        &crate::ledger::effects::Opening {
            policy: &l.policy,
            item_key: key,
            run_id: &l.run_id,
            command_id,
            scope: &l.effect_scope(),
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
        return Ok(Decision::Called(
            parse_outcome(row.get::<Option<String>, _>("prior_outcome").as_deref()),
            row.get("prior_recorded"),
        ));
    }
    let judged = Judgement::of(
        found,
        row.get("reason"),
        row.get::<Option<bool>, _>("old_enough").unwrap_or(false),
        row.get("not_eligible_reason"),
    );
    match judged {
        // Gone: the desired end state. An effect of ours left `calling` is closed with it.
        Judgement::Absent if own_open("calling") => {
            return Ok(Decision::Called(Outcome::AlreadyAbsent, None));
        }
        Judgement::Excluded(_) | Judgement::NotEligible(_) if own_open("calling") => {
            let now = match &judged {
                Judgement::Excluded(r) => format!("excluded ({r})"),
                _ => "not eligible".to_string(),
            };
            return Ok(Decision::FailedOpen(format!(
                "the row became {now} while its effect was open (a call may have been made); an \
                 operator decides"
            )));
        }
        Judgement::Eligible => {}
        final_without_call => {
            let (outcome, reason) = final_without_call.outcome(Outcome::AlreadyAbsent);
            return Ok(Decision::Final(outcome, reason));
        }
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
// Over 80 lines: the item loop of one attempt, whose exits (stop, transient, pause, done) each
// finish the command differently.
pub(crate) async fn run(
    state: &AppState,
    command_id: &str,
    l: Loaded,
    actor: &str,
    started: Instant,
) -> Result<Ended, Setback> {
    let attempt = l.command.clone();
    let n = attempt.attempt().number();
    let dep = l.rules.action.dependency().unwrap_or_default().to_string();
    let Some(rt) = state.dependencies.get(&dep) else {
        let f = Failure::permanent(format!(
            "dependency {dep} is not configured on this replica"
        ));
        return record_failure(state, command_id, f.into(), started, Some(attempt)).await;
    };
    // Items an earlier attempt of this command already finished (read by the gate).
    let finished = &l.finished;
    let retry = state
        .config
        .policy(&l.policy)
        .map(|p| p.retry)
        .unwrap_or_default();

    let mut finals: Vec<Final> = Vec::new();
    let mut called: Vec<Called> = Vec::new();
    let mut transient: Option<Failure> = None;
    let mut stop: Option<Setback> = None;
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
                Decision::Called(o, recorded) => {
                    called.push((key.clone(), o, recorded));
                    continue;
                }
                Decision::Final(o, reason) => {
                    finals.push((key.clone(), o, reason, None));
                    continue;
                }
                Decision::FailedOpen(reason) => {
                    finals.push((key.clone(), Outcome::Failed, Some(reason), None));
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
                ItemStep::Called(o, recorded) => called.push((key.clone(), o, recorded)),
                ItemStep::Failed(reason) => {
                    finals.push((key.clone(), Outcome::Failed, Some(reason), None))
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
    let unfinished = stop.or(transient.map(Setback::from)).or_else(|| {
        timed_out.then(|| {
            Failure::transient(format!(
                "the command exceeded its deadline of {deadline}; finished items are kept"
            ))
            .into()
        })
    });

    crate::pause_point!("effect_before_close", command_id);
    let closed = close(
        state,
        &l,
        command_id,
        &called,
        &finals,
        unfinished.is_none(),
        actor,
        started,
    )
    .await;
    match (closed, unfinished) {
        (Ok(Closed::Stale), _) => Ok(ConsumeOutcome::Stale(Overtaken)),
        (Ok(Closed::Done { counts, run_status }), None) => {
            crate::metrics::attempt_succeeded();
            Ok(ConsumeOutcome::Executed {
                command_id: command_id.to_string(),
                counts,
                run_status,
            })
        }
        (Ok(Closed::Done { .. }), Some(f)) | (Err(f), _) => {
            record_failure(state, command_id, f, started, Some(attempt)).await
        }
    }
}

/// What one item's call came to.
enum ItemStep {
    /// The call succeeded and its effect is marked `called` (with the answer's recorded fields).
    Called(Outcome, Option<String>),
    /// The dependency refused this item for good (an item dead letter; its neighbours go on).
    Failed(String),
    /// This item is retried later; its neighbours go on.
    Transient(Failure),
    /// The command stops here (throttled, a permanent failure, the ledger, a hold).
    Stop(Setback),
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
    // Over 80 lines: one item's steps in order (admission, call, one short pause waited out,
    // classification, effect marked called).
    async fn item(&self, key: &str, effect_n: i32, fields: &serde_json::Value) -> ItemStep {
        let (state, l, dep) = (self.state, self.l, self.dep);
        let idempotency_key = l.idempotency_key(key, effect_n);
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
                    crate::execute::store::delete_object(self.rt, o, fields).await
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
            CallResult::Done(outcome, recorded) => {
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
                    &l.effect_scope(),
                    key,
                    &l.run_id,
                    outcome.as_str(),
                    recorded.as_deref(),
                )
                .await;
                if let Err(e) = marked {
                    // Left `calling`: the next attempt calls again with the same key.
                    return ItemStep::Stop(db(e));
                }
                crate::crash_point!("effect_after_called");
                ItemStep::Called(outcome, recorded)
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
                ItemStep::Stop(
                    Failure::throttled(
                        chrono::Utc::now()
                            + chrono::TimeDelta::milliseconds(pause.as_millis() as i64),
                        format!("{reason}; paused for {:.1}s", pause.as_secs_f64()),
                    )
                    .into(),
                )
            }
            CallResult::Failed(f) if f.class == FailureClass::Permanent => {
                crate::metrics::dependency_call(dep, "permanent");
                ItemStep::Stop(f.into())
            }
            CallResult::Failed(f) => {
                crate::metrics::dependency_call(dep, "transient");
                ItemStep::Transient(f)
            }
        }
    }
}
