//! Windows: the schedule ticks a run serves (docs/design.md §2.1).
//!
//! A window is a tick of the policy's cron schedule evaluated in its IANA time zone, written as an
//! RFC 3339 UTC instant with whole seconds and `Z`. Everything here is a pure function of its
//! inputs: no clock is read.

use std::str::FromStr;

use chrono::{DateTime, NaiveDate, SecondsFormat, TimeZone, Timelike, Utc};
use chrono_tz::Tz;
use croner::Cron;

/// A cron expression (5 fields, standard Vixie syntax plus `L`, `W` and `#`) in an IANA zone.
///
/// Daylight-saving rules are croner's (OCPS): a fixed-time tick that falls into a spring-forward
/// gap fires at the first instant after the gap; in an autumn fold it fires once, on the first pass.
#[derive(Debug, Clone)]
pub struct Schedule {
    cron: Cron,
    expr: String,
    zone: Tz,
}

impl Schedule {
    /// Parses `expr` and `timezone` (e.g. `"0 2 * * *"`, `"Europe/Berlin"`).
    ///
    /// Errors name the bad part: `cron: ...` or `timezone: ...`.
    pub fn new(expr: &str, timezone: &str) -> Result<Self, String> {
        let fields = expr.split_whitespace().count();
        if fields != 5 {
            return Err(format!(
                "cron: `{expr}` has {fields} fields; write the 5 fields minute hour day-of-month month day-of-week"
            ));
        }
        let cron = Cron::from_str(expr).map_err(|e| format!("cron: `{expr}`: {e}"))?;
        let zone: Tz = timezone
            .parse()
            .map_err(|_| format!("timezone: `{timezone}` is not an IANA time zone name"))?;
        let schedule = Self {
            cron,
            expr: expr.to_string(),
            zone,
        };
        // An expression that never fires (e.g. `0 0 31 2 *`) has no windows.
        let probe = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        if schedule.next_tick_after(probe).is_none() {
            return Err(format!("cron: `{expr}` never fires"));
        }
        Ok(schedule)
    }

    /// The cron expression as configured.
    pub fn expr(&self) -> &str {
        &self.expr
    }

    /// The IANA zone name.
    pub fn zone_name(&self) -> &str {
        self.zone.name()
    }

    /// The latest tick at or before `t`, or `None` if the schedule never fired before `t`.
    pub fn latest_tick_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let local = t.with_timezone(&self.zone);
        self.cron
            .find_previous_occurrence(&local, true)
            .ok()
            .map(|d| d.with_timezone(&Utc))
    }

    /// The first tick strictly after `t`.
    pub fn next_tick_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let local = t.with_timezone(&self.zone);
        self.cron
            .find_next_occurrence(&local, false)
            .ok()
            .map(|d| d.with_timezone(&Utc))
    }

    /// Whether `t` (already normalized to whole seconds) is a tick.
    pub fn is_tick(&self, t: DateTime<Utc>) -> bool {
        self.latest_tick_at_or_before(t) == Some(t)
    }

    /// The shortest gap between consecutive ticks over about a year from a fixed reference,
    /// in seconds. Used to check that the early tolerance is shorter than the period.
    pub fn shortest_period_seconds(&self) -> i64 {
        self.gaps().min().unwrap_or(i64::MAX)
    }

    /// The longest gap between consecutive ticks over about a year from a fixed reference, in
    /// seconds (a weekday schedule's weekend, a monthly schedule's 31-day month, a daily
    /// schedule's 25-hour autumn day). Used to warn of a retention shorter than the period.
    pub fn longest_period_seconds(&self) -> i64 {
        self.gaps().max().unwrap_or(0)
    }

    /// Gaps between consecutive ticks, in seconds: the first 400 ticks after 2026-01-01, or
    /// those of the 13 months after it, whichever ends first.
    fn gaps(&self) -> impl Iterator<Item = i64> + '_ {
        let start = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let end = Utc.with_ymd_and_hms(2027, 2, 1, 0, 0, 0).unwrap();
        let mut t = self.next_tick_after(start);
        std::iter::from_fn(move || {
            let now = t?;
            let next = self.next_tick_after(now)?;
            t = (next < end).then_some(next);
            Some((next - now).num_seconds())
        })
        .take(400)
    }

    /// The ticks falling on `date` in the schedule's zone (used for `?window=YYYY-MM-DD`).
    pub fn ticks_on_local_date(&self, date: NaiveDate) -> Vec<DateTime<Utc>> {
        let start = date.and_hms_opt(0, 0, 0).unwrap();
        let Some(begin) = self.zone.from_local_datetime(&start).earliest() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut t = begin.with_timezone(&Utc) - chrono::TimeDelta::seconds(1);
        while let Some(next) = self.next_tick_after(t) {
            if next.with_timezone(&self.zone).date_naive() != date || out.len() > 1_440 {
                break;
            }
            out.push(next);
            t = next;
        }
        out
    }
}

