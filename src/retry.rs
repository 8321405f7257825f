//! The one failure classification (DESIGN §2.7), decided near the source of an error and read by
//! the retry logic only, and the retry delay.

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
    /// Another attempt cannot help: quarantine now.
    Permanent,
    /// Not the command's fault, and not for an attempt to fix: the target cannot be acted on as
    /// configured right now. The work is *held* (DESIGN §14): no attempt and no budget spent,
    /// never quarantined, re-checked every `consume.retry_after`.
    Held(HoldKind),
}

/// What holds work that cannot run as configured (shown as `held.kind` on a run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldKind {
    /// The target's schema does not match the policy: SQLSTATE class 42 (a dropped or renamed
    /// column, 42703, or table, 42P01; a revoked privilege, 42501), or a configured column the
    /// catalog lacks. Re-checked with the table's columns read afresh, so the work proceeds on
    /// its own once the schema is right again.
    Schema,
    /// The policy's current version changes the target, timestamp or action of a run pinned
    /// to another version: an operator decides (cancel the run, or restore the policy).
    PolicyChanged,
}

impl HoldKind {
    /// `schema` or `policy_changed`.
    pub fn as_str(self) -> &'static str {
        match self {
            HoldKind::Schema => "schema",
            HoldKind::PolicyChanged => "policy_changed",
        }
    }
}

impl FailureClass {
    /// The name stored in `commands.last_error_class`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::Transient => "transient",
            FailureClass::Throttled { .. } => "throttled",
            FailureClass::Permanent => "permanent",
            FailureClass::Held(_) => "held",
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
    /// A permanent failure.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Permanent, message)
    }
    /// Work held, for `kind`.
    pub fn held(kind: HoldKind, message: impl Into<String>) -> Self {
        Self::new(FailureClass::Held(kind), message)
    }
    fn new(class: FailureClass, message: impl Into<String>) -> Self {
        let mut message: String = message.into();
        if message.chars().count() > MAX_ERROR_CHARS {
            message = message.chars().take(MAX_ERROR_CHARS).collect();
        }
        Self { class, message }
    }

    /// Classifies a database error.
    ///
    /// Transient: lock and statement timeouts (SQLSTATE 55P03, 57014), serialization failures
    /// and deadlocks (40001, 40P01), connection and resource errors (class 08, 53, 57P0x), pool
    /// timeouts and I/O. Held: schema errors (class 42: a dropped or renamed column or table, a
    /// revoked privilege), which an operator fixes in the database, not in sweeper. Permanent:
    /// integrity violations (class 23, e.g. a referencing foreign key), errors raised by triggers
    /// (P0001), and the rest.
    pub fn from_db(e: &sqlx::Error) -> Self {
        match e {
            sqlx::Error::Database(db) => {
                let code = db.code().map(|c| c.to_string()).unwrap_or_default();
                let transient = matches!(code.as_str(), "55P03" | "57014" | "40001" | "40P01")
                    || code.starts_with("08")
                    || code.starts_with("53")
                    || code.starts_with("57P");
                let message = format!("{} (SQLSTATE {code})", db.message());
                if transient {
                    Self::transient(message)
                } else if code.starts_with("42") {
                    Self::held(HoldKind::Schema, message)
                } else {
                    Self::permanent(message)
                }
            }
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed => Self::transient(e.to_string()),
            _ => Self::permanent(e.to_string()),
        }
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

/// Parses a `Retry-After` value (RFC 9110 §10.2.3): delta-seconds (`120`) or an HTTP-date in any
/// of its three grammars (IMF-fixdate, obsolete RFC 850, asctime; parsed by `httpdate`).
///
/// The value is untrusted: the wait is clamped to `cap`; a huge delta saturates to `cap` instead
/// of overflowing; a date in the past, a negative or fractional number, an empty value or garbage
/// give `None`, and the caller falls back to jittered backoff. `now` is the wall clock the date is
/// measured against.
pub fn parse_retry_after(
    value: &str,
    now: std::time::SystemTime,
    cap: std::time::Duration,
) -> Option<std::time::Duration> {
    let v = value.trim();
    if v.is_empty() {
        return None;
    }
    if v.bytes().all(|b| b.is_ascii_digit()) {
        // All digits: delta-seconds. Too many digits for u64 is simply "very long".
        let secs = v.parse::<u64>().unwrap_or(u64::MAX);
        return Some(std::time::Duration::from_secs(secs).min(cap));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    let wait = at.duration_since(now).ok()?;
    if wait.is_zero() {
        return None;
    }
    Some(wait.min(cap))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

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
    fn retry_after_reads_both_forms_and_distrusts_them() {
        use std::time::{Duration, UNIX_EPOCH};
        // Sun, 06 Nov 1994 08:49:37 GMT, RFC 9110's own example instant.
        let example = UNIX_EPOCH + Duration::from_secs(784_111_777);
        let now = example - Duration::from_secs(30);
        let cap = Duration::from_secs(3_600);
        let p = |v: &str| parse_retry_after(v, now, cap);
        assert_eq!(p("120"), Some(Duration::from_secs(120)));
        assert_eq!(p(" 2 "), Some(Duration::from_secs(2)));
        assert_eq!(p("0"), Some(Duration::ZERO));
        assert_eq!(p("86400"), Some(cap), "capped");
        assert_eq!(p("99999999999999999999999999"), Some(cap), "no overflow");
        for date in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(p(date), Some(Duration::from_secs(30)), "{date}");
        }
        let far = "Fri, 31 Dec 9999 23:59:59 GMT";
        assert_eq!(p(far), Some(cap), "a far date is capped");
        // Past dates and garbage fall back to backoff.
        let past = parse_retry_after(
            "Sun, 06 Nov 1994 08:49:37 GMT",
            example + Duration::from_secs(5),
            cap,
        );
        assert_eq!(past, None);
        for bad in [
            "",
            "-1",
            "1.5",
            "soon",
            "0x10",
            "Sun, 06 Nov 1994 08:49:37 PST",
            "+5",
        ] {
            assert_eq!(p(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn long_messages_are_bounded() {
        let f = Failure::transient("x".repeat(10_000));
        assert_eq!(f.message.len(), MAX_ERROR_CHARS);
    }
}
