//! Retention policies: configuration, validation, versions, and the SQL they stand for.
//!
//! A [`Policy`] is parsed from configuration once; a `Policy` that exists is valid. The part that
//! decides eligibility and the action is its [`PolicySpec`]; the spec's hash is the policy
//! version (docs/design.md §6). Specs are stored in `sweeper.policy_versions`, so a run can always be
//! executed under its pinned version, and the stricter rule wins when the configuration changes
//! mid-run (docs/design.md §2.10, see [`RuleSet::effective`]).

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Postgres, QueryBuilder};

pub mod action;
mod catalog;
pub mod check;
mod key;
mod name;
pub mod partitions;
pub mod path;
pub mod references;
pub mod related;
mod rules;
pub mod safety;
pub mod select;
mod spec;
pub mod stages;
mod template;
mod written;

pub use catalog::*;
pub use key::*;
pub use name::*;
pub use rules::*;
pub use spec::*;
pub use written::*;

use crate::config::DurationSpec;
use crate::window::Schedule;

/// A validated policy.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Its name.
    pub name: PolicyName,
    /// The schedule whose ticks are its windows.
    pub schedule: Schedule,
    /// How early before a tick a trigger may arrive and still create that tick's run.
    pub early_tolerance: DurationSpec,
    /// Items per command.
    pub batch_size: usize,
    /// The transport of its commands.
    pub transport: Transport,
    /// The versioned rules.
    pub spec: PolicySpec,
    /// `spec.version()`, computed once.
    pub version: String,
    /// Retry settings.
    pub retry: RetryPolicy,
    /// Cap on commands executing at once, across replicas.
    pub max_concurrent_commands: u32,
    /// The kinds of TOML literal each value test's values were written as, by the path
    /// check-config names the test by (not part of the version: the values are compared as text
    /// cast to the column's type, and check-config refuses a boolean or number written for a
    /// text column, where the cast would silently change what matches).
    pub literals: related::Literals,
    /// When its work may run (not part of the version).
    pub safety: Safety,
    /// Policies whose run of the same window must complete before this one's executes
    /// ([`stages`]; not part of the version).
    pub after: Vec<String>,
    /// Whether an upstream run `completed_with_dead_letters` releases it.
    pub after_allows_dead_letters: bool,
    /// How its target's expired partitions go (not part of the version: which rows are removed
    /// does not change, only how).
    pub partitions: partitions::Retirement,
    /// Whether a drop may go ahead on a table in a publication.
    pub allow_unreplicated_drop: bool,
    /// How long a retired partition stays detached before its drop, in seconds (0: dropped at
    /// once; not part of the version).
    pub drop_grace_seconds: i64,
}

/// A policy's production-safety controls (docs/design.md §14 "Holds"), validated.
#[derive(Debug, Clone, Default)]
pub struct Safety {
    /// Active hours; `None`: any hour.
    pub active: Option<safety::ActiveHours>,
    /// Items per second across replicas; `None`: no pace.
    pub max_items_per_second: Option<u32>,
    /// The blast-radius guard; `None`: none.
    pub guard: Option<safety::BlastGuard>,
    /// Governor marks with `[governor]`'s and this policy's overrides applied (set when the
    /// whole configuration is validated).
    pub governor: crate::governor::Marks,
    /// The overrides as written.
    pub governor_overrides: crate::governor::MarksConfig,
}

/// How an exclusion value was written in TOML.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Literal {
    /// `true` / `false`.
    Bool,
    /// An integer or a float.
    Number,
    /// A string.
    Text,
}

/// A scalar value in TOML (`equals = true`, `in = ["open", "pending_export"]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Scalar {
    /// `true` / `false`.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Text(String),
}

impl Scalar {
    fn literal(&self) -> Literal {
        match self {
            Scalar::Bool(_) => Literal::Bool,
            Scalar::Int(_) | Scalar::Float(_) => Literal::Number,
            Scalar::Text(_) => Literal::Text,
        }
    }

