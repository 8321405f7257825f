//! The carve-out (docs/design.md §14 "Carve-out"): an expired partition with a few held rows
//! retires whole all the same. In one transaction, under the pool's `lock_timeout` (a lock
//! timeout or a deadlock fails the step, which the retirer tries again with backoff):
//!
//! 1. the partition is locked `SHARE ROW EXCLUSIVE`: writes to it wait, reads go on;
//! 2. a new table is made `LIKE` it, indexes included, with a `CHECK` of the partition's own
//!    constraint (so the attach needs no validation scan), and the rows the run must keep — held
//!    now, not only at planning — are copied into it, found by one scan of the partition;
//! 3. the partition is detached (ACCESS EXCLUSIVE on the parent: from here to the commit every
//!    query on the table waits) and renamed `sweeper_retired_<oid>`; the new table takes its
//!    name, its owner, grants, row-level security, replica identity, storage options and
//!    publications, and is attached for the same bounds;
//! 4. the retirement is recorded `carved`, with the carried rows' keys.
//!
//! Copying under the lock means no update to a held row is lost between the copy and the swap.
//! The detached table then retires as in part 1 (its keys but the carried ones exported, a
//! manifest, the drop). Beside a default partition, a `CHECK` on the default excluding the
//! range is added and validated first, outside the swap (one scan of the default under SHARE
//! UPDATE EXCLUSIVE), so the attach does not scan the default either; it is dropped in the swap.

use anyhow::{Context, bail};
use sqlx::{PgConnection, Postgres, QueryBuilder};
use tracing::{info, warn};
use uuid::Uuid;

use crate::ledger;
use crate::ledger::retirements::Retirement;
use crate::policy::{RuleSet, TableName};
use crate::state::AppState;

/// What the catalog says of the partition to carve.
#[derive(Debug, sqlx::FromRow)]
struct Partition {
    oid: i64,
    /// Its schema, quoted.
    schema: String,
    /// Its name within the schema (unquoted).
    relname: String,
    /// Attached under the parent it was planned under, for the same bound.
    attached_as_planned: bool,
    /// Its partition constraint as PostgreSQL prints it.
    constraint: String,
    /// `unlogged` or empty.
    persistence: String,
    /// `with (...)` or empty.
    options: String,
    /// `tablespace x` or empty.
    tablespace: String,
    /// Its default partition's sibling, quoted, if the parent has one.
    default_partition: Option<String>,
}

/// Reads what the carve-out needs of `r`'s partition; `None` when no table has its name.
async fn partition(conn: &mut PgConnection, r: &Retirement) -> sqlx::Result<Option<Partition>> {
    sqlx::query_as(
        "select c.oid::bigint as oid, quote_ident(n.nspname) as schema, c.relname::text as relname,
                coalesce(i.inhparent = to_regclass($1)
                         and pg_get_expr(c.relpartbound, c.oid) = $3, false)
                    as attached_as_planned,
                coalesce(pg_get_partition_constraintdef(c.oid), 'true') as constraint,
                case when c.relpersistence = 'u' then 'unlogged' else '' end as persistence,
                coalesce('with (' || array_to_string(c.reloptions, ', ') || ')', '') as options,
                coalesce((select 'tablespace ' || quote_ident(t.spcname) from pg_tablespace t
                           where t.oid = c.reltablespace), '') as tablespace,
                (select d.oid::regclass::text from pg_inherits j join pg_class d on d.oid = j.inhrelid
                  where j.inhparent = to_regclass($1)
                    and pg_get_expr(d.relpartbound, d.oid) = 'DEFAULT') as default_partition
           from pg_class c join pg_namespace n on n.oid = c.relnamespace
           left join pg_inherits i on i.inhrelid = c.oid
          where c.oid = to_regclass($2)",
    )
    .bind(&r.parent)
    .bind(&r.partition)
    .bind(&r.bound)
    .fetch_optional(conn)
    .await
}

