//! The rules that decide eligibility at the moment of the effect (docs/design.md §2.3, §2.10): the
//! target, the cutoff and every exclusion, turned into SQL with bound parameters.

use super::related::NullMatches;
use super::select::Selection;
use super::*;

/// The rules that decide eligibility at the moment of the effect: the target, the cutoff and
/// every exclusion, turned into SQL with bound parameters.
#[derive(Debug, Clone)]
pub struct RuleSet {
    /// The target (identical in the pinned and current versions, else the command is held).
    pub target: Target,
    /// The cutoff bound into every eligibility test.
    pub cutoff: chrono::DateTime<chrono::Utc>,
    /// All exclusions that apply.
    pub exclude: Vec<Exclusion>,
    /// A selection policy's predicates, of both versions (all must hold).
    pub select: Vec<crate::policy::select::Selection>,
    /// The run's window (what `older_than` / `newer_than` count back from).
    pub window: chrono::DateTime<chrono::Utc>,
    /// The run's own cutoff (what [`RuleSet::cutoff`] is unless a stricter one applies).
    pub run_cutoff: chrono::DateTime<chrono::Utc>,
    /// Whose cutoff [`RuleSet::cutoff`] is: the run's (`None`), or the current version's when
    /// its `retain_for` is longer (stricter) than the pinned one's.
    pub stricter_cutoff: Option<StricterCutoff>,
    /// Whose cutoff it is, said in a `younger_than_cutoff` reason when no stricter one applies
    /// (`the run's cutoff`, or for a live evaluation `the cutoff of a run starting now`).
    cutoff_of: &'static str,
    /// The pinned action.
    pub action: ActionSpec,
    /// `(policy, run_id)`: hold items whose effect is open in another run of the policy.
    effects: Option<(String, String)>,
    key: Key,
    column_types: HashMap<String, String>,
    /// The partition constraint of the leaf a command's keys were planned in, while it is still
    /// attached under the target ([`crate::policy::partitions`]): the command's statements are
    /// confined to that leaf. `None`: the whole target.
    partition: Option<String>,
}

/// The current version's cutoff, when it is earlier than the run's: what a run reports as its
/// effective cutoff, and what every row it keeps for being younger names.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StricterCutoff {
    /// The current version.
    pub version: String,
    /// `window − its retain_for`.
    pub cutoff: chrono::DateTime<chrono::Utc>,
}

impl StricterCutoff {
    /// The current version's cutoff for a run of `window` whose own cutoff is `run_cutoff`, when
    /// it is earlier (a longer `retain_for` since the run was pinned); `None` otherwise. The one
    /// place that decides which cutoff a run acts under.
    pub fn of(
        current_version: &str,
        current: &PolicySpec,
        run_cutoff: chrono::DateTime<chrono::Utc>,
        window: chrono::DateTime<chrono::Utc>,
    ) -> Option<StricterCutoff> {
        let cutoff = window - chrono::TimeDelta::seconds(current.retain_for_seconds);
        (cutoff < run_cutoff).then(|| StricterCutoff {
            version: current_version.to_string(),
            cutoff,
        })
    }
}

/// Why a rule set could not be built: the work waits (is *held*) until the database or the
/// policy is put right.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{detail}")]
pub struct Held {
    /// What holds it.
    pub kind: HoldKind,
    /// Why, for operators.
    pub detail: String,
}

pub use crate::retry::HoldKind;

impl Held {
    fn schema(detail: String) -> Self {
        Held {
            kind: HoldKind::Schema,
            detail,
        }
    }
}

impl From<Held> for crate::retry::Setback {
    fn from(h: Held) -> Self {
        crate::retry::Setback::held(h.kind, h.detail)
    }
}

