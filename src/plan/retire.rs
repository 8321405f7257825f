//! Which expired partitions a run retires whole (docs/design.md §14 "Partition sweep"), decided on
//! its first page for a policy with `partitions = "drop"`: a leaf, not a default partition,
//! whose range on the timestamp ends at or before the run's cutoff, and whose rows are all
//! eligible — counted on the data, not trusted from the bounds. A leaf with a row the run must
//! keep (held by an exclusion, not selected, at or after the cutoff despite its bounds, or with a
//! key no item key text names) is kept and swept row by row like any other.

use sqlx::{PgConnection, Postgres, QueryBuilder};

use crate::ledger::retirements::Chosen;
use crate::policy::RuleSet;
use crate::policy::partitions::{Leaf, next_attached};

/// Chooses among `leaves` (those the run would walk) the ones it retires or keeps, with one
/// count per candidate leaf (a scan of it, confined to it by its partition constraint).
pub(super) async fn choose(
    conn: &mut PgConnection,
    rules: &RuleSet,
    leaves: &[Leaf],
) -> sqlx::Result<Vec<Chosen>> {
    let mut chosen = Vec::new();
    for leaf in leaves {
        let Some(to) = leaf.timestamp_to else {
            continue;
        };
        if leaf.default || to > rules.cutoff {
            continue;
        }
        let target = &rules.target.table;
        let Some((_, constraint)) =
            next_attached(&mut *conn, target, std::slice::from_ref(&leaf.name), 0).await?
        else {
            continue;
        };
        let parent: Option<String> = sqlx::query_scalar(
            "select quote_ident(n.nspname) || '.' || quote_ident(c.relname)
               from pg_inherits i join pg_class c on c.oid = i.inhparent
               join pg_namespace n on n.oid = c.relnamespace
              where i.inhrelid = to_regclass($1)",
        )
        .bind(&leaf.name)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(parent) = parent else { continue };
        let scoped = rules.clone().in_partition(Some(constraint));
        let mut q = QueryBuilder::<Postgres>::new("select count(*), count(*) filter (where not (");
        scoped.push_has_key(&mut q);
        q.push(" and ");
        scoped.push_eligible(&mut q);
        q.push(")), count(*) filter (where not coalesce(");
        scoped.push_timestamp(&mut q);
        q.push(" < ");
        q.push_bind(rules.cutoff);
        q.push(format!(", false)) from {} where ", scoped.table_sql()));
        scoped.push_partition_scope(&mut q);
        q.push("true");
        let (rows, kept, younger): (i64, i64, i64) =
            q.build_query_as().fetch_one(&mut *conn).await?;
        let plain_name = crate::policy::TableName::parse(&leaf.name.replace('"', "")).is_ok()
            && !leaf.name.contains("\"\"");
        let kept = if younger > 0 {
            Some(format!(
                "{younger} of its {rows} rows have {} at or after the run's cutoff although its \
                 bounds end before it: swept row by row",
                rules.target.timestamp.as_str()
            ))
        } else if kept > 0 {
            Some(format!(
                "{kept} of its {rows} rows are kept by an exclusion or the selection, or have a \
                 key no item key names: swept row by row, so they stay"
            ))
        } else if !plain_name {
            Some("its name is not a plain identifier: swept row by row".to_string())
        } else {
            None
        };
        chosen.push(Chosen {
            partition: leaf.name.clone(),
            parent,
            bound: leaf.bound.clone(),
            timestamp_from: leaf.timestamp_from,
            timestamp_to: to,
            rows,
            kept,
        });
    }
    Ok(chosen)
}
