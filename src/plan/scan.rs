//! One planning page's scan, along the run's path: the key-order walk reads every row with a key
//! after the cursor; the timestamp-index walk reads the rows older than the cutoff after the
//! keyset cursor (timestamp, key). Both classify each row with the run's rules in the same
//! statement and stay bounded in rows and in bytes of keys.

use sqlx::Row;

use crate::policy::RuleSet;
use crate::policy::path::PlanningPath;

/// Where the walk stands: after this key (and, on the timestamp-index walk, this timestamp, as
/// PostgreSQL's text of a `timestamptz`: `infinity` and `-infinity` have no chrono value).
#[derive(Debug, Clone, Default)]
pub(super) struct Cursor {
    pub(super) key: Option<String>,
    pub(super) timestamp: Option<String>,
}

/// One scanned page: its classified rows in walk order, and whether the walk reached its end
/// (a page cut by the byte budget did not).
pub(super) struct Scanned {
    pub(super) rows: Vec<sqlx::postgres::PgRow>,
    pub(super) end_of_walk: bool,
}

impl Scanned {
    /// A page with no rows that ends its walk (no leaf was left to scan).
    pub(super) fn empty() -> Scanned {
        Scanned {
            rows: Vec::new(),
            end_of_walk: true,
        }
    }

    /// The cursor after the page: its last row, or `before` when the page was empty. The
    /// key-order walk has no timestamp in its cursor.
    pub(super) fn cursor_after(&self, path: PlanningPath, before: &Cursor) -> Cursor {
        match self.rows.last() {
            Some(r) => Cursor {
                key: Some(r.get("item_key")),
                timestamp: match path {
                    PlanningPath::KeyOrder => None,
                    PlanningPath::TimestampIndex => r.get("cursor_ts"),
                },
            },
            None => before.clone(),
        }
    }
}

/// One bounded scan along `path` after `cursor`: at most `page_rows` rows, and of those only as
/// many as fit `key_bytes` of item keys (at most PAGE_KEY_BYTES) (always at least one), so a page stays bounded in bytes
/// too (docs/design.md §2.11). A key without text columns has a longest item key text; when a
/// page of those cannot reach the budget, the byte count is skipped.
pub(super) async fn scan_page(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    rules: &RuleSet,
    path: PlanningPath,
    cursor: &Cursor,
    page_rows: i64,
    key_bytes: usize,
) -> sqlx::Result<Scanned> {
    // Keys of bounded width whose page cannot reach the budget skip the count.
    let fixed_width = rules
        .key()
        .max_text_bytes()
        .is_some_and(|w| w as i64 * page_rows <= key_bytes as i64);
    let order = match path {
        PlanningPath::KeyOrder => rules.sort_keys(),
        PlanningPath::TimestampIndex => format!("sort_ts, {}", rules.sort_keys()),
    };
    let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new("");
    if !fixed_width {
        q.push(format!(
            "select item_key, cursor_ts, old_enough, null_timestamp, reason, scanned from (
                 select p.*, sum(octet_length(p.item_key)) over (order by {order}) as key_bytes,
                        count(*) over () as scanned
                   from ("
        ));
    }
    q.push("select ");
    rules.push_classify_columns(&mut q);
    q.push(", ");
    rules.push_timestamp(&mut q);
    q.push(" as sort_ts, (");
    rules.push_timestamp(&mut q);
    q.push(format!(
        ")::text as cursor_ts from {} where ",
        rules.table_sql()
    ));
    rules.push_partition_scope(&mut q);
    rules.push_has_key(&mut q);
    push_after_cursor(&mut q, rules, path, cursor);
    q.push(format!(" order by {order} limit "));
    q.push_bind(page_rows);
    if !fixed_width {
        q.push(") p) w where w.key_bytes - octet_length(w.item_key) < ");
        q.push_bind(key_bytes as i64);
        q.push(format!(" order by {order}"));
    }
    let rows = q.build().fetch_all(&mut **tx).await?;
    let scanned: i64 = if fixed_width {
        rows.len() as i64
    } else {
        rows.first().map(|r| r.get("scanned")).unwrap_or(0)
    };
    let cut_by_bytes = (rows.len() as i64) < scanned;
    Ok(Scanned {
        end_of_walk: scanned < page_rows && !cut_by_bytes,
        rows,
    })
}

/// Pushes the walk's range after `cursor`: `and key > $cursor` on the key-order walk; on the
/// timestamp-index walk `and ts < $cutoff` and, past the first page, `and ts >= $ts and (ts, key)
/// > ($ts, $key)`.
fn push_after_cursor(
    q: &mut sqlx::QueryBuilder<'_, sqlx::Postgres>,
    rules: &RuleSet,
    path: PlanningPath,
    cursor: &Cursor,
) {
    match (path, &cursor.key, &cursor.timestamp) {
        (PlanningPath::KeyOrder, Some(c), _) => rules.key().push_after(q, c, None),
        (PlanningPath::KeyOrder, None, _) => {}
        (PlanningPath::TimestampIndex, c, ts) => {
            // The raw column against the cutoff (the path needs timestamptz), so the index's
            // range bounds the walk; `ts >= cursor` lets an index on the timestamp alone start
            // at the cursor too, the row comparison then skips what was planned.
            q.push(" and ");
            rules.push_timestamp(q);
            q.push(" < ");
            q.push_bind(rules.cutoff);
            if let (Some(c), Some(ts)) = (c, ts) {
                q.push(" and ");
                rules.push_timestamp(q);
                q.push(" >= cast(");
                q.push_bind(ts.clone());
                q.push(" as timestamptz)");
                let lead = |q: &mut sqlx::QueryBuilder<'_, sqlx::Postgres>| rules.push_timestamp(q);
                rules.key().push_after(q, c, Some((&lead, ts)));
            }
        }
    }
}