/// Carves `r`'s held rows out of its partition and swaps a new partition holding only them in
/// its place; returns the state after (`carved`, or `kept`/`gone` with the reason recorded).
/// On `carved`, `r` is updated with the detached table's name and the carried keys.
pub(super) async fn carve(
    state: &AppState,
    r: &mut Retirement,
    token: Uuid,
) -> anyhow::Result<String> {
    let pool = &state.pool;
    let mut conn = pool.acquire().await?;
    let Some(p) = partition(&mut conn, r).await? else {
        release_default(&mut conn, r, None).await?;
        let why = "the partition was dropped or renamed outside sweeper before its retirement";
        ledger::retirements::set_state(&mut conn, r, token, "gone", Some(why)).await?;
        warn!(run_id = r.run_id, partition = r.partition, "{why}");
        return Ok("gone".into());
    };
    if !p.attached_as_planned {
        release_default(&mut conn, r, Some(p.oid)).await?;
        let why = "the partition is no longer attached under its parent for the bound it was \
                   planned with (detached, moved or attached again): left as it is";
        ledger::retirements::set_state(&mut conn, r, token, "gone", Some(why)).await?;
        warn!(run_id = r.run_id, partition = r.partition, "{why}");
        return Ok("gone".into());
    }
    if let Some(why) = crate::plan::carve_refusal(&mut conn, &r.partition).await? {
        return keep_refused(&mut conn, r, token, &p, &why).await;
    }
    drop(conn);
    if let Some(default) = &p.default_partition {
        exclude_from_default(state, r, token, &p, default).await?;
    }
    let rules = super::rules_of(state, r).await?;
    let began = std::time::Instant::now();
    let (detached, carried, carried_rows) = match swap(state, r, token, &p, &rules).await {
        Ok(Swap::Done(swapped)) => swapped,
        Ok(Swap::Refused(why)) => {
            let mut conn = pool.acquire().await?;
            return keep_refused(&mut conn, r, token, &p, &why).await;
        }
        Err(e) => {
            // A cancel that kept the retirement before its CHECK was on the default partition
            // (so before the carve-out had begun) leaves it to no one else to drop.
            if p.default_partition.is_some() {
                let mut conn = pool.acquire().await?;
                let state = ledger::retirements::state_of(&mut conn, r).await?;
                if state.as_deref() != Some("planned") {
                    release_default(&mut conn, r, Some(p.oid)).await?;
                }
            }
            return Err(e);
        }
    };
    crate::crash_point!("carve_after_swap");
    info!(
        run_id = r.run_id,
        partition = r.partition,
        detached_as = detached,
        carried = carried.len(),
        seconds = began.elapsed().as_secs_f64(),
        "held rows carved out: the partition was swapped for a new one holding only them"
    );
    r.state = "carved".into();
    r.detached_as = Some(detached);
    r.carried_keys = Some(carried);
    r.carried_rows = Some(carried_rows);
    Ok("carved".into())
}

/// Keeps `r`'s partition, whose held rows a copy can no longer carry out faithfully (`why`, from
/// [`crate::plan::carve_refusal`]): releases the default partition's `CHECK` and records `kept`
/// with the reason.
async fn keep_refused(
    conn: &mut PgConnection,
    r: &Retirement,
    token: Uuid,
    p: &Partition,
    why: &str,
) -> anyhow::Result<String> {
    release_default(conn, r, Some(p.oid)).await?;
    let why = format!(
        "its held rows cannot be carved out since planning: {why}; the next run sweeps it row by \
         row"
    );
    ledger::retirements::set_state(conn, r, token, "kept", Some(&why)).await?;
    warn!(run_id = r.run_id, partition = r.partition, "{why}");
    Ok("kept".into())
}

/// What a swap did: swapped the partition (the detached table's name, the carried keys, the rows
/// copied), or nothing, the partition having gained since the last look what a copy would not
/// carry.
enum Swap {
    Done((String, Vec<String>, i64)),
    Refused(String),
}

/// Drops from the default partition of `r`'s parent the `CHECK` an earlier try of this carve-out
/// added ([`exclude_from_default`]) when the carve-out is abandoned: the one of partition `oid`,
/// or, when the partition is gone (its oid unknown), any whose partition is no longer attached
/// under the parent. Left there, it would refuse every row of the range the default partition
/// must take once the partition is detached or dropped.
async fn release_default(
    conn: &mut PgConnection,
    r: &Retirement,
    oid: Option<i64>,
) -> anyhow::Result<()> {
    let statements: Vec<String> = sqlx::query_scalar(
        "select format('alter table %s drop constraint %I', d.oid::regclass, k.conname)
           from pg_inherits j join pg_class d on d.oid = j.inhrelid
           join pg_constraint k on k.conrelid = d.oid
          where j.inhparent = to_regclass($1)
            and pg_get_expr(d.relpartbound, d.oid) = 'DEFAULT'
            and k.conname ~ '^sweeper_carve_[0-9]+$'
            and case when $2::bigint is not null
                     then substr(k.conname, 15) = $2::bigint::text
                     else not exists (select 1 from pg_inherits i
                                       where i.inhparent = j.inhparent
                                         and i.inhrelid::bigint::text = substr(k.conname, 15))
                end",
    )
    .bind(&r.parent)
    .bind(oid)
    .fetch_all(&mut *conn)
    .await?;
    for s in statements {
        sqlx::query(&s)
            .execute(&mut *conn)
            .await
            .context("dropping the CHECK an earlier try added to the default partition")?;
    }
    Ok(())
}

