//! Retention policies: configuration, validation, versions, and the SQL they stand for.
//!
//! A [`Policy`] is parsed from configuration once; a `Policy` that exists is valid. The part that
//! decides eligibility and the action is its [`PolicySpec`]; the spec's hash is the policy
//! version (DESIGN §6). Specs are stored in `sweeper.policy_versions`, so a run can always be
//! executed under its pinned version, and the stricter rule wins when the configuration changes
//! mid-run (DESIGN §2.10, see [`RuleSet::effective`]).

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Postgres, QueryBuilder};

pub mod action;
pub mod check;

use crate::config::DurationSpec;
use crate::window::Schedule;

/// A policy's name: lowercase letters, digits, `-` and `_`, at most 63 characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PolicyName(String);

impl PolicyName {
    /// Validates `s`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let ok = !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            && s.as_bytes()[0].is_ascii_alphanumeric();
        if ok {
            Ok(Self(s.to_string()))
        } else {
            Err(format!(
                "name: `{s}` must be 1-63 characters of a-z, 0-9, `-` and `_`, starting with a letter or digit"
            ))
        }
    }
    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A SQL identifier from configuration, validated so it can be double-quoted safely.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Ident(String);

impl Ident {
    /// Accepts `[A-Za-z_][A-Za-z0-9_$]*`, at most 63 bytes (PostgreSQL's NAMEDATALEN - 1).
    pub fn parse(s: &str) -> Result<Self, String> {
        let ok = !s.is_empty()
            && s.len() <= 63
            && (s.as_bytes()[0].is_ascii_alphabetic() || s.as_bytes()[0] == b'_')
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'$');
        if ok {
            Ok(Self(s.to_string()))
        } else {
            Err(format!(
                "`{s}` is not a plain SQL identifier (letters, digits, `_`, `$`; at most 63)"
            ))
        }
    }
    /// The identifier double-quoted for SQL.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }
    /// The bare name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `schema.table`; the schema defaults to `public`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TableName {
    /// Schema name.
    pub schema: Ident,
    /// Table name.
    pub name: Ident,
}

impl TableName {
    /// Parses `table` or `schema.table`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (schema, name) = match s.split_once('.') {
            Some((schema, name)) => (schema, name),
            None => ("public", s),
        };
        Ok(Self {
            schema: Ident::parse(schema)?,
            name: Ident::parse(name)?,
        })
    }
    /// `"schema"."table"`.
    pub fn quoted(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.name.quoted())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema.as_str(), self.name.as_str())
    }
}

/// What a policy cleans: a table, its key column and the timestamp that ages its rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// The table.
    pub table: TableName,
    /// The key column: `bigint`, `integer`, `uuid` or `text`, unique (the primary key).
    pub key: Ident,
    /// The timestamp column: `timestamptz`, or `timestamp` with `timestamp_zone`.
    pub timestamp: Ident,
    /// The IANA zone a `timestamp without time zone` column is written in.
    pub timestamp_zone: Option<String>,
}

/// One exclusion: rows it matches are never acted on (DESIGN §2.3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exclusion {
    /// The reason recorded when it holds a row (defaults to the column name).
    pub name: String,
    /// The column it tests.
    pub column: Ident,
    /// The test.
    pub test: ExclusionTest,
}

/// An exclusion's test. Values are kept as text and cast to the column's type in SQL, always as
/// bound parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ExclusionTest {
    /// `column = value`; a NULL protects the row (reason `unknown:{column}`).
    Equals {
        /// The value, as text.
        value: String,
    },
    /// `column = ANY(values)`; a NULL protects the row (reason `unknown:{column}`).
    In {
        /// The values, as text.
        values: Vec<String>,
    },
    /// `column IS NULL`.
    IsNull,
    /// `column IS NOT NULL`.
    IsNotNull,
}

