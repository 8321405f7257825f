//! Names that must not be mixed up: a policy's name, a SQL identifier, a table name.

use super::*;

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
