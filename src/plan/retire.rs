//! Which expired partitions a run retires whole (docs/design.md §14 "Partition sweep"), decided on
//! its first page for a policy with `partitions = "drop"`: a leaf, not a default partition,
//! whose range on the timestamp ends at or before the run's cutoff, and whose rows are all
//! eligible — counted on the data, not trusted from the bounds. A leaf with a row the run must
//! keep (held by an exclusion, not selected, at or after the cutoff despite its bounds, or with a
//! key no item key text names) retires with those rows carved out (docs/design.md §14
//! "Carve-out"): they are copied into a new partition of the same range, which takes the old
//! one's place. It is kept and swept row by row like any other when the carve-out cannot serve:
//! every row is kept, more than [`CARVE_OUT_MAX_ROWS`] are, a row is younger than the cutoff
//! despite the bounds, or the leaf has what a copy would not carry ([`carve_refusal`]).

use std::collections::BTreeMap;

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
        if let Some(run) =
            crate::ledger::retirements::carve_under_way(&mut *conn, &leaf.name).await?
        {
            chosen.push(swept(
                leaf,
                parent,
                format!(
                    "run {run} carved its held rows out and has not dropped its old table yet: \
                     swept row by row"
                ),
            ));
            continue;
        }
        let hidden: bool = sqlx::query_scalar("select row_security_active(to_regclass($1))")
            .bind(&leaf.name)
            .fetch_one(&mut *conn)
            .await?;
        if hidden {
            // Its rows are counted, exported and copied by reading it by name: a policy would
            // hide some from every one of those reads, and the drop would take them.
            chosen.push(swept(
                leaf,
                parent,
                "row security is active on it for this role (its own policies): a count or an \
                 export of it could miss rows a drop would take; swept row by row"
                    .into(),
            ));
            continue;
        }
        let scoped = rules.clone().in_partition(Some(constraint));
        // One scan of the leaf, its rows counted by class: NULL (retired), `younger` (at or
        // after the cutoff despite the bounds), `held:<reason>` (old enough, held by an
        // exclusion), `kept` (not selected, or a key no item key names).
        let mut q = QueryBuilder::<Postgres>::new("select class, count(*) from (select case when ");
        scoped.push_has_key(&mut q);
        q.push(" and ");
        scoped.push_eligible(&mut q);
        q.push(" then null when not coalesce(");
        scoped.push_timestamp(&mut q);
        q.push(" < ");
        q.push_bind(rules.cutoff);
        q.push(", false) then 'younger' when not ");
        scoped.push_has_key(&mut q);
        q.push(" then 'kept' when ");
        scoped.push_old_enough(&mut q);
        q.push(" then coalesce('held:' || ");
        scoped.push_excluded_reason(&mut q);
        q.push(format!(
            ", 'kept') else 'kept' end as class from {} where ",
            scoped.table_sql()
        ));
        scoped.push_partition_scope(&mut q);
        q.push("true) c group by class");
        let classes: Vec<(Option<String>, i64)> = q.build_query_as().fetch_all(&mut *conn).await?;
        let rows: i64 = classes.iter().map(|(_, n)| n).sum();
        let count = |class: &str| -> i64 {
            classes
                .iter()
                .filter(|(c, _)| c.as_deref() == Some(class))
                .map(|(_, n)| n)
                .sum()
        };
        let younger = count("younger");
        let kept: i64 = classes
            .iter()
            .filter(|(c, _)| c.is_some())
            .map(|(_, n)| n)
            .sum();
        let held: BTreeMap<String, i64> = classes
            .iter()
            .filter_map(|(c, n)| Some((c.as_deref()?.strip_prefix("held:")?.to_string(), *n)))
            .collect();
        let plain_name = crate::policy::TableName::parse(&leaf.name.replace('"', "")).is_ok()
            && !leaf.name.contains("\"\"");
        let kept_reason = if younger > 0 {
            Some(format!(
                "{younger} of its {rows} rows have {} at or after the run's cutoff although its \
                 bounds end before it: swept row by row",
                rules.target.timestamp.as_str()
            ))
        } else if !plain_name {
            Some("its name is not a plain identifier: swept row by row".to_string())
        } else if kept == 0 {
            dependents_refusal(&mut *conn, &leaf.name)
                .await?
                .map(|why| {
                    format!(
                        "its rows could be retired whole, but {why}: its drop would fail (or drop \
                     what depends on it); swept row by row"
                    )
                })
        } else if kept == rows {
            Some(format!(
                "all of its {rows} rows are kept by an exclusion or the selection, or have a key \
                 no item key names: swept row by row, so they stay"
            ))
        } else if kept > CARVE_OUT_MAX_ROWS {
            Some(format!(
                "{kept} of its {rows} rows are kept by an exclusion or the selection, or have a \
                 key no item key names, more than the {CARVE_OUT_MAX_ROWS} a carve-out copies: \
                 swept row by row, so they stay"
            ))
        } else {
            carve_refusal(&mut *conn, &leaf.name).await?.map(|why| {
                format!(
                    "{kept} of its {rows} rows are kept, and its held rows cannot be carved out: \
                     {why}; swept row by row, so they stay"
                )
            })
        };
        chosen.push(Chosen {
            partition: leaf.name.clone(),
            parent,
            bound: leaf.bound.clone(),
            timestamp_from: leaf.timestamp_from,
            timestamp_to: to,
            rows: if kept_reason.is_none() {
                rows - kept
            } else {
                rows
            },
            held_rows: (kept_reason.is_none() && kept > 0).then_some(kept),
            held: if kept_reason.is_none() {
                held
            } else {
                BTreeMap::new()
            },
            kept: kept_reason,
        });
    }
    Ok(chosen)
}

