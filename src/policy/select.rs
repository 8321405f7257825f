//! Selection policies: rows chosen by predicates instead of a retention cutoff (a weekly digest
//! selects every active customer, whatever its age).
//!
//! A selection policy writes `select = [ ... ]` and no `retain_for`; its run's cutoff is the
//! window itself, so a row is eligible when its `target.timestamp` is before the window (a row
//! created after the window belongs to the next one), every `select` predicate holds, and no
//! exclusion holds it. The predicate kinds are those of `exclude` plus `older_than` /
//! `newer_than`, which compare a `timestamptz` column with a duration before the window. A NULL
//! never satisfies a value test (the row is not selected: the conservative side, as a NULL
//! protects a row from an exclusion's test). The predicates are re-checked at the moment of the
//! effect like every other rule; a row that stops matching is `not_eligible` with the reason
//! `not_selected:{column}`.

use super::related::{NullMatches, Related};
use super::*;

/// One `select` entry as written: `column` plus exactly one of `equals`, `in`, `is_null`,
/// `is_not_null`, `older_than`, `newer_than`; or `exists` / `not_exists`, rows of another table
/// (see [`super::related`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectionConfig {
    /// Column tested.
    #[serde(default)]
    pub column: Option<String>,
    /// Selected when equal.
    #[serde(default)]
    pub equals: Option<Scalar>,
    /// Selected when equal to one of these.
    #[serde(default, rename = "in")]
    pub in_: Option<Vec<Scalar>>,
    /// `is_null = true`: selected when NULL.
    #[serde(default)]
    pub is_null: Option<bool>,
    /// `is_not_null = true`: selected when not NULL.
    #[serde(default)]
    pub is_not_null: Option<bool>,
    /// Selected when the column (a `timestamptz`) is earlier than this long before the window.
    #[serde(default)]
    pub older_than: Option<DurationSpec>,
    /// Selected when the column (a `timestamptz`) is this long before the window or later.
    #[serde(default)]
    pub newer_than: Option<DurationSpec>,
    /// Selected while a related row matches (a NULL in a compared column: no match).
    #[serde(default)]
    pub exists: Option<super::related::RelatedConfig>,
    /// Selected while no related row matches (a NULL in a compared column: a match, so the row
    /// is not selected).
    #[serde(default)]
    pub not_exists: Option<super::related::RelatedConfig>,
}

/// One `select` predicate: a row is selected when every predicate holds. Untagged, so a
/// column predicate keeps the JSON (and the policy version) it always had.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Selection {
    /// A test of the target row's own column.
    Column {
        /// The column it tests.
        column: Ident,
        /// The test.
        test: SelectionTest,
    },
    /// Selected while a related row matches.
    Exists {
        /// The related rows.
        exists: Related,
    },
    /// Selected while no related row matches.
    NotExists {
        /// The related rows.
        not_exists: Related,
    },
}

/// A selection's test. Values are kept as text and cast to the column's type in SQL, always as
/// bound parameters; durations are seconds before the run's window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SelectionTest {
    /// `column = value` (NULL: not selected).
    Equals {
        /// The value, as text.
        value: String,
    },
    /// `column = ANY(values)` (NULL: not selected).
    In {
        /// The values, as text.
        values: Vec<String>,
    },
    /// `column IS NULL`.
    IsNull,
    /// `column IS NOT NULL`.
    IsNotNull,
    /// `column < window − seconds` (NULL: not selected).
    OlderThan {
        /// Seconds before the window.
        seconds: i64,
    },
    /// `column >= window − seconds` (NULL: not selected).
    NewerThan {
        /// Seconds before the window.
        seconds: i64,
    },
}

impl SelectionTest {
    /// Whether it compares a timestamp with the window (the column must be `timestamptz`).
    pub fn is_temporal(&self) -> bool {
        matches!(
            self,
            SelectionTest::OlderThan { .. } | SelectionTest::NewerThan { .. }
        )
    }
}