/// What happens to an eligible item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ActionSpec {
    /// Delete the row from the target table, in the command's transaction.
    DeleteRows,
    /// Call a dependency's HTTP API per item, then change the row (see [`crate::action`]).
    Http(Box<crate::policy::action::HttpAction>),
    /// Delete an object per item from an object store, then change the row.
    ObjectStore(crate::policy::action::ObjectStoreAction),
}

impl ActionSpec {
    /// The dependency an external action calls; `None` for `delete_rows`.
    pub fn dependency(&self) -> Option<&str> {
        match self {
            ActionSpec::DeleteRows => None,
            ActionSpec::Http(h) => Some(&h.dependency),
            ActionSpec::ObjectStore(o) => Some(&o.dependency),
        }
    }

    /// The item columns the action reads (templates, the object column, a stamped column).
    pub fn columns(&self) -> Vec<&Ident> {
        match self {
            ActionSpec::DeleteRows => vec![],
            ActionSpec::Http(h) => h.columns.iter().chain(h.then.column()).collect(),
            ActionSpec::ObjectStore(o) => {
                std::iter::once(&o.column).chain(o.then.column()).collect()
            }
        }
    }
}

/// The versioned part of a policy: everything that decides eligibility and the action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicySpec {
    /// What is cleaned.
    pub target: Target,
    /// `retain_for` in seconds.
    pub retain_for_seconds: i64,
    /// Exclusions, in configuration order (the first that matches names the reason).
    pub exclude: Vec<Exclusion>,
    /// The action.
    pub action: ActionSpec,
}

impl PolicySpec {
    /// The version: the first 16 hex digits of SHA-256 over the spec's canonical JSON.
    pub fn version(&self) -> String {
        let json = serde_json::to_vec(self).expect("a spec always serializes");
        hex::encode(&Sha256::digest(&json)[..8])
    }
}

/// How commands of a policy reach `/consume` (DESIGN §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    /// The built-in PostgreSQL queue.
    Builtin,
    /// Google Cloud Pub/Sub: published by the relay, pushed to `/consume`.
    Pubsub,
    /// Upstash QStash: published by the relay, delivered to `/consume` with a signature.
    Qstash,
}

impl Transport {
    /// The name stored on each command.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Builtin => "builtin",
            Transport::Pubsub => "pubsub",
            Transport::Qstash => "qstash",
        }
    }
}

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
    /// The kinds of TOML literal each exclusion's values were written as, in `spec.exclude`
    /// order (not part of the version: the values are compared as text cast to the column's
    /// type, and check-config refuses a boolean or number written for a text column, where the
    /// cast would silently change what matches).
    pub exclusion_literals: Vec<Vec<Literal>>,
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

/// A policy as written in the TOML file (`[[policy]]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// Name, used in URLs and run ids.
    pub name: String,
    /// `{ cron = "0 2 * * *", timezone = "Europe/Berlin" }`; the zone defaults to UTC.
    pub schedule: ScheduleConfig,
    /// Default `5m`; must be shorter than the schedule's period.
    #[serde(default)]
    pub early_tolerance: Option<DurationSpec>,
    /// `{ table = "support.tickets", key = "id", timestamp = "closed_at" }`.
    pub target: TargetConfig,
    /// How long a row is kept after its timestamp.
    pub retain_for: DurationSpec,
    /// Exclusions.
    #[serde(default)]
    pub exclude: Vec<ExclusionConfig>,
    /// Items per command, 1..=10000, default 250.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    /// `{ kind = "delete_rows" }` (the default).
    #[serde(default)]
    pub action: Option<ActionConfig>,
    /// `builtin` (the default) or `pubsub` (needs a `[pubsub]` section).
    #[serde(default)]
    pub transport: Option<String>,
    /// `{ max_attempts = 5, base = "1s", cap = "1h", max_age = "24h" }` (these are the defaults).
    #[serde(default)]
    pub retry: Option<RetryConfig>,
    /// Most commands of this policy executing at once across all replicas (default 4). More are
    /// snoozed (class `throttled`), which protects the production database from a burst.
    #[serde(default)]
    pub max_concurrent_commands: Option<u32>,
}

