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
}

impl FailureClass {
    /// The name stored in `commands.last_error_class`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::Transient => "transient",
            FailureClass::Throttled { .. } => "throttled",
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
    /// A permanent failure.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Permanent, message)
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
    /// timeouts and I/O. Permanent: integrity violations (class 23, e.g. a referencing foreign
    /// key), errors raised by triggers (P0001), and schema errors (class 42: a dropped column).
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
    fn long_messages_are_bounded() {
        let f = Failure::transient("x".repeat(10_000));
        assert_eq!(f.message.len(), MAX_ERROR_CHARS);
    }
}
