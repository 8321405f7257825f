//! Holds and selections kept in another table: `exists = { table, on, where }` in an exclusion,
//! `exists` / `not_exists` in a selection (docs/configuration.md "Holds kept in another table").
//!
//! A row of the target *relates* to a row of the other table when every `on` pair is equal; the
//! related row *matches* when every `where` test holds. NULLs fall on the safe side, as a NULL in
//! an own-column exclusion protects the row: in an exclusion, a related row whose compared
//! (`equals`, `in`) column is NULL counts as a match (reason `unknown:{table}.{column}`); in a
//! selection's `exists` it does not match; in `not_exists` it does (the row is not selected).
//!
//! What a hold committed while a delete runs does is decided by the database, not by us: under
//! READ COMMITTED the delete re-reads the target row's own columns on its newest version, but the
//! subquery on the related table reads the statement's snapshot. `check-config` states per
//! exclusion which case applies ([`check`]); docs/design.md §2.3 has the reasoning.

use super::check::Level;
use super::*;

/// The related table's alias in its subquery. The target is always named by its full quoted
/// name, so the two never collide, even when the related table is the target itself.
const ALIAS: &str = "sweeper_related";

/// Related rows: those of `table` equal to the target row on every `on` pair and matching every
/// `where` test.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Related {
    /// The other table.
    pub table: TableName,
    /// 1–4 column pairs, compared with `=`.
    pub on: Vec<OnPair>,
    /// Value tests on the other table's columns (every one must hold).
    #[serde(rename = "where", default, skip_serializing_if = "Vec::is_empty")]
    pub where_: Vec<ColumnTest>,
}

/// A column of the related table paired with a column of the target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OnPair {
    /// The related table's column.
    pub related: Ident,
    /// The target's column.
    pub target: Ident,
}

/// `exists = { table = "legal.holds", on = [...], where = [...] }` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelatedConfig {
    /// `table` or `schema.table`.
    pub table: String,
    /// `[ { related = "customer_id", target = "customer_id" } ]`.
    pub on: Vec<OnConfig>,
    /// `[ { column = "released_at", is_null = true } ]`.
    #[serde(default, rename = "where")]
    pub where_: Vec<WhereConfig>,
}

/// One `on` pair as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnConfig {
    /// The related table's column.
    pub related: String,
    /// The target's column.
    pub target: String,
}

/// One `where` test as written: `column` plus exactly one of `equals`, `in`, `is_null`,
/// `is_not_null`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WhereConfig {
    /// Column tested.
    pub column: String,
    /// Matches when equal.
    #[serde(default)]
    pub equals: Option<Scalar>,
    /// Matches when equal to one of these.
    #[serde(default, rename = "in")]
    pub in_: Option<Vec<Scalar>>,
    /// `is_null = true`: matches when NULL.
    #[serde(default)]
    pub is_null: Option<bool>,
    /// `is_not_null = true`: matches when not NULL.
    #[serde(default)]
    pub is_not_null: Option<bool>,
}

/// How the TOML literals of each value test were written, keyed by the path check-config names
/// the test by (`exclude[0]`, `exclude[1].exists.where[0]`, `select[0].exists.where[1]`).
pub type Literals = HashMap<String, Vec<Literal>>;

/// Which side a NULL in a compared column of a related row falls on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NullMatches {
    /// The related row matches (an exclusion holds the row; a `not_exists` fails).
    Yes,
    /// It does not (an `exists` selection fails).
    No,
}