/// `retry = { ... }`: how failed commands are retried (DESIGN §2.7).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Attempts (claimed executions) before a transiently failing command is quarantined.
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Backoff scale: the n-th retry waits a uniformly random time in [0, min(cap, base·2^n)].
    #[serde(default)]
    pub base: Option<DurationSpec>,
    /// Largest backoff.
    #[serde(default)]
    pub cap: Option<DurationSpec>,
    /// Longest a command may stay unfinished from when it became due (snoozes count, suspended
    /// time does not) before it is quarantined.
    #[serde(default)]
    pub max_age: Option<DurationSpec>,
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

fn default_batch_size() -> usize {
    250
}

/// `schedule = { cron = ..., timezone = ... }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    /// 5-field cron expression.
    pub cron: String,
    /// IANA zone name, default `UTC`.
    #[serde(default = "default_zone")]
    pub timezone: String,
}

fn default_zone() -> String {
    "UTC".into()
}

/// `target = { ... }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// `table` or `schema.table`.
    pub table: String,
    /// Key column.
    pub key: String,
    /// Timestamp column.
    pub timestamp: String,
    /// Zone for a `timestamp without time zone` column.
    #[serde(default)]
    pub timestamp_zone: Option<String>,
}

/// One `exclude` entry: `column` plus exactly one of `equals`, `in`, `is_null`, `is_not_null`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExclusionConfig {
    /// Column tested.
    pub column: String,
    /// Reason recorded; defaults to the column name.
    #[serde(default)]
    pub name: Option<String>,
    /// Excluded when equal.
    #[serde(default)]
    pub equals: Option<Scalar>,
    /// Excluded when equal to one of these.
    #[serde(default, rename = "in")]
    pub in_: Option<Vec<Scalar>>,
    /// `is_null = true`: excluded when NULL.
    #[serde(default)]
    pub is_null: Option<bool>,
    /// `is_not_null = true`: excluded when not NULL.
    #[serde(default)]
    pub is_not_null: Option<bool>,
}

pub use action::ActionConfig;

impl Policy {
    /// Validates a configured policy; errors are `field: message` without the policy prefix.
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
        if c.retain_for.seconds() < 1 {
            errors.push("retain_for: must be at least 1s".into());
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
        let key = Ident::parse(&c.target.key)
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
        let mut exclusion_literals = Vec::new();
        for (i, e) in c.exclude.iter().enumerate() {
            match exclusion_from_config(e) {
                Ok(x) => {
                    exclude.push(x);
                    exclusion_literals.push(
                        e.equals
                            .iter()
                            .chain(e.in_.iter().flatten())
                            .map(Scalar::literal)
                            .collect(),
                    );
                }
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
        ) && (column == k || column == ts)
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
            let stamped = Exclusion {
                name: column.as_str().to_string(),
                column: column.clone(),
                test: ExclusionTest::IsNotNull,
            };
            if !exclude.contains(&stamped) {
                exclude.push(stamped);
            }
        }
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
            retain_for_seconds: c.retain_for.seconds(),
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
            exclusion_literals,
        })
    }

    /// The run's cutoff for `window`: `window − retain_for` (DESIGN §2.2).
    pub fn cutoff(&self, window: chrono::DateTime<chrono::Utc>) -> chrono::DateTime<chrono::Utc> {
        window - chrono::TimeDelta::seconds(self.spec.retain_for_seconds)
    }
}