/// A leaf kept before it was counted, with the reason: swept row by row.
fn swept(leaf: &Leaf, parent: String, reason: String) -> Chosen {
    Chosen {
        partition: leaf.name.clone(),
        parent,
        bound: leaf.bound.clone(),
        timestamp_from: leaf.timestamp_from,
        timestamp_to: leaf.timestamp_to.unwrap_or_default(),
        rows: 0,
        kept: Some(reason),
        held_rows: None,
        held: BTreeMap::new(),
    }
}

/// The most held rows a carve-out copies. The copy runs while the partition is locked against
/// writes (reads go on), and the held rows are found by a scan of it: a few thousand rows copy
/// in well under a second; a partition with more held rows than this is swept row by row.
pub const CARVE_OUT_MAX_ROWS: i64 = 10_000;

/// Why `leaf`'s held rows cannot be carved out into a copy of it, or `None`: what a new table
/// made `LIKE` it, with its owner, grants, row-level security, replica identity, storage
/// options and publications, would not carry — triggers or foreign keys of its own (not
/// cloned from its parent), a cloned trigger enabled differently from its parent's (the new
/// partition's clone would follow the parent), rules, rows another table references through a foreign key (the
/// detach would fail), a foreign table, or row security active on it for this role (the copy
/// would not see the rows its policies hide).
pub async fn carve_refusal(conn: &mut PgConnection, leaf: &str) -> sqlx::Result<Option<String>> {
    let why = sqlx::query_scalar::<_, Option<String>>(
        "select case
                  when c.relkind <> 'r' then 'it is not a plain table'
                  when row_security_active(c.oid)
                    then 'row security is active on it for this role: its policies would hide \
                          rows from the copy'
                  when exists (select 1 from pg_trigger t
                                where t.tgrelid = c.oid and not t.tgisinternal
                                  and t.tgparentid = 0)
                    then 'it has a trigger of its own, not cloned from its parent'
                  when exists (select 1 from pg_trigger t join pg_trigger o on o.oid = t.tgparentid
                                where t.tgrelid = c.oid and t.tgenabled <> o.tgenabled)
                    then 'a trigger cloned from its parent is enabled or disabled differently on it'
                  when exists (select 1 from pg_constraint k
                                where k.conrelid = c.oid and k.contype = 'f'
                                  and k.conparentid = 0)
                    then 'it has a foreign key of its own, not cloned from its parent'
                  when exists (select 1 from pg_constraint k
                                where k.confrelid = c.oid and k.contype = 'f')
                    then 'another table references it through a foreign key'
                  when exists (select 1 from pg_rewrite w
                                where w.ev_class = c.oid and w.rulename <> '_RETURN')
                    then 'it has a rule'
                end
           from pg_class c where c.oid = to_regclass($1)",
    )
    .bind(leaf)
    .fetch_optional(&mut *conn)
    .await?
    .flatten();
    match why {
        Some(why) => Ok(Some(why)),
        None => dependents_refusal(conn, leaf).await,
    }
}

/// Why `leaf` can be neither swapped for a copy nor dropped because of an object outside it that
/// names it, or `None`: a view, materialized view or SQL-standard function body reading it (it would follow
/// the old table, renamed and then dropped — its drop would fail), or a sequence owned by one of
/// its columns (dropped with the old table). Creating such a view takes only an `ACCESS SHARE`
/// lock, so the swap asks again once its detach holds the partition `ACCESS EXCLUSIVE`.
pub async fn dependents_refusal(
    conn: &mut PgConnection,
    leaf: &str,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "select case
                  when exists (select 1 from pg_depend d
                                left join pg_rewrite w on d.classid = 'pg_rewrite'::regclass
                                                      and w.oid = d.objid
                                where d.refclassid = 'pg_class'::regclass and d.refobjid = c.oid
                                  and d.deptype = 'n'
                                  and d.classid in ('pg_rewrite'::regclass, 'pg_proc'::regclass)
                                  and w.ev_class is distinct from c.oid)
                    then 'a view or a function reads it by name'
                  when exists (select 1 from pg_depend d join pg_class s on s.oid = d.objid
                                where d.classid = 'pg_class'::regclass
                                  and d.refclassid = 'pg_class'::regclass
                                  and d.refobjid = c.oid and d.deptype = 'a'
                                  and s.relkind = 'S')
                    then 'a sequence is owned by one of its columns'
                end
           from pg_class c where c.oid = to_regclass($1)",
    )
    .bind(leaf)
    .fetch_optional(conn)
    .await
    .map(Option::flatten)
}