impl Selection {
    /// Validates one written `select` entry at `path` (`select[0]`); the error names the field.
    pub fn from_config(
        c: &SelectionConfig,
        path: &str,
        literals: &mut super::related::Literals,
    ) -> Result<Selection, String> {
        let related = [("exists", &c.exists), ("not_exists", &c.not_exists)]
            .into_iter()
            .filter_map(|(field, r)| r.as_ref().map(|r| (field, r)))
            .collect::<Vec<_>>();
        if let Some((field, r)) = related.first() {
            let tested = c.equals.is_some()
                || c.in_.is_some()
                || c.is_null.is_some()
                || c.is_not_null.is_some()
                || c.older_than.is_some()
                || c.newer_than.is_some();
            if related.len() > 1 || c.column.is_some() || tested {
                return Err(format!(
                    "`{field}` stands alone: its tests go in its own `where` (give either a \
                     column with its test, or one of exists, not_exists)"
                ));
            }
            let rel = Related::from_config(r, &format!("{path}.{field}"), literals)
                .map_err(|m| format!("{field}.{m}"))?;
            return Ok(if *field == "exists" {
                Selection::Exists { exists: rel }
            } else {
                Selection::NotExists { not_exists: rel }
            });
        }
        let Some(column) = &c.column else {
            return Err(
                "give `column` with one of equals, in, is_null, is_not_null, older_than, \
                 newer_than; or `exists` / `not_exists` for rows of another table"
                    .into(),
            );
        };
        let column = Ident::parse(column).map_err(|m| format!("column: {m}"))?;
        let mut tests = Vec::new();
        if let Some(v) = &c.equals {
            tests.push(SelectionTest::Equals { value: v.to_text() });
        }
        if let Some(vs) = &c.in_ {
            if vs.is_empty() {
                return Err("in: give at least one value".into());
            }
            tests.push(SelectionTest::In {
                values: vs.iter().map(Scalar::to_text).collect(),
            });
        }
        match c.is_null {
            Some(true) => tests.push(SelectionTest::IsNull),
            Some(false) => return Err("is_null: write `is_null = true` or leave it out".into()),
            None => {}
        }
        match c.is_not_null {
            Some(true) => tests.push(SelectionTest::IsNotNull),
            Some(false) => {
                return Err("is_not_null: write `is_not_null = true` or leave it out".into());
            }
            None => {}
        }
        for (field, d) in [("older_than", c.older_than), ("newer_than", c.newer_than)] {
            let Some(d) = d else { continue };
            if d.seconds() < 1 {
                return Err(format!("{field}: must be at least 1s"));
            }
            tests.push(if field == "older_than" {
                SelectionTest::OlderThan {
                    seconds: d.seconds(),
                }
            } else {
                SelectionTest::NewerThan {
                    seconds: d.seconds(),
                }
            });
        }
        if tests.len() != 1 {
            return Err(format!(
                "give exactly one of equals, in, is_null, is_not_null, older_than, newer_than \
                 (found {})",
                tests.len()
            ));
        }
        Ok(Selection::Column {
            column,
            test: tests.pop().expect("one test"),
        })
    }

    /// The reason recorded when this predicate stops holding: `not_selected:{column}`, or
    /// `not_selected:exists:{table}` / `not_selected:not_exists:{table}`.
    pub fn unselected_reason(&self) -> String {
        match self {
            Selection::Column { column, .. } => format!("not_selected:{}", column.as_str()),
            Selection::Exists { exists } => format!("not_selected:exists:{}", exists.table),
            Selection::NotExists { not_exists } => {
                format!("not_selected:not_exists:{}", not_exists.table)
            }
        }
    }

    /// The related rows it tests, if it tests another table.
    pub fn related(&self) -> Option<&Related> {
        match self {
            Selection::Column { .. } => None,
            Selection::Exists { exists: r } | Selection::NotExists { not_exists: r } => Some(r),
        }
    }

    /// The target's columns it reads.
    pub fn target_columns(&self) -> Vec<&Ident> {
        match self {
            Selection::Column { column, .. } => vec![column],
            _ => self
                .related()
                .map(|r| r.target_columns().collect())
                .unwrap_or_default(),
        }
    }

    /// Whether it compares a timestamp column with the window.
    pub fn is_temporal(&self) -> bool {
        matches!(self, Selection::Column { test, .. } if test.is_temporal())
    }

    /// Pushes the predicate for the row of `target` (the target's quoted name), false for a
    /// NULL in a value or time test. `types` holds the column types of the rule set (a
    /// column's values are cast to its type).
    pub fn push(
        &self,
        q: &mut QueryBuilder<'_, Postgres>,
        target: &str,
        types: &HashMap<String, String>,
        window: chrono::DateTime<chrono::Utc>,
    ) {
        let (column, test) = match self {
            Selection::Column { column, test } => (column, test),
            Selection::Exists { exists } => {
                q.push("(");
                exists.push_exists(q, target, types, NullMatches::No);
                q.push(")");
                return;
            }
            Selection::NotExists { not_exists } => {
                q.push("(not ");
                not_exists.push_exists(q, target, types, NullMatches::Yes);
                q.push(")");
                return;
            }
        };
        let col = column.quoted();
        let ty = types.get(column.as_str()).map(String::as_str).unwrap_or("");
        match test {
            SelectionTest::Equals { value } => {
                q.push(format!("coalesce({col} = cast("));
                q.push_bind(value.clone());
                q.push(format!(" as {ty}), false)"));
            }
            SelectionTest::In { values } => {
                q.push(format!("coalesce({col} = any(cast("));
                q.push_bind(values.clone());
                q.push(format!(" as {ty}[])), false)"));
            }
            SelectionTest::IsNull => {
                q.push(format!("({col} is null)"));
            }
            SelectionTest::IsNotNull => {
                q.push(format!("({col} is not null)"));
            }
            SelectionTest::OlderThan { seconds } => {
                q.push(format!("coalesce({col} < "));
                q.push_bind(window - chrono::TimeDelta::seconds(*seconds));
                q.push(", false)");
            }
            SelectionTest::NewerThan { seconds } => {
                q.push(format!("coalesce({col} >= "));
                q.push_bind(window - chrono::TimeDelta::seconds(*seconds));
                q.push(", false)");
            }
        }
    }
}

