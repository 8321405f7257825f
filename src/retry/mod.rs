//! The one failure classification (docs/design.md §2.7), decided near the source of an error and read by
//! the retry logic only, and the retry delay.

mod reset;

pub use reset::{ResetFormat, parse_reset, parse_retry_after};

use chrono::{DateTime, Utc};
use rand::Rng;

/// How a failure is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// Another attempt may help: retry with capped, jittered exponential backoff.
    Transient,
    /// The dependency asked us to wait: snooze until the instant, spending no attempt.
    Throttled {
        /// No new attempt before this instant.
        until: DateTime<Utc>,
    },
    /// Rows of the command are locked by another transaction (or a deadlock ended its
    /// statement): the rows it could act on are done and audited, the locked ones wait. A snooze
    /// until the instant, spending no attempt; its time counts against `max_age`, which alone
    /// turns it into a dead letter (docs/design.md §2.4).
    Locked {
        /// No new attempt before this instant.
        until: DateTime<Utc>,
    },
    /// Another attempt cannot help: quarantine now.
    Permanent,
}

/// Why a try stopped before its work was done: it failed, and its [`FailureClass`] decides what
/// follows ([`decide`]); or the work is *held* (docs/design.md §14) — not the command's fault
/// and not for an attempt to fix: nothing is spent, it is never quarantined, and it is checked
/// again later. A hold is not a failure: only [`Setback::Failed`] reaches [`decide`], a
/// quarantine or the failure metrics.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Setback {
    /// The try failed.
    #[error(transparent)]
    Failed(#[from] Failure),
    /// The work is held.
    #[error("held ({}): {why}", kind.as_str())]
    Held {
        /// What holds it.
        kind: HoldKind,
        /// Why, at most [`MAX_ERROR_CHARS`] characters.
        why: String,
    },
}

/// What holds work (shown as `held.kind` on a run). [`HoldKind::ALL`] is the one precedence every
/// reader follows when several apply (docs/design.md §14); `crate::ledger::holds` turns it into
/// the SQL the claim, the relay and the gauges use, and picks a run's or a command's first hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldKind {
    /// The database is not the one sweeper served, or its timeline changed after a long silence
    /// (the restore and clone guard): every policy waits for `POST /guard/accept`.
    Identity,
    /// An operator suspended the policy (`POST /policies/{name}/suspend`): nothing of it runs
    /// until resumed. Read from the policy's state at each check, never recorded on a command.
    Suspended,
    /// The target's schema does not match the policy: SQLSTATE class 42 (a dropped or renamed
    /// column, 42703, or table, 42P01; a revoked privilege, 42501), or a configured column the
    /// catalog lacks. Re-checked with the table's columns read afresh, so the work proceeds on
    /// its own once the schema is right again.
    Schema,
    /// The policy's current version changes the target, timestamp or action of a run pinned
    /// to another version: an operator decides (cancel the run, or restore the policy).
    PolicyChanged,
    /// The run's planned count crossed the blast-radius guard: it waits for
    /// `POST /runs/{id}/approve` (or for planning to finish, before which it executes nothing).
    Approval,
    /// A stage (`after`): a run it follows for the same window has not completed.
    After,
    /// Outside the policy's active hours: due again when they open.
    ActiveHours,
    /// A database-health signal is above its high mark.
    Governor,
    /// The policy's pace reserved a later start.
    Pace,
}

impl HoldKind {
    /// Every kind, in precedence order: the ledger's guards (identity, a suspension), then what
    /// no approval can get past (a target that does not match, a changed policy: they keep a
    /// plan from finishing), the blast-radius guard's approval, a stage's upstream runs, what this
    /// replica sees now (active hours, the governor), and last the pace's reserved start.
    pub const ALL: [HoldKind; 9] = [
        HoldKind::Identity,
        HoldKind::Suspended,
        HoldKind::Schema,
        HoldKind::PolicyChanged,
        HoldKind::Approval,
        HoldKind::After,
        HoldKind::ActiveHours,
        HoldKind::Governor,
        HoldKind::Pace,
    ];