    fn to_text(&self) -> String {
        match self {
            Scalar::Bool(b) => b.to_string(),
            Scalar::Int(i) => i.to_string(),
            Scalar::Float(f) => f.to_string(),
            Scalar::Text(s) => s.clone(),
        }
    }
}

/// A policy's validated retry settings.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RetryPolicy {
    /// Attempts before quarantine.
    pub max_attempts: u32,
    /// Backoff scale.
    pub base: DurationSpec,
    /// Largest backoff.
    pub cap: DurationSpec,
    /// Age budget.
    pub max_age: DurationSpec,
}

impl Default for RetryPolicy {
    /// 5 attempts, base 1 s, cap 1 h, max age 24 h.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base: DurationSpec::from_seconds(1),
            cap: DurationSpec::from_seconds(3_600),
            max_age: DurationSpec::from_seconds(86_400),
        }
    }
}

impl RetryPolicy {
    /// The budget these settings give a command.
    pub fn budget(&self) -> crate::retry::Budget {
        crate::retry::Budget {
            max_attempts: self.max_attempts,
            max_age_seconds: self.max_age.seconds(),
            backoff: self.backoff(),
        }
    }

    /// The backoff these settings describe.
    pub fn backoff(&self) -> crate::retry::Backoff {
        crate::retry::Backoff {
            base_seconds: self.base.seconds() as f64,
            cap_seconds: self.cap.seconds() as f64,
        }
    }
}

pub use action::ActionConfig;

/// `c`'s safety controls, each problem pushed onto `errors` with its field: a `batch_size` over
/// the pace's burst is refused (a command could never fit in its budget).
fn safety_from_config(c: &PolicyConfig, errors: &mut Vec<String>) -> Safety {
    let active = c.active.as_ref().and_then(|a| {
        safety::ActiveHours::from_config(a)
            .map_err(|es| errors.extend(es))
            .ok()
    });
    let guard = c.guard.as_ref().and_then(|g| {
        safety::BlastGuard::from_config(g)
            .map_err(|es| errors.extend(es))
            .ok()
    });
    if let Some(rate) = c.max_items_per_second {
        if !(1..=1_000_000).contains(&rate) {
            errors.push(format!(
                "max_items_per_second: {rate} is outside 1..=1000000"
            ));
        } else if c.batch_size as u64 > u64::from(safety::pace_burst(rate)) {
            errors.push(format!(
                "batch_size: {} is over the pace's burst of {} items (10 % of ten seconds' \
                 budget at max_items_per_second {rate}); lower batch_size or raise the pace",
                c.batch_size,
                safety::pace_burst(rate)
            ));
        }
    }
    Safety {
        active,
        max_items_per_second: c.max_items_per_second,
        guard,
        governor: crate::governor::Marks::default(),
        governor_overrides: c.governor.clone().unwrap_or_default(),
    }
}

