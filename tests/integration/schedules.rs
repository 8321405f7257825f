//! `sweeper schedules`: for every format, each printed definition's next tick, computed from the
//! printed text alone (an independent cron evaluator here, `systemd-analyze calendar` for
//! systemd), is a tick sweeper accepts: a trigger with no window at that instant creates the run
//! of exactly that window, across daylight-saving changes. Refusals name their reason; no
//! definition holds a token.

use chrono::{DateTime, Datelike, TimeDelta, Timelike, Utc};
use chrono_tz::Tz;
use serde::Deserialize;
use serde_json::Value;

use crate::common::*;
use crate::kit::process::{sweeper, write_config};

const FORMATS: [&str; 5] = [
    "cloud-scheduler",
    "kubernetes",
    "qstash",
    "crontab",
    "systemd",
];

/// Two policies in daylight-saving zones: daily at 03:00 in Berlin, and every 20 minutes in New
/// York's office hours on weekdays (names, steps and ranges to translate).
fn policies() -> String {
    let policy = |name: &str, cron: &str, zone: &str| {
        format!(
            r#"
[[policy]]
name = "{name}"
schedule = {{ cron = "{cron}", timezone = "{zone}" }}
target = {{ table = "demo.tickets", key = "id", timestamp = "closed_at" }}
retain_for = "90d"
"#
        )
    };
    policy("berlin-nightly", "0 3 * * *", "Europe/Berlin")
        + &policy(
            "office-hours",
            "*/20 9-17 * JAN-DEC MON-FRI",
            "America/New_York",
        )
}

/// Instants to search the next tick from: ordinary days, and the days before each zone's spring
/// and autumn changes of 2026 (Berlin: 29 March, 25 October; New York: 8 March, 1 November).
const BASES: [&str; 6] = [
    "2026-09-01T00:00:00Z",
    "2026-03-28T12:00:00Z",
    "2026-10-24T12:00:00Z",
    "2026-03-06T23:00:00Z",
    "2026-10-30T23:00:00Z",
    "2026-10-31T23:00:00Z",
];

// ---- an independent reading of the printed cron ----------------------------------------------

/// A printed 5-field cron in Vixie semantics: a day matches both day fields when either is `*`,
/// else either of them.
struct PrintedCron {
    fields: Vec<Vec<bool>>,
    dom_star: bool,
    dow_star: bool,
}

fn parse_field(text: &str, lo: usize, hi: usize) -> Vec<bool> {
    let mut set = vec![false; hi + 1];
    for item in text.split(',') {
        let (range, step) = match item.split_once('/') {
            Some((r, s)) => (r, s.parse::<usize>().unwrap()),
            None => (item, 1),
        };
        let (a, b) = if range == "*" {
            (lo, hi)
        } else if let Some((a, b)) = range.split_once('-') {
            (a.parse().unwrap(), b.parse().unwrap())
        } else {
            let n: usize = range.parse().unwrap_or_else(|_| panic!("field `{text}`"));
            (n, n)
        };
        assert!(lo <= a && a <= b && b <= hi, "field `{text}`");
        for n in (a..=b).step_by(step) {
            set[n] = true;
        }
    }
    set
}

impl PrintedCron {
    fn parse(text: &str) -> PrintedCron {
        let parts: Vec<&str> = text.split_whitespace().collect();
        assert_eq!(parts.len(), 5, "printed cron `{text}`");
        let bounds = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 6)];
        PrintedCron {
            fields: parts
                .iter()
                .zip(bounds)
                .map(|(p, (lo, hi))| parse_field(p, lo, hi))
                .collect(),
            dom_star: parts[2] == "*",
            dow_star: parts[4] == "*",
        }
    }

    /// The first wall-clock match strictly after `t`, minute by minute in `zone`.
    fn next_after(&self, t: DateTime<Utc>, zone: Tz) -> DateTime<Utc> {
        let mut m = t.with_second(0).unwrap() + TimeDelta::minutes(1);
        for _ in 0..(40 * 1440) {
            let l = m.with_timezone(&zone);
            let dom = self.fields[2][l.day() as usize];
            let dow = self.fields[4][l.weekday().num_days_from_sunday() as usize];
            let day = if self.dom_star || self.dow_star {
                dom && dow
            } else {
                dom || dow
            };
            if self.fields[0][l.minute() as usize]
                && self.fields[1][l.hour() as usize]
                && self.fields[3][l.month() as usize]
                && day
            {
                return m;
            }
            m += TimeDelta::minutes(1);
        }
        panic!("no tick within 40 days of {t}");
    }
}