impl Related {
    /// Validates `exists` (or `not_exists`) as written at `path`; the literals of its `where`
    /// tests go to `literals`. The error names the field within it.
    pub fn from_config(
        c: &RelatedConfig,
        path: &str,
        literals: &mut Literals,
    ) -> Result<Related, String> {
        let table = TableName::parse(&c.table).map_err(|m| format!("table: {m}"))?;
        if !(1..=4).contains(&c.on.len()) {
            return Err(format!(
                "on: pair 1-4 columns of {table} with columns of the target \
                 (on = [ {{ related = \"customer_id\", target = \"customer_id\" }} ]); found {}",
                c.on.len()
            ));
        }
        let mut on = Vec::new();
        for (i, p) in c.on.iter().enumerate() {
            let pair = OnPair {
                related: Ident::parse(&p.related).map_err(|m| format!("on[{i}].related: {m}"))?,
                target: Ident::parse(&p.target).map_err(|m| format!("on[{i}].target: {m}"))?,
            };
            if on.contains(&pair) {
                return Err(format!("on[{i}]: repeats an earlier pair"));
            }
            on.push(pair);
        }
        let mut where_ = Vec::new();
        for (i, w) in c.where_.iter().enumerate() {
            let column = Ident::parse(&w.column).map_err(|m| format!("where[{i}].column: {m}"))?;
            let (test, kinds) = value_test(&w.equals, &w.in_, w.is_null, w.is_not_null)
                .map_err(|m| format!("where[{i}]: {m}"))?;
            literals.insert(format!("{path}.where[{i}]"), kinds);
            where_.push(ColumnTest { column, test });
        }
        Ok(Related { table, on, where_ })
    }

    /// The key under which a related column's type is kept among a rule set's column types
    /// (`legal.holds.released_at`; a target column is kept under its bare name, which has no
    /// dot).
    pub fn type_key(&self, column: &Ident) -> String {
        format!("{}.{}", self.table, column.as_str())
    }

    /// The reason of a row held only because a compared column of a related row is NULL.
    pub fn unknown_reason(&self, column: &Ident) -> String {
        format!("unknown:{}.{}", self.table, column.as_str())
    }

    /// Whether a `where` test compares values (so a NULL can leave it unknown).
    pub fn compares_values(&self) -> bool {
        self.where_.iter().any(|w| w.test.compares_values())
    }

    /// Pushes `exists (select 1 from <table> where <on> and <where>)` for the row of `target`
    /// (the target's quoted name); `types` holds the `where` columns' types under
    /// [`Related::type_key`].
    pub fn push_exists(
        &self,
        q: &mut QueryBuilder<'_, Postgres>,
        target: &str,
        types: &HashMap<String, String>,
        nulls: NullMatches,
    ) {
        q.push("exists (select 1");
        self.push_from(q, target, types, nulls);
        q.push(")");
    }

    /// Pushes the reason of a row held by a related row that matches only through a NULL: a
    /// scalar subquery naming the first NULL compared column of such a row. Used after
    /// [`Related::push_exists`] with [`NullMatches::No`] found none and with
    /// [`NullMatches::Yes`] found one.
    pub fn push_unknown_reason(
        &self,
        q: &mut QueryBuilder<'_, Postgres>,
        target: &str,
        types: &HashMap<String, String>,
    ) {
        q.push("(select case");
        for w in self.where_.iter().filter(|w| w.test.compares_values()) {
            q.push(format!(" when {ALIAS}.{} is null then ", w.column.quoted()));
            q.push_bind(self.unknown_reason(&w.column));
        }
        q.push(" end");
        self.push_from(q, target, types, NullMatches::Yes);
        q.push(" limit 1)");
    }

    /// ` from <table> sweeper_related where <on pairs> and <where tests>`.
    fn push_from(
        &self,
        q: &mut QueryBuilder<'_, Postgres>,
        target: &str,
        types: &HashMap<String, String>,
        nulls: NullMatches,
    ) {
        q.push(format!(" from {} {ALIAS} where ", self.table.quoted()));
        let on: Vec<String> = self
            .on
            .iter()
            .map(|p| {
                format!(
                    "{ALIAS}.{} = {target}.{}",
                    p.related.quoted(),
                    p.target.quoted()
                )
            })
            .collect();
        q.push(on.join(" and "));
        for w in &self.where_ {
            let col = format!("{ALIAS}.{}", w.column.quoted());
            let ty = &types[&self.type_key(&w.column)];
            q.push(" and coalesce(");
            w.test.push(q, &col, ty);
            q.push(match nulls {
                NullMatches::Yes => ", true)",
                NullMatches::No => ", false)",
            });
        }
    }

    /// The target's columns it reads (the `on` pairs' target side).
    pub fn target_columns(&self) -> impl Iterator<Item = &Ident> {
        self.on.iter().map(|p| &p.target)
    }
}