impl RuleSet {
    /// The stricter of the pinned and the current version (docs/design.md §2.10): exclusions are the
    /// union, a selection policy's predicates are the union too (a row must satisfy both
    /// versions' `select`), the cutoff is the earlier of the run's and `window − current
    /// retain_for`. A current
    /// version that changes the target, timestamp or action holds the command.
    pub fn effective(
        pinned: &PolicySpec,
        current: Option<(&str, &PolicySpec)>,
        run_cutoff: chrono::DateTime<chrono::Utc>,
        window: chrono::DateTime<chrono::Utc>,
        tables: &Tables,
        checked: Option<&CheckedTypes>,
    ) -> Result<RuleSet, Held> {
        let mut exclude = pinned.exclude.clone();
        let mut select = pinned.select.clone();
        let mut cutoff = run_cutoff;
        let mut stricter_cutoff = None;
        if let Some((current_version, cur)) = current {
            if cur.target != pinned.target || cur.action != pinned.action {
                return Err(Held {
                    kind: HoldKind::PolicyChanged,
                    detail: "the policy's current version changes its target, timestamp or \
                             action; an operator must decide what happens to this run"
                        .into(),
                });
            }
            union(&mut exclude, &cur.exclude);
            union(&mut select, &cur.select);
            stricter_cutoff = StricterCutoff::of(current_version, cur, run_cutoff, window);
            if let Some(s) = &stricter_cutoff {
                cutoff = s.cutoff;
            }
        }
        // Every column the rules use must exist, with the type this replica checked the policy
        // against: a retyped column can change what a value matches (`'true'` cast to text
        // never equals `'t'`), so it holds the work instead of deleting under other rules. A
        // related table's columns are checked under `schema.table.column`.
        let type_in = |table: &TableInfo, prefix: &str, c: &Ident| -> Result<String, Held> {
            let t = table.type_of(c).map_err(|m| match prefix {
                "" => Held::schema(m),
                _ => Held::schema(format!("{m} in {}", prefix.trim_end_matches('.'))),
            })?;
            let checked_as = format!("{prefix}{}", c.as_str());
            match checked.and_then(|m| m.get(&checked_as)) {
                Some(was) if was != t => Err(Held::schema(format!(
                    "column `{checked_as}` is {t} now; this replica checked the policy against \
                     {was}: restore the type, or check the policy (sweeper check-config) and \
                     restart the replicas to accept it"
                ))),
                _ => Ok(t.to_string()),
            }
        };
        let table = tables
            .get(&pinned.target.table)
            .ok_or_else(|| Held::schema(format!("table {} does not exist", pinned.target.table)))?;
        let type_of = |c: &Ident| type_in(table, "", c);
        let mut column_types = HashMap::new();
        for c in pinned.target.key.columns() {
            type_of(c)?;
        }
        let key = table.key(&pinned.target.key).map_err(Held::schema)?;
        // Exactly-once rests on a key naming one row: without the index that makes it (dropped,
        // made partial, or comparing under another collation) the work waits.
        if table.unique_index_of(&pinned.target.key).is_none() {
            return Err(Held::schema(format!(
                "no primary key or unique index of {} is exactly {} (valid, not partial, not on \
                 expressions, each column under its own deterministic collation): a key must \
                 name exactly one row; restore the index",
                pinned.target.table, pinned.target.key
            )));
        }
        type_of(&pinned.target.timestamp)?;
        for e in &exclude {
            if let ExclusionRule::Column(c) = &e.rule {
                column_types.insert(c.column.as_str().to_string(), type_of(&c.column)?);
            }
        }
        for s in &select {
            let Selection::Column { column, .. } = s else {
                continue;
            };
            let t = type_of(column)?;
            if s.is_temporal() && t != "timestamp with time zone" {
                return Err(Held::schema(format!(
                    "select: column `{}` is {t}; older_than / newer_than compare a timestamptz \
                     with the window",
                    column.as_str()
                )));
            }
            column_types.insert(column.as_str().to_string(), t);
        }
        // Rows of another table: each `on` pair of one type (an implicit cast could change
        // which rows are equal), each `where` column's type kept for its values' casts.
        let related = exclude
            .iter()
            .filter_map(|e| match &e.rule {
                ExclusionRule::Related { exists } => Some(exists),
                ExclusionRule::Column(_) => None,
            })
            .chain(select.iter().filter_map(Selection::related));
        for r in related {
            let info = tables
                .get(&r.table)
                .ok_or_else(|| Held::schema(format!("table {} does not exist", r.table)))?;
            // A row security policy would hide holds from this role: held rows would look free.
            if info.row_security {
                return Err(Held::schema(row_security_hides(&r.table)));
            }
            let prefix = format!("{}.", r.table);
            for p in &r.on {
                let (theirs, ours) = (type_in(info, &prefix, &p.related)?, type_of(&p.target)?);
                if theirs != ours {
                    return Err(Held::schema(format!(
                        "{}.{} is {theirs} but {}.{} is {ours}: the columns of an `on` pair \
                         must have one type",
                        r.table,
                        p.related.as_str(),
                        pinned.target.table,
                        p.target.as_str()
                    )));
                }
            }
            for w in &r.where_ {
                column_types.insert(r.type_key(&w.column), type_in(info, &prefix, &w.column)?);
            }
        }
        for c in pinned.action.columns() {
            type_of(c)?;
        }
        Ok(RuleSet {
            target: pinned.target.clone(),
            cutoff,
            run_cutoff,
            exclude,
            select,
            window,
            stricter_cutoff,
            cutoff_of: "the run's cutoff",
            action: pinned.action.clone(),
            effects: None,
            key,
            column_types,
            partition: None,
        })
    }

