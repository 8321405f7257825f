//! How long a dependency asks us to wait: `Retry-After` (RFC 9110 §10.2.3) and the rate-limit
//! reset headers providers send instead, each read as untrusted input with one reading for every
//! client (a dependency's calls, the QStash and Pub/Sub publishers).

/// How a rate-limit reset header writes its instant (a dependency's `reset_header` names one).
/// Providers disagree: `X-RateLimit-Reset-After` is delta-seconds, GitHub's and QStash's
/// `*-Reset` are Unix seconds, some send Unix milliseconds, a few an HTTP-date.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResetFormat {
    /// Seconds from now (`120`).
    Delta,
    /// Seconds since the Unix epoch (`1767225600`).
    Epoch,
    /// Milliseconds since the Unix epoch (`1767225600000`).
    EpochMs,
    /// An HTTP-date in any of RFC 9110's three grammars.
    HttpDate,
    /// By the value itself: an HTTP-date when it is not all digits; a number ≥ 10¹² is epoch
    /// milliseconds, ≥ 10⁹ epoch seconds (a delta that long would be over 31 years), else
    /// delta-seconds.
    Auto,
}

impl ResetFormat {
    /// The name as written in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            ResetFormat::Delta => "delta",
            ResetFormat::Epoch => "epoch",
            ResetFormat::EpochMs => "epoch_ms",
            ResetFormat::HttpDate => "http_date",
            ResetFormat::Auto => "auto",
        }
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
    if v.bytes().all(|b| b.is_ascii_digit()) {
        parse_reset(v, ResetFormat::Delta, now, cap)
    } else {
        parse_reset(v, ResetFormat::HttpDate, now, cap)
    }
}

/// The one reading of a rate-limit reset value written in `format` (every client uses it: a
/// dependency's `reset_header`, QStash's own reset headers). Untrusted like `Retry-After`: the
/// wait is clamped to `cap`, huge numbers saturate, an instant in the past, an empty value or
/// garbage give `None` (the caller falls back to jittered backoff).
pub fn parse_reset(
    value: &str,
    format: ResetFormat,
    now: std::time::SystemTime,
    cap: std::time::Duration,
) -> Option<std::time::Duration> {
    use std::time::{Duration, UNIX_EPOCH};
    let v = value.trim();
    if v.is_empty() {
        return None;
    }
    let digits = v.bytes().all(|b| b.is_ascii_digit());
    // Too many digits for u64 is simply "very long" (or very far).
    let number = || v.parse::<u64>().unwrap_or(u64::MAX);
    let until = |at: std::time::SystemTime| {
        let wait = at.duration_since(now).ok()?;
        (!wait.is_zero()).then_some(wait.min(cap))
    };
    let since_epoch = |d: Duration| UNIX_EPOCH.checked_add(d).map_or(Some(cap), until);
    let format = match format {
        ResetFormat::Auto if !digits => ResetFormat::HttpDate,
        ResetFormat::Auto if number() >= 1_000_000_000_000 => ResetFormat::EpochMs,
        ResetFormat::Auto if number() >= 1_000_000_000 => ResetFormat::Epoch,
        ResetFormat::Auto => ResetFormat::Delta,
        f => f,
    };
    match format {
        ResetFormat::HttpDate => until(httpdate::parse_http_date(v).ok()?),
        _ if !digits => None,
        ResetFormat::Delta => Some(Duration::from_secs(number()).min(cap)),
        ResetFormat::Epoch => since_epoch(Duration::from_secs(number())),
        ResetFormat::EpochMs => since_epoch(Duration::from_millis(number())),
        ResetFormat::Auto => unreachable!("resolved above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn reset_headers_are_read_in_their_named_format_or_by_magnitude() {
        use std::time::{Duration, UNIX_EPOCH};
        let now = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        let cap = Duration::from_secs(3_600);
        let p = |v: &str, f| parse_reset(v, f, now, cap);
        let in_90s = "1767225690";
        let in_90s_ms = "1767225690500";
        let date = "Thu, 01 Jan 2026 00:01:30 GMT";
        use ResetFormat::*;
        assert_eq!(p("90", Delta), Some(Duration::from_secs(90)));
        assert_eq!(
            p(in_90s, Delta),
            Some(cap),
            "an epoch read as a delta is capped"
        );
        assert_eq!(p(in_90s, Epoch), Some(Duration::from_secs(90)));
        assert_eq!(p(in_90s_ms, EpochMs), Some(Duration::from_millis(90_500)));
        assert_eq!(p(date, HttpDate), Some(Duration::from_secs(90)));
        assert_eq!(p(in_90s, Auto), Some(Duration::from_secs(90)));
        assert_eq!(p(in_90s_ms, Auto), Some(Duration::from_millis(90_500)));
        assert_eq!(p("90", Auto), Some(Duration::from_secs(90)));
        assert_eq!(p("999999999", Auto), Some(cap), "below 10^9 is a delta");
        assert_eq!(p(date, Auto), Some(Duration::from_secs(90)));
        // Instants in the past, garbage, a number where a date is named: backoff instead.
        assert_eq!(p("1767225500", Epoch), None);
        assert_eq!(p("1767225600", Auto), None);
        assert_eq!(p("1767225500000", EpochMs), None);
        assert_eq!(p("90", HttpDate), None);
        assert_eq!(p(date, Epoch), None);
        for bad in ["", "-5", "1.5", "soon"] {
            for f in [Delta, Epoch, EpochMs, HttpDate, Auto] {
                assert_eq!(p(bad, f), None, "{bad:?} as {f:?}");
            }
        }
        // Far instants saturate to the cap instead of overflowing.
        assert_eq!(p("99999999999999999999999", Epoch), Some(cap));
        assert_eq!(p("18446744073709551615", Epoch), Some(cap));
    }
}