impl Policy {
    /// Validates a configured policy; errors are `field: message` without the policy prefix.
    // Over 80 lines: validation field by field, collecting every error in one pass so check-config
    // names them all.
    pub fn from_config(c: PolicyConfig) -> Result<Policy, Vec<String>> {
        let mut errors = Vec::new();
        let name = PolicyName::parse(&c.name).map_err(|e| errors.push(e)).ok();
        let schedule = Schedule::new(&c.schedule.cron, &c.schedule.timezone)
            .map_err(|e| errors.push(format!("schedule.{e}")))
            .ok();
        let early_tolerance = c.early_tolerance.unwrap_or(DurationSpec::from_seconds(300));
        if let Some(s) = &schedule {
            let period = s.shortest_period_seconds();
            if early_tolerance.seconds() >= period {
                errors.push(format!(
                    "early_tolerance: {early_tolerance} is not shorter than the schedule's period ({}s); \
                     a trigger could not tell two windows apart",
                    period
                ));
            }
        }
        if !(1..=10_000).contains(&c.batch_size) {
            errors.push(format!("batch_size: {} is outside 1..=10000", c.batch_size));
        }
        let table = TableName::parse(&c.target.table)
            .map_err(|e| errors.push(format!("target.table: {e}")))
            .ok()
            .filter(|t| {
                let ledger = t.schema.as_str().eq_ignore_ascii_case("sweeper");
                if ledger {
                    errors.push(format!(
                        "target.table: {t} is in schema sweeper, the ledger's own; a policy cannot clean it"
                    ));
                }
                !ledger
            });
        let key = KeyColumns::parse(&c.target.key)
            .map_err(|e| errors.push(format!("target.key: {e}")))
            .ok();
        let timestamp = Ident::parse(&c.target.timestamp)
            .map_err(|e| errors.push(format!("target.timestamp: {e}")))
            .ok();
        if let Some(z) = &c.target.timestamp_zone
            && z.parse::<chrono_tz::Tz>().is_err()
        {
            errors.push(format!(
                "target.timestamp_zone: `{z}` is not an IANA time zone name"
            ));
        }
        let action = match &c.action {
            None => Some(ActionSpec::DeleteRows),
            Some(a) => crate::policy::action::from_config(a)
                .map_err(|es| errors.extend(es.into_iter().map(|e| format!("action.{e}"))))
                .ok(),
        };
        if c.partitions == partitions::Retirement::Drop
            && !matches!(action, None | Some(ActionSpec::DeleteRows))
        {
            errors.push(
                "partitions: \"drop\" removes rows without calling anything; it needs the \
                 default action (delete the rows)"
                    .into(),
            );
        }
        if c.allow_unreplicated_drop && c.partitions != partitions::Retirement::Drop {
            errors.push(
                "allow_unreplicated_drop: only means something with partitions = \"drop\"".into(),
            );
        }
        if c.drop_grace.is_some() && c.partitions != partitions::Retirement::Drop {
            errors.push("drop_grace: only means something with partitions = \"drop\"".into());
        }
        let transport = match c.transport.as_deref() {
            None | Some("builtin") => Transport::Builtin,
            Some("pubsub") => Transport::Pubsub,
            Some("qstash") => Transport::Qstash,
            Some(other) => {
                errors.push(format!(
                    "transport: `{other}` is not supported (supported: builtin, pubsub, qstash)"
                ));
                Transport::Builtin
            }
        };
        let defaults = RetryPolicy::default();
        let r = c.retry.clone().unwrap_or(RetryConfig {
            max_attempts: None,
            base: None,
            cap: None,
            max_age: None,
        });
        let retry = RetryPolicy {
            max_attempts: r.max_attempts.unwrap_or(defaults.max_attempts),
            base: r.base.unwrap_or(defaults.base),
            cap: r.cap.unwrap_or(defaults.cap),
            max_age: r.max_age.unwrap_or(defaults.max_age),
        };
        if !(1..=100).contains(&retry.max_attempts) {
            errors.push("retry.max_attempts: must be between 1 and 100".into());
        }
        if retry.base.seconds() < 1 || retry.base > retry.cap {
            errors.push(format!(
                "retry.base ({}) must be at least 1s and not longer than retry.cap ({})",
                retry.base, retry.cap
            ));
        }
        if retry.max_age.seconds() < 60 {
            errors.push("retry.max_age: must be at least 1m".into());
        }
        let max_concurrent_commands = c.max_concurrent_commands.unwrap_or(4);
        if !(1..=1_000).contains(&max_concurrent_commands) {
            errors.push("max_concurrent_commands: must be between 1 and 1000".into());
        }
        let mut exclude = Vec::new();
        let mut literals = related::Literals::new();
        for (i, e) in c.exclude.iter().enumerate() {
            match exclusion_from_config(e, &format!("exclude[{i}]"), &mut literals) {
                Ok(x) => exclude.push(x),
                Err(msg) => errors.push(format!("exclude[{i}]: {msg}")),
            }
        }
        if let (Some(column), Some(k), Some(ts)) = (
            action.as_ref().and_then(|a| match a {
                ActionSpec::Http(h) => h.then.column(),
                ActionSpec::ObjectStore(o) => o.then.column(),
                ActionSpec::DeleteRows => None,
            }),
            &key,
            &timestamp,
        ) && (k.contains(column) || column == ts)
        {
            errors.push(format!(
                "action.then.set: `{}` is the target's key or timestamp; stamp a column of its own",
                column.as_str()
            ));
        }
        // `then = { set = "reconciled_at" }`: a stamped row is never selected again.
        if let Some(column) = action.as_ref().and_then(|a| match a {
            ActionSpec::Http(h) => h.then.column(),
            ActionSpec::ObjectStore(o) => o.then.column(),
            ActionSpec::DeleteRows => None,
        }) {
            let stamped = Exclusion::column(
                column.as_str().to_string(),
                column.clone(),
                ExclusionTest::IsNotNull,
            );
            if !exclude.contains(&stamped) {
                exclude.push(stamped);
            }
        }
        let (select, retain_for_seconds) = select::selection_from_config(
            &c,
            matches!(action, Some(ActionSpec::DeleteRows)),
            &mut errors,
            &mut literals,
        );
        let safety = safety_from_config(&c, &mut errors);
        if !errors.is_empty() {
            return Err(errors);
        }
        let spec = PolicySpec {
            target: Target {
                table: table.unwrap(),
                key: key.unwrap(),
                timestamp: timestamp.unwrap(),
                timestamp_zone: c.target.timestamp_zone,
            },
            retain_for_seconds,
            select,
            exclude,
            action: action.unwrap(),
        };
        let version = spec.version();
        Ok(Policy {
            name: name.unwrap(),
            schedule: schedule.unwrap(),
            early_tolerance,
            batch_size: c.batch_size,
            transport,
            spec,
            version,
            retry,
            max_concurrent_commands,
            literals,
            safety,
            after: c.after,
            after_allows_dead_letters: c.after_allows_dead_letters,
            partitions: c.partitions,
            allow_unreplicated_drop: c.allow_unreplicated_drop,
            drop_grace_seconds: c.drop_grace.map_or(0, |d| d.seconds()),
        })
    }