/// `systemd-analyze calendar`'s next elapse of `expr` after `t`.
fn systemd_next(expr: &str, t: DateTime<Utc>) -> DateTime<Utc> {
    let base = t.format("%Y-%m-%d %H:%M:%S UTC").to_string();
    let out = std::process::Command::new("systemd-analyze")
        .args([
            "calendar",
            "--iterations=1",
            &format!("--base-time={base}"),
            expr,
        ])
        .env("TZ", "UTC")
        .output()
        .expect("systemd-analyze runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "systemd-analyze `{expr}`: {text}");
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("Next elapse:"))
        .unwrap_or_else(|| panic!("no next elapse for `{expr}`: {text}"));
    // "Next elapse: Sun 2026-03-29 01:00:00 UTC"
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words[5], "UTC", "{line}");
    at(&format!("{}T{}Z", words[3], words[4]))
}

// ---- reading the printed definitions ---------------------------------------------------------

/// When a definition fires, as printed.
enum When {
    Cron(PrintedCron, Tz),
    Calendar(String),
}

struct Definition {
    policy: String,
    url: String,
    when: When,
}

impl Definition {
    fn next_after(&self, t: DateTime<Utc>) -> DateTime<Utc> {
        match &self.when {
            When::Cron(c, zone) => c.next_after(t, *zone),
            When::Calendar(expr) => systemd_next(expr, t),
        }
    }
}

fn policy_of(url: &str) -> String {
    url.rsplit_once("/trigger/").unwrap().1.to_string()
}

fn definition(url: &str, cron: &str, zone: &str) -> Definition {
    Definition {
        policy: policy_of(url),
        url: url.to_string(),
        when: When::Cron(PrintedCron::parse(cron), zone.parse().unwrap()),
    }
}

