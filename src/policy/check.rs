//! Checking policies against the database (docs/design.md §6), for `sweeper check-config` and start-up:
//! tables and columns exist; the key is one column or 2–4 that are exactly a unique index, each
//! of a type in [`crate::policy::KEY_TYPES`]; the
//! timestamp is `timestamptz` (or `timestamp` with `timestamp_zone`); exclusion values cast to
//! their column's type; indexes support the scans; foreign keys that reference the target are
//! reported with their `ON DELETE` rule; the connecting role holds the privileges the policy
//! needs on the target, named one per line when it lacks them.

use std::fmt;

use sqlx::PgPool;

use crate::policy::select::Selection;
use crate::policy::{ExclusionRule, KEY_TYPES, KeyType, Policy, TableInfo, related};

/// How serious a finding is. Errors stop `serve` and make `check-config` exit 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// The policy cannot work.
    Error,
    /// It works, but slowly or with a caveat.
    Warning,
    /// Worth knowing.
    Info,
}

/// One finding about one policy.
#[derive(Debug, Clone)]
pub struct Finding {
    /// Severity.
    pub level: Level,
    /// The policy.
    pub policy: String,
    /// What was found and what to do.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let level = match self.level {
            Level::Error => "error",
            Level::Warning => "warning",
            Level::Info => "info",
        };
        write!(f, "{level}: policy[{}]: {}", self.policy, self.message)
    }
}

/// Checks every policy (the planning path a run would take under `path`, `planning.path`);
/// database errors (not findings) are returned as `Err`.
pub async fn check_policies(
    pool: &PgPool,
    policies: &[Policy],
    path: crate::config::PathSetting,
) -> sqlx::Result<Vec<Finding>> {
    let mut out = Vec::new();
    for p in policies {
        check_policy(pool, p, path, &mut out).await?;
    }
    Ok(out)
}

/// Findings that need no database: a retention shorter than the schedule's period (its
/// longest gap between two ticks: a weekday schedule's period is its weekend).
pub fn check_schedule(p: &Policy) -> Option<Finding> {
    let period = p.schedule.longest_period_seconds();
    let retain = p.spec.retain_for_seconds;
    // A selection policy has no retention: its cutoff is the window.
    (p.spec.select.is_empty() && retain < period).then(|| Finding {
        level: Level::Warning,
        policy: p.name.to_string(),
        message: {
            let (r, per) = (
                crate::config::DurationSpec::from_seconds(retain),
                crate::config::DurationSpec::from_seconds(period),
            );
            format!(
                "retain_for ({r}) is shorter than the schedule's period ({per}): each run deletes \
                 every record older than its window minus {r}, so a record is kept anywhere from \
                 {r} to {per} + {r} depending on when in the period it was written; retention is \
                 really decided by the schedule. Make sure that is meant, or set retain_for to \
                 at least {per}"
            )
        },
    })
}

async fn check_policy(
    pool: &PgPool,
    p: &Policy,
    path: crate::config::PathSetting,
    out: &mut Vec<Finding>,
) -> sqlx::Result<()> {
    out.extend(check_schedule(p));
    let t = &p.spec.target;
    // Without USAGE on the schema even resolving the table's name fails (42501).
    if let Some(line) = missing_usage(pool, &t.table.schema).await? {
        out.push(Finding {
            level: Level::Error,
            policy: p.name.to_string(),
            message: line,
        });
        out.push(Finding {
            level: Level::Info,
            policy: p.name.to_string(),
            message: "the other checks of this policy run once the role may use the schema above"
                .into(),
        });
        return Ok(());
    }
    let Some(info) = TableInfo::load(pool, &t.table).await? else {
        out.push(Finding {
            level: Level::Error,
            policy: p.name.to_string(),
            message: format!("target.table: table {} does not exist", t.table),
        });
        return Ok(());
    };
    let mut c = Check {
        pool,
        p,
        info,
        path,
        out,
    };
    if !c.privileges().await? {
        // The other checks read the table's columns, which the role may not.
        c.say(
            Level::Info,
            "the other checks of this policy run once the role may read the columns above".into(),
        );
        return Ok(());
    }
    c.key().await?;
    c.action_columns().await?;
    c.timestamp().await?;
    c.partitions().await?;
    c.partition_drop().await?;
    let covered = c.exclusions().await?;
    for m in crate::policy::select::check_columns(&p.spec.select, |n| c.col(n)) {
        c.say(Level::Error, m);
    }
    c.foreign_keys(&covered).await
}

