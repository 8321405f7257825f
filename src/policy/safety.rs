//! A policy's production-safety controls (docs/design.md §14 "Holds"), as written and validated: active
//! hours, the pace, the blast-radius guard and the governor's per-policy marks. They are not part
//! of the policy's version: they decide when its work runs, never what it does, so changing them
//! never re-pins or holds a run.

use chrono::{DateTime, NaiveDate, NaiveTime, TimeDelta, TimeZone, Utc};
use chrono_tz::Tz;
use serde::Deserialize;

/// `active = { from = "01:00", to = "05:00", timezone = "Europe/Berlin" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActiveHoursConfig {
    /// Local opening time, `HH:MM`.
    pub from: String,
    /// Local closing time, `HH:MM` (earlier than `from`: the hours cross midnight).
    pub to: String,
    /// IANA zone, default UTC.
    #[serde(default)]
    pub timezone: Option<String>,
}

/// `guard = { max_items = 100000, max_ratio = 10.0, max_fraction = 0.5 }`: the blast-radius
/// guard. Each limit is optional; a run over any of them waits for approval.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardConfig {
    /// Most items a run may plan.
    #[serde(default)]
    pub max_items: Option<i64>,
    /// Most a run may plan as a multiple of the median of the policy's last completed runs.
    #[serde(default)]
    pub max_ratio: Option<f64>,
    /// The ratio limit is never below this many items (default 1000), so a young or quiet
    /// policy whose median is tiny is not held for an ordinary run.
    #[serde(default)]
    pub ratio_floor: Option<i64>,
    /// Most a run may plan as a fraction (0 < f ≤ 1) of the table's estimated rows
    /// (`pg_class.reltuples`).
    #[serde(default)]
    pub max_fraction: Option<f64>,
}

/// Active hours, validated: commands are claimed only inside `[from, to)` local time.
#[derive(Debug, Clone, PartialEq)]
pub struct ActiveHours {
    /// Opening, local.
    pub from: NaiveTime,
    /// Closing, local.
    pub to: NaiveTime,
    /// The zone of both.
    pub zone: Tz,
}

/// Active hours at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hours {
    /// Inside: work may be claimed.
    Open,
    /// Outside since `since`, opening at `opens_at`.
    Closed {
        /// When they last closed.
        since: DateTime<Utc>,
        /// When they open next.
        opens_at: DateTime<Utc>,
    },
}

impl ActiveHours {
    /// Validates `c`; errors name the field.
    pub fn from_config(c: &ActiveHoursConfig) -> Result<Self, Vec<String>> {
        let mut errors = Vec::new();
        let time = |field: &str, v: &str, errors: &mut Vec<String>| {
            NaiveTime::parse_from_str(v, "%H:%M")
                .map_err(|_| errors.push(format!("active.{field}: `{v}` is not a time like 01:00")))
                .ok()
        };
        let from = time("from", &c.from, &mut errors);
        let to = time("to", &c.to, &mut errors);
        let zone_name = c.timezone.as_deref().unwrap_or("UTC");
        let zone = zone_name
            .parse::<Tz>()
            .map_err(|_| {
                errors.push(format!(
                    "active.timezone: `{zone_name}` is not an IANA time zone name"
                ))
            })
            .ok();
        if from.is_some() && from == to {
            errors.push(
                "active: from and to are equal; leave `active` out to run at any hour".into(),
            );
        }
        match (from, to, zone) {
            (Some(from), Some(to), Some(zone)) if errors.is_empty() => {
                Ok(ActiveHours { from, to, zone })
            }
            _ => Err(errors),
        }
    }

