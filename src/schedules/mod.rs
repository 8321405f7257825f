//! `sweeper schedules`: the external scheduler's definitions, written from the policies' own
//! `schedule = { cron, timezone }` (docs/design.md §2.1, docs/transports-and-deployment.md).
//!
//! sweeper accepts a trigger only for a tick of the policy's schedule; the scheduler that sends
//! it must fire on the same ticks. This module writes that scheduler's definitions so the schedule
//! is written once, in the configuration. A cron a target cannot express exactly is refused with
//! the reason, and the whole command prints nothing (see [`render`]). Definitions never hold a
//! token: they name the variable, secret or file to read it from.

pub mod cron;

use std::fmt::Write as _;
use std::path::Path;

use chrono::{DateTime, NaiveDateTime, Offset, TimeDelta, TimeZone, Utc};
use chrono_tz::Tz;
use serde::Deserialize;

use crate::policy::Policy;
use crate::policy::PolicyConfig;
use crate::window::Schedule;
use cron::{Fields, Unplain};

/// The external schedulers sweeper writes definitions for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// `gcloud scheduler jobs create http` commands (a bash script).
    CloudScheduler,
    /// One `batch/v1` CronJob per policy (YAML).
    Kubernetes,
    /// QStash schedules (a JSON array, one object per policy).
    Qstash,
    /// crontab lines for cronie (`CRON_TZ`).
    Crontab,
    /// A `.timer` and a `.service` unit per policy.
    Systemd,
}

impl Format {
    fn label(self) -> &'static str {
        match self {
            Format::CloudScheduler => "Cloud Scheduler",
            Format::Kubernetes => "Kubernetes",
            Format::Qstash => "QStash",
            Format::Crontab => "cron",
            Format::Systemd => "systemd",
        }
    }

    fn flag(self) -> &'static str {
        match self {
            Format::CloudScheduler => "cloud-scheduler",
            Format::Kubernetes => "kubernetes",
            Format::Qstash => "qstash",
            Format::Crontab => "crontab",
            Format::Systemd => "systemd",
        }
    }
}

/// What the command needs from the configuration file: the policies and `[qstash] public_url`.
/// Other sections are not read, so no secret, variable or database is needed.
#[derive(Debug, Deserialize)]
struct ScheduleFile {
    #[serde(default)]
    policy: Vec<PolicyConfig>,
    #[serde(default)]
    qstash: Option<crate::transport::qstash::QstashConfig>,
}

/// The policies of a configuration file and its `[qstash] public_url`.
pub struct Source {
    /// The policies, validated as the server validates them.
    pub policies: Vec<Policy>,
    /// `[qstash] public_url`, without a trailing `/`.
    pub public_url: Option<String>,
}

/// Reads `path`'s policies (validated like the server's) and `[qstash] public_url`; the errors
/// name their place like `check-config`'s.
pub fn read(path: &Path) -> Result<Source, Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| vec![e.to_string()])?;
    let file: ScheduleFile = config::Config::builder()
        .add_source(config::File::from_str(&text, config::FileFormat::Toml))
        .build()
        .and_then(|c| c.try_deserialize())
        .map_err(|e| vec![e.to_string()])?;
    let mut errors = Vec::new();
    let mut policies: Vec<Policy> = Vec::new();
    for (i, p) in file.policy.into_iter().enumerate() {
        let label = if p.name.is_empty() {
            format!("policy[{i}]")
        } else {
            format!("policy[{}]", p.name)
        };
        if policies.iter().any(|q| q.name.as_str() == p.name) {
            errors.push(format!("{label}: a policy of this name is defined twice"));
            continue;
        }
        match Policy::from_config(p) {
            Ok(p) => policies.push(p),
            Err(es) => errors.extend(es.into_iter().map(|e| format!("{label}.{e}"))),
        }
    }
    if policies.is_empty() && errors.is_empty() {
        errors.push("no [[policy]] in the configuration: there is nothing to schedule".into());
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(Source {
        policies,
        public_url: file
            .qstash
            .map(|q| q.public_url.trim_end_matches('/').to_string()),
    })
}