fn exclusion_from_config(e: &ExclusionConfig) -> Result<Exclusion, String> {
    let column = Ident::parse(&e.column).map_err(|m| format!("column: {m}"))?;
    let mut tests = Vec::new();
    if let Some(v) = &e.equals {
        tests.push(ExclusionTest::Equals { value: v.to_text() });
    }
    if let Some(vs) = &e.in_ {
        if vs.is_empty() {
            return Err("in: give at least one value".into());
        }
        tests.push(ExclusionTest::In {
            values: vs.iter().map(Scalar::to_text).collect(),
        });
    }
    match e.is_null {
        Some(true) => tests.push(ExclusionTest::IsNull),
        Some(false) => return Err("is_null: write `is_null = true` or leave it out".into()),
        None => {}
    }
    match e.is_not_null {
        Some(true) => tests.push(ExclusionTest::IsNotNull),
        Some(false) => return Err("is_not_null: write `is_not_null = true` or leave it out".into()),
        None => {}
    }
    if tests.len() != 1 {
        return Err(format!(
            "give exactly one of equals, in, is_null, is_not_null (found {})",
            tests.len()
        ));
    }
    let name = e.name.clone().unwrap_or_else(|| e.column.clone());
    if name.is_empty() || name.len() > 100 || name.starts_with("unknown:") {
        return Err("name: 1-100 characters, not starting with `unknown:`".into());
    }
    Ok(Exclusion {
        name,
        column,
        test: tests.pop().unwrap(),
    })
}

/// Column facts read from the catalog, so configured values can be cast to each column's type.
#[derive(Debug, Clone)]
pub struct TableInfo {
    /// Column name → (`format_type` text, `typname`, is it NOT NULL).
    pub columns: HashMap<String, ColumnInfo>,
}

/// Column name → type (`format_type`, e.g. `boolean`) of a policy's table as this replica
/// checked it at start-up; rules built later hold the work when a column's type differs.
pub type CheckedTypes = HashMap<String, String>;

impl TableInfo {
    /// Every column's type, as [`CheckedTypes`].
    pub fn types(&self) -> CheckedTypes {
        self.columns
            .iter()
            .map(|(n, c)| (n.clone(), c.type_sql.clone()))
            .collect()
    }
}

/// One column.
#[derive(Debug, Clone)]
pub struct ColumnInfo {
    /// The type as SQL (e.g. `bigint`, `timestamp with time zone`, `character varying(20)`).
    pub type_sql: String,
    /// `pg_type.typname` (e.g. `int8`, `timestamptz`).
    pub type_name: String,
    /// Whether the column is declared NOT NULL.
    pub not_null: bool,
}

impl TableInfo {
    /// Reads `table`'s columns; `Ok(None)` when the table does not exist.
    pub async fn load(pool: &PgPool, table: &TableName) -> sqlx::Result<Option<TableInfo>> {
        let rows: Vec<(String, String, String, bool)> = sqlx::query_as(
            "select a.attname::text, format_type(a.atttypid, a.atttypmod), t.typname::text,
                    a.attnotnull
               from pg_attribute a join pg_type t on t.oid = a.atttypid
              where a.attrelid = to_regclass($1) and a.attnum > 0 and not a.attisdropped",
        )
        .bind(table.quoted())
        .fetch_all(pool)
        .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        Ok(Some(TableInfo {
            columns: rows
                .into_iter()
                .map(|(name, type_sql, type_name, not_null)| {
                    (
                        name,
                        ColumnInfo {
                            type_sql,
                            type_name,
                            not_null,
                        },
                    )
                })
                .collect(),
        }))
    }

    fn type_of(&self, column: &Ident) -> Result<&str, String> {
        self.columns
            .get(column.as_str())
            .map(|c| c.type_sql.as_str())
            .ok_or_else(|| format!("column `{}` does not exist", column.as_str()))
    }
}

/// The rules that decide eligibility at the moment of the effect: the target, the cutoff and
/// every exclusion, turned into SQL with bound parameters.
#[derive(Debug, Clone)]
pub struct RuleSet {
    /// The target (identical in the pinned and current versions, else the command is held).
    pub target: Target,
    /// The cutoff bound into every eligibility test.
    pub cutoff: chrono::DateTime<chrono::Utc>,
    /// All exclusions that apply.
    pub exclude: Vec<Exclusion>,
    /// The pinned action.
    pub action: ActionSpec,
    /// `(policy, run_id)`: hold items whose effect is open in another run of the policy.
    effects: Option<(String, String)>,
    key_type: String,
    column_types: HashMap<String, String>,
}

