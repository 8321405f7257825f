//! A dependency's `rate_limit` (docs/design.md §9, §14): per replica in memory, or across every
//! replica through a reservation in the ledger.

use std::num::NonZeroU32;

use super::written;

/// A dependency's `rate_limit`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Sustained calls per second.
    pub per_second: NonZeroU32,
    /// Calls allowed at once (per replica) or at each second's start (global).
    pub burst: NonZeroU32,
    /// Who keeps it.
    pub scope: RateScope,
}

/// Who keeps a dependency's rate limit (docs/design.md §9, §14).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateScope {
    /// Each replica on its own, in memory (the default): N replicas call up to N × `per_second`.
    Replica,
    /// Every replica together: each call reserves its instant in
    /// `sweeper.dependency_call_slots` (one statement per call, outside any transaction), the
    /// reservation a policy's pace uses.
    Global,
}

impl RateLimit {
    /// Validates `rate_limit = { per_second, burst, scope }`; the error names the field.
    pub fn from_config(r: &written::RateLimitConfig) -> Result<RateLimit, String> {
        let scope = match r.scope.as_deref() {
            None | Some("replica") => RateScope::Replica,
            Some("global") => RateScope::Global,
            Some(other) => {
                return Err(format!(
                    "rate_limit.scope: expected \"replica\" or \"global\", found {other:?}"
                ));
            }
        };
        let (Some(per_second), Some(burst)) = (
            NonZeroU32::new(r.per_second),
            NonZeroU32::new(r.burst.unwrap_or(1)),
        ) else {
            return Err("rate_limit: per_second and burst must be at least 1".into());
        };
        if scope == RateScope::Global && burst > per_second {
            return Err(format!(
                "rate_limit: with scope = \"global\", burst ({burst}) may not exceed per_second \
                 ({per_second}): the burst is taken from each second's calls"
            ));
        }
        Ok(RateLimit {
            per_second,
            burst,
            scope,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_limit_is_per_replica_unless_global_and_a_global_burst_fits_a_second() {
        let base = "base_url = 'https://api.example.com'\n";
        let r = |t: &str| {
            crate::dependency::tests::dep(&format!("{base}rate_limit = {t}"))
                .map(|d| d.rate_limit.unwrap())
        };
        let l = r("{ per_second = 20, burst = 5 }").unwrap();
        assert_eq!((l.per_second.get(), l.burst.get()), (20, 5));
        assert_eq!(l.scope, RateScope::Replica);
        let g = r("{ per_second = 20, scope = 'global' }").unwrap();
        assert_eq!((g.burst.get(), g.scope), (1, RateScope::Global));
        let e = r("{ per_second = 20, scope = 'cluster' }").unwrap_err();
        assert!(
            e[0].contains("rate_limit.scope") && e[0].contains("\"cluster\""),
            "{e:?}"
        );
        let e = r("{ per_second = 5, burst = 6, scope = 'global' }").unwrap_err();
        assert!(e[0].contains("may not exceed per_second (5)"), "{e:?}");
        assert!(
            r("{ per_second = 5, burst = 6 }").is_ok(),
            "a per-replica burst may exceed"
        );
        let e = r("{ per_second = 0 }").unwrap_err();
        assert!(e[0].contains("at least 1"), "{e:?}");
    }
}