/// The name of the `CHECK` on the default partition that keeps the carved range out of it.
fn default_check(p: &Partition) -> String {
    format!("sweeper_carve_{}", p.oid)
}

/// Adds to the default partition a `CHECK` that no row of it falls in the partition's range,
/// `NOT VALID`, then validates it (a scan of the default, which writes may go on beside): the
/// swap's attach then proves the default holds none of the range without scanning it.
/// Idempotent: a constraint left by an earlier try is validated or kept.
async fn exclude_from_default(
    state: &AppState,
    r: &Retirement,
    token: Uuid,
    p: &Partition,
    default: &str,
) -> anyhow::Result<()> {
    // Its own connection, closed afterwards: the validation runs without statement_timeout and
    // may be stopped mid-statement by a lost lease.
    let mut conn = state.pool.acquire().await?;
    conn.close_on_drop();
    let name = default_check(p);
    let validated: Option<bool> = sqlx::query_scalar(
        "select convalidated from pg_constraint where conrelid = to_regclass($1) and conname = $2",
    )
    .bind(default)
    .bind(&name)
    .fetch_optional(&mut *conn)
    .await?;
    if validated == Some(true) {
        return Ok(());
    }
    if validated.is_none() {
        sqlx::query(&format!(
            "alter table {default} add constraint {name} check (not ({})) not valid",
            p.constraint
        ))
        .execute(&mut *conn)
        .await
        .context("adding to the default partition a CHECK that excludes the carved range")?;
    }
    sqlx::query("set statement_timeout = 0")
        .execute(&mut *conn)
        .await?;
    let validating = async {
        sqlx::query(&format!("alter table {default} validate constraint {name}"))
            .execute(&mut *conn)
            .await
            .context(
                "validating the default partition's CHECK that excludes the carved range (a row \
                 of the default partition falls in it?)",
            )
    };
    super::renewing(state, r, token, validating, super::Lost::Stop).await?;
    Ok(())
}

