//! A policy's spec: the part that decides eligibility and the action, whose hash is the
//! policy version (docs/design.md §6), and the transport of its commands.

use super::*;

/// What a policy cleans: a table, its key and the timestamp that ages its rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// The table.
    pub table: TableName,
    /// The key: one column, or 2–4 that together are exactly a primary key or a unique index
    /// (see [`crate::policy::Key`] for the types and the item key text).
    pub key: KeyColumns,
    /// The timestamp column: `timestamptz`, or `timestamp` with `timestamp_zone`.
    pub timestamp: Ident,
    /// The IANA zone a `timestamp without time zone` column is written in.
    pub timestamp_zone: Option<String>,
}

/// One exclusion: rows it matches are never acted on (docs/design.md §2.3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exclusion {
    /// The reason recorded when it holds a row (defaults to the column name, or to the related
    /// table's name).
    pub name: String,
    /// What it tests: one of the row's own columns, or rows of another table. Flattened, so an
    /// own-column exclusion keeps the JSON (and the policy version) it always had.
    #[serde(flatten)]
    pub rule: ExclusionRule,
}

/// What an exclusion tests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ExclusionRule {
    /// A column of the target row (`column = "legal_hold", equals = true`).
    Column(ColumnTest),
    /// Rows of another table related to the target row (`exists = { table, on, where }`): the
    /// row is held while one matches (see [`crate::policy::related`]).
    Related {
        /// The related rows.
        exists: super::related::Related,
    },
}

/// A value test on one column: an own-column exclusion, or one `where` entry of related rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnTest {
    /// The column it tests.
    pub column: Ident,
    /// The test.
    pub test: ExclusionTest,
}

impl Exclusion {
    /// An exclusion on the target row's own `column`.
    pub fn column(name: String, column: Ident, test: ExclusionTest) -> Self {
        Exclusion {
            name,
            rule: ExclusionRule::Column(ColumnTest { column, test }),
        }
    }
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

impl ExclusionTest {
    /// Whether it compares values (`equals`, `in`): its column being NULL leaves it unknown.
    pub fn compares_values(&self) -> bool {
        matches!(
            self,
            ExclusionTest::Equals { .. } | ExclusionTest::In { .. }
        )
    }

    /// The values it compares, as text.
    pub fn values(&self) -> Vec<String> {
        match self {
            ExclusionTest::Equals { value } => vec![value.clone()],
            ExclusionTest::In { values } => values.clone(),
            ExclusionTest::IsNull | ExclusionTest::IsNotNull => vec![],
        }
    }

    /// Pushes the bare test on `col` (a column as SQL), values cast to `ty`: NULL when a
    /// compared column is NULL, for the caller to decide which side that falls on.
    pub fn push(&self, q: &mut QueryBuilder<'_, Postgres>, col: &str, ty: &str) {
        match self {
            ExclusionTest::Equals { value } => {
                q.push(format!("{col} = cast("));
                q.push_bind(value.clone());
                q.push(format!(" as {ty})"));
            }
            ExclusionTest::In { values } => {
                q.push(format!("{col} = any(cast("));
                q.push_bind(values.clone());
                q.push(format!(" as {ty}[]))"));
            }
            ExclusionTest::IsNull => {
                q.push(format!("{col} is null"));
            }
            ExclusionTest::IsNotNull => {
                q.push(format!("{col} is not null"));
            }
        }
    }
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

    /// Whether its effect is once per (window, item) (`once_per = "window"`).
    pub fn once_per_window(&self) -> bool {
        matches!(self, ActionSpec::Http(h) if h.once_per == crate::policy::action::OncePer::Window)
    }

    /// The `sweeper.effects.scope` of its effects in `window`: the window as run ids write it
    /// for an effect once per window, `''` for one once per item.
    pub fn effect_scope(&self, window: chrono::DateTime<chrono::Utc>) -> String {
        if self.once_per_window() {
            crate::window::format(window)
        } else {
            String::new()
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
    /// `retain_for` in seconds (0 for a selection policy: its cutoff is the window).
    pub retain_for_seconds: i64,
    /// A selection policy's predicates (every one must hold); empty for a retention policy, and
    /// then left out of the version's JSON so versions written before selections existed keep
    /// their hash.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub select: Vec<super::select::Selection>,
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

    /// The related tables its exclusions and selections read (`exists`, `not_exists`), each
    /// once, in configuration order.
    pub fn related(&self) -> Vec<&super::related::Related> {
        let exclusions = self.exclude.iter().filter_map(|e| match &e.rule {
            ExclusionRule::Related { exists } => Some(exists),
            ExclusionRule::Column(_) => None,
        });
        let selections = self.select.iter().filter_map(|s| s.related());
        exclusions.chain(selections).collect()
    }

    /// Every table its rules read: the target, then each related table once.
    pub fn tables(&self) -> Vec<&TableName> {
        let mut out = vec![&self.target.table];
        for r in self.related() {
            if !out.contains(&&r.table) {
                out.push(&r.table);
            }
        }
        out
    }
}

/// How commands of a policy reach `/consume` (docs/design.md §8).
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