/// Checks the trigger URL base: http(s), no query, fragment or credentials, and only characters
/// that need no quoting in a shell, YAML, a crontab (no `%`) or a unit file.
pub fn base_url(raw: &str) -> Result<String, String> {
    let base = raw.trim().trim_end_matches('/');
    let url = url::Url::parse(base).map_err(|e| format!("--url `{raw}`: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("--url `{raw}`: not an http(s) URL"));
    }
    if url.query().is_some()
        || url.fragment().is_some()
        || !url.username().is_empty()
        || url.password().is_some()
    {
        return Err(format!(
            "--url `{raw}`: give the base URL alone, without query, fragment or credentials"
        ));
    }
    if !base
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"._~:/-".contains(&b))
    {
        return Err(format!(
            "--url `{raw}`: only letters, digits and . _ ~ : / - are written into definitions"
        ));
    }
    Ok(base.to_string())
}

/// One policy's schedule, ready to write.
struct Job<'a> {
    policy: &'a Policy,
    fields: Fields,
    url: String,
    notes: Vec<String>,
}

impl Job<'_> {
    fn name(&self) -> &str {
        self.policy.name.as_str()
    }
    fn zone_name(&self) -> &str {
        self.policy.schedule.zone_name()
    }
    fn cron(&self) -> String {
        self.fields.plain()
    }
    /// `"0 3 * * *" in Europe/Berlin`, as configured.
    fn described(&self) -> String {
        format!(
            "\"{}\" in {}",
            self.policy.schedule.expr(),
            self.zone_name()
        )
    }
}

/// Why `format` cannot express `policy`'s schedule, if it cannot.
fn refusal(format: Format, policy: &Policy) -> Result<Fields, String> {
    let expr = policy.schedule.expr();
    let fields = match Fields::parse(expr) {
        Ok(f) => f,
        Err(Unplain::Special(why)) => {
            let more = if format == Format::Systemd {
                " (systemd's `~` could express some of them; sweeper does not translate them)"
            } else {
                ""
            };
            return Err(format!(
                "{why}; {} has no such syntax{more}: write the days out, or schedule it elsewhere",
                format.label()
            ));
        }
        Err(Unplain::Unknown(what)) => {
            return Err(format!(
                "sweeper cannot translate {what} into plain cron fields"
            ));
        }
    };
    if !fields.agrees_with_croner(expr) {
        return Err(format!(
            "the plain form `{}` does not fire on exactly the ticks croner reads from `{expr}`",
            fields.plain()
        ));
    }
    let both = fields.both_days_restricted();
    match format {
        Format::Systemd if both && !fields.days_and_weekdays => Err(
            "both day of month and day of week are restricted, and cron fires on a day matching \
             either; a systemd calendar event matches a day by both"
                .into(),
        ),
        Format::Systemd => Ok(fields),
        _ if both && fields.days_and_weekdays => Err(format!(
            "the `+` prefix makes a day match both day of month and day of week (croner's \
             extension); {} fires on a day matching either",
            match format {
                Format::Crontab => "cron".to_string(),
                other => format!("{}'s cron", other.label()),
            }
        )),
        Format::Kubernetes
            if policy.name.as_str().contains('_')
                || policy.name.as_str().len() > 52 - "sweeper-trigger-".len() =>
        {
            Err(format!(
                "the CronJob name sweeper-trigger-{} is not a Kubernetes CronJob name (at most \
                 52 characters, no `_`)",
                policy.name
            ))
        }
        _ => Ok(fields),
    }
}

/// What a zone's daylight-saving changes do to a schedule, over 2026-2035.
#[derive(Debug, PartialEq)]
struct Daylight {
    /// The first spring-forward gap (`YYYY-MM-DD HH:MM-HH:MM`, local) after which sweeper has a
    /// tick that a scheduler skipping the gap's local times misses. croner moves a tick in the
    /// gap to its end only for a schedule with a single minute and a single hour; otherwise it
    /// skips the gap, as the targets do, and nothing is missed.
    gap: Option<String>,
    /// The first fall-back fold whose local times hold a tick, and whether sweeper ticks on its
    /// second pass too (croner fires once, on the first pass, only for a schedule with a single
    /// minute and a single hour).
    fold: Option<(String, bool)>,
}