/// Validates a policy's `select`, `retain_for` and `allow_delete` together: a selection policy
/// has no `retain_for` (its cutoff is the window), a retention policy needs one, and
/// `delete_rows` on a selection needs `allow_delete = true`. Returns the predicates and
/// `retain_for` in seconds (0 for a selection policy).
pub(super) fn selection_from_config(
    c: &PolicyConfig,
    deletes_rows: bool,
    errors: &mut Vec<String>,
    literals: &mut super::related::Literals,
) -> (Vec<Selection>, i64) {
    let mut select = Vec::new();
    for (i, s) in c.select.iter().enumerate() {
        match Selection::from_config(s, &format!("select[{i}]"), literals) {
            Ok(s) if select.contains(&s) => {
                errors.push(format!("select[{i}]: repeats an earlier predicate"));
            }
            Ok(s) => select.push(s),
            Err(msg) => errors.push(format!("select[{i}]: {msg}")),
        }
    }
    let retain = match (&c.retain_for, c.select.is_empty()) {
        (Some(r), true) => {
            if r.seconds() < 1 {
                errors.push("retain_for: must be at least 1s".into());
            }
            r.seconds()
        }
        (None, true) => {
            errors.push(
                "retain_for: required (or write `select = [...]` for a policy that selects by \
                 predicates instead of age)"
                    .into(),
            );
            0
        }
        (Some(_), false) => {
            errors.push(
                "retain_for: a selection policy (`select`) has no retain_for: its cutoff is the \
                 window itself"
                    .into(),
            );
            0
        }
        (None, false) => 0,
    };
    if !c.select.is_empty() && deletes_rows && !c.allow_delete {
        errors.push(
            "action: a selection policy deletes rows only with `allow_delete = true`: it selects \
             rows by what they are, not by age, so a predicate written for a send (status = \
             'active') would delete every row it matches"
                .into(),
        );
    }
    if c.select.is_empty() && c.allow_delete {
        errors.push("allow_delete: only a selection policy (`select`) takes it".into());
    }
    (select, retain)
}

/// check-config's findings on a selection's columns (each an error): a column missing from the
/// table, or an `older_than` / `newer_than` on a column that is not `timestamptz`. `col` looks a
/// column up in the target table.
pub(super) fn check_columns(
    select: &[Selection],
    col: impl Fn(&str) -> Option<ColumnInfo>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (i, s) in select.iter().enumerate() {
        let Selection::Column { column, test } = s else {
            continue;
        };
        match col(column.as_str()) {
            None => out.push(format!(
                "select[{i}]: column {} does not exist in the target table",
                column.as_str()
            )),
            Some(c) if test.is_temporal() && c.type_sql != "timestamp with time zone" => {
                out.push(format!(
                    "select[{i}]: column {} is {}; older_than / newer_than compare a timestamptz \
                     with the window",
                    column.as_str(),
                    c.type_sql
                ))
            }
            Some(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(extra: &str) -> Result<Policy, Vec<String>> {
        let text = format!(
            "name = 'p'\nschedule = {{ cron = '0 9 * * 1' }}\n\
             target = {{ table = 'crm.customers', key = 'id', timestamp = 'created_at' }}\n{extra}"
        );
        let c: PolicyConfig = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Toml))
            .build()
            .unwrap()
            .try_deserialize()
            .unwrap();
        Policy::from_config(c)
    }

    #[test]
    fn a_retention_policy_keeps_its_version_and_a_selection_is_part_of_it() {
        let retention = policy("retain_for = '90d'").unwrap();
        let json = serde_json::to_value(&retention.spec).unwrap();
        assert!(json.get("select").is_none(), "{json}");
        let a =
            policy("select = [ { column = 'status', equals = 'active' } ]\nallow_delete = true")
                .unwrap();
        let b = policy("select = [ { column = 'status', equals = 'gone' } ]\nallow_delete = true")
            .unwrap();
        assert_ne!(a.version, b.version);
        assert_eq!(a.spec.retain_for_seconds, 0);
        let w = chrono::DateTime::parse_from_rfc3339("2026-09-07T09:00:00Z")
            .unwrap()
            .to_utc();
        assert_eq!(a.cutoff(w), w, "a selection's cutoff is its window");
    }

    #[test]
    fn each_predicate_has_exactly_one_test() {
        let e = policy("select = [ { column = 'seen', newer_than = '0s' } ]\nallow_delete = true")
            .unwrap_err();
        assert_eq!(e, vec!["select[0]: newer_than: must be at least 1s"]);
        let e = policy("select = [ { column = 'seen' } ]\nallow_delete = true").unwrap_err();
        assert!(e[0].starts_with("select[0]: give exactly one of"), "{e:?}");
        let e = policy(
            "select = [ { column = 's', equals = 'a' }, { column = 's', equals = 'a' } ]\n\
             allow_delete = true",
        )
        .unwrap_err();
        assert_eq!(e, vec!["select[1]: repeats an earlier predicate"]);
        let e = policy("retain_for = '90d'\nallow_delete = true").unwrap_err();
        assert_eq!(
            e,
            vec!["allow_delete: only a selection policy (`select`) takes it"]
        );
    }
}
