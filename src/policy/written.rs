//! Policies as written in the TOML file (`[[policy]]` and its inline tables): plain data that
//! serde reads with `deny_unknown_fields`; [`super::Policy::from_config`] validates it into a
//! [`super::Policy`].

use super::*;

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
    /// How long a row is kept after its timestamp (a retention policy; a selection policy has
    /// none).
    #[serde(default)]
    pub retain_for: Option<DurationSpec>,
    /// Predicates that select rows instead of a retention cutoff (a selection policy, see
    /// [`super::select`]).
    #[serde(default)]
    pub select: Vec<super::select::SelectionConfig>,
    /// A selection policy may use `delete_rows` only with `allow_delete = true`.
    #[serde(default)]
    pub allow_delete: bool,
    /// Policies whose run of the same window must complete first (see [`super::stages`]).
    #[serde(default)]
    pub after: Vec<String>,
    /// An upstream run `completed_with_dead_letters` releases this one too (default false).
    #[serde(default)]
    pub after_allows_dead_letters: bool,
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
    /// `{ from = "01:00", to = "05:00", timezone = "Europe/Berlin" }`: commands are claimed only
    /// inside these hours (default: any hour).
    #[serde(default)]
    pub active: Option<super::safety::ActiveHoursConfig>,
    /// Most items a second this policy's commands start, across every replica (default: no
    /// pace). `batch_size` may not exceed it (the burst is one second's budget).
    #[serde(default)]
    pub max_items_per_second: Option<u32>,
    /// The blast-radius guard (default: none).
    #[serde(default)]
    pub guard: Option<super::safety::GuardConfig>,
    /// Governor marks overriding `[governor]`'s for this policy.
    #[serde(default)]
    pub governor: Option<crate::governor::MarksConfig>,
    /// How a partitioned target's expired partitions go: `"rows"` (default: row by row, like any
    /// table) or `"drop"` (the partition sweep: a partition whose whole range is expired and
    /// whose rows are all eligible is exported, recorded and dropped).
    #[serde(default)]
    pub partitions: super::partitions::Retirement,
    /// With `partitions = "drop"`: drop partitions of a table in a publication although logical
    /// subscribers keep their rows (a detach or a drop is not replicated).
    #[serde(default)]
    pub allow_unreplicated_drop: bool,
    /// With `partitions = "drop"`: how long a retired partition stays detached, its evidence
    /// recorded, before it is dropped (default `"0s"`: dropped at once). Attaching it again
    /// meanwhile keeps it.
    #[serde(default)]
    pub drop_grace: Option<crate::config::DurationSpec>,
}

/// `retry = { ... }`: how failed commands are retried (docs/design.md §2.7).
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
    /// Key: a column, or an array of 2–4 columns.
    pub key: KeyConfig,
    /// Timestamp column.
    pub timestamp: String,
    /// Zone for a `timestamp without time zone` column.
    #[serde(default)]
    pub timestamp_zone: Option<String>,
}

/// One `exclude` entry: `column` plus exactly one of `equals`, `in`, `is_null`, `is_not_null`;
/// or `exists`, rows of another table that hold the row (see [`super::related`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExclusionConfig {
    /// Column tested.
    #[serde(default)]
    pub column: Option<String>,
    /// Reason recorded; defaults to the column name (or the related table's name).
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
    /// Excluded while a related row of another table matches.
    #[serde(default)]
    pub exists: Option<super::related::RelatedConfig>,
}
