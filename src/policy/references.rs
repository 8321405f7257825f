//! Whether the cause of an item's failure is gone: rows of other tables that still reference it
//! through a foreign key that refuses the delete (ON DELETE NO ACTION or RESTRICT, SQLSTATE
//! 23503 when violated). Read with `SELECT EXISTS` per constraint under a short
//! `lock_timeout` — never a trial delete — so asking cannot take the locks a delete would.

use std::collections::HashMap;

use serde::Serialize;
use sqlx::{PgPool, Postgres, QueryBuilder};

use super::spec::Target;
use super::{Key, TableInfo};

/// A foreign key that still references an item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reference {
    /// The constraint's name.
    pub constraint: String,
    /// The referencing table, as `regclass` prints it.
    pub table: String,
}

/// How long the check waits for a lock before it gives up (and answers `unknown`).
const LOCK_TIMEOUT: &str = "500ms";

/// The target's key resolved against its table as the catalog says it is now; Err says why it
/// cannot be (the table is gone, a key column is gone or of a type a key cannot have).
pub async fn key(pool: &PgPool, target: &Target) -> sqlx::Result<Result<Key, String>> {
    Ok(match TableInfo::load(pool, &target.table).await? {
        Some(t) => t.key(&target.key),
        None => Err(format!("table {} does not exist", target.table)),
    })
}

/// What [`still_referenced`] found.
#[derive(Debug, Default)]
pub struct Found {
    /// Per key still referenced: the constraints and referencing tables.
    pub referenced: HashMap<String, Vec<Reference>>,
    /// The names of the constraints checked: the refusing foreign keys that reference the
    /// target directly. A failure naming another constraint (one further down a cascade, or a
    /// SET DEFAULT whose default is no key) was not re-checked.
    pub checked: Vec<String>,
}

/// For each of `keys` (the target's keys as text) still referenced through a refusing foreign
/// key: the constraints and referencing tables. One statement per such constraint, all keys at
/// once, in one read-only transaction with `lock_timeout` set; Err on a lock timeout or any
/// other failure (the caller answers `unknown`). A partitioned referencing table counts once
/// (its partitions' cloned constraints are skipped).
pub async fn still_referenced(
    pool: &PgPool,
    target: &Target,
    keys: &[String],
) -> sqlx::Result<Found> {
    let mut out = Found::default();
    if keys.is_empty() {
        return Ok(out);
    }
    let Ok(key) = key(pool, target).await? else {
        return Ok(out);
    };
    let mut tx = pool.begin().await?;
    sqlx::query("set transaction read only")
        .execute(&mut *tx)
        .await?;
    sqlx::query(&format!("set local lock_timeout = '{LOCK_TIMEOUT}'"))
        .execute(&mut *tx)
        .await?;
    sqlx::query("set local statement_timeout = '5s'")
        .execute(&mut *tx)
        .await?;
    // (name, referencing table, its columns, the target's columns), quoted, in key order.
    let constraints: Vec<(String, String, Vec<String>, Vec<String>)> = sqlx::query_as(
        "select c.conname::text, c.conrelid::regclass::text,
                array(select quote_ident(a.attname) from unnest(c.conkey) with ordinality k(n, i)
                        join pg_attribute a on a.attrelid = c.conrelid and a.attnum = k.n
                       order by k.i),
                array(select quote_ident(a.attname) from unnest(c.confkey) with ordinality k(n, i)
                        join pg_attribute a on a.attrelid = c.confrelid and a.attnum = k.n
                       order by k.i)
           from pg_constraint c
          where c.contype = 'f' and c.confrelid = to_regclass($1) and c.confdeltype in ('a', 'r')
            and c.conparentid = 0
          order by c.conname",
    )
    .bind(target.table.quoted())
    .fetch_all(&mut *tx)
    .await?;
    let table = target.table.quoted();
    for (name, referencing, from, to) in constraints {
        out.checked.push(name.clone());
        let on = from
            .iter()
            .zip(&to)
            .map(|(f, t)| format!("r.{f} = t.{t}"))
            .collect::<Vec<_>>()
            .join(" and ");
        // Names come from the catalog, quoted by quote_ident / regclass; keys are bound.
        let mut q = QueryBuilder::<Postgres>::new(format!(
            "select {} from {table} t where ",
            key.text_sql("t.")
        ));
        key.push_in(&mut q, "t.", keys.to_vec());
        q.push(format!(
            " and exists (select 1 from {referencing} r where {on})"
        ));
        let hit: Vec<String> = q.build_query_scalar().fetch_all(&mut *tx).await?;
        for k in hit {
            out.referenced.entry(k).or_default().push(Reference {
                constraint: name.clone(),
                table: referencing.clone(),
            });
        }
    }
    tx.rollback().await?;
    Ok(out)
}
