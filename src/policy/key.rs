//! A policy's key (docs/design.md §6): one column, or 2–4 columns that together are exactly a
//! primary key or a unique index, and the one text that names an item of it everywhere — the
//! ledger, the audit, effects, dead letters, idempotency keys and URLs.
//!
//! The item key text is written in SQL by [`Key::text_sql`] (planning, the delete's `RETURNING`)
//! and in Rust by [`Key::text_of`] (the item endpoint, tests); both write each column's
//! canonical value ([`KeyType::value_sql`], [`KeyType::canonical`]) and, for a composite key,
//! a compact JSON array of those values as strings, escaped as RFC 8785 escapes them. Exactly-once
//! depends on the two agreeing byte for byte (effects and dead letters are keyed by the text).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sqlx::{Postgres, QueryBuilder};

use super::Ident;

/// Most columns a key may have.
pub const MAX_KEY_COLUMNS: usize = 4;

/// The columns of a policy's key, in the order the policy names them (the order of the values
/// in a composite key's text). One column serializes as its name, as before composite keys, so
/// the version of every existing policy is unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyColumns(Vec<Ident>);

impl KeyColumns {
    /// A key of one column.
    pub fn one(column: Ident) -> Self {
        KeyColumns(vec![column])
    }

    /// Validates `target.key` as written: one name, or 2–4 distinct names.
    pub fn parse(written: &KeyConfig) -> Result<Self, String> {
        let names: Vec<&str> = match written {
            KeyConfig::One(n) => vec![n.as_str()],
            KeyConfig::Many(ns) => ns.iter().map(String::as_str).collect(),
        };
        if let KeyConfig::Many(_) = written
            && !(2..=MAX_KEY_COLUMNS).contains(&names.len())
        {
            return Err(format!(
                "a key of several columns names 2 to {MAX_KEY_COLUMNS} of them, not {} (write \
                 one column as a string: key = \"id\")",
                names.len()
            ));
        }
        let mut columns: Vec<Ident> = Vec::with_capacity(names.len());
        for n in names {
            let c = Ident::parse(n)?;
            if columns.contains(&c) {
                return Err(format!("column `{n}` is named twice"));
            }
            columns.push(c);
        }
        Ok(KeyColumns(columns))
    }

    /// The columns, in the policy's order.
    pub fn columns(&self) -> &[Ident] {
        &self.0
    }

    /// Whether the key has more than one column (its item key text is a JSON array).
    pub fn is_composite(&self) -> bool {
        self.0.len() > 1
    }

    /// The first column in the policy's order.
    pub fn first(&self) -> &Ident {
        &self.0[0]
    }

    /// Whether `c` is one of the key's columns.
    pub fn contains(&self, c: &Ident) -> bool {
        self.0.contains(c)
    }