/// The swap, in one transaction; returns the detached table's name, the carried rows' keys and
/// how many rows were carried (those without a key included).
async fn swap(
    state: &AppState,
    r: &Retirement,
    token: Uuid,
    p: &Partition,
    rules: &RuleSet,
) -> anyhow::Result<Swap> {
    let mut tx = state.pool.begin().await?;
    sqlx::query(&format!(
        "lock table {} in share row exclusive mode",
        r.partition
    ))
    .execute(&mut *tx)
    .await
    .context("locking the partition against writes")?;
    // Judged again under the lock: still the partition planned, with nothing a copy would lose.
    let now = partition(&mut tx, r).await?;
    let Some(p) = now.filter(|n| n.oid == p.oid && n.attached_as_planned) else {
        bail!("the partition changed before its swap (detached, replaced or moved); tried again");
    };
    // From here on, the partition as read under the lock: a setting changed while the swap
    // waited (logged or unlogged, storage options, tablespace) is the one the new table gets.
    let p = &p;
    // A trigger, rule, foreign key or policy added since the last look committed before this
    // lock was granted (each takes a lock this one conflicts with): the copy would lose it.
    if let Some(why) = crate::plan::carve_refusal(&mut tx, &r.partition).await? {
        tx.rollback().await?;
        return Ok(Swap::Refused(why));
    }
    let new = format!("{}.sweeper_carve_{}", p.schema, p.oid);
    let detached = format!("{}.sweeper_retired_{}", p.schema, p.oid);
    let bounds_check = format!("sweeper_bounds_{}", p.oid);
    sqlx::query(&format!(
        "create {} table {new} (like {} including all) {} {}",
        p.persistence, r.partition, p.options, p.tablespace
    ))
    .execute(&mut *tx)
    .await
    .context("making the new partition")?;
    sqlx::query(&format!(
        "alter table {new} add constraint {bounds_check} check ({})",
        p.constraint
    ))
    .execute(&mut *tx)
    .await?;
    let old_table = TableName::parse(&r.partition.replace('"', ""))
        .map_err(|e| anyhow::anyhow!("the partition's name: {e}"))?;
    let (copied, carried) =
        copy_kept(&mut tx, &rules.clone().on_table(old_table), &new, None).await?;
    crate::crash_point!("carve_after_copy");
    sqlx::query(&format!(
        "alter table {} detach partition {}",
        r.parent, r.partition
    ))
    .execute(&mut *tx)
    .await
    .context("detaching the partition (plain DETACH, inside the swap)")?;
    // The detach holds the old table ACCESS EXCLUSIVE: a view created since the last look (it
    // needed only ACCESS SHARE) has committed, and no other can come.
    if let Some(why) = crate::plan::dependents_refusal(&mut tx, &r.partition).await? {
        // Rolled back here, not on drop: the detach's locks go before the default's CHECK is
        // released on another connection.
        tx.rollback().await?;
        return Ok(Swap::Refused(why));
    }
    crate::crash_point!("carve_after_detach");
    let relname = sqlx::query_scalar::<_, String>("select quote_ident($1)")
        .bind(&p.relname)
        .fetch_one(&mut *tx)
        .await?;
    sqlx::query(&format!(
        "alter table {} rename to sweeper_retired_{}",
        r.partition, p.oid
    ))
    .execute(&mut *tx)
    .await?;
    sqlx::query(&format!("alter table {new} rename to {relname}"))
        .execute(&mut *tx)
        .await?;
    let new = format!("{}.{relname}", p.schema);
    faithful(&mut tx, &detached, &new).await?;
    sqlx::query(&format!(
        "alter table {} attach partition {new} {}",
        r.parent, r.bound
    ))
    .execute(&mut *tx)
    .await
    .context("attaching the new partition for the same bounds")?;
    sqlx::query(&format!("alter table {new} drop constraint {bounds_check}"))
        .execute(&mut *tx)
        .await?;
    if let Some(default) = &p.default_partition {
        sqlx::query(&format!(
            "alter table {default} drop constraint if exists {}",
            default_check(p)
        ))
        .execute(&mut *tx)
        .await?;
    }
    if !ledger::retirements::record_carve(&mut tx, r, token, &detached, (&carried, copied)).await? {
        bail!("the retirement's lease was lost; the swap is rolled back");
    }
    tx.commit().await?;
    Ok(Swap::Done((detached, carried, copied)))
}

/// Carries over into the new partition the rows of a carved retirement's detached table held
/// since the swap (not among its carried keys), and records their keys, in one transaction that
/// locks the detached table against writes.
pub(super) async fn carry_over(
    state: &AppState,
    r: &Retirement,
    token: Uuid,
    rules: &RuleSet,
) -> anyhow::Result<()> {
    let carried = r.carried_keys.as_deref().unwrap_or_default();
    let mut tx = state.pool.begin().await?;
    sqlx::query(&format!(
        "lock table {} in share row exclusive mode",
        rules.table_sql()
    ))
    .execute(&mut *tx)
    .await?;
    let (_, more) = copy_kept(&mut tx, rules, &r.parent, Some(carried)).await?;
    if !ledger::retirements::add_carried(&mut tx, r, token, &more).await? {
        bail!("the retirement's lease was lost; nothing is carried over");
    }
    tx.commit().await?;
    info!(
        run_id = r.run_id,
        partition = r.partition,
        carried = more.len(),
        "rows held since the swap carried over into the new partition"
    );
    Ok(())
}

