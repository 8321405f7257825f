//! A declaratively partitioned target (docs/design.md §14 "Partitioned targets"): its leaf partitions in bound order,
//! and the predicate that confines a statement to one of them.
//!
//! A partitioned target is always addressed through its parent. Planning walks it one leaf at a
//! time, in bound order, skipping the leaves whose range on the policy's timestamp lies entirely
//! at or after the cutoff; each command names the leaf its keys were planned in. A statement
//! for one leaf carries the leaf's partition constraint as PostgreSQL prints it
//! (`pg_get_partition_constraintdef`: constants, not parameters), so the plan is pruned to that
//! leaf when it is made, generic or custom, and no other partition is opened or locked. The
//! constraint is read afresh in the statement's transaction, and only while the leaf is still
//! attached under the target: a leaf detached, dropped or renamed since planning gives no
//! constraint, and the command's statements then address the whole target by its keys.

use sqlx::{PgConnection, Postgres, QueryBuilder, Row};

use super::{TableName, Target};

/// How a policy retires a partitioned target's expired partitions (`partitions = ...`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Retirement {
    /// Row by row, like any table.
    #[default]
    Rows,
    /// The partition sweep: detached, exported, recorded and dropped whole.
    Drop,
}

/// One leaf partition of a target, as planning walks it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Leaf {
    /// Its name, schema-qualified and quoted as needed (`quote_ident`).
    pub name: String,
    /// Its bound as PostgreSQL prints it (`FOR VALUES FROM (...) TO (...)`, `DEFAULT`); for a
    /// sub-partition, its own level's.
    pub bound: String,
    /// The lower end of its range on the policy's timestamp, when a level of the tree is range
    /// partitioned on that column alone (RFC 3339; `None`: unbounded below, or not known).
    pub timestamp_from: Option<chrono::DateTime<chrono::Utc>>,
    /// The upper end (exclusive), likewise.
    pub timestamp_to: Option<chrono::DateTime<chrono::Utc>>,
    /// Whether it is a default partition (at any level).
    pub default: bool,
}

impl Leaf {
    /// Whether every row the leaf can hold is at or after `cutoff` (its range on the timestamp
    /// starts there or later): planning skips it, no row in it is old enough.
    pub fn newer_than(&self, cutoff: chrono::DateTime<chrono::Utc>) -> bool {
        self.timestamp_from.is_some_and(|from| from >= cutoff)
    }
}

/// How a target is laid out, as planning walks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Not a partitioned table.
    Plain,
    /// Partitioned by range or list at every level: walked one leaf at a time.
    Partitioned,
    /// Some level is hash partitioned: a hash leaf's constraint (`satisfies_hash_partition`)
    /// prunes nothing, so a scan confined to it would still read every sibling; the table is
    /// walked through its parent as a plain table is, commands across partitions.
    Hashed,
}

/// How `table` is laid out.
pub async fn layout(conn: &mut PgConnection, table: &TableName) -> sqlx::Result<Layout> {
    let (partitioned, hashed): (bool, bool) = sqlx::query_as(
        "select coalesce((select relkind = 'p' from pg_class where oid = to_regclass($1)), false),
                exists (select 1 from pg_partition_tree(to_regclass($1)) t
                          join pg_partitioned_table pt on pt.partrelid = t.relid
                         where pt.partstrat = 'h')",
    )
    .bind(table.quoted())
    .fetch_one(conn)
    .await?;
    Ok(match (partitioned, hashed) {
        (false, _) => Layout::Plain,
        (true, false) => Layout::Partitioned,
        (true, true) => Layout::Hashed,
    })
}

