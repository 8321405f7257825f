//! What the database says a target table looks like: its columns and their types, cached per
//! process and read again after [`CATALOG_MAX_AGE`] or a schema error.

use super::*;

/// Column facts read from the catalog, so configured values can be cast to each column's type.
#[derive(Debug, Clone)]
pub struct TableInfo {
    /// Column name → (`format_type` text, `typname`, is it NOT NULL).
    pub columns: HashMap<String, ColumnInfo>,
    /// The column names of each valid unique index that is neither partial nor on expressions,
    /// in index order (included columns left out); the primary key first.
    pub unique_indexes: Vec<Vec<String>>,
    /// Whether row security applies to the connecting role's reads of the table
    /// (`row_security_active`): rows a policy hides are not there for it.
    pub row_security: bool,
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
    /// Its collation (`"C"`, `"default"`), for a collatable type.
    pub collation: Option<String>,
}

impl TableInfo {
    /// Reads `table`'s columns; `Ok(None)` when the table does not exist.
    pub async fn load(pool: &PgPool, table: &TableName) -> sqlx::Result<Option<TableInfo>> {
        TableInfo::load_on(&mut *pool.acquire().await?, table).await
    }

    /// [`TableInfo::load`] on one connection.
    pub async fn load_on(
        conn: &mut sqlx::PgConnection,
        table: &TableName,
    ) -> sqlx::Result<Option<TableInfo>> {
        // A type outside pg_catalog is named with its schema (`demo.int8`), so a type that
        // shadows a built-in name is never taken for it.
        let rows: Vec<(String, String, String, bool, Option<String>)> = sqlx::query_as(
            "select a.attname::text, format_type(a.atttypid, a.atttypmod),
                    case when t.typnamespace = 'pg_catalog'::regnamespace then t.typname::text
                         else t.typnamespace::regnamespace::text || '.' || t.typname end,
                    a.attnotnull,
                    case when a.attcollation <> 0 then a.attcollation::regcollation::text end
               from pg_attribute a join pg_type t on t.oid = a.atttypid
              where a.attrelid = to_regclass($1) and a.attnum > 0 and not a.attisdropped",
        )
        .bind(table.quoted())
        .fetch_all(&mut *conn)
        .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        // An index that compares a column under another collation than the column's, or under a
        // nondeterministic one (`'a'` equal to `'A'`), does not make the key: the keyset walk,
        // the key match and the item key text would disagree about which rows are one.
        let unique_indexes: Vec<Vec<String>> = sqlx::query_scalar(
            "select array(select a.attname::text
                            from unnest(i.indkey) with ordinality k(n, o)
                            join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.n
                           where k.o <= i.indnkeyatts order by k.o)
               from pg_index i
              where i.indrelid = to_regclass($1) and i.indisunique and i.indisvalid
                and i.indpred is null and i.indexprs is null
                and not exists (
                    select 1
                      from unnest(i.indkey::int2[], i.indcollation::oid[]) with ordinality
                           k(n, coll, o)
                      join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.n
                      left join pg_collation c on c.oid = k.coll
                     where k.o <= i.indnkeyatts
                       and (k.coll is distinct from a.attcollation
                            or not coalesce(c.collisdeterministic, true)))
              order by i.indisprimary desc, i.indexrelid",
        )
        .bind(table.quoted())
        .fetch_all(&mut *conn)
        .await?;
        let row_security: bool = sqlx::query_scalar("select row_security_active(to_regclass($1))")
            .bind(table.quoted())
            .fetch_one(&mut *conn)
            .await?;
        Ok(Some(TableInfo {
            unique_indexes,
            row_security,
            columns: rows
                .into_iter()
                .map(|(name, type_sql, type_name, not_null, collation)| {
                    (
                        name,
                        ColumnInfo {
                            type_sql,
                            type_name,
                            not_null,
                            collation,
                        },
                    )
                })
                .collect(),
        }))
    }

    /// The unique index whose columns are exactly `key`'s (in any order), if there is one.
    pub fn unique_index_of(&self, key: &KeyColumns) -> Option<&[String]> {
        self.unique_indexes
            .iter()
            .find(|ix| {
                ix.len() == key.columns().len()
                    && key
                        .columns()
                        .iter()
                        .all(|c| ix.iter().any(|n| n == c.as_str()))
            })
            .map(Vec::as_slice)
    }

    /// `key` resolved against this table: each column's key type, walked in the order of the
    /// unique index that makes it. Err names a missing column or a type a key cannot have.
    pub fn key(&self, key: &KeyColumns) -> Result<Key, String> {
        let mut types = Vec::with_capacity(key.columns().len());
        for c in key.columns() {
            let info = self
                .columns
                .get(c.as_str())
                .ok_or_else(|| format!("key column `{}` does not exist", c.as_str()))?;
            types.push(KeyType::from_type_name(&info.type_name).ok_or_else(|| {
                format!(
                    "key column `{}` is {}; a key column is {KEY_TYPES}",
                    c.as_str(),
                    info.type_sql
                )
            })?);
        }
        Ok(Key::new(key, types, self.unique_index_of(key)))
    }

    pub(super) fn type_of(&self, column: &Ident) -> Result<&str, String> {
        self.columns
            .get(column.as_str())
            .map(|c| c.type_sql.as_str())
            .ok_or_else(|| format!("column `{}` does not exist", column.as_str()))
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
    ) -> Result<std::sync::Arc<TableInfo>, crate::retry::Setback> {
        if let Some((at, t)) = self.tables.lock().expect("catalog lock").get(table)
            && at.elapsed() < CATALOG_MAX_AGE
        {
            return Ok(t.clone());
        }
        let info = TableInfo::load(pool, table)
            .await
            .map_err(|e| crate::retry::Setback::from_db(&e))?
            .ok_or_else(|| {
                crate::retry::Setback::held(
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

    /// The columns of every table `specs` read (their target and related tables); a missing
    /// table holds the work.
    pub async fn tables(
        &self,
        pool: &PgPool,
        specs: &[&PolicySpec],
    ) -> Result<Tables, crate::retry::Setback> {
        let mut out = Tables::default();
        for spec in specs {
            for t in spec.tables() {
                if !out.0.contains_key(t) {
                    out.0.insert(t.clone(), self.get(pool, t).await?);
                }
            }
        }
        Ok(out)
    }

    /// Forgets every table `spec` reads (after a schema error).
    pub fn forget_all(&self, spec: &PolicySpec) {
        for t in spec.tables() {
            self.forget(t);
        }
    }
}

/// The tables a rule set reads, by name: its target and its related tables.
#[derive(Debug, Clone, Default)]
pub struct Tables(HashMap<TableName, std::sync::Arc<TableInfo>>);

impl Tables {
    /// `table`'s columns, if it was read.
    pub fn get(&self, table: &TableName) -> Option<&TableInfo> {
        self.0.get(table).map(|t| t.as_ref())
    }

    /// Adds `table`'s columns.
    pub fn insert(&mut self, table: TableName, info: TableInfo) {
        self.0.insert(table, std::sync::Arc::new(info));
    }
}

/// The column types of every table `spec` reads, as this replica checks them at start-up
/// ([`CheckedTypes`]): the target's under their bare names, a related table's under
/// [`crate::policy::related::Related::type_key`].
pub async fn checked_types(pool: &PgPool, spec: &PolicySpec) -> sqlx::Result<CheckedTypes> {
    let mut out = CheckedTypes::new();
    if let Some(t) = TableInfo::load(pool, &spec.target.table).await? {
        out.extend(t.types());
    }
    for r in spec.related() {
        if let Some(t) = TableInfo::load(pool, &r.table).await? {
            out.extend(
                t.types()
                    .into_iter()
                    .map(|(c, ty)| (format!("{}.{c}", r.table), ty)),
            );
        }
    }
    Ok(out)
}
