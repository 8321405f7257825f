//! A policy's cron read into plain sets of minutes, hours, days, months and weekdays, written back
//! in the subset of cron every external scheduler reads alike: numbers, `*`, ranges and lists.
//!
//! The sets are read from the expression as croner reads it (names, `?`, `7` for Sunday, steps,
//! the `+` prefix of the weekday field), then checked against croner itself over a span of years
//! ([`Fields::agrees_with_croner`]): a translation that does not match croner tick for tick is
//! refused, never printed.

use std::str::FromStr;

use chrono::{Datelike, NaiveDate, NaiveDateTime, Timelike};
use croner::Cron;

/// The five fields as sets, and how the two day fields combine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fields {
    /// Minutes 0-59 (bit n = minute n).
    pub minutes: u64,
    /// Hours 0-23.
    pub hours: u64,
    /// Days of the month 1-31.
    pub days: u64,
    /// Months 1-12.
    pub months: u64,
    /// Weekdays 0-6, Sunday = 0.
    pub weekdays: u64,
    /// The day-of-month field is `*` or `?` (unrestricted: only the weekday field decides).
    pub days_star: bool,
    /// The weekday field is `*` or `?`.
    pub weekdays_star: bool,
    /// The weekday field starts with `+`: a day must match both fields (croner's extension;
    /// otherwise a day matches either, when both are restricted).
    pub days_and_weekdays: bool,
}

/// Why an expression cannot be written as plain fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unplain {
    /// It uses `L`, `W` or `#` (last, nearest weekday, nth weekday).
    Special(String),
    /// Something this reader does not know; croner accepted it, so it is refused as untranslatable.
    Unknown(String),
}