/// The leaf partitions of `target` (empty when it is not partitioned), in bound order: by the
/// lower end of their range on the policy's timestamp (unbounded first), default partitions
/// last, then by name. One statement.
pub async fn leaves(
    conn: &mut PgConnection,
    target: &Target,
    timestamp_type: &str,
) -> sqlx::Result<Vec<Leaf>> {
    // Each level of a leaf's ancestry (the leaf included) that is range partitioned on the
    // timestamp column alone bounds the leaf's range: the latest lower and the earliest upper
    // end. A bound's side is a quoted literal, MINVALUE or MAXVALUE.
    let mut q = QueryBuilder::<Postgres>::new(
        "with leaf as (
             select l.oid, quote_ident(n.nspname) || '.' || quote_ident(l.relname) as name,
                    pg_get_expr(l.relpartbound, l.oid) as bound
               from pg_partition_tree(to_regclass(",
    );
    q.push_bind(target.table.quoted());
    q.push(
        ")) t
               join pg_class l on l.oid = t.relid
               join pg_namespace n on n.oid = l.relnamespace
              where t.isleaf and l.relkind = 'r'),
         level as (
             select leaf.oid as leaf, pg_get_expr(a.relpartbound, a.oid) as bound,
                    pt.partstrat, pt.partnatts, pt.partattrs[0] as attnum, i.inhparent
               from leaf
               cross join lateral pg_partition_ancestors(leaf.oid) anc(relid)
               join pg_class a on a.oid = anc.relid and a.relispartition
               join pg_inherits i on i.inhrelid = a.oid
               join pg_partitioned_table pt on pt.partrelid = i.inhparent),
         ranged as (
             select lv.leaf, m[1] as lo, m[2] as hi
               from level lv
               join pg_attribute att on att.attrelid = lv.inhparent and att.attnum = lv.attnum
               cross join lateral regexp_match(lv.bound, '^FOR VALUES FROM \\((.*)\\) TO \\((.*)\\)$') m
              where lv.partstrat = 'r' and lv.partnatts = 1 and att.attname = ",
    );
    q.push_bind(target.timestamp.as_str().to_string());
    q.push(
        "),
         ends as (
             select leaf,
                    max(",
    );
    push_literal_as_timestamp(&mut q, "lo", timestamp_type, target);
    q.push(") as ts_from, min(");
    push_literal_as_timestamp(&mut q, "hi", timestamp_type, target);
    q.push(
        ") as ts_to
               from ranged group by leaf)
         select leaf.name, leaf.bound,
                case when isfinite(e.ts_from) then e.ts_from end as ts_from,
                case when isfinite(e.ts_to) then e.ts_to end as ts_to,
                exists (select 1 from level lv where lv.leaf = leaf.oid and lv.bound = 'DEFAULT')
                    as is_default
           from leaf left join ends e on e.leaf = leaf.oid
          order by is_default, ts_from nulls first, leaf.name",
    );
    let rows = q.build().fetch_all(conn).await?;
    Ok(rows
        .iter()
        .map(|r| Leaf {
            name: r.get("name"),
            bound: r.get("bound"),
            timestamp_from: r.get("ts_from"),
            timestamp_to: r.get("ts_to"),
            default: r.get("is_default"),
        })
        .collect())
}

/// Pushes the bound side `column` (a quoted literal, or MINVALUE / MAXVALUE: NULL) as the
/// policy's timestamp, a `timestamptz` (a `timestamp` column's literal read in its zone).
fn push_literal_as_timestamp(
    q: &mut QueryBuilder<'_, Postgres>,
    column: &str,
    timestamp_type: &str,
    target: &Target,
) {
    // `timestamp_type` is the column's type as `format_type` printed it; the zone was validated
    // against the IANA database: both safe in the statement's text.
    let literal = format!(
        "cast(case when {column} like '''%''' then replace(substr({column}, 2, length({column}) - 2), '''''', '''') end as {timestamp_type})"
    );
    match &target.timestamp_zone {
        Some(zone) => q.push(format!("({literal} at time zone '{zone}')")),
        None => q.push(literal),
    };
}

/// The first of `leaves[from..]` still attached under `target` (`target` among its ancestors:
/// the policy's table may itself be a partition), with its position and its current partition
/// constraint (`true` for the only partition of a tree, a default one, which has none); `None`
/// when every one was detached, dropped or renamed since. Only that leaf's constraint is read,
/// which takes its ACCESS SHARE lock until the transaction ends, so it cannot be detached under
/// the statements that use it; the others are looked up in the catalog without a lock. One
/// statement.
pub async fn next_attached(
    conn: &mut PgConnection,
    target: &TableName,
    leaves: &[String],
    from: usize,
) -> sqlx::Result<Option<(usize, String)>> {
    let found: Option<(i64, String)> = sqlx::query_as(
        "select f.n, coalesce(pg_get_partition_constraintdef(f.oid), 'true')
           from (select l.n, c.oid
                   from unnest($2::text[]) with ordinality l(name, n)
                   join pg_class c on c.oid = to_regclass(l.name)
                  where l.n > $3 and c.relispartition and c.relkind = 'r'
                    and to_regclass($1) in (select a.relid from pg_partition_ancestors(c.oid) a)
                  order by l.n
                  limit 1) f",
    )
    .bind(target.quoted())
    .bind(leaves)
    .bind(from as i64)
    .fetch_optional(conn)
    .await?;
    Ok(found.map(|(n, c)| (n as usize - 1, c)))
}

/// The SQL that reads, in the gate's statement, the current constraint of the command's leaf
/// (`leaf`: a column holding its name) under the policy's target (`target`: an expression
/// naming it): as in [`next_attached`].
pub fn constraint_sql(leaf: &str, target: &str) -> String {
    format!(
        "(select coalesce(pg_get_partition_constraintdef(pc.oid), 'true')
            from pg_class pc
           where pc.oid = to_regclass({leaf}) and pc.relispartition and pc.relkind = 'r'
             and to_regclass({target}) in (select a.relid from pg_partition_ancestors(pc.oid) a))"
    )
}