    /// The latest tick a trigger arriving at `arrival` may create (the early tolerance counts);
    /// `window` when the schedule has none.
    pub fn latest_tick(
        &self,
        window: chrono::DateTime<chrono::Utc>,
        arrival: chrono::DateTime<chrono::Utc>,
    ) -> chrono::DateTime<chrono::Utc> {
        self.schedule
            .latest_tick_at_or_before(arrival + self.early_tolerance.delta())
            .unwrap_or(window)
    }

    /// Whether a run of `window` created at `arrival` is a backfill: its window is older than the
    /// latest tick minus the early tolerance (creating it needs `ops:write`; its metrics are kept
    /// apart from live runs').
    pub fn is_backfill(
        &self,
        window: chrono::DateTime<chrono::Utc>,
        arrival: chrono::DateTime<chrono::Utc>,
    ) -> bool {
        window < self.latest_tick(window, arrival) - self.early_tolerance.delta()
    }

    /// The run's cutoff for `window`: `window − retain_for` (docs/design.md §2.2); the window itself for a
    /// selection policy.
    pub fn cutoff(&self, window: chrono::DateTime<chrono::Utc>) -> chrono::DateTime<chrono::Utc> {
        window - chrono::TimeDelta::seconds(self.spec.retain_for_seconds)
    }
}