    /// The kind's name in the ledger and JSON (`held.kind`).
    pub fn as_str(self) -> &'static str {
        match self {
            HoldKind::Identity => "identity",
            HoldKind::Suspended => "suspended",
            HoldKind::Schema => "schema",
            HoldKind::PolicyChanged => "policy_changed",
            HoldKind::Approval => "approval",
            HoldKind::After => "after",
            HoldKind::ActiveHours => "active_hours",
            HoldKind::Governor => "governor",
            HoldKind::Pace => "pace",
        }
    }

    /// The kind named `s`, if any.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Its place in [`HoldKind::ALL`]: the lower comes first.
    pub fn precedence(self) -> usize {
        Self::ALL
            .iter()
            .position(|k| *k == self)
            .unwrap_or(usize::MAX)
    }

    /// Decided by each replica from its view of the present (active hours, the governor): a
    /// marker of one left on a command tells when the hold reached it, not that it still holds.
    pub fn is_live(self) -> bool {
        matches!(self, HoldKind::ActiveHours | HoldKind::Governor)
    }

    /// Known to a reader only by the marker the gate or planning left on a command or a planning
    /// job (a schema that did not match, a changed policy, a stage, the pace's start). Every
    /// other kind is read where it is decided — the identity guard, the policy's state, the
    /// run's approval, this replica's view — and a marker of one is history, not a hold.
    pub fn is_recorded(self) -> bool {
        matches!(
            self,
            HoldKind::Schema | HoldKind::PolicyChanged | HoldKind::After | HoldKind::Pace
        )
    }

    /// A wait that is planned, not a problem: never overdue (`held.overdue`,
    /// `sweeper_held_overdue`), however long it lasts.
    pub fn is_expected(self) -> bool {
        matches!(self, HoldKind::ActiveHours | HoldKind::Pace)
    }
}

impl FailureClass {
    /// The stored name of [`FailureClass::Locked`].
    pub const LOCKED: &'static str = "locked";

    /// A wait that spends no attempt (throttled, locked): only `max_age` ends it.
    pub fn is_snooze(self) -> bool {
        matches!(
            self,
            FailureClass::Throttled { .. } | FailureClass::Locked { .. }
        )
    }

    /// The name stored in `commands.last_error_class`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::Transient => "transient",
            FailureClass::Throttled { .. } => "throttled",
            FailureClass::Locked { .. } => Self::LOCKED,
            FailureClass::Permanent => "permanent",
        }
    }
}

/// A classified failure with a message fit for the ledger (bounded, no secrets).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{class:?}: {message}")]
pub struct Failure {
    /// Its class.
    pub class: FailureClass,
    /// What went wrong, at most [`MAX_ERROR_CHARS`] characters.
    pub message: String,
}

/// Longest error text kept in the ledger.
pub const MAX_ERROR_CHARS: usize = 2_000;

impl Failure {
    /// A transient failure.
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Transient, message)
    }
    /// A throttled failure: no new attempt before `until`.
    pub fn throttled(until: DateTime<Utc>, message: impl Into<String>) -> Self {
        Self::new(FailureClass::Throttled { until }, message)
    }
    /// Rows locked by another transaction: no new attempt before `until`.
    pub fn locked(until: DateTime<Utc>, message: impl Into<String>) -> Self {
        Self::new(FailureClass::Locked { until }, message)
    }
    /// A permanent failure.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Permanent, message)
    }
    fn new(class: FailureClass, message: impl Into<String>) -> Self {
        Self {
            class,
            message: bounded(message.into()),
        }
    }
}

/// `message`, cut to at most [`MAX_ERROR_CHARS`] characters.
fn bounded(mut message: String) -> String {
    if message.chars().count() > MAX_ERROR_CHARS {
        message = message.chars().take(MAX_ERROR_CHARS).collect();
    }
    message
}

impl Setback {
    /// Work held, for `kind`.
    pub fn held(kind: HoldKind, why: impl Into<String>) -> Self {
        Setback::Held {
            kind,
            why: bounded(why.into()),
        }
    }

    /// What went wrong, or why it is held.
    pub fn message(&self) -> &str {
        match self {
            Setback::Failed(f) => &f.message,
            Setback::Held { why, .. } => why,
        }
    }

    /// The failure's class; `None` for a hold.
    pub fn class(&self) -> Option<FailureClass> {
        match self {
            Setback::Failed(f) => Some(f.class),
            Setback::Held { .. } => None,
        }
    }

    /// How it is named in logs and answers: the failure's class, or `held (<kind>)`.
    pub fn name(&self) -> String {
        match self {
            Setback::Failed(f) => f.class.as_str().to_string(),
            Setback::Held { kind, .. } => format!("held ({})", kind.as_str()),
        }
    }
}