/// Shell words as bash reads them (single and double quotes; `$VAR` left as written).
fn words(line: &str) -> Vec<String> {
    let (mut out, mut word, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    for c in line.chars() {
        match (quote, c) {
            (None, ' ') => {
                if any {
                    out.push(std::mem::take(&mut word));
                }
                any = false;
            }
            (None, '\'' | '"') => (quote, any) = (Some(c), true),
            (Some(q), c) if c == q => quote = None,
            (_, c) => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(word);
    }
    out
}

#[derive(Deserialize)]
struct CronJob {
    spec: CronJobSpec,
}
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CronJobSpec {
    schedule: String,
    time_zone: String,
    job_template: Value,
}

fn definitions(format: &str, text: &str) -> Vec<Definition> {
    match format {
        "cloud-scheduler" => text
            .lines()
            .filter(|l| l.starts_with("gcloud scheduler jobs create http "))
            .map(|l| {
                let w = words(l);
                let flag = |name: &str| {
                    w.iter()
                        .find_map(|a| a.strip_prefix(&format!("--{name}=")))
                        .unwrap_or_else(|| panic!("no --{name} in {l}"))
                        .to_string()
                };
                assert_eq!(w[5], format!("sweeper-{}", policy_of(&flag("uri"))));
                assert_eq!(flag("http-method"), "POST");
                definition(&flag("uri"), &flag("schedule"), &flag("time-zone"))
            })
            .collect(),
        "kubernetes" => yaml_serde::Deserializer::from_str(text)
            .map(|doc| {
                let job = CronJob::deserialize(doc).unwrap();
                let containers = &job.spec.job_template["spec"]["template"]["spec"]["containers"];
                let script = containers[0]["args"][0].as_str().unwrap();
                let url = script.split_whitespace().last().unwrap();
                definition(url, &job.spec.schedule, &job.spec.time_zone)
            })
            .collect(),
        "qstash" => {
            let list: Vec<Value> = serde_json::from_str(text).unwrap();
            list.iter()
                .map(|s| {
                    let cron = s["cron"].as_str().unwrap();
                    let (tz, fields) = cron.split_once(' ').unwrap();
                    let url = s["destination"].as_str().unwrap();
                    assert_eq!(s["method"], "POST");
                    assert_eq!(s["scheduleId"], format!("sweeper-{}", policy_of(url)));
                    definition(url, fields, tz.strip_prefix("CRON_TZ=").unwrap())
                })
                .collect()
        }
        "crontab" => {
            let mut zone = None;
            let mut out = Vec::new();
            for line in text.lines() {
                if line.starts_with('#') || line.trim().is_empty() {
                    continue;
                }
                if let Some(z) = line.strip_prefix("CRON_TZ=") {
                    zone = Some(z.to_string());
                    continue;
                }
                let w: Vec<&str> = line.split_whitespace().collect();
                if w.len() == 1 && w[0].contains('=') {
                    continue; // a variable
                }
                let cron = w[..5].join(" ");
                out.push(definition(
                    w.last().unwrap(),
                    &cron,
                    zone.as_deref().expect("CRON_TZ before the line"),
                ));
            }
            out
        }
        "systemd" => {
            let mut calendars = Vec::new();
            let mut urls = Vec::new();
            for line in text.lines() {
                if let Some(expr) = line.strip_prefix("OnCalendar=") {
                    calendars.push(expr.to_string());
                }
                if let Some(cmd) = line.strip_prefix("ExecStart=") {
                    urls.push(
                        cmd.trim_end_matches('\'')
                            .split_whitespace()
                            .last()
                            .unwrap(),
                    );
                }
            }
            assert_eq!(calendars.len(), urls.len(), "{text}");
            calendars
                .into_iter()
                .zip(urls)
                .map(|(expr, url)| Definition {
                    policy: policy_of(url),
                    url: url.to_string(),
                    when: When::Calendar(expr),
                })
                .collect()
        }
        other => panic!("format {other}"),
    }
}

fn run_schedules(
    config: &std::path::Path,
    format: &str,
    url: Option<&str>,
) -> (i32, String, String) {
    let mut args = vec![
        "schedules",
        "--config",
        config.to_str().unwrap(),
        "--format",
        format,
    ];
    if let Some(u) = url {
        args.extend(["--url", u]);
    }
    let out = sweeper(&args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

// ---- the tests -------------------------------------------------------------------------------

#[tokio::test]
async fn every_format_fires_on_ticks_sweeper_accepts_across_daylight_saving() {
    for format in FORMATS {
        let app = TestApp::spawn(Spawn {
            policies: policies(),
            ..Default::default()
        })
        .await;
        let config = write_config(&config_toml(&app.db.url, 0, "", &policies()));
        let (code, text, stderr) = run_schedules(&config, format, Some(&app.base));
        assert_eq!(code, 0, "{format}: {stderr}");
        assert!(
            !text.contains(SECRET) && !text.contains("eyJ"),
            "{format}: {text}"
        );
        let defs = definitions(format, &text);
        let mut named: Vec<&str> = defs.iter().map(|d| d.policy.as_str()).collect();
        named.sort();
        assert_eq!(
            named,
            ["berlin-nightly", "office-hours"],
            "{format}: {text}"
        );

        let token = app.token(&["trigger:*"]);
        // Every definition's next tick from every base, fired in time order.
        let mut ticks = std::collections::BTreeSet::new();
        for (i, def) in defs.iter().enumerate() {
            assert_eq!(def.url, format!("{}/trigger/{}", app.base, def.policy));
            for base in BASES {
                ticks.insert((def.next_after(at(base)), i));
            }
        }
        let mut shifted = std::collections::BTreeSet::new();
        for (tick, i) in ticks {
            let def = &defs[i];
            // The same local time before and after each change: the UTC instant shifts.
            shifted.insert((def.policy.clone(), tick.time()));
            set_clock(&app.pool, tick).await;
            let r = app
                .client
                .post(&def.url)
                .bearer_auth(&token)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap();
            assert_eq!(
                (status, body["window"].as_str()),
                (202, Some(sweeper::window::format(tick).as_str())),
                "{format} {} at {tick}: {body}",
                def.policy
            );
        }
        // Berlin's 03:00 is 01:00Z in summer and 02:00Z in winter; New York's 09:00 13:00Z and
        // 14:00Z.
        for (policy, hour) in [
            ("berlin-nightly", 1),
            ("berlin-nightly", 2),
            ("office-hours", 13),
            ("office-hours", 14),
        ] {
            assert!(
                shifted.contains(&(
                    policy.into(),
                    chrono::NaiveTime::from_hms_opt(hour, 0, 0).unwrap()
                )),
                "{format}: {policy} at {hour}:00Z in {shifted:?}"
            );
        }
        app.stop().await;
    }
}

#[tokio::test]
async fn crons_a_format_cannot_express_are_refused_with_the_reason() {
    let policy = |name: &str, cron: &str| {
        format!(
            r#"
[[policy]]
name = "{name}"
schedule = {{ cron = "{cron}", timezone = "Europe/Berlin" }}
target = {{ table = "demo.tickets", key = "id", timestamp = "closed_at" }}
retain_for = "90d"
"#
        )
    };
    let config = |policies: &str| {
        write_config(&config_toml(
            "postgres://127.0.0.1:1/unused",
            0,
            "",
            policies,
        ))
    };
    let url = Some("https://sweeper.example.com");
    // The last day of the month: croner's L, in no target's syntax.
    let last_day = config(&(policy("ok", "0 3 * * *") + &policy("month-end", "0 3 L * *")));
    for format in FORMATS {
        let (code, out, err) = run_schedules(&last_day, format, url);
        assert_eq!(code, 1, "{format}: {out}{err}");
        assert!(out.is_empty(), "{format}: nothing is printed: {out}");
        assert!(
            err.contains("policy month-end:") && err.contains("L, W or #"),
            "{format}: {err}"
        );
        assert!(!err.contains("policy ok:"), "{format}: {err}");
    }
    // The first of the month or a Monday: systemd matches days by both fields.
    let either = config(&policy("either", "0 3 1 * MON"));
    let (code, _, err) = run_schedules(&either, "systemd", url);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("policy either:") && err.contains("either"),
        "{err}"
    );
    for format in ["cloud-scheduler", "kubernetes", "qstash", "crontab"] {
        assert_eq!(run_schedules(&either, format, url).0, 0, "{format}");
    }
    // A Monday among the first seven days (croner's `+`): unix cron cannot say "both".
    let both = config(&policy("first-monday", "0 3 1-7 * +MON"));
    for format in ["cloud-scheduler", "kubernetes", "qstash", "crontab"] {
        let (code, _, err) = run_schedules(&both, format, url);
        assert_eq!(code, 1, "{format}: {err}");
        assert!(
            err.contains("policy first-monday:") && err.contains("both"),
            "{format}: {err}"
        );
        assert!(!err.contains("cron's cron"), "{format}: {err}");
    }
    let (code, out, err) = run_schedules(&both, "systemd", url);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("OnCalendar=Mon *-*-01..07 03:00:00 Europe/Berlin"),
        "{out}"
    );
    // The policy's label stays a string whatever the name (YAML reads `true` unquoted as a bool).
    for name in ["true", "null", "123"] {
        let (code, out, err) =
            run_schedules(&config(&policy(name, "0 3 * * *")), "kubernetes", url);
        assert_eq!(code, 0, "{name}: {err}");
        let job: Value = yaml_serde::from_str(&out).unwrap();
        assert_eq!(
            job["metadata"]["labels"]["sweeper.example.com/policy"],
            Value::String(name.into()),
            "{out}"
        );
    }
    // A policy name Kubernetes does not take as a CronJob name.
    let underscore = config(&policy("ticket_retention", "0 3 * * *"));
    let (code, _, err) = run_schedules(&underscore, "kubernetes", url);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("policy ticket_retention:") && err.contains("CronJob name"),
        "{err}"
    );
}

#[tokio::test]
async fn the_url_defaults_to_qstash_public_url_and_is_otherwise_required() {
    let policies = r#"
[[policy]]
name = "nightly"
schedule = { cron = "30 2 * * *", timezone = "Europe/Berlin" }
target = { table = "demo.tickets", key = "id", timestamp = "closed_at" }
retain_for = "90d"
"#;
    let plain = write_config(&config_toml(
        "postgres://127.0.0.1:1/unused",
        0,
        "",
        policies,
    ));
    for format in FORMATS {
        let (code, out, err) = run_schedules(&plain, format, None);
        assert_eq!(code, 2, "{format}: {out}");
        assert!(
            out.is_empty() && err.contains("--url is required"),
            "{format}: {err}"
        );
    }
    // [qstash] without its secrets in the environment: the command reads no secret.
    let extra = "[qstash]\npublic_url = \"https://sweeper.example.com/\"\n";
    let with_qstash = write_config(&config_toml(
        "postgres://127.0.0.1:1/unused",
        0,
        extra,
        policies,
    ));
    for format in FORMATS {
        let (code, out, err) = run_schedules(&with_qstash, format, None);
        assert_eq!(code, 0, "{format}: {err}");
        assert!(
            out.contains("https://sweeper.example.com/trigger/nightly"),
            "{format}: {out}"
        );
        // 02:30 is skipped in Berlin's spring and repeated in its autumn: each format says so.
        assert!(
            out.contains("2026-03-29 02:00-03:00") && out.contains("2026-10-25 02:00-03:00"),
            "{format}: {out}"
        );
        assert!(!out.contains(SECRET), "{format}");
    }
    let (code, _, err) = run_schedules(&plain, "crontab", Some("https://x.example/a b"));
    assert_eq!(code, 2, "{err}");
}