    /// Rules evaluated now rather than for a run (a record's present state): a younger row's
    /// reason names the cutoff of a run starting now.
    pub fn evaluated_now(mut self) -> Self {
        self.cutoff_of = "the cutoff of a run starting now";
        self
    }

    /// For an action with external calls: also hold every item whose effect is open in another
    /// run of `policy` (reason `effect_open`, docs/design.md §2.4), and, for an action with a
    /// mismatch rule, every item with an open `mismatched` dead letter (`dead_letter_open`).
    /// Planning and execution both apply it.
    pub fn with_effects(mut self, policy: &str, run_id: &str) -> Self {
        if self.action.dependency().is_some() {
            self.effects = Some((policy.to_string(), run_id.to_string()));
        }
        self
    }

    /// These rules confined to one leaf partition of the target: `constraint` is its partition
    /// constraint as PostgreSQL prints it (constants only, so every plan is pruned to the leaf),
    /// `None` for the whole target.
    pub fn in_partition(mut self, constraint: Option<String>) -> Self {
        self.partition = constraint;
        self
    }

    /// These rules applied to `table` instead of the target: a partition detached from it,
    /// whose columns are the target's.
    pub fn on_table(mut self, table: crate::policy::TableName) -> Self {
        self.target.table = table;
        self.partition = None;
        self
    }

    /// Pushes `(constraint) and ` when the rules are confined to a leaf ([`RuleSet::in_partition`]),
    /// right after a `where` on the target (its column names are unqualified).
    pub fn push_partition_scope(&self, q: &mut QueryBuilder<'_, Postgres>) {
        if let Some(c) = &self.partition {
            q.push(format!("({c}) and "));
        }
    }

    /// `"schema"."table"`.
    pub fn table_sql(&self) -> String {
        self.target.table.quoted()
    }

    /// The key, resolved against the table.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The item key text of the table's row (see [`Key::text_sql`]).
    pub fn key_text_sql(&self) -> String {
        self.key.text_sql("")
    }