impl Setback {
    /// Classifies a database error.
    ///
    /// Transient: lock and statement timeouts (SQLSTATE 55P03, 57014), serialization failures
    /// and deadlocks (40001, 40P01), connection and resource errors (class 08, 53, 57P0x), pool
    /// timeouts and I/O. Held: schema errors (class 42: a dropped or renamed column or table, a
    /// revoked privilege), which an operator fixes in the database, not in sweeper. Permanent:
    /// integrity violations (class 23, e.g. a referencing foreign key), errors raised by triggers
    /// (P0001), and the rest — but PostgreSQL's internal error for a partition detached while the
    /// statement waited to read its bound, which is transient.
    pub fn from_db(e: &sqlx::Error) -> Self {
        match e {
            sqlx::Error::Database(db) => {
                let code = db.code().map(|c| c.to_string()).unwrap_or_default();
                let transient = matches!(code.as_str(), "55P03" | "57014" | "40001" | "40P01")
                    || code.starts_with("08")
                    || code.starts_with("53")
                    || code.starts_with("57P");
                let message = format!("{} (SQLSTATE {code})", db.message());
                if code == "23514" && is_missing_audit_partition(db.as_ref()) {
                    // The ledger cannot record this month yet: housekeeping (and every start)
                    // creates the audit's partitions ahead of the clock. Never the items' fault.
                    return Failure::transient(format!(
                        "ledger unavailable: the audit has no partition for now ({message}); \
                         sweeper creates them at start and every housekeeping round"
                    ))
                    .into();
                }
                if code == "XX000"
                    && db
                        .message()
                        .starts_with("could not find tuple for parent of relation")
                {
                    // A partition detached (committed) while this statement waited for its lock
                    // to read its bound: a fresh statement sees it detached.
                    return Failure::transient(format!(
                        "a partition was detached while the statement waited for it ({message}); \
                         tried again"
                    ))
                    .into();
                }
                if transient {
                    Failure::transient(message).into()
                } else if code.starts_with("42") {
                    Self::held(HoldKind::Schema, message)
                } else {
                    Failure::permanent(message).into()
                }
            }
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed => Failure::transient(e.to_string()).into(),
            _ => Failure::permanent(e.to_string()).into(),
        }
    }
}

/// Whether `db` is PostgreSQL's "no partition of relation found for row" for
/// one of the audit's tables (`sweeper.audit`, `audit_executions`, `audit_items`,
/// `audit_manifests`: SQLSTATE 23514 with the table named in the error's fields), not for a
/// partitioned target table.
fn is_missing_audit_partition(db: &dyn sqlx::error::DatabaseError) -> bool {
    db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some_and(|pg| {
            pg.schema() == Some("sweeper")
                && matches!(
                    pg.table(),
                    Some("audit" | "audit_executions" | "audit_items" | "audit_manifests")
                )
                && pg.message().starts_with("no partition of relation")
        })
}

/// A command's budget: how many attempts and how much age it may spend before quarantine.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Attempts before quarantine.
    pub max_attempts: u32,
    /// Seconds of age (since it first became due, minus time credited while suspended or
    /// held) before quarantine.
    pub max_age_seconds: i64,
    /// The retry delay.
    pub backoff: Backoff,
}

/// What the ledger does with a try that failed (docs/design.md §2.7, §14), decided from the failure,
/// the attempt it ran as and the command's budget alone.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Quarantine now, with this reason.
    Quarantine {
        /// The attempt count to record.
        attempts: i32,
        /// Why: the failure's message, prefixed when it was the age budget that ran out.
        reason: String,
    },
    /// Try again after `delay_seconds` (at least 1); a snooze gives its attempt back.
    Retry {
        /// The attempt count to record.
        attempts: i32,
        /// Seconds until the next attempt.
        delay_seconds: f64,
        /// Whether it was a snooze (throttled: no attempt spent).
        snooze: bool,
    },
}

/// Decides what happens after `f` ended the try that ran as attempt `this_attempt` of a
/// command `age_seconds` old. Permanent failures and spent budgets quarantine; a snooze spends
/// no attempt (but its age counts). A hold is not decided here: it spends nothing. `now` measures a throttle's `until`;
/// `rng` jitters the backoff.
pub fn decide(
    f: &Failure,
    this_attempt: i32,
    age_seconds: f64,
    budget: &Budget,
    now: DateTime<Utc>,
    rng: &mut impl Rng,
) -> Decision {
    let snooze = f.class.is_snooze();
    let attempts = if snooze {
        this_attempt - 1
    } else {
        this_attempt
    };
    let age_spent = age_seconds > budget.max_age_seconds as f64;
    let permanent = f.class == FailureClass::Permanent;
    if permanent || age_spent || (!snooze && attempts >= budget.max_attempts as i32) {
        let reason = if age_spent && !permanent {
            format!(
                "max_age {} spent: {}",
                crate::config::DurationSpec::from_seconds(budget.max_age_seconds),
                f.message
            )
        } else {
            f.message.clone()
        };
        return Decision::Quarantine { attempts, reason };
    }
    let delay_seconds = match f.class {
        FailureClass::Throttled { until } | FailureClass::Locked { until } => {
            (until - now).num_milliseconds().max(1_000) as f64 / 1000.0
        }
        _ => budget
            .backoff
            .delay_seconds(attempts.max(0) as u32, rng)
            .max(1.0),
    };
    Decision::Retry {
        attempts,
        delay_seconds,
        snooze,
    }
}