    /// Whether `at` is inside the hours, and if not since when and until when it is outside.
    /// A local time that does not exist (a DST gap) moves forward an hour; an ambiguous one
    /// takes its earlier instant.
    pub fn at(&self, at: DateTime<Utc>) -> Hours {
        let today = at.with_timezone(&self.zone).date_naive();
        let crosses_midnight = self.to < self.from;
        let mut last_close = None;
        let mut next_open = None;
        for offset in -2..=2 {
            let day = today + TimeDelta::days(offset);
            let open = self.instant(day, self.from);
            let close_day = if crosses_midnight {
                day + TimeDelta::days(1)
            } else {
                day
            };
            let close = self.instant(close_day, self.to);
            if open <= at && at < close {
                return Hours::Open;
            }
            if close <= at {
                last_close = Some(close);
            }
            if open > at && next_open.is_none() {
                next_open = Some(open);
            }
        }
        Hours::Closed {
            since: last_close.unwrap_or(at),
            opens_at: next_open.unwrap_or(at + TimeDelta::days(1)),
        }
    }

    fn instant(&self, day: NaiveDate, time: NaiveTime) -> DateTime<Utc> {
        let local = day.and_time(time);
        let resolved = self
            .zone
            .from_local_datetime(&local)
            .earliest()
            .or_else(|| {
                self.zone
                    .from_local_datetime(&(local + TimeDelta::hours(1)))
                    .earliest()
            });
        match resolved {
            Some(t) => t.with_timezone(&Utc),
            // Unreachable for IANA zones (gaps are at most 2 h); fall back to the UTC reading.
            None => Utc.from_utc_datetime(&local),
        }
    }

    /// `01:00–05:00 Europe/Berlin`, for reasons and logs.
    pub fn describe(&self) -> String {
        format!(
            "{}–{} {}",
            self.from.format("%H:%M"),
            self.to.format("%H:%M"),
            self.zone.name()
        )
    }
}

/// The blast-radius guard, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct BlastGuard {
    /// Most items a run may plan.
    pub max_items: Option<i64>,
    /// Most a run may plan as a multiple of the median of the last completed runs.
    pub max_ratio: Option<f64>,
    /// The ratio limit's floor, in items.
    pub ratio_floor: i64,
    /// Most a run may plan as a fraction of the table's estimated rows.
    pub max_fraction: Option<f64>,
}

/// How many of the policy's last completed live runs the ratio limit takes the median of.
pub const GUARD_HISTORY_RUNS: i64 = 5;