fn exclusion_from_config(
    e: &ExclusionConfig,
    path: &str,
    literals: &mut related::Literals,
) -> Result<Exclusion, String> {
    let tested =
        e.equals.is_some() || e.in_.is_some() || e.is_null.is_some() || e.is_not_null.is_some();
    let (rule, default_name) = match (&e.column, &e.exists) {
        (Some(_), Some(_)) => {
            return Err("give either `column` with its test or `exists`, not both".into());
        }
        (None, Some(_)) if tested => {
            return Err(
                "`exists` takes its tests in its own `where`; equals, in, is_null and \
                 is_not_null beside it test a column of the target row"
                    .into(),
            );
        }
        (None, Some(r)) => {
            let exists = related::Related::from_config(r, &format!("{path}.exists"), literals)
                .map_err(|m| format!("exists.{m}"))?;
            let name = exists.table.to_string();
            (ExclusionRule::Related { exists }, name)
        }
        (Some(column), None) => {
            let parsed = Ident::parse(column).map_err(|m| format!("column: {m}"))?;
            let (test, kinds) = related::value_test(&e.equals, &e.in_, e.is_null, e.is_not_null)?;
            literals.insert(path.to_string(), kinds);
            (
                ExclusionRule::Column(ColumnTest {
                    column: parsed,
                    test,
                }),
                column.clone(),
            )
        }
        (None, None) => {
            return Err(
                "give `column` with one of equals, in, is_null, is_not_null; or `exists = { \
                 table, on, where }` for a hold kept in another table"
                    .into(),
            );
        }
    };
    let name = e.name.clone().unwrap_or(default_name);
    if name.is_empty() || name.len() > 100 || name.starts_with("unknown:") {
        return Err("name: 1-100 characters, not starting with `unknown:`".into());
    }
    Ok(Exclusion { name, rule })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> PolicyConfig {
        let text = format!(
            "name = 'p'\nschedule = {{ cron = '0 2 * * *' }}\nretain_for = '90d'\n\
             target = {{ table = 'demo.tickets', key = 'id', timestamp = 'closed_at' }}\n{extra}"
        );
        let c = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Toml))
            .build()
            .unwrap();
        c.try_deserialize().unwrap()
    }

    #[test]
    fn version_ignores_schedule_and_batch_size_but_not_exclusions() {
        let a = Policy::from_config(cfg("")).unwrap();
        let mut c = cfg("batch_size = 10");
        c.schedule.cron = "0 3 * * *".into();
        let b = Policy::from_config(c).unwrap();
        assert_eq!(a.version, b.version);
        let d = Policy::from_config(cfg("exclude = [{ column = 'legal_hold', equals = true }]"))
            .unwrap();
        assert_ne!(a.version, d.version);
        assert_eq!(d.spec.exclude[0].name, "legal_hold");
        // An own-column exclusion keeps the JSON (and so the version) it had before related
        // rows existed.
        assert_eq!(
            serde_json::to_string(&d.spec.exclude[0]).unwrap(),
            r#"{"name":"legal_hold","column":"legal_hold","test":{"op":"equals","value":"true"}}"#
        );
    }

    #[test]
    fn bad_policies_name_the_field() {
        let errs = Policy::from_config(cfg(
            "exclude = [{ column = 'x', equals = 1, is_null = true }]\nbatch_size = 0\nearly_tolerance = '2d'",
        ))
        .unwrap_err();
        let all = errs.join("\n");
        assert!(all.contains("exclude[0]: give exactly one"), "{all}");
        assert!(all.contains("batch_size"), "{all}");
        assert!(all.contains("early_tolerance"), "{all}");
        let mut c = cfg("");
        c.target.table = "sweeper.runs".into();
        assert!(Policy::from_config(c).unwrap_err()[0].contains("ledger"));
        let mut c = cfg("");
        c.target.table = "demo.tick\"ets".into();
        assert!(Policy::from_config(c).unwrap_err()[0].starts_with("target.table"));
    }
}