/// Normalizes an instant to a window's form: UTC, whole seconds (sub-second digits dropped).
pub fn normalize(t: DateTime<Utc>) -> DateTime<Utc> {
    t.with_nanosecond(0).unwrap_or(t)
}

/// Formats a window as docs/design.md §2.1 writes it: `2026-11-29T02:00:00Z`.
pub fn format(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// Parses an RFC 3339 instant with any offset into UTC.
pub fn parse_rfc3339(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s.trim())
        .ok()
        .map(|d| d.with_timezone(&Utc))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        parse_rfc3339(s).unwrap()
    }

    #[test]
    fn latest_tick_is_inclusive_and_zone_aware() {
        let s = Schedule::new("0 2 * * *", "Europe/Berlin").unwrap();
        // 02:00 Berlin in winter is 01:00Z.
        assert_eq!(
            s.latest_tick_at_or_before(at("2026-11-29T01:00:00Z")),
            Some(at("2026-11-29T01:00:00Z"))
        );
        assert_eq!(
            s.latest_tick_at_or_before(at("2026-11-29T00:59:59Z")),
            Some(at("2026-11-28T01:00:00Z"))
        );
        assert!(s.is_tick(at("2026-11-29T01:00:00Z")));
        assert!(!s.is_tick(at("2026-11-29T02:00:00Z")));
    }

    #[test]
    fn spring_forward_gap_still_has_a_tick() {
        // 02:30 does not exist in New York on 2025-03-09; croner fires at 03:00 EDT (07:00Z).
        let s = Schedule::new("30 2 * * *", "America/New_York").unwrap();
        assert_eq!(
            s.latest_tick_at_or_before(at("2025-03-09T12:00:00Z")),
            Some(at("2025-03-09T07:00:00Z"))
        );
    }

    #[test]
    fn longest_periods_cover_weekends_long_months_and_autumn_days() {
        let weekdays = Schedule::new("0 2 * * 1-5", "UTC").unwrap();
        assert_eq!(weekdays.shortest_period_seconds(), 86_400);
        assert_eq!(weekdays.longest_period_seconds(), 3 * 86_400);
        let monthly = Schedule::new("0 2 1 * *", "UTC").unwrap();
        assert_eq!(monthly.longest_period_seconds(), 31 * 86_400);
        let berlin = Schedule::new("0 2 * * *", "Europe/Berlin").unwrap();
        assert_eq!(berlin.shortest_period_seconds(), 23 * 3_600);
        assert_eq!(berlin.longest_period_seconds(), 25 * 3_600);
    }

    #[test]
    fn a_repeated_hour_has_one_tick() {
        // 01:30 happens twice in New York on 2025-11-02 (EDT, then EST): one window, the first.
        let s = Schedule::new("30 1 * * *", "America/New_York").unwrap();
        let ticks = s.ticks_on_local_date(NaiveDate::from_ymd_opt(2025, 11, 2).unwrap());
        assert_eq!(ticks, vec![at("2025-11-02T05:30:00Z")]);
        assert!(!s.is_tick(at("2025-11-02T06:30:00Z")));
        assert_eq!(
            s.latest_tick_at_or_before(at("2025-11-02T12:00:00Z")),
            Some(at("2025-11-02T05:30:00Z"))
        );
    }

    #[test]
    fn bad_expressions_and_zones_are_named() {
        assert!(
            Schedule::new("0 2 * *", "UTC")
                .unwrap_err()
                .starts_with("cron:")
        );
        assert!(
            Schedule::new("0 25 * * *", "UTC")
                .unwrap_err()
                .starts_with("cron:")
        );
        assert!(
            Schedule::new("0 2 * * *", "Mars/Olympus")
                .unwrap_err()
                .starts_with("timezone:")
        );
    }

    #[test]
    fn period_and_local_dates() {
        let hourly = Schedule::new("0 * * * *", "UTC").unwrap();
        assert_eq!(hourly.shortest_period_seconds(), 3_600);
        let daily = Schedule::new("0 2 * * *", "Asia/Tokyo").unwrap();
        assert_eq!(daily.shortest_period_seconds(), 86_400);
        let ticks = daily.ticks_on_local_date(NaiveDate::from_ymd_opt(2026, 9, 1).unwrap());
        assert_eq!(ticks, vec![at("2026-08-31T17:00:00Z")]);
    }

    #[test]
    fn windows_are_written_in_utc_whole_seconds() {
        let t = normalize(at("2026-09-01T04:00:00.750+02:00"));
        assert_eq!(format(t), "2026-09-01T02:00:00Z");
    }
}