/// Why a rule set could not be built: the work waits (is *held*) until the database or the
/// policy is put right.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{detail}")]
pub struct Held {
    /// What holds it.
    pub kind: HoldKind,
    /// Why, for operators.
    pub detail: String,
}

pub use crate::retry::HoldKind;

impl Held {
    fn schema(detail: String) -> Self {
        Held {
            kind: HoldKind::Schema,
            detail,
        }
    }

    /// As a failure of class `held`.
    pub fn into_failure(self) -> crate::retry::Failure {
        crate::retry::Failure::held(self.kind, self.detail)
    }
}

impl RuleSet {
    /// The stricter of the pinned and the current version (DESIGN §2.10): exclusions are the
    /// union, the cutoff is the earlier of the run's and `window − current retain_for`. A current
    /// version that changes the target, timestamp or action holds the command.
    pub fn effective(
        pinned: &PolicySpec,
        current: Option<&PolicySpec>,
        run_cutoff: chrono::DateTime<chrono::Utc>,
        window: chrono::DateTime<chrono::Utc>,
        table: &TableInfo,
        checked: Option<&CheckedTypes>,
    ) -> Result<RuleSet, Held> {
        let mut exclude = pinned.exclude.clone();
        let mut cutoff = run_cutoff;
        if let Some(cur) = current {
            if cur.target != pinned.target || cur.action != pinned.action {
                return Err(Held {
                    kind: HoldKind::PolicyChanged,
                    detail: "the policy's current version changes its target, timestamp or \
                             action; an operator must decide what happens to this run"
                        .into(),
                });
            }
            for e in &cur.exclude {
                if !exclude.contains(e) {
                    exclude.push(e.clone());
                }
            }
            let current_cutoff = window - chrono::TimeDelta::seconds(cur.retain_for_seconds);
            cutoff = cutoff.min(current_cutoff);
        }
        // Every column the rules use must exist, with the type this replica checked the policy
        // against: a retyped column can change what a value matches (`'true'` cast to text
        // never equals `'t'`), so it holds the work instead of deleting under other rules.
        let type_of = |c: &Ident| -> Result<&str, Held> {
            let t = table.type_of(c).map_err(Held::schema)?;
            match checked.and_then(|m| m.get(c.as_str())) {
                Some(was) if was != t => Err(Held::schema(format!(
                    "column `{}` is {t} now; this replica checked the policy against {was}: \
                     restore the type, or check the policy (sweeper check-config) and restart \
                     the replicas to accept it",
                    c.as_str()
                ))),
                _ => Ok(t),
            }
        };
        let mut column_types = HashMap::new();
        let key_type = type_of(&pinned.target.key)?.to_string();
        type_of(&pinned.target.timestamp)?;
        for e in &exclude {
            let t = type_of(&e.column)?;
            column_types.insert(e.column.as_str().to_string(), t.to_string());
        }
        for c in pinned.action.columns() {
            type_of(c)?;
        }
        Ok(RuleSet {
            target: pinned.target.clone(),
            cutoff,
            exclude,
            action: pinned.action.clone(),
            effects: None,
            key_type,
            column_types,
        })
    }

    /// For an action with external calls: also hold every item whose effect is open in another
    /// run of `policy` (reason `effect_open`, DESIGN §2.4). Planning and execution both apply it.
    pub fn with_effects(mut self, policy: &str, run_id: &str) -> Self {
        if self.action.dependency().is_some() {
            self.effects = Some((policy.to_string(), run_id.to_string()));
        }
        self
    }

    /// `"schema"."table"`.
    pub fn table_sql(&self) -> String {
        self.target.table.quoted()
    }