impl BlastGuard {
    /// Validates `c`; errors name the field.
    pub fn from_config(c: &GuardConfig) -> Result<Self, Vec<String>> {
        let mut errors = Vec::new();
        if c.max_items.is_some_and(|n| n < 1) {
            errors.push("guard.max_items: must be at least 1".into());
        }
        if c.max_ratio.is_some_and(|r| !(r.is_finite() && r > 1.0)) {
            errors.push("guard.max_ratio: must be a number above 1".into());
        }
        if c.ratio_floor.is_some_and(|n| n < 0) {
            errors.push("guard.ratio_floor: must not be negative".into());
        }
        if c.max_fraction
            .is_some_and(|f| !(f.is_finite() && f > 0.0 && f <= 1.0))
        {
            errors.push("guard.max_fraction: must be above 0 and at most 1".into());
        }
        if c.max_items.is_none() && c.max_ratio.is_none() && c.max_fraction.is_none() {
            errors.push(
                "guard: set at least one of max_items, max_ratio, max_fraction (or leave guard out)"
                    .into(),
            );
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(BlastGuard {
            max_items: c.max_items,
            max_ratio: c.max_ratio,
            ratio_floor: c.ratio_floor.unwrap_or(1_000),
            max_fraction: c.max_fraction,
        })
    }

    /// The guard's verdict on a run that planned `planned` items, given the median of the
    /// policy's last completed runs (`None`: no completed run yet) and the table's estimated
    /// rows (`None` or ≤ 0: never analyzed). `Some(why)` when the run must wait for approval.
    pub fn verdict(
        &self,
        planned: i64,
        median: Option<f64>,
        estimated_rows: Option<f64>,
    ) -> Option<String> {
        if let Some(max) = self.max_items
            && planned > max
        {
            return Some(format!(
                "planned {planned} items, over guard.max_items {max}"
            ));
        }
        if let (Some(ratio), Some(median)) = (self.max_ratio, median) {
            let limit = (ratio * median).max(self.ratio_floor as f64);
            if planned as f64 > limit {
                return Some(format!(
                    "planned {planned} items, over guard.max_ratio {ratio} × the median {median} of \
                     the last completed runs (limit {limit:.0}, floor {})",
                    self.ratio_floor
                ));
            }
        }
        match (self.max_fraction, estimated_rows.filter(|r| *r >= 0.0)) {
            (Some(fraction), Some(rows)) if planned as f64 > fraction * rows => Some(format!(
                "planned {planned} items, over guard.max_fraction {fraction} of the table's \
                 estimated {rows:.0} rows"
            )),
            // A table never analyzed (a fresh restore, before autovacuum's ANALYZE) has no
            // estimate: the fraction cannot be checked, so the run waits rather than passes.
            (Some(fraction), None) if planned > 0 => Some(format!(
                "planned {planned} items; guard.max_fraction {fraction} cannot be checked: the \
                 table has no row estimate (never analyzed; run ANALYZE on it)"
            )),
            _ => None,
        }
    }
}

/// The burst a pace of `per_second` items allows: 10 % of ten seconds' budget (one second's
/// worth). A command is never larger than its policy's `batch_size`, which validation keeps at
/// or under this.
pub fn pace_burst(per_second: u32) -> u32 {
    per_second
}

/// One line saying when `p`'s work may run, for `check-config`: its pace, active hours,
/// blast-radius guard and governor marks (with units), or that each is off.
pub fn summary(p: &super::Policy) -> String {
    let s = &p.safety;
    let pace = match s.max_items_per_second {
        Some(n) => format!("pace {n} items/s across replicas (burst {})", pace_burst(n)),
        None => "no pace".into(),
    };
    let active = match &s.active {
        Some(a) => format!("active {}", a.describe()),
        None => "any hour".into(),
    };
    let guard = match &s.guard {
        Some(g) => {
            let mut limits = Vec::new();
            if let Some(n) = g.max_items {
                limits.push(format!("max_items {n}"));
            }
            if let Some(r) = g.max_ratio {
                limits.push(format!("max_ratio {r} (floor {} items)", g.ratio_floor));
            }
            if let Some(f) = g.max_fraction {
                limits.push(format!("max_fraction {f}"));
            }
            format!("guard {}", limits.join(", "))
        }
        None => "no blast-radius guard".into(),
    };
    let m = &s.governor;
    let governor = if m.enabled {
        format!(
            "governor holds above / resumes at: replay lag {} / {} s and {} / {} bytes, xmin age \
             {} / {} transactions, lock waiters {} / {} sessions",
            m.replay_lag_seconds.0,
            m.replay_lag_seconds.1,
            m.replay_lag_bytes.0,
            m.replay_lag_bytes.1,
            m.xmin_age.0,
            m.xmin_age.1,
            m.lock_waiters.0,
            m.lock_waiters.1
        )
    } else {
        "governor off".into()
    };
    format!("policy[{}]: {pace}; {active}; {guard}; {governor}", p.name)
}

/// The governor's marks: `[governor]` over the defaults, then each policy's overrides over those
/// (stored in `policy.safety.governor`). Returns the global marks; problems go onto `errors`.
pub fn resolve_marks(
    global: &crate::governor::MarksConfig,
    policies: &mut [super::Policy],
    errors: &mut Vec<String>,
) -> crate::governor::Marks {
    use crate::governor::Marks;
    let before = errors.len();
    let marks = Marks::with(Marks::default(), global, "governor", errors);
    // A policy inherits a bad global mark: report it once, under `governor`.
    let global_ok = errors.len() == before;
    let mut scratch = Vec::new();
    for p in policies {
        let path = format!("policy[{}].governor", p.name);
        let sink = if global_ok {
            &mut *errors
        } else {
            &mut scratch
        };
        p.safety.governor = Marks::with(marks, &p.safety.governor_overrides, &path, sink);
    }
    marks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hours(from: &str, to: &str, zone: &str) -> ActiveHours {
        ActiveHours::from_config(&ActiveHoursConfig {
            from: from.into(),
            to: to.into(),
            timezone: Some(zone.into()),
        })
        .unwrap()
    }

    fn utc(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn hours_inside_and_outside_with_the_next_opening() {
        let h = hours("01:00", "05:00", "UTC");
        assert_eq!(h.at(utc("2026-12-02T03:00:00Z")), Hours::Open);
        assert_eq!(
            h.at(utc("2026-12-02T05:00:00Z")),
            Hours::Closed {
                since: utc("2026-12-02T05:00:00Z"),
                opens_at: utc("2026-12-03T01:00:00Z")
            }
        );
        assert_eq!(
            h.at(utc("2026-12-02T00:30:00Z")),
            Hours::Closed {
                since: utc("2026-12-01T05:00:00Z"),
                opens_at: utc("2026-12-02T01:00:00Z")
            }
        );
    }

    #[test]
    fn hours_across_midnight_in_a_zone() {
        // 22:00–02:00 Berlin (UTC+1 in December): 21:00–01:00 UTC.
        let h = hours("22:00", "02:00", "Europe/Berlin");
        assert_eq!(h.at(utc("2026-12-02T23:30:00Z")), Hours::Open);
        assert_eq!(h.at(utc("2026-12-03T00:59:00Z")), Hours::Open);
        assert_eq!(
            h.at(utc("2026-12-03T01:00:00Z")),
            Hours::Closed {
                since: utc("2026-12-03T01:00:00Z"),
                opens_at: utc("2026-12-03T21:00:00Z")
            }
        );
    }

    #[test]
    fn an_opening_in_a_dst_gap_moves_forward() {
        // 2026-03-29 02:30 does not exist in Berlin; it opens at 03:30 CEST = 01:30 UTC.
        let h = hours("02:30", "05:00", "Europe/Berlin");
        match h.at(utc("2026-03-29T00:00:00Z")) {
            Hours::Closed { opens_at, .. } => assert_eq!(opens_at, utc("2026-03-29T01:30:00Z")),
            open => panic!("{open:?}"),
        }
    }

    #[test]
    fn bad_hours_are_refused_with_their_field() {
        let e = ActiveHours::from_config(&ActiveHoursConfig {
            from: "25:00".into(),
            to: "01:00".into(),
            timezone: Some("Mars/Base".into()),
        })
        .unwrap_err();
        assert!(e.iter().any(|e| e.starts_with("active.from")), "{e:?}");
        assert!(e.iter().any(|e| e.starts_with("active.timezone")), "{e:?}");
    }

    #[test]
    fn the_guard_names_the_limit_crossed() {
        let g = BlastGuard::from_config(&GuardConfig {
            max_items: Some(10_000),
            max_ratio: Some(10.0),
            ratio_floor: None,
            max_fraction: Some(0.5),
        })
        .unwrap();
        assert_eq!(
            g.verdict(900, Some(100.0), Some(100_000.0)),
            None,
            "floor 1000"
        );
        assert!(
            g.verdict(2_000, Some(100.0), None)
                .unwrap()
                .contains("max_ratio")
        );
        assert!(g.verdict(10_001, None, None).unwrap().contains("max_items"));
        assert!(
            g.verdict(600, None, Some(1_000.0))
                .unwrap()
                .contains("max_fraction")
        );
        assert!(
            g.verdict(600, None, Some(-1.0))
                .unwrap()
                .contains("never analyzed"),
            "no estimate: held"
        );
        assert_eq!(g.verdict(0, None, None), None, "nothing planned");
    }
}