    /// `id`, or `(tenant_id, id)`, for messages.
    pub fn names(&self) -> String {
        match self.0.as_slice() {
            [one] => one.as_str().to_string(),
            many => format!(
                "({})",
                many.iter()
                    .map(Ident::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

impl fmt::Display for KeyColumns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.names())
    }
}

impl Serialize for KeyColumns {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => one.serialize(s),
            many => many.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for KeyColumns {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let written = KeyConfig::deserialize(d)?;
        KeyColumns::parse(&written).map_err(serde::de::Error::custom)
    }
}

/// `target.key` as written: `"id"` or `["tenant_id", "id"]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyConfig {
    /// One column.
    One(String),
    /// Several columns, in the order the item key text lists their values.
    Many(Vec<String>),
}

impl<'de> Deserialize<'de> for KeyConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = KeyConfig;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "a column name (key = \"id\") or an array of 2 to {MAX_KEY_COLUMNS} column \
                     names (key = [\"tenant_id\", \"id\"])"
                )
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<KeyConfig, E> {
                Ok(KeyConfig::One(v.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<KeyConfig, A::Error> {
                let mut names = Vec::new();
                while let Some(ColumnName(n)) = seq.next_element::<ColumnName>()? {
                    names.push(n);
                }
                Ok(KeyConfig::Many(names))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// One name in `target.key = [...]`, refused in our words when it is not a string.
struct ColumnName(String);

impl<'de> Deserialize<'de> for ColumnName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ColumnName;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a column name (each entry of key = [...] names one column)")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ColumnName, E> {
                Ok(ColumnName(v.to_string()))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// A type a key column may have. Each has one canonical text, written by
/// [`KeyType::value_sql`] in SQL and [`KeyType::canonical`] in Rust.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyType {
    /// `bigint`: decimal.
    Bigint,
    /// `integer`: decimal.
    Integer,
    /// `smallint`: decimal.
    Smallint,
    /// `uuid`: lower case, hyphenated.
    Uuid,
    /// `text`: as stored.
    Text,
    /// `varchar`: as stored.
    Varchar,
    /// `timestamptz`: RFC 3339 in UTC with `Z`, fractional seconds only when not zero
    /// (microseconds, trailing zeros trimmed).
    Timestamptz,
    /// `timestamp`: as `timestamptz`, without an offset.
    Timestamp,
    /// `date`: `YYYY-MM-DD`.
    Date,
}

/// The types a key column may have, as `check-config` lists them.
pub const KEY_TYPES: &str =
    "bigint, integer, smallint, uuid, text, varchar, timestamptz, timestamp or date";

impl KeyType {
    /// The type of a column whose `pg_type.typname` is `typname`; None for a type a key cannot
    /// have.
    pub fn from_type_name(typname: &str) -> Option<KeyType> {
        Some(match typname {
            "int8" => KeyType::Bigint,
            "int4" => KeyType::Integer,
            "int2" => KeyType::Smallint,
            "uuid" => KeyType::Uuid,
            "text" => KeyType::Text,
            "varchar" => KeyType::Varchar,
            "timestamptz" => KeyType::Timestamptz,
            "timestamp" => KeyType::Timestamp,
            "date" => KeyType::Date,
            _ => return None,
        })
    }

    /// The type's SQL name (what values are cast to).
    pub fn as_str(self) -> &'static str {
        match self {
            KeyType::Bigint => "bigint",
            KeyType::Integer => "integer",
            KeyType::Smallint => "smallint",
            KeyType::Uuid => "uuid",
            KeyType::Text => "text",
            KeyType::Varchar => "varchar",
            KeyType::Timestamptz => "timestamptz",
            KeyType::Timestamp => "timestamp",
            KeyType::Date => "date",
        }
    }

    /// The longest canonical text of a value, in bytes; None for text, whose values have no
    /// bound.
    pub fn max_text_bytes(self) -> Option<usize> {
        Some(match self {
            KeyType::Bigint => 20,
            KeyType::Integer => 11,
            KeyType::Smallint => 6,
            KeyType::Uuid => 36,
            KeyType::Timestamptz => 27,
            KeyType::Timestamp => 26,
            KeyType::Date => 10,
            KeyType::Text | KeyType::Varchar => return None,
        })
    }

    /// Whether the canonical text never needs escaping in a JSON string (digits, hex, `-`, `:`,
    /// `.`, `T`, `Z`): every type but text.
    fn is_json_plain(self) -> bool {
        self.max_text_bytes().is_some()
    }

    /// Whether the type has values no text of ours names (`infinity`, years outside 0001–9999):
    /// rows holding one are kept at planning as held `key_out_of_range`.
    pub fn is_temporal(self) -> bool {
        matches!(
            self,
            KeyType::Timestamptz | KeyType::Timestamp | KeyType::Date
        )
    }

    /// The SQL expression of `column`'s canonical text: independent of the session's
    /// `TimeZone` and `DateStyle` (a `timestamptz` is read at UTC; `to_char` with fixed fields).
    /// Defined for the values [`KeyType::push_in_range`] admits.
    pub fn value_sql(self, column: &str) -> String {
        // `.US` always writes six digits after the point: trimming zeros stops at the point,
        // and trimming the point then leaves whole seconds bare.
        match self {
            KeyType::Timestamptz => format!(
                "(rtrim(rtrim(to_char({column} at time zone 'UTC', \
                 'YYYY-MM-DD\"T\"HH24:MI:SS.US'), '0'), '.') || 'Z')"
            ),
            KeyType::Timestamp => {
                format!("rtrim(rtrim(to_char({column}, 'YYYY-MM-DD\"T\"HH24:MI:SS.US'), '0'), '.')")
            }
            KeyType::Date => format!("to_char({column}, 'YYYY-MM-DD')"),
            _ => format!("{column}::text"),
        }
    }

    /// For a temporal type, pushes ` and <column> within 0001-01-01 .. 9999-12-31` (finite, a
    /// year our text writes in four digits); nothing for other types.
    fn push_in_range(self, q: &mut QueryBuilder<'_, Postgres>, column: &str) {
        let (low, high) = match self {
            KeyType::Timestamptz => ("'0001-01-01T00:00:00Z'", "'9999-12-31T23:59:59.999999Z'"),
            KeyType::Timestamp => ("'0001-01-01T00:00:00'", "'9999-12-31T23:59:59.999999'"),
            KeyType::Date => ("'0001-01-01'", "'9999-12-31'"),
            _ => return,
        };
        let t = self.as_str();
        q.push(format!(
            " and {column} >= {low}::{t} and {column} <= {high}::{t}"
        ));
    }

    /// The canonical text of a value written `v` in any spelling the type accepts here (`007` for
    /// 7, an upper-case uuid, a timestamp at another offset or with `.000000`); Err says why `v`
    /// is not one. Parsed here, never by a PostgreSQL cast (which also takes `now` or `epoch`).
    pub fn canonical(self, v: &str) -> Result<String, String> {
        let not = || {
            format!(
                "`{}` is not a {}",
                crate::ledger::printable(v, 64),
                self.as_str()
            )
        };
        match self {
            KeyType::Bigint => v.parse::<i64>().map(|n| n.to_string()).map_err(|_| not()),
            KeyType::Integer => v.parse::<i32>().map(|n| n.to_string()).map_err(|_| not()),
            KeyType::Smallint => v.parse::<i16>().map(|n| n.to_string()).map_err(|_| not()),
            KeyType::Uuid => uuid::Uuid::parse_str(v)
                .map(|u| u.hyphenated().to_string())
                .map_err(|_| not()),
            KeyType::Text | KeyType::Varchar => Ok(v.to_string()),
            KeyType::Timestamptz => {
                let t = parse_timestamptz(v).ok_or_else(not)?;
                Ok(format!("{}Z", format_naive(&t.naive_utc())))
            }
            KeyType::Timestamp => {
                let t = parse_timestamp(v).ok_or_else(not)?;
                Ok(format_naive(&t))
            }
            KeyType::Date => {
                let d = chrono::NaiveDate::parse_from_str(v, "%Y-%m-%d").map_err(|_| not())?;
                if !(1..=9999).contains(&chrono::Datelike::year(&d)) {
                    return Err(not());
                }
                Ok(d.format("%Y-%m-%d").to_string())
            }
        }
    }
}

/// `2026-08-01T00:00:00Z`, `2026-08-01 02:00:00+02`, `2026-08-01T00:00:00.5+00:00`: a time with
/// an offset, years 0001–9999, at most microseconds.
fn parse_timestamptz(v: &str) -> Option<chrono::DateTime<chrono::FixedOffset>> {
    let t = chrono::DateTime::parse_from_rfc3339(v)
        .ok()
        .or_else(|| chrono::DateTime::parse_from_str(v, "%Y-%m-%dT%H:%M:%S%.f%#z").ok())
        .or_else(|| chrono::DateTime::parse_from_str(v, "%Y-%m-%d %H:%M:%S%.f%#z").ok())?;
    in_range(&t.naive_utc()).then_some(t)
}

/// `2026-08-01T00:00:00`, `2026-08-01 00:00:00.25`: a time without an offset, years
/// 0001–9999, at most microseconds.
fn parse_timestamp(v: &str) -> Option<chrono::NaiveDateTime> {
    let t = chrono::NaiveDateTime::parse_from_str(v, "%Y-%m-%dT%H:%M:%S%.f")
        .ok()
        .or_else(|| chrono::NaiveDateTime::parse_from_str(v, "%Y-%m-%d %H:%M:%S%.f").ok())?;
    in_range(&t).then_some(t)
}

fn in_range(t: &chrono::NaiveDateTime) -> bool {
    use chrono::{Datelike, Timelike};
    (1..=9999).contains(&t.year())
        && t.nanosecond().is_multiple_of(1_000)
        && t.nanosecond() < 1_000_000_000
}

/// `YYYY-MM-DDTHH:MM:SS` plus `.ffffff` with trailing zeros trimmed, nothing when zero.
fn format_naive(t: &chrono::NaiveDateTime) -> String {
    use chrono::Timelike;
    let whole = t.format("%Y-%m-%dT%H:%M:%S").to_string();
    let micros = t.nanosecond() / 1_000;
    if micros == 0 {
        return whole;
    }
    let fraction = format!("{micros:06}");
    format!("{whole}.{}", fraction.trim_end_matches('0'))
}

/// Something that pushes a piece of SQL (the timestamp expression before a keyset cursor).
pub type PushSql<'f> = &'f dyn Fn(&mut QueryBuilder<'_, Postgres>);

/// A policy's key resolved against its table: each column's type, and the order planning walks
/// the keys in (the order of the unique index that makes the key, so its keyset cursor is an
/// index range).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    columns: Vec<(Ident, KeyType)>,
    walk: Vec<usize>,
}

impl Key {
    /// The key of `names` whose column types are `types` (in the same order), walked in the
    /// column order of `index` (the names of the unique index that is exactly the key's columns;
    /// the policy's order when none is given).
    pub fn new(names: &KeyColumns, types: Vec<KeyType>, index: Option<&[String]>) -> Key {
        let columns: Vec<(Ident, KeyType)> = names.columns().iter().cloned().zip(types).collect();
        let walk = index
            .and_then(|ix| {
                ix.iter()
                    .map(|n| columns.iter().position(|(c, _)| c.as_str() == n))
                    .collect::<Option<Vec<usize>>>()
            })
            .filter(|w| w.len() == columns.len())
            .unwrap_or_else(|| (0..columns.len()).collect());
        Key { columns, walk }
    }

    /// The columns and their types, in the policy's order.
    pub fn columns(&self) -> &[(Ident, KeyType)] {
        &self.columns
    }

    /// Whether the key has more than one column.
    pub fn is_composite(&self) -> bool {
        self.columns.len() > 1
    }

    /// The column (and its type) planning walks first.
    pub fn leading(&self) -> &(Ident, KeyType) {
        &self.columns[self.walk[0]]
    }

    /// The value of the leading column (see [`Key::leading`]) in an item key text.
    pub fn leading_value(&self, text: &str) -> Option<String> {
        self.values(text)
            .ok()
            .map(|mut v| v.swap_remove(self.walk[0]))
    }

    /// The longest item key text, in bytes; None when a key column is text (no bound).
    pub fn max_text_bytes(&self) -> Option<usize> {
        let values: usize = self
            .columns
            .iter()
            .map(|(_, t)| t.max_text_bytes())
            .sum::<Option<usize>>()?;
        Some(match self.columns.len() {
            1 => values,
            // Brackets, a pair of quotes per value, commas between.
            n => values + 2 + 2 * n + (n - 1),
        })
    }

    /// Whether a column of the key is of a temporal type (some rows may be out of range).
    pub fn has_temporal(&self) -> bool {
        self.columns.iter().any(|(_, t)| t.is_temporal())
    }

    fn column(qual: &str, c: &Ident) -> String {
        format!("{qual}{}", c.quoted())
    }

    /// The key columns (qualified by `qual`, e.g. `t.`), quoted, in walk order.
    pub fn walk_column_list(&self, qual: &str) -> Vec<String> {
        self.walk
            .iter()
            .map(|&i| Key::column(qual, &self.columns[i].0))
            .collect()
    }

    /// The key columns' bare names, in walk order.
    pub fn walk_names(&self) -> Vec<&str> {
        self.walk
            .iter()
            .map(|&i| self.columns[i].0.as_str())
            .collect()
    }

    /// `"a", "b"` (qualified by `qual`), in walk order: an `ORDER BY` or a row.
    pub fn walk_columns(&self, qual: &str) -> String {
        self.walk_column_list(qual).join(", ")
    }

    /// Pushes the item key text of the row (columns qualified by `qual`): the canonical value of
    /// a one-column key, or `'[' || to_json(v1)::text || ',' || ... || ']'` (PostgreSQL's JSON
    /// string escaping is RFC 8785's: `\"`, `\\`, `\b \f \n \r \t`, other control characters as
    /// lowercase `\u00xx`, nothing else).
    pub fn text_sql(&self, qual: &str) -> String {
        match self.columns.as_slice() {
            [(c, t)] => t.value_sql(&Key::column(qual, c)),
            many => {
                // `to_json` only where escaping can be needed: the other types' canonical text
                // is plain (quoting it is what `to_json` would write, at half the cost).
                let parts: Vec<String> = many
                    .iter()
                    .map(|(c, t)| {
                        let v = t.value_sql(&Key::column(qual, c));
                        if t.is_json_plain() {
                            format!("'\"' || {v} || '\"'")
                        } else {
                            format!("to_json({v})::text")
                        }
                    })
                    .collect();
                format!("('[' || {} || ']')", parts.join(" || ',' || "))
            }
        }
    }

    /// Pushes that the row can be named by an item key: every key column not NULL and, for a
    /// temporal one, within the years 0001–9999.
    pub fn push_nameable(&self, q: &mut QueryBuilder<'_, Postgres>, qual: &str) {
        q.push("(");
        for (i, (c, t)) in self.columns.iter().enumerate() {
            if i > 0 {
                q.push(" and ");
            }
            let col = Key::column(qual, c);
            q.push(format!("{col} is not null"));
            t.push_in_range(q, &col);
        }
        q.push(")");
    }

    /// Pushes that some key column is NULL.
    pub fn push_some_null(&self, q: &mut QueryBuilder<'_, Postgres>, qual: &str) {
        let any: Vec<String> = self
            .columns
            .iter()
            .map(|(c, _)| format!("{} is null", Key::column(qual, c)))
            .collect();
        q.push(format!("({})", any.join(" or ")));
    }

    /// Pushes that the row's key is in `keys` (item key texts): `key = any($keys)` for one
    /// column; for several, `(a, b) in (select * from unnest($a::ta[], $b::tb[]))`, the texts
    /// split into one array per column here (half the server's work of splitting JSON there).
    /// One bound array per column, never a parameter per key; a text that is not such an array
    /// (none the ledger holds) contributes NULLs, which match no row.
    pub fn push_in(&self, q: &mut QueryBuilder<'_, Postgres>, qual: &str, keys: Vec<String>) {
        match self.columns.as_slice() {
            [(c, t)] => {
                q.push(format!("{} = any(cast(", Key::column(qual, c)));
                q.push_bind(keys);
                q.push(format!(" as {}[]))", t.as_str()));
            }
            many => {
                let mut split: Vec<Vec<Option<String>>> =
                    vec![Vec::with_capacity(keys.len()); many.len()];
                for k in &keys {
                    match serde_json::from_str::<Vec<String>>(k) {
                        Ok(values) if values.len() == many.len() => {
                            for (column, v) in split.iter_mut().zip(values) {
                                column.push(Some(v));
                            }
                        }
                        _ => split.iter_mut().for_each(|column| column.push(None)),
                    }
                }
                let columns: Vec<String> = many.iter().map(|(c, _)| Key::column(qual, c)).collect();
                q.push(format!(
                    "({}) in (select * from unnest(",
                    columns.join(", ")
                ));
                for (i, ((_, t), values)) in many.iter().zip(split).enumerate() {
                    if i > 0 {
                        q.push(", ");
                    }
                    q.push("cast(");
                    q.push_bind(values);
                    q.push(format!(" as {}[])", t.as_str()));
                }
                q.push("))");
            }
        }
    }

    /// The canonical values of an item key text, in the policy's order; Err says why the text
    /// names no key of this shape. Accepts equivalent spellings (see [`KeyType::canonical`]);
    /// a composite key's text is a JSON array of one value per column, each a string (an integer
    /// may be written bare).
    pub fn values(&self, text: &str) -> Result<Vec<String>, String> {
        match self.columns.as_slice() {
            [(_, t)] => Ok(vec![t.canonical(text)?]),
            many => {
                let shape = || {
                    format!(
                        "a key of {} is a JSON array of {} strings, one per column in that order \
                         (for example {})",
                        self.names(),
                        many.len(),
                        self.example()
                    )
                };
                let parsed: Vec<serde_json::Value> =
                    serde_json::from_str(text).map_err(|_| shape())?;
                if parsed.len() != many.len() {
                    return Err(shape());
                }
                parsed
                    .iter()
                    .zip(many)
                    .map(|(v, (c, t))| {
                        let written = match v {
                            serde_json::Value::String(s) => s.clone(),
                            // An integer written bare (`[42, "..."]`) is its decimal text; any
                            // other number has no exact spelling as one.
                            serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => {
                                n.to_string()
                            }
                            _ => return Err(shape()),
                        };
                        t.canonical(&written)
                            .map_err(|e| format!("{}: {e}", c.as_str()))
                    })
                    .collect()
            }
        }
    }

    /// The item key text of canonical `values` (in the policy's order): the value itself for
    /// one column, else compact JSON — serde_json escapes strings exactly as RFC 8785 does,
    /// as PostgreSQL's `to_json` does.
    pub fn text_of(&self, values: &[String]) -> String {
        match values {
            [one] if !self.is_composite() => one.clone(),
            many => serde_json::to_string(many).expect("strings always serialize"),
        }
    }

    /// The canonical item key text of `text` written in any accepted spelling.
    pub fn canonical(&self, text: &str) -> Result<String, String> {
        self.values(text).map(|v| self.text_of(&v))
    }

    /// `id` or `(tenant_id, id)`.
    pub fn names(&self) -> String {
        KeyColumns(self.columns.iter().map(|(c, _)| c.clone()).collect()).names()
    }

    /// An item key text of this shape, for messages: `["42","2026-08-01T00:00:00Z"]`.
    fn example(&self) -> String {
        let values: Vec<String> = self
            .columns
            .iter()
            .map(|(_, t)| {
                match t {
                    KeyType::Bigint | KeyType::Integer | KeyType::Smallint => "42",
                    KeyType::Uuid => "0190a5f0-7c3e-7a51-9f0e-1b2c3d4e5f60",
                    KeyType::Text | KeyType::Varchar => "acme",
                    KeyType::Timestamptz => "2026-08-01T00:00:00Z",
                    KeyType::Timestamp => "2026-08-01T00:00:00",
                    KeyType::Date => "2026-08-01",
                }
                .to_string()
            })
            .collect();
        self.text_of(&values)
    }

    /// Pushes ` and (a, b) > (cast($a as ta), cast($b as tb))` in walk order — the keyset
    /// cursor after the item `after` — preceded on the timestamp walk by its timestamp
    /// (`(ts, a, b) > ($ts, $a, $b)`, `push_lead` pushing the timestamp expression). The caller
    /// has checked that `after` is a key of this shape ([`Key::values`]); pushes nothing if not.
    pub fn push_after(
        &self,
        q: &mut QueryBuilder<'_, Postgres>,
        after: &str,
        lead: Option<(PushSql<'_>, &str)>,
    ) {
        let Ok(values) = self.values(after) else {
            return;
        };
        q.push(" and (");
        if let Some((push_lead, _)) = lead {
            push_lead(q);
            q.push(", ");
        }
        q.push(self.walk_columns(""));
        q.push(") > (");
        if let Some((_, ts)) = lead {
            q.push("cast(");
            q.push_bind(ts.to_string());
            q.push(" as timestamptz), ");
        }
        for (n, &i) in self.walk.iter().enumerate() {
            if n > 0 {
                q.push(", ");
            }
            q.push("cast(");
            q.push_bind(values[i].clone());
            q.push(format!(" as {})", self.columns[i].1.as_str()));
        }
        q.push(")");
    }

    /// `{column: value}` of an item key text, and `[{name, type}]` of the columns, for JSON
    /// answers.
    pub fn describe(&self, text: &str) -> (serde_json::Value, serde_json::Value) {
        let values = self.values(text).unwrap_or_default();
        let key: serde_json::Map<String, serde_json::Value> = self
            .columns
            .iter()
            .zip(values)
            .map(|((c, _), v)| (c.as_str().to_string(), serde_json::Value::String(v)))
            .collect();
        let columns: Vec<serde_json::Value> = self
            .columns
            .iter()
            .map(|(c, t)| serde_json::json!({ "name": c.as_str(), "type": t.as_str() }))
            .collect();
        (
            serde_json::Value::Object(key),
            serde_json::Value::Array(columns),
        )
    }
}

/// Longest idempotency key sent (many APIs refuse longer ones, Stripe's among them).
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;

/// How an item of a composite key appears in an idempotency key: its text, or — when the whole
/// idempotency key would exceed [`MAX_IDEMPOTENCY_KEY_BYTES`] with it — `sha256:` and the hex
/// SHA-256 of the text. A fixed rule: changing it would change the key of an effect already
/// open, which is also why a one-column key's item is never hashed (effects opened before this
/// rule existed keep the key they were called with).
pub fn idempotency_item(item: &str, others_bytes: usize) -> String {
    use sha2::Digest;
    if others_bytes + item.len() <= MAX_IDEMPOTENCY_KEY_BYTES {
        item.to_string()
    } else {
        format!(
            "sha256:{}",
            hex::encode(sha2::Sha256::digest(item.as_bytes()))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(types: &[(&str, KeyType)]) -> Key {
        let names = KeyColumns(
            types
                .iter()
                .map(|(n, _)| Ident::parse(n).unwrap())
                .collect(),
        );
        Key::new(&names, types.iter().map(|(_, t)| *t).collect(), None)
    }

    #[test]
    fn values_are_written_canonically() {
        use KeyType::*;
        let ok = |t: KeyType, v: &str, want: &str| assert_eq!(t.canonical(v).unwrap(), want, "{v}");
        ok(Bigint, "007", "7");
        ok(Bigint, "+42", "42");
        ok(Smallint, "-32768", "-32768");
        ok(
            Uuid,
            "0190A5F0-7C3E-7A51-9F0E-1B2C3D4E5F60",
            "0190a5f0-7c3e-7a51-9f0e-1b2c3d4e5f60",
        );
        ok(
            Uuid,
            "0190a5f07c3e7a519f0e1b2c3d4e5f60",
            "0190a5f0-7c3e-7a51-9f0e-1b2c3d4e5f60",
        );
        ok(Text, " a\"b ", " a\"b ");
        ok(Timestamptz, "2026-08-01T00:00:00Z", "2026-08-01T00:00:00Z");
        ok(
            Timestamptz,
            "2026-08-01T02:00:00.000000+02:00",
            "2026-08-01T00:00:00Z",
        );
        ok(
            Timestamptz,
            "2026-08-01 00:00:00.120+00",
            "2026-08-01T00:00:00.12Z",
        );
        ok(
            Timestamptz,
            "0001-01-01T00:00:00.000001Z",
            "0001-01-01T00:00:00.000001Z",
        );
        ok(Timestamp, "2026-08-01 00:00:00.5", "2026-08-01T00:00:00.5");
        ok(Date, "2026-08-01", "2026-08-01");
        let bad = |t: KeyType, v: &str| assert!(t.canonical(v).is_err(), "{t:?} {v}");
        bad(Smallint, "40000");
        bad(Bigint, "now");
        bad(Timestamptz, "now");
        bad(Timestamptz, "epoch");
        bad(Timestamptz, "infinity");
        bad(Timestamptz, "2026-08-01T00:00:00");
        bad(Timestamptz, "2026-08-01T00:00:00.0000001Z");
        bad(Timestamp, "2026-08-01T00:00:00Z");
        bad(Date, "2026-8-1x");
        bad(Uuid, "42");
    }

    #[test]
    fn a_composite_key_is_compact_json_in_the_policys_order() {
        let k = key(&[("id", KeyType::Bigint), ("at", KeyType::Timestamptz)]);
        assert_eq!(
            k.canonical(r#"[ "042", "2026-08-01T02:00:00+02:00" ]"#)
                .unwrap(),
            r#"["42","2026-08-01T00:00:00Z"]"#
        );
        assert_eq!(
            k.canonical(r#"[42,"2026-08-01T00:00:00Z"]"#).unwrap(),
            r#"["42","2026-08-01T00:00:00Z"]"#
        );
        assert!(
            k.canonical(r#"["42"]"#)
                .unwrap_err()
                .contains("JSON array of 2 strings")
        );
        assert!(k.canonical("42").is_err());
        // A number with no exact integer spelling is refused, not rounded.
        assert!(k.canonical(r#"[1e26,"2026-08-01T00:00:00Z"]"#).is_err());
        assert!(k.canonical(r#"[4.0,"2026-08-01T00:00:00Z"]"#).is_err());
        let t = key(&[("tenant", KeyType::Text), ("id", KeyType::Integer)]);
        assert_eq!(
            t.text_of(&["a\"\\\u{1}\u{7f}\n/é".into(), "1".into()]),
            "[\"a\\\"\\\\\\u0001\u{7f}\\n/é\",\"1\"]"
        );
        // One column keeps its bare text.
        assert_eq!(
            key(&[("id", KeyType::Bigint)]).canonical("007").unwrap(),
            "7"
        );
    }

    #[test]
    fn key_columns_keep_the_one_column_spelling() {
        let one: KeyColumns = serde_json::from_str(r#""id""#).unwrap();
        assert_eq!(serde_json::to_string(&one).unwrap(), r#""id""#);
        let two: KeyColumns = serde_json::from_str(r#"["tenant_id","id"]"#).unwrap();
        assert_eq!(
            serde_json::to_string(&two).unwrap(),
            r#"["tenant_id","id"]"#
        );
        assert!(serde_json::from_str::<KeyColumns>(r#"["id"]"#).is_err());
        assert!(serde_json::from_str::<KeyColumns>(r#"["a","b","c","d","e"]"#).is_err());
        assert!(serde_json::from_str::<KeyColumns>(r#"["a","a"]"#).is_err());
    }

    #[test]
    fn a_long_item_is_hashed_in_the_idempotency_key() {
        assert_eq!(idempotency_item("42", 10), "42");
        let long = "x".repeat(250);
        let h = idempotency_item(&long, 10);
        assert!(h.starts_with("sha256:") && h.len() == 7 + 64, "{h}");
        assert_eq!(idempotency_item(&"x".repeat(245), 10).len(), 245);
    }
}