    /// The key column, quoted.
    pub fn key_sql(&self) -> String {
        self.target.key.quoted()
    }

    /// The key column's SQL type (`bigint`, `uuid`, ...).
    pub fn key_type(&self) -> &str {
        &self.key_type
    }

    /// Pushes the timestamp expression as a `timestamptz`.
    pub fn push_timestamp(&self, q: &mut QueryBuilder<'_, Postgres>) {
        match &self.target.timestamp_zone {
            // The zone name was validated against the IANA database: safe as a literal.
            Some(zone) => {
                q.push(format!(
                    "({} at time zone '{}')",
                    self.target.timestamp.quoted(),
                    zone
                ));
            }
            None => {
                q.push(self.target.timestamp.quoted());
            }
        }
    }

    /// Pushes `(ts < $cutoff)`: strict, and false for a NULL timestamp.
    pub fn push_old_enough(&self, q: &mut QueryBuilder<'_, Postgres>) {
        q.push("coalesce(");
        self.push_timestamp(q);
        q.push(" < ");
        q.push_bind(self.cutoff);
        q.push(", false)");
    }

    /// Pushes a `CASE` giving the first matching exclusion's reason, or NULL when none holds the
    /// row. A NULL in a value-tested column protects the row as `unknown:{column}` (DESIGN §2.3).
    pub fn push_excluded_reason(&self, q: &mut QueryBuilder<'_, Postgres>) {
        if self.exclude.is_empty() && self.effects.is_none() {
            q.push("null::text");
            return;
        }
        q.push("(case");
        if let Some((policy, run_id)) = &self.effects {
            // Qualified by the table's full name: an effects column could share the key's name.
            q.push(" when exists (select 1 from sweeper.effects e where e.policy = ");
            q.push_bind(policy.clone());
            q.push(format!(
                " and e.item_key = ({}.{})::text and e.state <> 'closed' and e.run_id <> ",
                self.table_sql(),
                self.key_sql()
            ));
            q.push_bind(run_id.clone());
            q.push(") then 'effect_open'");
        }
        for e in &self.exclude {
            let col = e.column.quoted();
            let ty = &self.column_types[e.column.as_str()];
            match &e.test {
                ExclusionTest::Equals { value } => {
                    q.push(format!(" when {col} is null then "));
                    q.push_bind(format!("unknown:{}", e.column.as_str()));
                    q.push(format!(" when {col} = cast("));
                    q.push_bind(value.clone());
                    q.push(format!(" as {ty}) then "));
                    q.push_bind(e.name.clone());
                }
                ExclusionTest::In { values } => {
                    q.push(format!(" when {col} is null then "));
                    q.push_bind(format!("unknown:{}", e.column.as_str()));
                    q.push(format!(" when {col} = any(cast("));
                    q.push_bind(values.clone());
                    q.push(format!(" as {ty}[])) then "));
                    q.push_bind(e.name.clone());
                }
                ExclusionTest::IsNull => {
                    q.push(format!(" when {col} is null then "));
                    q.push_bind(e.name.clone());
                }
                ExclusionTest::IsNotNull => {
                    q.push(format!(" when {col} is not null then "));
                    q.push_bind(e.name.clone());
                }
            }
        }
        q.push(" end)");
    }