/// Backoff settings in seconds.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// Delay scale of the first retry.
    pub base_seconds: f64,
    /// Largest delay.
    pub cap_seconds: f64,
}

impl Default for Backoff {
    /// `base` 1 s, `cap` 1 h.
    fn default() -> Self {
        Self {
            base_seconds: 1.0,
            cap_seconds: 3_600.0,
        }
    }
}

impl Backoff {
    /// "Full jitter": a uniformly random delay in `[0, min(cap, base·2^attempt)]` seconds, so
    /// retries of many commands spread out instead of arriving together.
    pub fn delay_seconds(&self, attempt: u32, rng: &mut impl Rng) -> f64 {
        let exp = self.base_seconds * 2f64.powi(attempt.min(60) as i32);
        let ceiling = exp.min(self.cap_seconds).max(0.0);
        rng.random_range(0.0..=ceiling)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn budget() -> Budget {
        Budget {
            max_attempts: 3,
            max_age_seconds: 3_600,
            backoff: Backoff {
                base_seconds: 1.0,
                cap_seconds: 60.0,
            },
        }
    }

    fn decide_at(f: Failure, attempt: i32, age: f64) -> Decision {
        let now = Utc::now();
        decide(
            &f,
            attempt,
            age,
            &budget(),
            now,
            &mut rand::rngs::StdRng::seed_from_u64(1),
        )
    }

    #[test]
    fn transient_failures_retry_until_max_attempts_then_quarantine() {
        match decide_at(Failure::transient("x"), 1, 10.0) {
            Decision::Retry {
                attempts: 1,
                delay_seconds,
                snooze: false,
            } => assert!((1.0..=2.0).contains(&delay_seconds), "{delay_seconds}"),
            d => panic!("{d:?}"),
        }
        assert_eq!(
            decide_at(Failure::transient("x"), 3, 10.0),
            Decision::Quarantine {
                attempts: 3,
                reason: "x".into()
            }
        );
    }

    #[test]
    fn permanent_failures_quarantine_at_once() {
        assert_eq!(
            decide_at(Failure::permanent("fk"), 1, 0.0),
            Decision::Quarantine {
                attempts: 1,
                reason: "fk".into()
            }
        );
    }

    #[test]
    fn snoozes_give_their_attempt_back_but_age_still_counts() {
        let until = Utc::now() + chrono::TimeDelta::seconds(30);
        match decide_at(Failure::throttled(until, "429"), 3, 10.0) {
            Decision::Retry {
                attempts: 2,
                delay_seconds,
                snooze: true,
            } => assert!((28.0..=30.0).contains(&delay_seconds), "{delay_seconds}"),
            d => panic!("{d:?}"),
        }
        assert_eq!(
            decide_at(Failure::throttled(until, "429"), 3, 3_601.0),
            Decision::Quarantine {
                attempts: 2,
                reason: "max_age 1h spent: 429".into()
            }
        );
    }

    #[test]
    fn a_hold_is_not_a_failure() {
        // A hold never reaches `decide` (the type says so): it has no class, is named by its
        // kind, and keeps a bounded reason like a failure's message.
        let held = Setback::held(HoldKind::Schema, "x".repeat(MAX_ERROR_CHARS + 10));
        assert_eq!(held.class(), None);
        assert_eq!(held.name(), "held (schema)");
        assert_eq!(held.message().chars().count(), MAX_ERROR_CHARS);
        let failed = Setback::from(Failure::permanent("bad"));
        assert_eq!(failed.class(), Some(FailureClass::Permanent));
        assert_eq!(failed.name(), "permanent");
    }

    #[test]
    fn delay_stays_within_the_capped_exponential() {
        let b = Backoff {
            base_seconds: 1.0,
            cap_seconds: 60.0,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for attempt in 0..100 {
            let d = b.delay_seconds(attempt, &mut rng);
            assert!(d >= 0.0 && d <= 60.0_f64.min(2f64.powi(attempt as i32)));
        }
    }

    #[test]
    fn full_jitter_spreads_delays_over_the_whole_range() {
        // Uniform on [0, 8]: mean 4, standard error of 10,000 samples ~0.023.
        let b = Backoff::default();
        let mut rng = rand::rng();
        let n = 10_000;
        let mean = (0..n).map(|_| b.delay_seconds(3, &mut rng)).sum::<f64>() / n as f64;
        assert!((3.8..=4.2).contains(&mean), "{mean}");
    }

    #[test]
    fn long_messages_are_bounded() {
        let f = Failure::transient("x".repeat(10_000));
        assert_eq!(f.message.len(), MAX_ERROR_CHARS);
    }
}