/// The line naming the connecting role's missing USAGE on `schema`, when it lacks it; none when it
/// has it or the schema does not exist (the table's own check says so).
pub(super) async fn missing_usage(
    pool: &PgPool,
    schema: &crate::policy::Ident,
) -> sqlx::Result<Option<String>> {
    let (role, usage): (String, Option<bool>) = sqlx::query_as(
        "select quote_ident(current_user),
                (select has_schema_privilege(n.oid, 'USAGE') from pg_namespace n
                  where n.nspname = $1)",
    )
    .bind(schema.as_str())
    .fetch_one(pool)
    .await?;
    Ok((usage == Some(false)).then(|| {
        format!(
            "privileges: role {role} lacks USAGE on schema {}: grant usage on schema {} to {role}",
            schema.as_str(),
            schema.quoted()
        )
    }))
}

/// One policy's checks against its table, each a section of findings.
struct Check<'a> {
    pool: &'a PgPool,
    p: &'a Policy,
    info: TableInfo,
    path: crate::config::PathSetting,
    out: &'a mut Vec<Finding>,
}

impl Check<'_> {
    fn say(&mut self, level: Level, message: String) {
        self.out.push(Finding {
            level,
            policy: self.p.name.to_string(),
            message,
        });
    }

    fn col(&self, name: &str) -> Option<crate::policy::ColumnInfo> {
        self.info.columns.get(name).cloned()
    }

    /// The connecting role's privileges on the target, a line for each one it lacks (deploy/
    /// roles.sql grants the ledger's; the target's are the user's to grant): USAGE on the
    /// table's schema, SELECT on each column the policy reads, DELETE when rows go, UPDATE on a
    /// stamped column, and UPDATE on at least one column, which PostgreSQL requires for the row
    /// locks a command takes when it meets a row another transaction holds or an item fails alone
    /// (`SELECT … FOR UPDATE SKIP LOCKED`). Returns whether the role may read every column the
    /// policy reads.
    async fn privileges(&mut self) -> sqlx::Result<bool> {
        let t = &self.p.spec.target;
        let spec = &self.p.spec;
        let deletes = match &spec.action {
            crate::policy::ActionSpec::DeleteRows => true,
            crate::policy::ActionSpec::Http(h) => {
                matches!(h.then, crate::policy::action::Then::DeleteRow)
            }
            crate::policy::ActionSpec::ObjectStore(o) => {
                matches!(o.then, crate::policy::action::Then::DeleteRow)
            }
        };
        let stamped = match &spec.action {
            crate::policy::ActionSpec::Http(h) => h.then.column(),
            crate::policy::ActionSpec::ObjectStore(o) => o.then.column(),
            crate::policy::ActionSpec::DeleteRows => None,
        };
        let mut read: Vec<&str> = t.key.columns().iter().map(|c| c.as_str()).collect();
        read.push(t.timestamp.as_str());
        for e in &spec.exclude {
            match &e.rule {
                ExclusionRule::Column(c) => read.push(c.column.as_str()),
                ExclusionRule::Related { exists } => {
                    read.extend(exists.target_columns().map(|c| c.as_str()))
                }
            }
        }
        for s in &spec.select {
            read.extend(s.target_columns().into_iter().map(|c| c.as_str()));
        }
        read.extend(spec.action.columns().into_iter().map(|c| c.as_str()));
        // Only columns that exist: a missing one is reported by its own check.
        read.retain(|c| self.info.columns.contains_key(*c));
        read.sort_unstable();
        read.dedup();
        // (privilege, column: '' for the table, '*' for any column)
        let mut needs: Vec<(&str, &str)> = read.iter().map(|c| ("SELECT", *c)).collect();
        if deletes {
            needs.push(("DELETE", ""));
        }
        if let Some(c) = stamped.filter(|c| self.info.columns.contains_key(c.as_str())) {
            needs.push(("UPDATE", c.as_str()));
        }
        needs.push(("UPDATE", "*"));
        // USAGE on the schema is checked before anything reads the table (check_policy).
        let (role, privileges, columns): (String, Vec<String>, Vec<String>) = sqlx::query_as(
            "select quote_ident(current_user),
                        coalesce(array_agg(n.p order by n.i), '{}'),
                        coalesce(array_agg(n.c order by n.i), '{}')
                   from unnest($2::text[], $3::text[]) with ordinality n(p, c, i)
                  where not case n.c
                            when '' then has_table_privilege(to_regclass($1), n.p)
                            when '*' then has_any_column_privilege(to_regclass($1), n.p)
                            else has_column_privilege(to_regclass($1), n.c, n.p)
                        end",
        )
        .bind(t.table.quoted())
        .bind(needs.iter().map(|n| n.0).collect::<Vec<_>>())
        .bind(needs.iter().map(|n| n.1).collect::<Vec<_>>())
        .fetch_one(self.pool)
        .await?;
        let table = &t.table;
        // Named as configured in the sentence, quoted in the statement to run.
        let quoted = table.quoted();
        let readable = !privileges.iter().any(|p| p == "SELECT");
        for (privilege, column) in privileges.into_iter().zip(columns) {
            let q = format!("\"{}\"", column.replace('"', "\"\""));
            let message = match (privilege.as_str(), column.as_str()) {
                ("DELETE", _) => format!(
                    "privileges: role {role} lacks DELETE on {table}, which the policy deletes \
                     from: grant delete on {quoted} to {role}"
                ),
                ("UPDATE", "*") => format!(
                    "privileges: role {role} lacks UPDATE on every column of {table}: a command \
                     that meets a row another transaction holds, or whose item fails alone, \
                     locks the rows it acts on (SELECT … FOR UPDATE SKIP LOCKED), which \
                     PostgreSQL allows only with UPDATE on at least one column: grant update ({}) \
                     on {quoted} to {role}",
                    t.timestamp.quoted()
                ),
                ("UPDATE", c) => format!(
                    "privileges: role {role} lacks UPDATE on column {c} of {table}, which the \
                     action stamps: grant update ({q}) on {quoted} to {role}"
                ),
                (p, c) => format!(
                    "privileges: role {role} lacks {p} on column {c} of {table}, which the \
                     policy reads: grant {} ({q}) on {quoted} to {role}",
                    p.to_lowercase()
                ),
            };
            self.say(Level::Error, message);
        }
        Ok(readable)
    }

    /// The key: its columns' types, the unique index that makes it, NULLs.
    async fn key(&mut self) -> sqlx::Result<()> {
        let t = &self.p.spec.target;
        let mut fits = true;
        for c in t.key.columns() {
            match self.col(c.as_str()) {
                None => {
                    fits = false;
                    self.say(
                        Level::Error,
                        format!(
                            "target.key: column {} does not exist in {}",
                            c.as_str(),
                            t.table
                        ),
                    )
                }
                Some(info) if KeyType::from_type_name(&info.type_name).is_none() => {
                    fits = false;
                    let type_sql = info.type_sql.clone();
                    self.say(
                        Level::Error,
                        format!(
                            "target.key: column {} is {type_sql}; a key column is {KEY_TYPES}",
                            c.as_str()
                        ),
                    )
                }
                Some(_) => {}
            }
        }
        if !fits {
            return Ok(());
        }
        if t.key.is_composite() {
            self.composite_key();
            return Ok(());
        }
        let key = t.key.first();
        // The same test as a composite key's: a unique index of exactly this column, valid, not
        // partial, not on an expression, under the column's own deterministic collation.
        let unique = self.info.unique_index_of(&t.key).is_some();
        let leading: bool = sqlx::query_scalar(
            "select exists (select 1 from pg_index i
                              join pg_attribute a on a.attrelid = i.indrelid
                                                 and a.attnum = i.indkey[0]
                             where i.indrelid = to_regclass($1) and a.attname = $2)",
        )
        .bind(t.table.quoted())
        .bind(key.as_str())
        .fetch_one(self.pool)
        .await?;
        if self.col(key.as_str()).is_some_and(|c| !c.not_null) {
            self.say(
                Level::Warning,
                format!(
                    "target.key: column {} admits NULL; a row whose key is NULL can never be \
                     named by a command, so it is kept and reported on every run as held \
                     `null_key` (declare the column NOT NULL)",
                    key.as_str()
                ),
            );
        }
        if !unique {
            self.say(
                Level::Error,
                format!(
                    "target.key: column {} has no unique index (primary key or unique constraint; \
                     one that is valid, not partial, not on an expression, under the column's own \
                     deterministic collation); a key must name exactly one row",
                    key.as_str()
                ),
            );
        } else if !leading {
            self.say(
                Level::Warning,
                format!(
                    "target.key: no index leads with {}; planning scans in key order",
                    key.as_str()
                ),
            );
        }
        Ok(())
    }

    /// A key of several columns: every column NOT NULL, and together exactly the columns of
    /// the primary key or of a unique index that is neither partial nor on expressions (in any
    /// order: planning walks in the index's).
    fn composite_key(&mut self) {
        let t = &self.p.spec.target;
        let nullable: Vec<String> = t
            .key
            .columns()
            .iter()
            .filter(|c| self.col(c.as_str()).is_some_and(|i| !i.not_null))
            .map(|c| c.as_str().to_string())
            .collect();
        if !nullable.is_empty() {
            self.say(
                Level::Error,
                format!(
                    "target.key: column(s) {} admit NULL; every column of a key of several columns \
                     must be NOT NULL (a unique index lets rows with a NULL repeat, so such a key \
                     would not name one row)",
                    nullable.join(", ")
                ),
            );
        }
        if self.info.unique_index_of(&t.key).is_none() {
            self.say(
                Level::Error,
                format!(
                    "target.key: no primary key or unique index of {} is exactly {} (one that is \
                     valid, not partial, not on expressions, each column under its own \
                     deterministic collation, in any column order); a key must name exactly one row",
                    t.table,
                    t.key.names()
                ),
            );
        }
    }

    /// Columns an external action reads or stamps.
    async fn action_columns(&mut self) -> sqlx::Result<()> {
        let t = &self.p.spec.target;
        for c in self.p.spec.action.columns() {
            if self.col(c.as_str()).is_none() {
                self.say(
                    Level::Error,
                    format!(
                        "action: column {} (named by the action) does not exist in {}",
                        c.as_str(),
                        t.table
                    ),
                );
            }
        }
        let stamped = match &self.p.spec.action {
            crate::policy::ActionSpec::Http(h) => h.then.column(),
            crate::policy::ActionSpec::ObjectStore(o) => o.then.column(),
            crate::policy::ActionSpec::DeleteRows => None,
        };
        if let Some(c) = stamped.and_then(|s| self.col(s.as_str()).map(|c| (s, c)))
            && !matches!(c.1.type_name.as_str(), "timestamptz" | "timestamp")
        {
            self.say(
                Level::Error,
                format!(
                    "action.then.set: column {} is {}; it is stamped with the database clock and must \
                     be a nullable timestamptz",
                    c.0.as_str(),
                    c.1.type_sql
                ),
            );
        }
        Ok(())
    }

    /// The timestamp column: its type and zone, NULLs, an index for the scans.
    async fn timestamp(&mut self) -> sqlx::Result<()> {
        let t = &self.p.spec.target;
        match (self.col(t.timestamp.as_str()), &t.timestamp_zone) {
            (None, _) => self.say(
                Level::Error,
                format!(
                    "target.timestamp: column {} does not exist in {}",
                    t.timestamp.as_str(),
                    t.table
                ),
            ),
            (Some(c), None) if c.type_name == "timestamptz" => {}
            (Some(c), Some(_)) if c.type_name == "timestamp" => {}
            (Some(c), None) if c.type_name == "timestamp" => self.say(
                Level::Error,
                format!(
                    "target.timestamp: column {} is timestamp without time zone; set target.timestamp_zone \
                     to the IANA zone its values are written in",
                    t.timestamp.as_str()
                ),
            ),
            (Some(c), Some(_)) if c.type_name == "timestamptz" => self.say(
                Level::Error,
                format!(
                    "target.timestamp_zone: column {} is timestamptz, which carries its own zone; remove timestamp_zone",
                    t.timestamp.as_str()
                ),
            ),
            (Some(c), _) => self.say(
                Level::Error,
                format!(
                    "target.timestamp: column {} is {}; it must be timestamptz (or timestamp with timestamp_zone)",
                    t.timestamp.as_str(),
                    c.type_sql
                ),
            ),
        }
        if self.col(t.timestamp.as_str()).is_some_and(|c| !c.not_null) {
            self.say(
                Level::Warning,
                format!(
                    "target.timestamp: column {} admits NULL; a row whose timestamp is NULL is never \
                     eligible, so it is kept and reported on every run as held `null_timestamp`",
                    t.timestamp.as_str()
                ),
            );
        }
        if self.col(t.timestamp.as_str()).is_some() {
            self.planning_path().await?;
        }
        Ok(())
    }

    /// Whether an index leads with the timestamp, and which planning path a run triggered now
    /// would take ([`crate::policy::path::choose`]).
    async fn planning_path(&mut self) -> sqlx::Result<()> {
        let t = &self.p.spec.target;
        let mut conn = self.pool.acquire().await?;
        // The same test the planner applies: a valid, non-partial B-tree index whose first
        // column is the timestamp.
        if crate::policy::path::timestamp_index(&mut conn, t)
            .await?
            .is_none()
        {
            let key_list = crate::policy::path::key_list(&mut conn, t).await?;
            self.say(
                Level::Warning,
                format!(
                    "target.timestamp: no index leads with {ts}; every run plans by walking every key of the \
                     table and the closure check after each run scans it (create index on {} ({}))",
                    t.table,
                    key_list,
                    ts = t.timestamp.as_str(),
                ),
            );
        }
        // The ledger's clock when the ledger is there (check-config may run before the first
        // migration), the database's otherwise.
        let now = match crate::ledger::now(&mut conn).await {
            Ok(now) => now,
            Err(_) => {
                sqlx::query_scalar("select now()")
                    .fetch_one(&mut *conn)
                    .await?
            }
        };
        let cutoff = now - chrono::TimeDelta::seconds(self.p.spec.retain_for_seconds);
        let choice = crate::policy::path::choose(&mut conn, t, cutoff, self.path).await?;
        // A forced timestamp walk that cannot be had is worth a warning.
        let level = match (self.path, choice.path) {
            (
                crate::config::PathSetting::TimestampIndex,
                crate::policy::path::PlanningPath::KeyOrder,
            ) => Level::Warning,
            _ => Level::Info,
        };
        self.say(
            level,
            format!(
                "planning: a run triggered now plans along the {} path: {}",
                choice.path.as_str(),
                choice.reason
            ),
        );
        Ok(())
    }

    /// `partitions = "drop"` (docs/design.md §14 "Partition sweep"): the target is range
    /// partitioned on the policy's timestamp alone (a partition's bounds then say how old its
    /// rows are); no row-level DELETE trigger and no foreign key would be bypassed (a drop fires
    /// neither); no publication would keep the rows a drop removes (a detach or a drop is not
    /// replicated) unless `allow_unreplicated_drop`; the role can detach and drop (a member of
    /// the table's owner).
    async fn partition_drop(&mut self) -> sqlx::Result<()> {
        if self.p.partitions != crate::policy::partitions::Retirement::Drop {
            return Ok(());
        }
        let t = &self.p.spec.target;
        let ts = t.timestamp.as_str();
        let shape: Option<(String, i16, Option<String>, String, bool)> = sqlx::query_as(
            "select pt.partstrat::text, pt.partnatts,
                    (select a.attname::text from pg_attribute a
                      where a.attrelid = pt.partrelid and a.attnum = pt.partattrs[0]),
                    pg_get_userbyid(c.relowner),
                    pg_has_role(current_user, c.relowner, 'MEMBER')
               from pg_partitioned_table pt join pg_class c on c.oid = pt.partrelid
              where pt.partrelid = to_regclass($1)",
        )
        .bind(t.table.quoted())
        .fetch_optional(self.pool)
        .await?;
        let Some((strategy, columns, column, owner, member)) = shape else {
            self.say(
                Level::Error,
                format!(
                    "partitions: \"drop\" needs a partitioned table; {} is not one (use the \
                     default, \"rows\")",
                    t.table
                ),
            );
            return Ok(());
        };
        if strategy != "r" || columns != 1 || column.as_deref() != Some(ts) {
            let by = match strategy.as_str() {
                "l" => "list",
                "h" => "hash",
                _ => "range",
            };
            self.say(
                Level::Error,
                format!(
                    "partitions: \"drop\" needs {} partitioned by range on {ts} alone (a \
                     partition's bounds then say how old its rows are); it is partitioned by {by} \
                     on {}",
                    t.table,
                    match (&column, columns) {
                        (Some(c), 1) => c.clone(),
                        _ => "several columns or an expression".into(),
                    }
                ),
            );
        }
        let tree = "select relid from pg_partition_tree(to_regclass($1))";
        let bypassed: Vec<String> = sqlx::query_scalar(&format!(
            "select 'trigger ' || quote_ident(tg.tgname) || ' on ' || tg.tgrelid::regclass::text
               from pg_trigger tg
              where tg.tgrelid in ({tree}) and not tg.tgisinternal and tg.tgparentid = 0
                and tg.tgtype & 1 = 1 and tg.tgtype & 8 = 8
             union all
             select 'foreign key ' || quote_ident(k.conname) || ' on ' || k.conrelid::regclass::text
               from pg_constraint k
              where k.contype = 'f' and k.confrelid in ({tree}) and k.conparentid = 0
              order by 1"
        ))
        .bind(t.table.quoted())
        .fetch_all(self.pool)
        .await?;
        for b in bypassed {
            self.say(
                Level::Error,
                format!(
                    "partitions: \"drop\" would bypass {b}: dropping a partition fires no \
                     row-level DELETE trigger and checks no foreign key; use \"rows\", or drop \
                     the trigger or the foreign key"
                ),
            );
        }
        let publications: Vec<String> = sqlx::query_scalar(&format!(
            "select distinct p.pubname::text
               from pg_publication_tables p
              where to_regclass(format('%I.%I', p.schemaname, p.tablename)) in ({tree})
              order by 1"
        ))
        .bind(t.table.quoted())
        .fetch_all(self.pool)
        .await?;
        for publication in publications {
            if self.p.allow_unreplicated_drop {
                self.say(
                    Level::Warning,
                    format!(
                        "partitions: {} is in publication {publication}: a detach or a drop is not \
                         replicated, so its subscribers keep the rows sweeper drops \
                         (allow_unreplicated_drop = true)",
                        t.table
                    ),
                );
            } else {
                self.say(
                    Level::Error,
                    format!(
                        "partitions: \"drop\" on {}, which is in publication {publication}: a \
                         detach or a drop is not replicated, so its subscribers would keep the \
                         rows; use \"rows\", or set allow_unreplicated_drop = true if that is \
                         meant",
                        t.table
                    ),
                );
            }
        }
        self.partman_retention().await?;
        if member {
            self.say(
                Level::Info,
                format!(
                    "partitions: expired partitions of {} are detached and dropped by this role, \
                     a member of their owner {owner}",
                    t.table
                ),
            );
        } else {
            self.say(
                Level::Error,
                format!(
                    "partitions: \"drop\" detaches and drops partitions of {}, which needs a \
                     member of its owner {owner}; this role is not one (grant {owner} to it)",
                    t.table
                ),
            );
        }
        Ok(())
    }

    /// With pg_partman managing the target: a warning when its own retention is set too (it
    /// drops or detaches whole partitions by their bounds, held rows included, without evidence).
    async fn partman_retention(&mut self) -> sqlx::Result<()> {
        let t = &self.p.spec.target;
        let schema: Option<String> = sqlx::query_scalar(
            "select quote_ident(n.nspname) from pg_extension e
               join pg_namespace n on n.oid = e.extnamespace
              where e.extname = 'pg_partman'",
        )
        .fetch_optional(self.pool)
        .await?;
        let Some(schema) = schema else {
            return Ok(());
        };
        let retention: Option<Option<String>> = sqlx::query_scalar(&format!(
            "select retention::text from {schema}.part_config where parent_table = $1"
        ))
        .bind(format!(
            "{}.{}",
            t.table.schema.as_str(),
            t.table.name.as_str()
        ))
        .fetch_optional(self.pool)
        .await?;
        if let Some(Some(retention)) = retention {
            self.say(
                Level::Warning,
                format!(
                    "partitions: pg_partman's own retention ({retention}) is set on {}: it drops or \
                     detaches whole partitions by their bounds alone, held rows included and \
                     without evidence, possibly before sweeper retires them; set its retention \
                     to NULL (update {schema}.part_config set retention = null where \
                     parent_table = '{}.{}') and let pg_partman only create partitions",
                    t.table,
                    t.table.schema.as_str(),
                    t.table.name.as_str()
                ),
            );
        }
        Ok(())
    }

    /// A partitioned target: its leaves in the order planning walks them, with their bounds; the
    /// index each walk reads every leaf through; a default partition warned about (its
    /// constraint is the negation of all its siblings', which grows with them and changes
    /// whenever a partition is attached).
    async fn partitions(&mut self) -> sqlx::Result<()> {
        let t = &self.p.spec.target;
        let mut conn = self.pool.acquire().await?;
        use crate::policy::partitions::{Layout, layout};
        match layout(&mut conn, &t.table).await? {
            Layout::Plain => return Ok(()),
            Layout::Partitioned => {}
            Layout::Hashed => {
                self.say(
                    Level::Warning,
                    format!(
                        "target: {} is hash partitioned at some level: a statement cannot be \
                         confined to one hash partition (its bound prunes nothing), so planning \
                         walks the table through its parent as it walks a plain table, and every \
                         statement of a command plans and locks every partition its keys may be in",
                        t.table
                    ),
                );
                return Ok(());
            }
        }
        let Some(ts) = self.col(t.timestamp.as_str()) else {
            return Ok(());
        };
        let leaves = crate::policy::partitions::leaves(&mut conn, t, &ts.type_sql).await?;
        let key_index = self
            .info
            .unique_index_of(&t.key)
            .map(|cols| cols.join(", "))
            .unwrap_or_else(|| t.key.names());
        let ts_index = crate::policy::path::timestamp_index(&mut conn, t).await?;
        let count = match leaves.len() {
            1 => "1 leaf partition".to_string(),
            n => format!("{n} leaf partitions"),
        };
        let ts = t.timestamp.as_str();
        let skips = if leaves
            .iter()
            .any(|l| l.timestamp_from.is_some() || l.timestamp_to.is_some())
        {
            format!("skips those whose range on {ts} starts at or after the run's cutoff")
        } else {
            format!("skips none by age (no level is range partitioned on {ts} alone)")
        };
        self.say(
            Level::Info,
            format!(
                "target: {} is partitioned ({count}); planning walks them one at a time in this \
                 order, each command within one, and {skips}; the key-order walk reads each leaf \
                 through its copy of the unique index on ({key_index}){}",
                t.table,
                match &ts_index {
                    Some((name, _)) => format!(", the timestamp walk through its copy of {name}"),
                    None => format!(", and no index leads with {}", t.timestamp.as_str()),
                }
            ),
        );
        for l in &leaves {
            self.say(
                Level::Info,
                format!("target: partition {} {}", l.name, l.bound),
            );
            if l.default {
                self.say(
                    Level::Warning,
                    format!(
                        "target: {} is a default partition: it is walked last and never skipped \
                         by age, its commands are confined to it by the negation of every other \
                         partition's bounds (a predicate that grows with the partitions), and rows \
                         moved out of it (a partition created for their range) are already_absent \
                         for a run that planned them there and met again by the next",
                        l.name
                    ),
                );
            }
        }
        Ok(())
    }

    /// Each exclusion: its column and its values against the column's type, or its related
    /// rows ([`crate::policy::related::check`]); then each selection's related rows. Returns
    /// the foreign keys a hold's finding already speaks for.
    async fn exclusions(&mut self) -> sqlx::Result<Vec<String>> {
        let t = &self.p.spec.target;
        let mut covered = Vec::new();
        for (i, e) in self.p.spec.exclude.iter().enumerate() {
            let path = format!("exclude[{i}]");
            let c = match &e.rule {
                ExclusionRule::Column(c) => c,
                ExclusionRule::Related { exists } => {
                    let (found, keys) = related::check(
                        self.pool,
                        t,
                        &self.info,
                        exists,
                        (&format!("{path}.exists"), related::Use::Hold(&e.name)),
                        &self.p.literals,
                    )
                    .await?;
                    for (level, m) in found {
                        self.say(level, m);
                    }
                    covered.extend(keys);
                    continue;
                }
            };
            let Some(info) = self.col(c.column.as_str()) else {
                self.say(
                    Level::Error,
                    format!(
                        "{path}: column {} does not exist in {}",
                        c.column.as_str(),
                        t.table
                    ),
                );
                continue;
            };
            let found = related::check_values(
                self.pool,
                &path,
                &c.column,
                &c.test,
                &info,
                self.p.literals.get(&path),
            )
            .await?;
            for (level, m) in found {
                self.say(level, m);
            }
        }
        for (i, s) in self.p.spec.select.iter().enumerate() {
            let (field, r) = match s {
                Selection::Exists { exists } => ("exists", exists),
                Selection::NotExists { not_exists } => ("not_exists", not_exists),
                Selection::Column { .. } => continue,
            };
            let keeps = field == "not_exists";
            let (found, keys) = related::check(
                self.pool,
                t,
                &self.info,
                r,
                (
                    &format!("select[{i}].{field}"),
                    related::Use::Selection { keeps },
                ),
                &self.p.literals,
            )
            .await?;
            for (level, m) in found {
                self.say(level, m);
            }
            covered.extend(keys);
        }
        Ok(covered)
    }

    /// Foreign keys that reference the target, with their ON DELETE rule (but those of a hold
    /// kept in another table, whose finding already says what they do: `covered`).
    async fn foreign_keys(&mut self, covered: &[String]) -> sqlx::Result<()> {
        let t = &self.p.spec.target;
        let fks: Vec<(String, String, String, String)> = sqlx::query_as(
            "select conname::text, conrelid::regclass::text,
                    (select n.nspname || '.' || c.relname from pg_class c
                       join pg_namespace n on n.oid = c.relnamespace where c.oid = conrelid),
                    case confdeltype when 'a' then 'NO ACTION' when 'r' then 'RESTRICT'
                                     when 'c' then 'CASCADE' when 'n' then 'SET NULL'
                                     when 'd' then 'SET DEFAULT' end
               from pg_constraint where contype = 'f' and confrelid = to_regclass($1)",
        )
        .bind(t.table.quoted())
        .fetch_all(self.pool)
        .await?;
        for (name, from, _, rule) in fks
            .into_iter()
            .filter(|(n, _, table, _)| !covered.contains(&format!("{table}:{n}")))
        {
            let consequence = match rule.as_str() {
                "CASCADE" => {
                    "deleting a row also deletes its referencing rows, which are not audited"
                }
                "SET NULL" | "SET DEFAULT" => "deleting a row rewrites its referencing rows",
                _ => "a row that is still referenced cannot be deleted and is recorded as `failed`",
            };
            self.say(
                Level::Warning,
                format!(
                    "foreign key {name} on {from} references {} with ON DELETE {rule}: {consequence}",
                    t.table
                ),
            );
        }
        Ok(())
    }
}