/// Reads one value test as written (`equals`, `in`, `is_null`, `is_not_null`: exactly one),
/// with the kinds of TOML literal its values were written as.
pub(super) fn value_test(
    equals: &Option<Scalar>,
    in_: &Option<Vec<Scalar>>,
    is_null: Option<bool>,
    is_not_null: Option<bool>,
) -> Result<(ExclusionTest, Vec<Literal>), String> {
    let mut tests = Vec::new();
    if let Some(v) = equals {
        tests.push(ExclusionTest::Equals { value: v.to_text() });
    }
    if let Some(vs) = in_ {
        if vs.is_empty() {
            return Err("in: give at least one value".into());
        }
        tests.push(ExclusionTest::In {
            values: vs.iter().map(Scalar::to_text).collect(),
        });
    }
    match is_null {
        Some(true) => tests.push(ExclusionTest::IsNull),
        Some(false) => return Err("is_null: write `is_null = true` or leave it out".into()),
        None => {}
    }
    match is_not_null {
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
    let kinds = equals
        .iter()
        .chain(in_.iter().flatten())
        .map(Scalar::literal)
        .collect();
    Ok((tests.pop().expect("one test"), kinds))
}

/// What a related-rows rule is for, in check-config's findings.
#[derive(Debug, Clone, Copy)]
pub(super) enum Use<'a> {
    /// An exclusion, by name: a hold.
    Hold(&'a str),
    /// A selection: `not_exists` (its related rows keep the target row, as a hold does) or
    /// `exists`.
    Selection {
        /// Whether it is `not_exists`.
        keeps: bool,
    },
}

/// A foreign key of the related table that references the target.
struct HoldKey {
    name: String,
    on_delete: String,
    /// Whether its columns are exactly the `on` pairs (the only key that ties a hold to the row).
    exact: bool,
}

/// check-config's findings on one related-rows rule at `path` of a policy over `target`
/// (`target_info`): the table and its columns exist and the role may read it, each `on` pair
/// has one type, `where` values cast to their columns, an index serves the lookup, and — for a
/// hold — what a hold committed while a delete runs does. Also returns the foreign keys whose
/// `ON DELETE` the finding already speaks for.
pub(super) async fn check(
    pool: &PgPool,
    target: &Target,
    target_info: &TableInfo,
    r: &Related,
    (path, role): (&str, Use<'_>),
    literals: &Literals,
) -> sqlx::Result<(Vec<(Level, String)>, Vec<String>)> {
    let mut out = Vec::new();
    // Without USAGE on its schema even resolving the table's name fails (42501).
    if let Some(line) = super::check::missing_usage(pool, &r.table.schema).await? {
        out.push((Level::Error, format!("{path}.table: {line}")));
        return Ok((out, vec![]));
    }
    let Some(info) = TableInfo::load(pool, &r.table).await? else {
        out.push((
            Level::Error,
            format!("{path}.table: table {} does not exist", r.table),
        ));
        return Ok((out, vec![]));
    };
    // SELECT on the columns it reads is enough (a column grant, as deploy/roles.sql advises).
    let read: Vec<&str> =
        r.on.iter()
            .map(|p| p.related.as_str())
            .chain(r.where_.iter().map(|w| w.column.as_str()))
            .filter(|c| info.columns.contains_key(*c))
            .collect();
    let (db_role, unreadable): (String, Vec<String>) = sqlx::query_as(
        "select quote_ident(current_user),
                coalesce((select array_agg(c order by i) from unnest($2::text[]) with ordinality u(c, i)
                           where not has_column_privilege(to_regclass($1), c, 'SELECT')), '{}')",
    )
    .bind(r.table.quoted())
    .bind(&read)
    .fetch_one(pool)
    .await?;
    let readable = unreadable.is_empty();
    if info.row_security {
        out.push((
            Level::Error,
            format!("{path}.table: {}", row_security_hides(&r.table)),
        ));
    }
    if !readable {
        out.push((
            Level::Error,
            format!(
                "{path}.table: privileges: role {db_role} lacks SELECT on column{} {} of {}: \
                 grant select ({}) on {} to {db_role}",
                if unreadable.len() == 1 { "" } else { "s" },
                unreadable.join(", "),
                r.table,
                unreadable
                    .iter()
                    .map(|c| format!("\"{}\"", c.replace('"', "\"\"")))
                    .collect::<Vec<_>>()
                    .join(", "),
                r.table.quoted()
            ),
        ));
    }
    for (i, p) in r.on.iter().enumerate() {
        let at = format!("{path}.on[{i}]");
        let (Some(a), Some(b)) = (
            info.columns.get(p.related.as_str()),
            target_info.columns.get(p.target.as_str()),
        ) else {
            if !info.columns.contains_key(p.related.as_str()) {
                out.push((
                    Level::Error,
                    format!(
                        "{at}.related: column {} does not exist in {}",
                        p.related.as_str(),
                        r.table
                    ),
                ));
            }
            if !target_info.columns.contains_key(p.target.as_str()) {
                out.push((
                    Level::Error,
                    format!(
                        "{at}.target: column {} does not exist in {}",
                        p.target.as_str(),
                        target.table
                    ),
                ));
            }
            continue;
        };
        let (theirs, ours) = (
            format!("{}.{}", r.table, p.related.as_str()),
            format!("{}.{}", target.table, p.target.as_str()),
        );
        if a.type_sql != b.type_sql {
            out.push((
                Level::Error,
                format!(
                    "{at}: {theirs} is {} but {ours} is {}; the columns of a pair must have one \
                     type (an implicit cast could change which rows are equal and keep any index \
                     from serving the lookup)",
                    a.type_sql, b.type_sql
                ),
            ));
        } else if a.collation != b.collation {
            out.push((
                Level::Error,
                format!(
                    "{at}: {theirs} is collated {} but {ours} is collated {}; the columns of a \
                     pair must compare under one collation",
                    a.collation.as_deref().unwrap_or("(none)"),
                    b.collation.as_deref().unwrap_or("(none)")
                ),
            ));
        } else if !has_equality(pool, &a.type_sql).await? {
            out.push((
                Level::Error,
                format!(
                    "{at}: {theirs} and {ours} are {}, which has no equality operator; pair \
                     columns that compare with =",
                    a.type_sql
                ),
            ));
        }
    }
    for (i, w) in r.where_.iter().enumerate() {
        let Some(c) = info.columns.get(w.column.as_str()) else {
            out.push((
                Level::Error,
                format!(
                    "{path}.where[{i}]: column {} does not exist in {}",
                    w.column.as_str(),
                    r.table
                ),
            ));
            continue;
        };
        let at = format!("{path}.where[{i}]");
        out.extend(check_values(pool, &at, &w.column, &w.test, c, literals.get(&at)).await?);
    }
    if !has_lookup_index(pool, r).await? {
        let cols: Vec<&str> = r.on.iter().map(|p| p.related.as_str()).collect();
        out.push((
            Level::Warning,
            format!(
                "{path}: no index of {} leads with {}; every row the rule tests scans it \
                 (create index on {} ({}))",
                r.table,
                cols.join(", "),
                r.table,
                cols.join(", ")
            ),
        ));
    }
    // An exclusion's rows, and a `not_exists` selection's, keep the target row: what one
    // committed while a delete runs does is theirs to say. (An `exists` selection's rows are
    // the reason to act; its foreign keys are reported as any other.)
    let name = match role {
        Use::Hold(name) => name,
        Use::Selection { keeps: true } => "not_exists",
        Use::Selection { keeps: false } => return Ok((out, vec![])),
    };
    let keys = hold_keys(pool, target, r).await?;
    let covered = keys
        .iter()
        .map(|k| format!("{}:{}", r.table, k.name))
        .collect();
    out.push(concurrency(target, r, name, path, &keys));
    // The key makes every referencing row block the delete, also one `where` no longer
    // matches (a released hold): its target row can then never be deleted.
    if let Some(k) = keys.iter().find(|k| k.exact && !r.where_.is_empty()) {
        out.push((
            Level::Warning,
            format!(
                "{path} ({name}): a row of {} that no longer matches `where` (a released hold) \
                 still references its row through foreign key {}: the delete fails \
                 (SQLSTATE 23503) and the item is recorded `failed`, an item dead letter, until \
                 that row is deleted; delete released holds, or test them without `where`",
                r.table, k.name
            ),
        ));
    }
    Ok((out, covered))
}

/// What a hold committed while a command deletes does, for the hold `name` at `path`.
fn concurrency(
    target: &Target,
    r: &Related,
    name: &str,
    path: &str,
    keys: &[HoldKey],
) -> (Level, String) {
    // Any such key, on whichever columns: deleting a row would delete or blank the rows that
    // reference it, a hold among them.
    if let Some(k) = keys
        .iter()
        .find(|k| matches!(k.on_delete.as_str(), "CASCADE" | "SET NULL" | "SET DEFAULT"))
    {
        return (
            Level::Error,
            format!(
                "{path} ({name}): foreign key {} on {} references {} with ON DELETE {}: deleting \
                 a row would {} the hold itself; make it ON DELETE NO ACTION or RESTRICT",
                k.name,
                r.table,
                target.table,
                k.on_delete,
                if k.on_delete == "CASCADE" {
                    "delete"
                } else {
                    "rewrite"
                }
            ),
        );
    }
    if let Some(k) = keys.iter().find(|k| k.exact) {
        return (
            Level::Info,
            format!(
                "{path} ({name}): a hold committed while a command deletes is safe: foreign key \
                 {} on {} references {} on exactly the `on` columns with ON DELETE {}, so of a \
                 hold's insert and the delete of its row, whichever commits second fails \
                 (SQLSTATE 23503): a delete that meets a new hold is redone and the row \
                 recorded `excluded` as {name}; a hold whose insert fails names a row already \
                 deleted",
                k.name, r.table, target.table, k.on_delete
            ),
        );
    }
    (
        Level::Warning,
        format!(
            "{path} ({name}): a hold committed while a delete statement runs can miss it: the \
             delete re-reads the target row's own columns at their newest version, but reads {} \
             as of the moment its statement began (READ COMMITTED), so a hold inserted later is \
             honoured by every delete that starts after it commits, not by those already running \
             (up to max_concurrent_commands commands of batch_size rows). This is the case for \
             any hold kept per customer or per matter. It is closed when the application, in the \
             hold's transaction, also sets a column of the target rows that an own-column \
             exclusion tests (check-config cannot see that), or, for holds per row, when {} \
             references {} with a foreign key on exactly the `on` columns (ON DELETE NO ACTION \
             or RESTRICT); see docs/configuration.md, \"Holds kept in another table\"",
            r.table, r.table, target.table
        ),
    )
}

/// Whether values of `type_sql` (a type as `format_type` writes it) compare with `=`.
async fn has_equality(pool: &PgPool, type_sql: &str) -> sqlx::Result<bool> {
    let sql = format!("select null::{type_sql} = null::{type_sql}");
    match sqlx::query(&sql).execute(pool).await {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether a valid, non-partial index of the related table has the `on` columns first (in any
/// order).
async fn has_lookup_index(pool: &PgPool, r: &Related) -> sqlx::Result<bool> {
    let indexes: Vec<Vec<String>> = sqlx::query_scalar(
        "select array(select coalesce(a.attname::text, '')
                        from unnest(i.indkey::int2[]) with ordinality k(n, o)
                        left join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.n
                       where k.o <= i.indnkeyatts order by k.o)
           from pg_index i
          where i.indrelid = to_regclass($1) and i.indisvalid and i.indpred is null",
    )
    .bind(r.table.quoted())
    .fetch_all(pool)
    .await?;
    let n = r.on.len();
    Ok(indexes.iter().any(|ix| {
        ix.len() >= n
            && r.on
                .iter()
                .all(|p| ix[..n].iter().any(|c| c == p.related.as_str()))
    }))
}

/// The foreign keys of the related table that reference the target on exactly the `on` pairs.
async fn hold_keys(pool: &PgPool, target: &Target, r: &Related) -> sqlx::Result<Vec<HoldKey>> {
    let rows: Vec<(String, Vec<String>, Vec<String>, String)> = sqlx::query_as(
        "select c.conname::text,
                array(select a.attname::text from unnest(c.conkey) with ordinality k(n, o)
                        join pg_attribute a on a.attrelid = c.conrelid and a.attnum = k.n
                       order by k.o),
                array(select a.attname::text from unnest(c.confkey) with ordinality k(n, o)
                        join pg_attribute a on a.attrelid = c.confrelid and a.attnum = k.n
                       order by k.o),
                case c.confdeltype when 'a' then 'NO ACTION' when 'r' then 'RESTRICT'
                                   when 'c' then 'CASCADE' when 'n' then 'SET NULL'
                                   when 'd' then 'SET DEFAULT' end
           from pg_constraint c
          where c.contype = 'f' and c.conrelid = to_regclass($1)
            and c.confrelid = to_regclass($2)
          order by c.conname",
    )
    .bind(r.table.quoted())
    .bind(target.table.quoted())
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, from, to, on_delete)| {
            let exact = from.len() == r.on.len()
                && from.iter().zip(&to).all(|(f, t)| {
                    r.on.iter()
                        .any(|p| p.related.as_str() == f && p.target.as_str() == t)
                });
            HoldKey {
                name,
                on_delete,
                exact,
            }
        })
        .collect())
}

/// check-config's findings on one value test's values at `path` against column `c`: a boolean
/// or a number written for a column of another kind (it would be cast to that type as text and
/// match something else than meant: `true` against a text column is the string 'true', never
/// 't'), and a value the column's type refuses.
pub(super) async fn check_values(
    pool: &PgPool,
    path: &str,
    column: &Ident,
    test: &ExclusionTest,
    c: &ColumnInfo,
    literals: Option<&Vec<Literal>>,
) -> sqlx::Result<Vec<(Level, String)>> {
    let mut out = Vec::new();
    for lit in literals.into_iter().flatten() {
        let textual = matches!(
            c.type_name.as_str(),
            "text" | "varchar" | "bpchar" | "name" | "citext"
        );
        let mismatch = match lit {
            Literal::Bool => c.type_name != "bool",
            Literal::Number => textual || c.type_name == "bool",
            Literal::Text => false,
        };
        if mismatch {
            out.push((
                Level::Error,
                format!(
                    "{path}: a {} value is given for column {}, which is {}: write the value as a \
                     string exactly as the column holds it",
                    match lit {
                        Literal::Bool => "boolean",
                        Literal::Number => "number",
                        Literal::Text => "string",
                    },
                    column.as_str(),
                    c.type_sql
                ),
            ));
        }
    }
    for v in test.values() {
        let sql = format!("select cast($1 as {}) is not null", c.type_sql);
        if let Err(err) = sqlx::query(&sql).bind(&v).execute(pool).await {
            let why = err
                .as_database_error()
                .map(|d| d.message().to_string())
                .unwrap_or_else(|| err.to_string());
            out.push((
                Level::Error,
                format!(
                    "{path}: value `{v}` is not a valid {} for column {}: {why}",
                    c.type_sql,
                    column.as_str()
                ),
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(extra: &str) -> Result<Policy, Vec<String>> {
        let text = format!(
            "name = 'p'\nschedule = {{ cron = '0 2 * * *' }}\n\
             target = {{ table = 'demo.tickets', key = 'id', timestamp = 'closed_at' }}\n{extra}"
        );
        let c: PolicyConfig = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Toml))
            .build()
            .unwrap()
            .try_deserialize()
            .unwrap();
        Policy::from_config(c)
    }

    const HOLD: &str = "retain_for = '90d'\nexclude = [ { name = 'legal_hold', exists = { \
        table = 'legal.holds', on = [ { related = 'customer_id', target = 'customer_id' } ], \
        where = [ { column = 'released_at', is_null = true }, { column = 'scope', in = ['all', 1] } ] } } ]";

    #[test]
    fn a_related_exclusion_is_versioned_and_reads_back_from_its_json() {
        let p = policy(HOLD).unwrap();
        let json = serde_json::to_string(&p.spec.exclude[0]).unwrap();
        assert_eq!(
            json,
            r#"{"name":"legal_hold","exists":{"table":{"schema":"legal","name":"holds"},"on":[{"related":"customer_id","target":"customer_id"}],"where":[{"column":"released_at","test":{"op":"is_null"}},{"column":"scope","test":{"op":"in","values":["all","1"]}}]}}"#
        );
        // The ledger reads pinned versions back from this JSON.
        let spec: PolicySpec =
            serde_json::from_value(serde_json::to_value(&p.spec).unwrap()).unwrap();
        assert_eq!(spec, p.spec);
        assert_eq!(
            p.literals["exclude[0].exists.where[1]"],
            vec![Literal::Text, Literal::Number]
        );
        assert_eq!(p.spec.tables().len(), 2);
        let plain =
            policy("retain_for = '90d'\nexclude = [ { column = 'x', equals = 1 } ]").unwrap();
        assert_ne!(p.version, plain.version);
    }

    /// The TOML 1.0 form the docs show (a table per exclusion, dotted keys) reads as the inline
    /// form does.
    #[test]
    fn the_documented_table_form_reads_as_the_inline_form() {
        let inline = policy(HOLD).unwrap();
        let table = policy(
            "retain_for = '90d'\n[[exclude]]\nname = 'legal_hold'\n\
             exists.table = 'legal.holds'\n\
             exists.on = [ { related = 'customer_id', target = 'customer_id' } ]\n\
             exists.where = [ { column = 'released_at', is_null = true },\n\
             { column = 'scope', in = ['all', 1] } ]\n",
        )
        .unwrap();
        assert_eq!(inline.version, table.version);
    }

    #[test]
    fn a_column_selection_keeps_its_json_and_related_ones_read_back() {
        let p = policy(
            "allow_delete = true\nselect = [ { column = 'status', equals = 'active' }, \
             { not_exists = { table = 'billing.invoices', on = [ { related = 'ticket_id', target = 'id' } ] } } ]",
        )
        .unwrap();
        let json = serde_json::to_value(&p.spec.select).unwrap();
        assert_eq!(
            json[0].to_string(),
            r#"{"column":"status","test":{"op":"equals","value":"active"}}"#
        );
        assert_eq!(
            json[1].to_string(),
            r#"{"not_exists":{"on":[{"related":"ticket_id","target":"id"}],"table":{"name":"invoices","schema":"billing"}}}"#
        );
        let back: Vec<crate::policy::select::Selection> = serde_json::from_value(json).unwrap();
        assert_eq!(back, p.spec.select);
        assert_eq!(
            back[1].unselected_reason(),
            "not_selected:not_exists:billing.invoices"
        );
    }

    #[test]
    fn a_related_rule_names_the_field_it_gets_wrong() {
        let errs = |extra: &str| policy(extra).unwrap_err().join("\n");
        let five = (0..5)
            .map(|i| format!("{{ related = 'a{i}', target = 'b{i}' }}"))
            .collect::<Vec<_>>()
            .join(", ");
        let e = errs(&format!(
            "retain_for = '90d'\nexclude = [ {{ exists = {{ table = 'h', on = [ {five} ] }} }} ]"
        ));
        assert!(
            e.contains("exclude[0]: exists.on: pair 1-4 columns of public.h"),
            "{e}"
        );
        let e = errs(
            "retain_for = '90d'\nexclude = [ { exists = { table = 'h', on = [ \
             { related = 'a', target = 'b' }, { related = 'a', target = 'b' } ] } } ]",
        );
        assert_eq!(e, "exclude[0]: exists.on[1]: repeats an earlier pair");
        let e = errs(
            "retain_for = '90d'\nexclude = [ { equals = 1, exists = { table = 'h', on = [ \
             { related = 'a', target = 'b' } ] } } ]",
        );
        assert!(
            e.starts_with("exclude[0]: `exists` takes its tests in its own `where`"),
            "{e}"
        );
        let e = errs("retain_for = '90d'\nexclude = [ { name = 'x' } ]");
        assert!(
            e.starts_with("exclude[0]: give `column` with one of"),
            "{e}"
        );
        let e = errs(
            "allow_delete = true\nselect = [ { column = 'a', exists = { table = 'h', on = [ \
             { related = 'a', target = 'b' } ] } } ]",
        );
        assert!(e.starts_with("select[0]: `exists` stands alone"), "{e}");
        let e = errs(
            "allow_delete = true\nselect = [ { not_exists = { table = 'h', on = [ \
             { related = 'a b', target = 'b' } ] } } ]",
        );
        assert!(
            e.starts_with(
                "select[0]: not_exists.on[0].related: `a b` is not a plain SQL identifier"
            ),
            "{e}"
        );
    }
}