/// Copies the rows of `rules`' table the run must keep (held by an exclusion, not selected, not
/// old enough, or with a key no item key names) into `into`; with `carried` (a detached table
/// whose held rows were carved out), only those with a key not among the carried ones (a row
/// without a key was carried by the swap). Returns how many rows it copied, and the item keys of
/// those that have one.
pub(super) async fn copy_kept(
    tx: &mut PgConnection,
    rules: &RuleSet,
    into: &str,
    carried: Option<&[String]>,
) -> anyhow::Result<(i64, Vec<String>)> {
    // The columns the copy writes are the source's; whether a value for an identity column
    // `GENERATED ALWAYS` needs `OVERRIDING SYSTEM VALUE` is the destination's (a partitioned
    // table's identity is not its partitions': the carry-over writes through the parent).
    let (columns, overriding): (String, bool) = sqlx::query_as(
        "select coalesce(string_agg(quote_ident(s.attname), ', ' order by s.attnum), ''),
                coalesce(bool_or(d.attidentity = 'a'), false)
           from pg_attribute s
           left join pg_attribute d
             on d.attrelid = to_regclass($2) and d.attname = s.attname and not d.attisdropped
          where s.attrelid = to_regclass($1) and s.attnum > 0 and not s.attisdropped
            and s.attgenerated = ''",
    )
    .bind(rules.table_sql())
    .bind(into)
    .fetch_one(&mut *tx)
    .await?;
    let mut q = QueryBuilder::<Postgres>::new(format!(
        "insert into {into} ({columns}) {} select {columns} from {} where not (",
        if overriding {
            "overriding system value"
        } else {
            ""
        },
        rules.table_sql()
    ));
    rules.push_has_key(&mut q);
    q.push(" and ");
    rules.push_eligible(&mut q);
    q.push(")");
    if let Some(carried) = carried {
        q.push(" and ");
        push_not_carried(&mut q, rules, carried);
    }
    q.push(format!(" returning {}", rules.key_text_sql()));
    let keys: Vec<Option<String>> = q.build_query_scalar().fetch_all(&mut *tx).await?;
    Ok((keys.len() as i64, keys.into_iter().flatten().collect()))
}

/// Pushes that the row has a key and it is not among `carried`: the rows of a detached table
/// not carried over (a hashed anti-join against the carried keys).
pub(super) fn push_not_carried(
    q: &mut QueryBuilder<'_, Postgres>,
    rules: &RuleSet,
    carried: &[String],
) {
    rules.push_has_key(q);
    q.push(format!(
        " and not coalesce(({}) in (select unnest(",
        rules.key_text_sql()
    ));
    q.push_bind(carried.to_vec());
    q.push("::text[])), false)");
}

/// Gives the new partition `new` what the old table `old` (now detached) had beyond `LIKE`, in
/// this order: its owner, its comment and statistics targets, its table and column grants,
/// row-level security and its policies, its indexes' names, its replica identity (by index name,
/// after the renames) and its by-name publications. Each step is a query over the catalog (`$1`
/// the old table, `$2` the new one) that writes the statements to run.
async fn faithful(tx: &mut PgConnection, old: &str, new: &str) -> anyhow::Result<()> {
    let mut statements = Vec::new();
    for step in FAITHFUL {
        statements.extend(
            sqlx::query_scalar::<_, String>(step)
                .bind(old)
                .bind(new)
                .fetch_all(&mut *tx)
                .await?,
        );
    }
    for s in statements {
        sqlx::query(&s)
            .execute(&mut *tx)
            .await
            .with_context(|| format!("giving the new partition what the old one had: {s}"))?;
    }
    Ok(())
}

/// The indexes of table `$1` matched to those of table `$2` of the same definition (`LIKE` names
/// its copies after the new table), as CTEs `o` and `nw`, for [`FAITHFUL`]'s renames.
macro_rules! matched_indexes {
    () => {
        "
    with ix as (
        select i.indrelid, c.oid, quote_ident(n.nspname) as schema, c.relname, i.indisunique,
               regexp_replace(pg_get_indexdef(i.indexrelid), '^.*? USING ', '') as def
          from pg_index i join pg_class c on c.oid = i.indexrelid
          join pg_namespace n on n.oid = c.relnamespace
         where i.indrelid in (to_regclass($1), to_regclass($2))),
    numbered as (
        select ix.*, row_number() over (partition by indrelid, indisunique, def order by oid) as nth
          from ix),
    o as (select * from numbered where indrelid = to_regclass($1)),
    nw as (select * from numbered where indrelid = to_regclass($2))"
    };
}