/// Finds [`Daylight`] from the policy's own `schedule` (sweeper's ticks) and its plain `fields`
/// (what a target that reads wall-clock times fires at).
fn daylight_saving(fields: &Fields, schedule: &Schedule, zone: Tz) -> Daylight {
    let offset = |t: DateTime<Utc>| {
        zone.offset_from_utc_datetime(&t.naive_utc())
            .fix()
            .local_minus_utc() as i64
    };
    let span = |from: NaiveDateTime, to: NaiveDateTime| {
        format!(
            "{} {}-{}",
            from.format("%Y-%m-%d"),
            from.format("%H:%M"),
            to.format("%H:%M")
        )
    };
    // sweeper's ticks in [from, to).
    let ticks = |from: DateTime<Utc>, to: DateTime<Utc>| {
        let mut out = Vec::new();
        let mut t = schedule.next_tick_after(from - TimeDelta::seconds(1));
        while let Some(tick) = t.filter(|tick| *tick < to) {
            out.push(tick);
            t = schedule.next_tick_after(tick);
        }
        out
    };
    let mut found = Daylight {
        gap: None,
        fold: None,
    };
    let mut t = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
    let end = Utc.with_ymd_and_hms(2036, 1, 1, 0, 0, 0).unwrap();
    let mut before = offset(t);
    while t < end && (found.gap.is_none() || found.fold.is_none()) {
        let next = t + TimeDelta::hours(1);
        let after = offset(next);
        if after != before {
            // The change's instant, to the minute.
            let mut at = t;
            while offset(at) == before {
                at += TimeDelta::minutes(1);
            }
            let (o1, o2) = (TimeDelta::seconds(before), TimeDelta::seconds(after));
            let local = at.naive_utc();
            if o2 > o1 && found.gap.is_none() {
                // After the gap, a tick whose local time is no wall-clock match is one croner
                // moved out of the gap: a target that skips the gap's times does not fire then.
                let missed = ticks(at, at + (o2 - o1))
                    .into_iter()
                    .any(|tick| !fields.matches(tick.naive_utc() + o2));
                if missed {
                    found.gap = Some(span(local + o1, local + o2));
                }
            }
            if o2 < o1 && found.fold.is_none() {
                let (from, to) = (local + o2, local + o1);
                let mut m = from;
                let mut hit = false;
                while m < to {
                    hit |= fields.matches(m);
                    m += TimeDelta::minutes(1);
                }
                if hit {
                    let second = !ticks(at, at + (o1 - o2)).is_empty();
                    found.fold = Some((span(from, to), second));
                }
            }
        }
        before = after;
        t = next;
    }
    found
}

/// What `format` does with a zone's daylight-saving changes where sweeper's schedule differs.
fn daylight_notes(format: Format, fields: &Fields, policy: &Policy, zone: Tz) -> Vec<String> {
    let found = daylight_saving(fields, &policy.schedule, zone);
    let name = policy.name.as_str();
    let zone = zone.name();
    let recover = format!(
        "the next run covers their rows, or create a run with POST /trigger/{name}?window=<tick> \
         and scope ops:write"
    );
    let mut notes = Vec::new();
    if let Some(gap) = found.gap {
        let what = match format {
            Format::Kubernetes => "Kubernetes (robfig/cron) skips them",
            Format::Systemd => "systemd skips them (checked with systemd 252)",
            Format::CloudScheduler => {
                "Cloud Scheduler runs on wall-clock time and does not document whether it fires them late or not at all"
            }
            Format::Qstash => "QStash does not document whether it fires them late or not at all",
            Format::Crontab => "cronie does not document what a CRON_TZ job does with them",
        };
        notes.push(format!(
            "daylight saving: local times {gap} do not exist in {zone} (spring forward); sweeper's \
             tick is then the first instant after the gap. {what}: where it does not fire, that \
             tick's window gets no trigger; {recover}."
        ));
    }
    if let Some((fold, second)) = found.fold {
        let sweeper = if second {
            "sweeper ticks on both passes"
        } else {
            "sweeper ticks on the first pass only"
        };
        let undocumented = match format {
            Format::CloudScheduler => "Cloud Scheduler",
            Format::Qstash => "QStash",
            Format::Crontab => "cronie",
            Format::Kubernetes | Format::Systemd => "",
        };
        let what = match (format, second) {
            (Format::Systemd, false) => {
                "systemd fires once, on the first pass, as sweeper does (checked with systemd 252)"
                    .to_string()
            }
            (Format::Systemd, true) => format!(
                "systemd fires on the first pass only (checked with systemd 252): sweeper's \
                 second-pass ticks get no trigger; {recover}"
            ),
            (Format::Kubernetes, false) => "Kubernetes (robfig/cron) fires on both passes; \
                 sweeper answers the second trigger with the first pass's run (200)"
                .to_string(),
            (Format::Kubernetes, true) => {
                "Kubernetes (robfig/cron) fires on both passes, as sweeper does".to_string()
            }
            (_, false) => format!(
                "{undocumented} does not document whether it fires on the second pass; if it \
                 does, sweeper answers that trigger with the first pass's run (200)"
            ),
            (_, true) => format!(
                "{undocumented} does not document whether it fires on the second pass; where it \
                 does not, sweeper's second-pass ticks get no trigger; {recover}"
            ),
        };
        notes.push(format!(
            "daylight saving: local times {fold} happen twice in {zone} (fall back); {sweeper}. \
             {what}."
        ));
    }
    notes
}