    /// The walk's sort columns as [`RuleSet::push_classify_columns`] names them (`sort_key_1,
    /// sort_key_2`): an `ORDER BY` in key order.
    pub fn sort_keys(&self) -> String {
        (1..=self.key.columns().len())
            .map(|i| format!("sort_key_{i}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Pushes the timestamp expression as a `timestamptz`.
    pub fn push_timestamp(&self, q: &mut QueryBuilder<'_, Postgres>) {
        match &self.target.timestamp_zone {
            // The zone name was validated against the IANA database: safe as a literal.
            Some(zone) => {
                q.push(format!(
                    "({} at time zone '{}')",
                    self.target.timestamp.quoted(),
                    zone
                ));
            }
            None => {
                q.push(self.target.timestamp.quoted());
            }
        }
    }

    /// Pushes `(ts < $cutoff)`: strict, and false for a NULL timestamp; for a selection policy
    /// (cutoff: the window) also every `select` predicate, so "old enough" reads "before the
    /// window and selected".
    pub fn push_old_enough(&self, q: &mut QueryBuilder<'_, Postgres>) {
        q.push("(coalesce(");
        self.push_timestamp(q);
        q.push(" < ");
        q.push_bind(self.cutoff);
        q.push(", false)");
        for s in &self.select {
            q.push(" and ");
            s.push(q, &self.table_sql(), &self.column_types, self.window);
        }
        q.push(")");
    }

    /// Why a row younger than the cutoff is kept: the predicate, the cutoff, and whose cutoff it
    /// is (`younger_than_cutoff: closed_at >= 2026-06-05T02:00:00Z, the cutoff of version v2`).
    pub fn younger_reason(&self) -> String {
        let whose = match &self.stricter_cutoff {
            Some(s) => format!(
                "the cutoff of the current version {}, stricter than the run's",
                s.version
            ),
            None => self.cutoff_of.to_string(),
        };
        format!(
            "younger_than_cutoff: {} >= {}, {whose}",
            self.target.timestamp.as_str(),
            crate::window::format(self.cutoff)
        )
    }

    /// Pushes why a row is not eligible — a NULL timestamp (`null_timestamp`), younger than the
    /// cutoff ([`RuleSet::younger_reason`]), or the first `select` predicate it fails
    /// (`not_selected:{column}`) — or NULL when it is eligible by all of them.
    pub fn push_not_eligible_reason(&self, q: &mut QueryBuilder<'_, Postgres>) {
        q.push("(case when ");
        self.push_timestamp(q);
        q.push(" is null then 'null_timestamp' when not (");
        self.push_timestamp(q);
        q.push(" < ");
        q.push_bind(self.cutoff);
        q.push(") then ");
        q.push_bind(self.younger_reason());
        for s in &self.select {
            q.push(" when not ");
            s.push(q, &self.table_sql(), &self.column_types, self.window);
            q.push(" then ");
            q.push_bind(s.unselected_reason());
        }
        q.push(" end)");
    }

    /// Pushes a `CASE` giving the first matching exclusion's reason, or NULL when none holds the
    /// row. A NULL in a value-tested column protects the row as `unknown:{column}` (docs/design.md §2.3).
    pub fn push_excluded_reason(&self, q: &mut QueryBuilder<'_, Postgres>) {
        if self.exclude.is_empty() && self.effects.is_none() {
            q.push("null::text");
            return;
        }
        q.push("(case");
        if let Some((policy, run_id)) = &self.effects {
            // Qualified by the table's full name: an effects column could share the key's name.
            q.push(" when exists (select 1 from sweeper.effects e where e.policy = ");
            q.push_bind(policy.clone());
            q.push(" and e.scope = ");
            q.push_bind(self.action.effect_scope(self.window));
            q.push(format!(
                " and e.item_key = {} and e.state <> 'closed' and e.run_id <> ",
                self.key.text_sql(&format!("{}.", self.table_sql()))
            ));
            q.push_bind(run_id.clone());
            q.push(") then 'effect_open'");
            // An answer that was a mismatch holds its item until an operator redrives or
            // abandons its dead letter: later runs do not call again.
            if let crate::policy::ActionSpec::Http(h) = &self.action
                && h.mismatch.is_some()
            {
                q.push(" when exists (select 1 from sweeper.dead_letters d where d.policy = ");
                q.push_bind(policy.clone());
                q.push(format!(
                    " and d.kind = 'item' and d.status = 'open' and d.outcome = 'mismatched' \
                     and d.item_key = {}) then 'dead_letter_open'",
                    self.key.text_sql(&format!("{}.", self.table_sql()))
                ));
            }
        }
        let table = self.table_sql();
        for e in &self.exclude {
            match &e.rule {
                ExclusionRule::Column(c) => {
                    let col = c.column.quoted();
                    let ty = &self.column_types[c.column.as_str()];
                    if c.test.compares_values() {
                        q.push(format!(" when {col} is null then "));
                        q.push_bind(format!("unknown:{}", c.column.as_str()));
                    }
                    q.push(" when ");
                    c.test.push(q, &col, ty);
                    q.push(" then ");
                    q.push_bind(e.name.clone());
                }
                // A related row that matches holds the row under the exclusion's name; one that
                // matches only through a NULL in a compared column holds it as unknown.
                ExclusionRule::Related { exists } => {
                    q.push(" when ");
                    exists.push_exists(q, &table, &self.column_types, NullMatches::No);
                    q.push(" then ");
                    q.push_bind(e.name.clone());
                    if exists.compares_values() {
                        q.push(" when ");
                        exists.push_exists(q, &table, &self.column_types, NullMatches::Yes);
                        q.push(" then ");
                        exists.push_unknown_reason(q, &table, &self.column_types);
                    }
                }
            }
        }
        q.push(" end)");
    }

    /// Starts the classifying scan used by planning and by execution:
    /// `select a as sort_key_1, b as sort_key_2, <key text> as item_key, <old enough> as old_enough,
    /// <timestamp> is null as null_timestamp, <first exclusion> as reason from <table>`; the
    /// caller adds its `where`.
    pub fn classify_select(&self) -> QueryBuilder<'static, Postgres> {
        let mut q = QueryBuilder::new("");
        self.push_classify_select(&mut q);
        q
    }

    /// Pushes [`RuleSet::classify_select`]'s text onto `q` (to nest it in a larger query).
    pub fn push_classify_select(&self, q: &mut QueryBuilder<'_, Postgres>) {
        q.push("select ");
        self.push_classify_columns(q);
        q.push(" from ");
        q.push(self.table_sql());
    }

    /// Pushes the classifying columns of [`RuleSet::classify_select`] alone (`sort_key_1..n`
    /// in walk order, `item_key, old_enough, null_timestamp, reason`), for a scan that selects
    /// more.
    pub fn push_classify_columns(&self, q: &mut QueryBuilder<'_, Postgres>) {
        for (i, c) in self.key.walk_column_list("").iter().enumerate() {
            q.push(format!("{c} as sort_key_{}, ", i + 1));
        }
        q.push(self.key_text_sql());
        q.push(" as item_key, ");
        self.push_old_enough(q);
        q.push(" as old_enough, ");
        self.push_timestamp(q);
        q.push(" is null as null_timestamp, ");
        self.push_excluded_reason(q);
        q.push(" as reason, ");
        self.push_not_eligible_reason(q);
        q.push(" as not_eligible_reason");
    }

    /// Pushes the full eligibility predicate: old enough and held by no exclusion.
    pub fn push_eligible(&self, q: &mut QueryBuilder<'_, Postgres>) {
        q.push("(");
        self.push_old_enough(q);
        q.push(" and ");
        self.push_excluded_reason(q);
        q.push(" is null)");
    }

    /// Pushes that the row has a key an item key text can name (every key column not NULL, a
    /// temporal one within the years 0001–9999): a command cannot name any other row (it is
    /// counted as held `null_key` or `key_out_of_range` instead).
    pub fn push_has_key(&self, q: &mut QueryBuilder<'_, Postgres>) {
        self.key.push_nameable(q, "");
    }

    /// `select count(*)` of the target's rows matching what `push_where` pushes, counting at
    /// most `cap` (the counts that report held or remaining rows stay bounded whatever the
    /// table holds).
    pub fn capped_count(
        &self,
        cap: i64,
        push_where: impl FnOnce(&mut QueryBuilder<'_, Postgres>),
    ) -> QueryBuilder<'static, Postgres> {
        let mut q = QueryBuilder::new("select count(*) from (select 1 from ");
        q.push(self.table_sql());
        q.push(" where ");
        push_where(&mut q);
        q.push(" limit ");
        q.push_bind(cap);
        q.push(") capped");
        q
    }

    /// Pushes that the row's key is one of `keys` (see [`Key::push_in`]).
    pub fn push_key_in(&self, q: &mut QueryBuilder<'_, Postgres>, keys: Vec<String>) {
        self.key.push_in(q, "", keys);
    }
}

impl RuleSet {
    /// For an action once per window (whose rows are kept): pushes ` and` a row whose effect of
    /// this window is not closed yet, so the closure check counts only the rows still to call.
    /// Pushes nothing for other actions.
    pub fn push_not_done_in_window(&self, q: &mut QueryBuilder<'_, Postgres>) {
        let Some((policy, _)) = self
            .effects
            .as_ref()
            .filter(|_| self.action.once_per_window())
        else {
            return;
        };
        q.push(" and not exists (select 1 from sweeper.effects e where e.policy = ");
        q.push_bind(policy.clone());
        q.push(" and e.scope = ");
        q.push_bind(self.action.effect_scope(self.window));
        q.push(format!(
            " and e.item_key = {} and e.state = 'closed')",
            self.key.text_sql(&format!("{}.", self.table_sql()))
        ));
    }

    /// The digest that tells whether an item's row changed during its call: of the whole row,
    /// or — for an action once per window, whose row is kept and may move for reasons of its own
    /// (a customer's `last_seen_at`) — of only the columns the rules and the templates read (the
    /// key, the timestamp, `select`, exclusions, the action's columns).
    pub fn row_digest_sql(&self) -> String {
        let table = self.table_sql();
        if !self.action.once_per_window() {
            return format!("md5({table}.*::text)");
        }
        let mut columns: Vec<&Ident> = self.target.key.columns().iter().collect();
        columns.push(&self.target.timestamp);
        columns.extend(self.select.iter().flat_map(Selection::target_columns));
        columns.extend(self.exclude.iter().flat_map(|e| match &e.rule {
            ExclusionRule::Column(c) => vec![&c.column],
            ExclusionRule::Related { exists } => exists.target_columns().collect(),
        }));
        columns.extend(self.action.columns());
        let mut seen = std::collections::HashSet::new();
        columns.retain(|c| seen.insert(c.as_str()));
        let list: Vec<String> = columns
            .iter()
            .map(|c| format!("{table}.{}", c.quoted()))
            .collect();
        format!("md5(jsonb_build_array({})::text)", list.join(", "))
    }
}

/// Why rows of another table cannot be tested under row security.
pub fn row_security_hides(table: &TableName) -> String {
    format!(
        "row security is active on {table} for this database role: its policies would hide \
         related rows (a hidden hold leaves its rows free to delete); give the role BYPASSRLS, \
         or make it the table's owner without FORCE ROW LEVEL SECURITY"
    )
}

/// Appends to `into` each of `more` it does not hold yet (both versions' rules apply).
fn union<T: PartialEq + Clone>(into: &mut Vec<T>, more: &[T]) {
    for m in more {
        if !into.contains(m) {
            into.push(m.clone());
        }
    }
}

impl crate::ledger::effects::ItemQuery for RuleSet {
    /// The item's row judged by these rules, for opening its effect: old enough, the first
    /// exclusion that holds it, its columns as JSON and a digest of the row.
    fn push_item(&self, q: &mut QueryBuilder<'_, Postgres>, key: &str) {
        let table = self.table_sql();
        q.push("select ");
        self.push_old_enough(q);
        q.push(" as old_enough, ");
        self.push_excluded_reason(q);
        q.push(" as reason, ");
        self.push_not_eligible_reason(q);
        q.push(format!(
            " as not_eligible_reason, to_jsonb({table}.*) as fields, {} as row_digest \
             from {table} where ",
            self.row_digest_sql(),
        ));
        self.push_key_in(q, vec![key.to_string()]);
    }
}

impl crate::ledger::commands::DeleteTarget for RuleSet {
    fn push_delete_first(
        &self,
        q: &mut QueryBuilder<'static, Postgres>,
        keys: &[String],
        skip_locked: bool,
    ) {
        q.push("delete from ");
        q.push(self.table_sql());
        q.push(" where ");
        self.push_partition_scope(q);
        self.push_key_in(q, keys.to_vec());
        q.push(" and ");
        self.push_eligible(q);
        if skip_locked {
            let columns = self.key.walk_columns("");
            q.push(format!(
                " and ({columns}) in (select {columns} from {} where ",
                self.table_sql()
            ));
            self.push_partition_scope(q);
            self.push_key_in(q, keys.to_vec());
            q.push(" for update skip locked)");
        }
        q.push(format!(" returning {}", self.key_text_sql()));
    }

    fn push_classify(&self, q: &mut QueryBuilder<'static, Postgres>, keys: &[String]) {
        q.push("select ");
        q.push(self.key_text_sql());
        q.push(" as item_key, ");
        self.push_old_enough(q);
        q.push(" as old_enough, ");
        self.push_excluded_reason(q);
        q.push(" as reason, ");
        self.push_not_eligible_reason(q);
        q.push(" as not_eligible_reason from ");
        q.push(self.table_sql());
        q.push(" where ");
        self.push_partition_scope(q);
        self.push_key_in(q, keys.to_vec());
    }

    fn push_lockers(&self, q: &mut QueryBuilder<'static, Postgres>, keys: &[String]) {
        q.push(
            "select l.pid, coalesce(extract(epoch from now() - a.xact_start), 0)::float8 \
               from ",
        );
        q.push(self.table_sql());
        q.push(
            " t join pg_locks l on l.locktype = 'transactionid' and l.granted \
                 and l.mode = 'ExclusiveLock' and l.transactionid = t.xmax \
               left join pg_stat_activity a on a.pid = l.pid \
              where l.pid <> pg_backend_pid() and ",
        );
        self.key.push_in(q, "t.", keys.to_vec());
        q.push(" order by 2 desc");
    }

    fn push_unlocked(&self, q: &mut QueryBuilder<'static, Postgres>, keys: &[String]) {
        q.push(format!("select {} from ", self.key_text_sql()));
        q.push(self.table_sql());
        q.push(" where ");
        self.push_partition_scope(q);
        self.push_key_in(q, keys.to_vec());
        q.push(" for update skip locked");
    }
}