const MONTHS: [&str; 12] = [
    "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

fn full(lo: u32, hi: u32) -> u64 {
    (lo..=hi).fold(0, |acc, n| acc | (1 << n))
}

/// One field: comma-separated `*`, `*/s`, `n`, `a-b`, `a-b/s` within `lo..=hi`.
fn field(text: &str, lo: u32, hi: u32, what: &str) -> Result<u64, Unplain> {
    let bad = || Unplain::Unknown(format!("{what} `{text}`"));
    let mut set = 0u64;
    for item in text.split(',') {
        let (range, step) = match item.split_once('/') {
            Some((r, s)) => (r, s.parse::<u32>().map_err(|_| bad())?),
            None => (item, 1),
        };
        if step == 0 {
            return Err(bad());
        }
        let (a, b) = if range == "*" {
            (lo, hi)
        } else if let Some((a, b)) = range.split_once('-') {
            (
                a.parse::<u32>().map_err(|_| bad())?,
                b.parse::<u32>().map_err(|_| bad())?,
            )
        } else {
            let n = range.parse::<u32>().map_err(|_| bad())?;
            if item.contains('/') {
                // `n/s` (croner refuses it unless sloppy; not worth guessing).
                return Err(bad());
            }
            (n, n)
        };
        if a < lo || b > hi || a > b {
            return Err(bad());
        }
        let mut n = a;
        while n <= b {
            set |= 1 << n;
            n += step;
        }
    }
    Ok(set)
}

impl Fields {
    /// Reads a 5-field expression already accepted by croner.
    pub fn parse(expr: &str) -> Result<Fields, Unplain> {
        let upper = expr.to_ascii_uppercase();
        let parts: Vec<&str> = upper.split_whitespace().collect();
        if parts.len() != 5 {
            return Err(Unplain::Unknown(format!("`{expr}` has not 5 fields")));
        }
        let mut month = parts[3].to_string();
        for (i, name) in MONTHS.iter().enumerate() {
            month = month.replace(name, &(i + 1).to_string());
        }
        let mut weekday = parts[4].to_string();
        weekday = weekday.replace("-SUN", "-7");
        for (i, name) in WEEKDAYS.iter().enumerate() {
            weekday = weekday.replace(name, &i.to_string());
        }
        let day = parts[2].replace('?', "*");
        let weekday = weekday.replace('?', "*");
        let (weekday, and) = match weekday.strip_prefix('+') {
            Some(rest) => (rest.to_string(), true),
            None => (weekday, false),
        };
        for (text, what) in [(&day, "day of month"), (&weekday, "day of week")] {
            if text.contains(['L', 'W', '#']) {
                return Err(Unplain::Special(format!(
                    "the {what} field `{text}` uses croner's L, W or # (last, nearest weekday, \
                     nth weekday)"
                )));
            }
        }
        let mut weekdays = field(&weekday, 0, 7, "day of week")?;
        if weekdays & (1 << 7) != 0 {
            weekdays = (weekdays & !(1 << 7)) | 1;
        }
        Ok(Fields {
            minutes: field(parts[0], 0, 59, "minute")?,
            hours: field(parts[1], 0, 23, "hour")?,
            days: field(&day, 1, 31, "day of month")?,
            months: field(&month, 1, 12, "month")?,
            weekdays,
            days_star: day == "*",
            weekdays_star: weekday == "*",
            days_and_weekdays: and,
        })
    }

    /// Both day fields are restricted, so how they combine matters.
    pub fn both_days_restricted(&self) -> bool {
        !self.days_star && !self.weekdays_star
    }

    /// Whether the wall-clock date `d` is a day of the schedule.
    pub fn matches_date(&self, d: NaiveDate) -> bool {
        if self.months & (1 << d.month()) == 0 {
            return false;
        }
        let dom = self.days & (1 << d.day()) != 0;
        let dow = self.weekdays & (1 << d.weekday().num_days_from_sunday()) != 0;
        match (self.days_star, self.weekdays_star) {
            (true, true) => true,
            (true, false) => dow,
            (false, true) => dom,
            (false, false) if self.days_and_weekdays => dom && dow,
            (false, false) => dom || dow,
        }
    }

    /// Whether the wall-clock minute `t` matches.
    pub fn matches(&self, t: NaiveDateTime) -> bool {
        self.minutes & (1 << t.minute()) != 0
            && self.hours & (1 << t.hour()) != 0
            && self.matches_date(t.date())
    }

    /// Whether these sets match exactly the wall-clock minutes croner's reading of `expr`
    /// matches: every minute of a matching day, and every day of 2026-2033.
    pub fn agrees_with_croner(&self, expr: &str) -> bool {
        let Ok(cron) = Cron::from_str(expr) else {
            return false;
        };
        let croner = |t: NaiveDateTime| cron.is_time_matching(&t).unwrap_or(false);
        let (h, m) = (self.hours.trailing_zeros(), self.minutes.trailing_zeros());
        let mut day = NaiveDate::from_ymd_opt(2026, 1, 1).unwrap();
        let end = NaiveDate::from_ymd_opt(2034, 1, 1).unwrap();
        let mut sample = None;
        while day < end {
            let t = day.and_hms_opt(h, m, 0).unwrap();
            if croner(t) != self.matches(t) {
                return false;
            }
            if sample.is_none() && self.matches_date(day) {
                sample = Some(day);
            }
            day = day.succ_opt().unwrap();
        }
        let Some(day) = sample else {
            return false;
        };
        (0..24 * 60).all(|i| {
            let t = day.and_hms_opt(i / 60, i % 60, 0).unwrap();
            croner(t) == self.matches(t)
        })
    }

    /// The expression in plain cron: numbers, `*`, `a-b` and lists; weekdays 0-6. A day field
    /// is `*` only when it was unrestricted (a full `1-31` is kept: with a restricted weekday
    /// field it still means "either").
    pub fn plain(&self) -> String {
        let f = |set: u64, lo: u32, hi: u32, star: bool| {
            if star {
                "*".to_string()
            } else {
                ranges(set, lo, hi, "-", |n| n.to_string())
            }
        };
        format!(
            "{} {} {} {} {}",
            f(self.minutes, 0, 59, self.minutes == full(0, 59)),
            f(self.hours, 0, 23, self.hours == full(0, 23)),
            f(self.days, 1, 31, self.days_star),
            f(self.months, 1, 12, self.months == full(1, 12)),
            f(self.weekdays, 0, 6, self.weekdays_star),
        )
    }

    /// The systemd calendar event (without the zone): `[Weekdays ]*-MM-DD HH:MM:00`. Only for
    /// fields whose day parts combine by AND (one of them unrestricted, or the `+` prefix).
    pub fn systemd(&self) -> String {
        const NAMES: [&str; 7] = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
        let two = |n: u32| format!("{n:02}");
        let part = |set: u64, lo: u32, hi: u32, star: bool| {
            if star {
                "*".to_string()
            } else {
                ranges(set, lo, hi, "..", two)
            }
        };
        let weekdays = if self.weekdays_star {
            String::new()
        } else {
            let names: Vec<&str> = (0..7)
                .filter(|n| self.weekdays & (1 << n) != 0)
                .map(|n| NAMES[n])
                .collect();
            format!("{} ", names.join(","))
        };
        format!(
            "{weekdays}*-{}-{} {}:{}:00",
            part(self.months, 1, 12, self.months == full(1, 12)),
            part(self.days, 1, 31, self.days_star || self.days == full(1, 31)),
            part(self.hours, 0, 23, false),
            part(self.minutes, 0, 59, false),
        )
    }
}

/// `set` within `lo..=hi` as a list of runs: `a`, `a,b` for two, `a<sep>b` for three or more.
fn ranges(set: u64, lo: u32, hi: u32, sep: &str, show: impl Fn(u32) -> String) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut n = lo;
    while n <= hi {
        if set & (1 << n) == 0 {
            n += 1;
            continue;
        }
        let start = n;
        while n < hi && set & (1 << (n + 1)) != 0 {
            n += 1;
        }
        match n - start {
            0 => out.push(show(start)),
            1 => out.extend([show(start), show(n)]),
            _ => out.push(format!("{}{sep}{}", show(start), show(n))),
        }
        n += 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(expr: &str) -> String {
        let f = Fields::parse(expr).unwrap();
        assert!(f.agrees_with_croner(expr), "{expr}");
        f.plain()
    }

    #[test]
    fn names_steps_and_sunday_seven_become_plain_numbers() {
        assert_eq!(plain("0 3 * * *"), "0 3 * * *");
        assert_eq!(plain("*/15 9-17 * * MON-FRI"), "0,15,30,45 9-17 * * 1-5");
        assert_eq!(plain("0 2 ? JAN,jul SUN"), "0 2 * 1,7 0");
        assert_eq!(plain("0 2 * * 5-7"), "0 2 * * 0,5,6");
        assert_eq!(plain("30 1 1-31 * 1"), "30 1 1-31 * 1");
        assert_eq!(
            plain("0 0 */2 * *"),
            "0 0 1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31 * *"
        );
    }

    #[test]
    fn day_fields_combine_as_croner_combines_them() {
        for expr in ["0 0 1 * 1", "0 0 */2 * 1", "0 0 1-7 * +1", "0 0 13 * FRI"] {
            assert!(
                Fields::parse(expr).unwrap().agrees_with_croner(expr),
                "{expr}"
            );
        }
        assert!(Fields::parse("0 0 1-7 * +1").unwrap().days_and_weekdays);
    }

    #[test]
    fn special_characters_are_named() {
        for expr in [
            "0 0 L * *",
            "0 0 15W * *",
            "0 0 * * 5L",
            "0 0 * * MON#2",
            "0 0 LW * *",
        ] {
            assert!(
                matches!(Fields::parse(expr), Err(Unplain::Special(_))),
                "{expr}"
            );
        }
        // Names that contain the letters are not special.
        assert!(Fields::parse("0 0 * JUL WED").is_ok());
    }

    #[test]
    fn systemd_calendar_events() {
        let s = |e: &str| Fields::parse(e).unwrap().systemd();
        assert_eq!(s("0 3 * * *"), "*-*-* 03:00:00");
        assert_eq!(
            s("*/30 9-17 * * 1-5"),
            "Mon,Tue,Wed,Thu,Fri *-*-* 09..17:00,30:00"
        );
        assert_eq!(s("15 2 1,15 3 *"), "*-03-01,15 02:15:00");
    }
}