/// The definitions for every policy, or every policy's refusal (`policy <name>: <reason>`):
/// one refused policy refuses the whole output, so a deploy step never installs part of the
/// schedules as if it were all of them.
pub fn render(
    format: Format,
    source: &Source,
    base: &str,
    config: &Path,
) -> Result<String, Vec<String>> {
    let mut jobs = Vec::new();
    let mut refused = Vec::new();
    for policy in &source.policies {
        let zone: Tz = policy
            .schedule
            .zone_name()
            .parse()
            .expect("a validated schedule's zone parses");
        match refusal(format, policy) {
            Ok(fields) => {
                let notes = daylight_notes(format, &fields, policy, zone);
                jobs.push(Job {
                    policy,
                    fields,
                    url: format!("{base}/trigger/{}", policy.name),
                    notes,
                });
            }
            Err(why) => refused.push(format!(
                "policy {}: {} cannot express the schedule {:?} ({}): {why}",
                policy.name,
                format.label(),
                policy.schedule.expr(),
                policy.schedule.zone_name()
            )),
        }
    }
    if !refused.is_empty() {
        return Err(refused);
    }
    let origin = format!(
        "Generated by `sweeper schedules --format {}` from the policies' schedules in {}; \
         regenerate it after changing one, do not edit it.",
        format.flag(),
        config.display()
    );
    Ok(match format {
        Format::CloudScheduler => cloud_scheduler(&jobs, &origin),
        Format::Kubernetes => kubernetes(&jobs, &origin),
        Format::Qstash => qstash(&jobs),
        Format::Crontab => crontab(&jobs, &origin),
        Format::Systemd => systemd(&jobs, &origin),
    })
}