    /// Starts the classifying scan used by planning and by execution:
    /// `select key as sort_key, key::text as item_key, <old enough> as old_enough,
    /// <timestamp> is null as null_timestamp, <first exclusion> as reason from <table>`; the
    /// caller adds its `where`.
    pub fn classify_select(&self) -> QueryBuilder<'static, Postgres> {
        let mut q = QueryBuilder::new("");
        self.push_classify_select(&mut q);
        q
    }

    /// Pushes [`RuleSet::classify_select`]'s text onto `q` (to nest it in a larger query).
    pub fn push_classify_select(&self, q: &mut QueryBuilder<'_, Postgres>) {
        q.push("select ");
        q.push(self.key_sql());
        q.push(" as sort_key, ");
        q.push(self.key_sql());
        q.push("::text as item_key, ");
        self.push_old_enough(q);
        q.push(" as old_enough, ");
        self.push_timestamp(q);
        q.push(" is null as null_timestamp, ");
        self.push_excluded_reason(q);
        q.push(" as reason from ");
        q.push(self.table_sql());
    }

    /// Pushes the full eligibility predicate: old enough and held by no exclusion.
    pub fn push_eligible(&self, q: &mut QueryBuilder<'_, Postgres>) {
        q.push("(");
        self.push_old_enough(q);
        q.push(" and ");
        self.push_excluded_reason(q);
        q.push(" is null)");
    }

    /// Pushes `key is not null`: a row without a key cannot be named by a command (it is counted
    /// as held `null_key` instead).
    pub fn push_has_key(&self, q: &mut QueryBuilder<'_, Postgres>) {
        q.push(format!("{} is not null", self.key_sql()));
    }

    /// Pushes `key = any(cast($keys as keytype[]))`.
    pub fn push_key_in(&self, q: &mut QueryBuilder<'_, Postgres>, keys: Vec<String>) {
        q.push(format!("{} = any(cast(", self.key_sql()));
        q.push_bind(keys);
        q.push(format!(" as {}[]))", self.key_type));
    }
}

impl crate::ledger::effects::ItemQuery for RuleSet {
    /// The item's row judged by these rules, for opening its effect: old enough, the first
    /// exclusion that holds it, its columns as JSON and a digest of the row.
    fn push_item(&self, q: &mut QueryBuilder<'_, Postgres>, key: &str) {
        let table = self.table_sql();
        q.push("select ");
        self.push_old_enough(q);
        q.push(" as old_enough, ");
        self.push_excluded_reason(q);
        q.push(format!(
            " as reason, to_jsonb({table}.*) as fields, md5({table}.*::text) as row_digest \
             from {table} where {} = cast(",
            self.key_sql()
        ));
        q.push_bind(key.to_string());
        q.push(format!(" as {})", self.key_type()));
    }
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
        assert_eq!(
            d.spec.exclude[0].test,
            ExclusionTest::Equals {
                value: "true".into()
            }
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

/// Longest a cached view of a table's columns is used before the catalog is read again, so a
/// schema change that raised no error (a column retyped, or restored) is seen within this.
pub const CATALOG_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(60);

/// A per-process cache of [`TableInfo`], filled on first use of each table, read again after
/// [`CATALOG_MAX_AGE`] or when work on the table is held for its schema.
#[derive(Debug, Default)]
pub struct Catalog {
    tables: std::sync::Mutex<HashMap<TableName, (std::time::Instant, std::sync::Arc<TableInfo>)>>,
}

impl Catalog {
    /// The columns of `table`; a missing table holds the work (class `held`).
    pub async fn get(
        &self,
        pool: &PgPool,
        table: &TableName,
    ) -> Result<std::sync::Arc<TableInfo>, crate::retry::Failure> {
        if let Some((at, t)) = self.tables.lock().expect("catalog lock").get(table)
            && at.elapsed() < CATALOG_MAX_AGE
        {
            return Ok(t.clone());
        }
        let info = TableInfo::load(pool, table)
            .await
            .map_err(|e| crate::retry::Failure::from_db(&e))?
            .ok_or_else(|| {
                crate::retry::Failure::held(
                    HoldKind::Schema,
                    format!("table {table} does not exist"),
                )
            })?;
        let info = std::sync::Arc::new(info);
        self.tables
            .lock()
            .expect("catalog lock")
            .insert(table.clone(), (std::time::Instant::now(), info.clone()));
        Ok(info)
    }

    /// Forgets `table`, so its next use reads the catalog again (after a schema error).
    pub fn forget(&self, table: &TableName) {
        self.tables.lock().expect("catalog lock").remove(table);
    }
}