/// The steps of [`faithful`], each a query writing statements.
const FAITHFUL: [&str; 8] = [
    // The owner.
    "select format('alter table %s owner to %I', $2::text, pg_get_userbyid(o.relowner))
       from pg_class o, pg_class n
      where o.oid = to_regclass($1) and n.oid = to_regclass($2) and o.relowner <> n.relowner",
    // The comment and the columns' statistics targets (`LIKE` copies neither).
    "select format('comment on table %s is %L', $2::text, d.description)
       from pg_description d
      where d.objoid = to_regclass($1) and d.classoid = 'pg_class'::regclass and d.objsubid = 0
     union all
     select format('alter table %s alter column %I set statistics %s', $2::text, a.attname,
                   a.attstattarget)
       from pg_attribute a
      where a.attrelid = to_regclass($1) and a.attnum > 0 and not a.attisdropped
        and a.attstattarget >= 0",
    // The grants, entry by entry, the table's and each column's (none when the table has the
    // defaults), the owner's own entry first revoked so that the new one ends up the same.
    "with o as (select oid, relacl, relowner from pg_class where oid = to_regclass($1)),
          entries as (
              select null::name as col, a.* from o, aclexplode(o.relacl) a
              union all
              select t.attname, a.* from pg_attribute t, aclexplode(t.attacl) a
               where t.attrelid = to_regclass($1) and t.attacl is not null and not t.attisdropped)
     select format('revoke all on %s from %I', $2::text, pg_get_userbyid(o.relowner))
       from o where o.relacl is not null
     union all
     select format('grant %s%s on %s to %s%s', e.privilege_type,
                   coalesce(' (' || quote_ident(e.col) || ')', ''), $2::text,
                   case when e.grantee = 0 then 'public'
                        else quote_ident(pg_get_userbyid(e.grantee)) end,
                   case when e.is_grantable then ' with grant option' else '' end)
       from entries e",
    // Row-level security and its policies.
    "select format('alter table %s enable row level security', $2::text)
       from pg_class where oid = to_regclass($1) and relrowsecurity
     union all
     select format('alter table %s force row level security', $2::text)
       from pg_class where oid = to_regclass($1) and relforcerowsecurity
     union all
     select format('create policy %I on %s as %s for %s to %s%s%s', p.polname, $2::text,
                   case when p.polpermissive then 'permissive' else 'restrictive' end,
                   case p.polcmd when 'r' then 'select' when 'a' then 'insert'
                                 when 'w' then 'update' when 'd' then 'delete' else 'all' end,
                   case when p.polroles = '{0}' then 'public'
                        else (select string_agg(quote_ident(pg_get_userbyid(x)), ', ')
                                from unnest(p.polroles) x) end,
                   coalesce(' using (' || pg_get_expr(p.polqual, p.polrelid) || ')', ''),
                   coalesce(' with check (' || pg_get_expr(p.polwithcheck, p.polrelid) || ')',
                            ''))
       from pg_policy p where p.polrelid = to_regclass($1)",
    // The indexes' names: the old table's renamed away first ...
    concat!(
        matched_indexes!(),
        " select format('alter index %s.%I rename to %I', o.schema, o.relname,
                        'sweeper_retired_' || o.oid)
            from o join nw using (indisunique, def, nth)"
    ),
    // ... then the new table's given them.
    concat!(
        matched_indexes!(),
        " select format('alter index %s.%I rename to %I', nw.schema, nw.relname, o.relname)
            from o join nw using (indisunique, def, nth)"
    ),
    // The replica identity: the same kind; for an index, the one of the same name (the renames
    // above gave the new table's copy the old one's name).
    "select format('alter table %s replica identity %s', $2::text,
                   case c.relreplident when 'f' then 'full' when 'n' then 'nothing'
                        else 'using index ' || quote_ident(
                            (select oc.relname from pg_index oi
                               join pg_class oc on oc.oid = oi.indexrelid
                              where oi.indrelid = c.oid and oi.indisreplident)) end)
       from pg_class c where c.oid = to_regclass($1) and c.relreplident in ('f', 'n', 'i')",
    // Publications the old table was a member of by name (one of its parent, of its schema or
    // of all tables covers the new one by itself), with its row filter where it had one.
    "select format('alter publication %I add table %s%s', p.pubname, $2::text,
                   coalesce(' where (' || (to_jsonb(t) ->> 'rowfilter') || ')', ''))
       from pg_publication_rel r join pg_publication p on p.oid = r.prpubid
       left join pg_publication_tables t
         on t.pubname = p.pubname
        and t.schemaname = (select nspname from pg_namespace
                             where oid = (select relnamespace from pg_class where oid = r.prrelid))
        and t.tablename = (select relname from pg_class where oid = r.prrelid)
      where r.prrelid = to_regclass($1)",
];