/// `text` wrapped at 98 columns as `# ` comment lines with `indent` before each.
fn comment(out: &mut String, indent: &str, text: &str) {
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && indent.len() + 2 + line.len() + 1 + word.len() > 98 {
            let _ = writeln!(out, "{indent}# {line}");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    let _ = writeln!(out, "{indent}# {line}");
}

/// One argument for bash, quoted only when it must be.
fn sh(arg: &str) -> String {
    if !arg.is_empty()
        && arg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_./:=@,+%-".contains(&b))
    {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

fn cloud_scheduler(jobs: &[Job], origin: &str) -> String {
    let mut out = String::from("#!/usr/bin/env bash\n");
    comment(
        &mut out,
        "",
        &format!(
            "Cloud Scheduler jobs calling POST /trigger/<policy>, one per policy. {origin} Each \
             job sends an OIDC token of $SCHEDULER_SA for $AUDIENCE: the configuration's Google \
             [[auth.jwks_issuer]] must list $AUDIENCE in its audiences and map $SCHEDULER_SA to \
             trigger:<policy>. Cloud Scheduler sends X-CloudScheduler-ScheduleTime, which names \
             the tick. An existing job is changed with `gcloud scheduler jobs update http` and the \
             same flags; add --project, --attempt-deadline and --max-retry-attempts as needed."
        ),
    );
    out.push_str("set -euo pipefail\n");
    out.push_str(": \"${REGION:?set REGION, the Cloud Scheduler location}\"\n");
    out.push_str(
        ": \"${SCHEDULER_SA:?set SCHEDULER_SA, the email of the service account whose OIDC tokens the jobs send}\"\n",
    );
    out.push_str(": \"${AUDIENCE:?set AUDIENCE, the OIDC audience sweeper expects}\"\n");
    for job in jobs {
        out.push('\n');
        comment(
            &mut out,
            "",
            &format!("policy {}: {}.", job.name(), job.described()),
        );
        for note in &job.notes {
            comment(&mut out, "", note);
        }
        let args = [
            format!("sweeper-{}", job.name()),
            "--location=\"$REGION\"".to_string(),
            format!("--schedule={}", sh(&job.cron())),
            format!("--time-zone={}", sh(job.zone_name())),
            format!("--uri={}", sh(&job.url)),
            "--http-method=POST".to_string(),
            "--oidc-service-account-email=\"$SCHEDULER_SA\"".to_string(),
            "--oidc-token-audience=\"$AUDIENCE\"".to_string(),
        ];
        let _ = writeln!(out, "gcloud scheduler jobs create http {}", args.join(" "));
    }
    out
}

fn kubernetes(jobs: &[Job], origin: &str) -> String {
    let mut out = String::new();
    for (i, job) in jobs.iter().enumerate() {
        if i > 0 {
            out.push_str("---\n");
        }
        let name = job.name();
        comment(
            &mut out,
            "",
            &format!(
                "The external scheduler of policy `{name}`: POST /trigger/{name} on every tick of \
                 its schedule, {}. {origin}",
                job.described()
            ),
        );
        out.push_str("#\n");
        comment(
            &mut out,
            "",
            &format!(
                "The trigger sends no window: sweeper takes the latest tick of the policy's \
                 schedule at or before arrival + early_tolerance ({}), so a Job that starts a few \
                 seconds or minutes late still serves the right window.",
                job.policy.early_tolerance
            ),
        );
        for note in &job.notes {
            out.push_str("#\n");
            comment(&mut out, "", note);
        }
        out.push_str("#\n");
        comment(
            &mut out,
            "",
            &format!(
                "Needs Secret `sweeper-cronjob-token` with key `token`: a token with scope \
                 trigger:{name} (one token may carry the scopes of several policies), minted with"
            ),
        );
        let _ = writeln!(
            out,
            "#   sweeper token --scope trigger:{name} --ttl 30d --sub k8s-cronjob"
        );
        out.push_str("# (re-mint it before it expires).\n");
        let _ = write!(
            out,
            r#"apiVersion: batch/v1
kind: CronJob
metadata:
  name: sweeper-trigger-{name}
  labels:
    app.kubernetes.io/name: sweeper
    app.kubernetes.io/component: trigger
    sweeper.example.com/policy: "{name}"
spec:
  schedule: "{cron}"
  timeZone: "{zone}"
  # Allow, not Forbid: triggers are idempotent. Every trigger for one window returns that
  # window's single run (202 when it creates it, 200 afterwards), so overlapping Jobs cannot
  # create a second run or plan anything twice. Forbid would only make a hung Job suppress the
  # next tick's trigger.
  concurrencyPolicy: Allow
  # A Job that could not start within the hour is skipped; the next tick's run covers its rows
  # (their cutoff has passed for it too).
  startingDeadlineSeconds: 3600
  successfulJobsHistoryLimit: 3
  failedJobsHistoryLimit: 5
  jobTemplate:
    metadata:
      labels:
        app.kubernetes.io/name: sweeper
        app.kubernetes.io/component: trigger
    spec:
      # Retrying the whole Job is as safe as retrying the request: same window, same run.
      backoffLimit: 3
      activeDeadlineSeconds: 900
      ttlSecondsAfterFinished: 86400
      template:
        metadata:
          labels:
            app.kubernetes.io/name: sweeper
            app.kubernetes.io/component: trigger
        spec:
          restartPolicy: Never
          automountServiceAccountToken: false
          securityContext:
            runAsNonRoot: true
            # curlimages/curl's curl_user
            runAsUser: 100
            runAsGroup: 101
            seccompProfile:
              type: RuntimeDefault
          containers:
            - name: trigger
              image: docker.io/curlimages/curl:8.11.1
              env:
                - name: SWEEPER_TOKEN
                  valueFrom:
                    secretKeyRef:
                      name: sweeper-cronjob-token
                      key: token
              command: ["/bin/sh", "-c"]
              # The header is read from stdin (-H @-), so the token is not in curl's argv.
              # --retry covers timeouts, 408, 429 and 5xx (503 carries Retry-After, which curl
              # honours) and, with --retry-connrefused, a Service without ready endpoints.
              # 4xx answers (401, 403, 404, 400) fail the Job at once: they need a person.
              args:
                - >-
                  printf 'Authorization: Bearer %s\n' "$SWEEPER_TOKEN" |
                  curl --fail-with-body --silent --show-error
                  --max-time 30 --retry 5 --retry-connrefused --retry-max-time 300
                  --request POST --header @-
                  --write-out '\nHTTP %{{http_code}}\n'
                  {url}
              resources:
                requests:
                  cpu: 10m
                  memory: 16Mi
                limits:
                  memory: 64Mi
              securityContext:
                allowPrivilegeEscalation: false
                readOnlyRootFilesystem: true
                capabilities:
                  drop: ["ALL"]
"#,
            cron = job.cron(),
            zone = job.zone_name(),
            url = job.url,
        );
    }
    out
}

fn qstash(jobs: &[Job]) -> String {
    let list: Vec<serde_json::Value> = jobs
        .iter()
        .map(|job| {
            serde_json::json!({
                "policy": job.name(),
                "scheduleId": format!("sweeper-{}", job.name()),
                "destination": job.url,
                "cron": format!("CRON_TZ={} {}", job.zone_name(), job.cron()),
                "method": "POST",
                "notes": job.notes,
            })
        })
        .collect();
    let mut out = serde_json::to_string_pretty(&list).expect("JSON values serialize");
    out.push('\n');
    out
}

fn crontab(jobs: &[Job], origin: &str) -> String {
    let mut out = String::new();
    comment(
        &mut out,
        "",
        &format!(
            "crontab lines calling POST /trigger/<policy>, one per policy. {origin} CRON_TZ \
             needs cronie (Fedora, RHEL, Arch, Debian's cronie package): other crons ignore it and \
             read the times in the system's zone, so use them only for policies in UTC on a \
             machine in UTC. Each line reads the Authorization header from the file named by \
             SWEEPER_TRIGGER_HEADER_FILE (mode 0600, one line `Authorization: Bearer <token>`, \
             the token from `sweeper token --scope trigger:<policy>`); the token is neither in \
             this file nor in curl's arguments."
        ),
    );
    out.push_str("SWEEPER_TRIGGER_HEADER_FILE=/etc/sweeper/trigger-header\n");
    for job in jobs {
        out.push('\n');
        comment(
            &mut out,
            "",
            &format!("policy {}: {}.", job.name(), job.described()),
        );
        for note in &job.notes {
            comment(&mut out, "", note);
        }
        let _ = writeln!(out, "CRON_TZ={}", job.zone_name());
        let _ = writeln!(
            out,
            "{} curl --fail-with-body --silent --show-error --max-time 30 --retry 5 \
             --retry-connrefused --request POST --header \"@$SWEEPER_TRIGGER_HEADER_FILE\" {}",
            job.cron(),
            job.url
        );
    }
    out
}

fn systemd(jobs: &[Job], origin: &str) -> String {
    let mut out = String::new();
    comment(
        &mut out,
        "",
        &format!(
            "systemd units calling POST /trigger/<policy>: a .timer and a .service per policy, \
             each after its `# file:` line. {origin} Put them in /etc/systemd/system and run \
             `systemctl enable --now sweeper-trigger-<policy>.timer`. The service reads the \
             Authorization header from the credential file /etc/sweeper/trigger-header (mode \
             0600, one line `Authorization: Bearer <token>`, the token from `sweeper token --scope \
             trigger:<policy>`); the token is neither in the units nor in curl's arguments."
        ),
    );
    for job in jobs {
        let name = job.name();
        let _ = write!(
            out,
            "\n# file: sweeper-trigger-{name}.timer\n[Unit]\nDescription=Trigger sweeper policy \
             {name} ({})\n\n[Timer]\n",
            job.described()
        );
        for note in &job.notes {
            comment(&mut out, "", note);
        }
        comment(
            &mut out,
            "",
            "Persistent: after downtime the timer fires once at start; sweeper then takes the \
             latest tick at or before arrival.",
        );
        let _ = write!(
            out,
            "OnCalendar={} {}\nAccuracySec=1s\nPersistent=true\n\n[Install]\nWantedBy=timers.target\n",
            job.fields.systemd(),
            job.zone_name()
        );
        let _ = write!(
            out,
            "\n# file: sweeper-trigger-{name}.service\n[Unit]\nDescription=Trigger sweeper policy \
             {name}\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\n\
             Type=oneshot\nDynamicUser=yes\nLoadCredential=trigger-header:/etc/sweeper/trigger-header\n\
             ExecStart=/bin/sh -c 'exec curl --fail-with-body --silent --show-error --max-time 30 \
             --retry 5 --retry-connrefused --request POST --header \
             \"@$${{CREDENTIALS_DIRECTORY}}/trigger-header\" {}'\n",
            job.url
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(expr: &str) -> Fields {
        Fields::parse(expr).unwrap()
    }

    fn daylight(expr: &str, zone: &str) -> Daylight {
        let schedule = Schedule::new(expr, zone).unwrap();
        daylight_saving(&fields(expr), &schedule, zone.parse().unwrap())
    }

    /// sweeper's ticks (croner, through `Schedule`) from `from` (RFC 3339).
    fn ticks(expr: &str, from: &str, n: usize) -> Vec<String> {
        let s = Schedule::new(expr, "Europe/Berlin").unwrap();
        let mut t = crate::window::parse_rfc3339(from).unwrap();
        (0..n)
            .map(|_| {
                t = s.next_tick_after(t).unwrap();
                crate::window::format(t)
            })
            .collect()
    }

    /// croner, as sweeper's `Schedule` runs it: a single minute and hour moves a gap's tick to
    /// the gap's end and fires once in a fold; any other schedule skips the gap and fires on both
    /// passes of the fold. (Berlin, 2026-03-29: 02:00 CET is 03:00 CEST, at 01:00Z; 2026-10-25:
    /// 03:00 CEST is 02:00 CET, at 01:00Z.)
    #[test]
    fn sweepers_ticks_around_berlins_changes() {
        assert_eq!(
            ticks("30 2 * * *", "2026-03-28T12:00:00Z", 1),
            ["2026-03-29T01:00:00Z"]
        );
        assert_eq!(
            ticks("30 * * * *", "2026-03-29T00:00:00Z", 2),
            ["2026-03-29T00:30:00Z", "2026-03-29T01:30:00Z"]
        );
        assert_eq!(
            ticks("*/30 2 * * *", "2026-03-28T12:00:00Z", 1),
            ["2026-03-30T00:00:00Z"]
        );
        assert_eq!(
            ticks("30 2 * * *", "2026-10-24T12:00:00Z", 2),
            ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]
        );
        assert_eq!(
            ticks("30 * * * *", "2026-10-25T00:00:00Z", 2),
            ["2026-10-25T00:30:00Z", "2026-10-25T01:30:00Z"]
        );
        assert_eq!(
            ticks("*/30 2 * * *", "2026-10-24T12:00:00Z", 4),
            [
                "2026-10-25T00:00:00Z",
                "2026-10-25T00:30:00Z",
                "2026-10-25T01:00:00Z",
                "2026-10-25T01:30:00Z"
            ]
        );
    }

    #[test]
    fn gaps_and_folds_are_found_where_a_tick_falls_in_them() {
        // A single minute and hour: the gap's tick moves to 03:00, which no target fires at;
        // the fold's tick is on the first pass only.
        assert_eq!(
            daylight("30 2 * * *", "Europe/Berlin"),
            Daylight {
                gap: Some("2026-03-29 02:00-03:00".into()),
                fold: Some(("2026-10-25 02:00-03:00".into(), false)),
            }
        );
        // Hourly: croner skips the gap as the targets do, and ticks on both passes.
        assert_eq!(
            daylight("30 * * * *", "Europe/Berlin"),
            Daylight {
                gap: None,
                fold: Some(("2026-10-25 02:00-03:00".into(), true)),
            }
        );
        assert_eq!(
            daylight("*/30 2 * * *", "Europe/Berlin"),
            Daylight {
                gap: None,
                fold: Some(("2026-10-25 02:00-03:00".into(), true)),
            }
        );
        let none = Daylight {
            gap: None,
            fold: None,
        };
        // 03:00 is neither skipped nor repeated in Berlin.
        assert_eq!(daylight("0 3 * * *", "Europe/Berlin"), none);
        assert_eq!(daylight("30 2 * * *", "UTC"), none);
    }

    #[test]
    fn base_urls_are_checked() {
        assert_eq!(
            base_url("https://sweeper.example.com/").unwrap(),
            "https://sweeper.example.com"
        );
        assert!(base_url("http://sweeper:8080").is_ok());
        for bad in [
            "ftp://x",
            "https://x/?a=1",
            "https://u:p@x",
            "https://x/a%20b",
            "nope",
        ] {
            assert!(base_url(bad).is_err(), "{bad}");
        }
    }
}
