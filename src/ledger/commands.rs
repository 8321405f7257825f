//! A command's state changes (docs/design.md §2.4-§2.7): leased for external calls, succeeded with its
//! audit rows, held, quarantined with a dead letter, or scheduled for another attempt. Each runs
//! in the caller's transaction, which holds the command row's lock (taken by `FOR UPDATE` when
//! the command was loaded), so two executions cannot both change it; and each is fenced by the
//! [`Attempt`] the caller saw, in its own `WHERE`, so a write of an overtaken try changes nothing.
//! The attempt arithmetic — what a result counts, what a hold or a release gives back — is
//! [`Attempt`]'s alone.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Postgres, QueryBuilder, Row};

/// `recorded_at` of a statement's audit rows: the ledger's clock read once per statement (an
/// uncorrelated subquery is evaluated once). The column's default, `sweeper.now()`, is a
/// volatile function that reads the clock offset per row — measured at about 40 % of the cost of
/// inserting 250 audit rows.
const RECORDED_AT: &str = "(select sweeper.now())";

/// Pushes `items as (…)`: the audited items as [`CommandTry::push_audit`] reads them, one row per
/// key with its place in the command (`ord`), outcome and reason.
fn push_items(q: &mut QueryBuilder<'_, Postgres>, a: &Audited<'_>) {
    q.push("items as (select u.ord, u.item_key, u.outcome, u.reason, u.recorded::json as recorded from unnest(");
    q.push_bind(a.keys.to_vec());
    q.push("::text[], ");
    q.push_bind(a.outcomes.iter().map(|o| o.to_string()).collect::<Vec<_>>());
    q.push("::text[], ");
    q.push_bind(a.reasons.to_vec());
    q.push("::text[], ");
    q.push_bind(a.recorded.to_vec());
    q.push("::text[]) with ordinality as u(item_key, outcome, reason, recorded, ord))");
}

/// The command row columns every state change that leaves `pending`/`leased` resets.
/// The time since the hold was last checked is credited to the command's age budget (time held
/// counts against no budget).
const HOLD_CLEARED: &str = "held_kind = null, held_reason = null, held_since = null, \
     age_credit_seconds = age_credit_seconds \
         + coalesce(extract(epoch from sweeper.now() - held_seen_at), 0), \
     held_seen_at = null";

/// The try of a command a caller holds, as the ledger counts it: every state change of the
/// command takes it, writes only while the row still holds [`Attempt::fence`] attempts, and
/// records what the try counts as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// A delivery (`/consume`) that locked the row holding `seen` attempts: the try is counted
    /// when it records its result (as attempt `seen + 1`).
    Uncounted {
        /// The attempt count the row held when the delivery locked it.
        seen: i32,
    },
    /// A built-in worker's claim, or a delivery's lease for calls: the ledger counted the try as
    /// attempt `n` when it was claimed or leased.
    Counted {
        /// The attempt number.
        n: i32,
    },
}

impl Attempt {
    /// The attempt number this try runs as.
    pub fn number(self) -> i32 {
        match self {
            Attempt::Uncounted { seen } => seen + 1,
            Attempt::Counted { n } => n,
        }
    }

    /// The attempt count the command row holds while this try is its latest.
    pub fn fence(self) -> i32 {
        match self {
            Attempt::Uncounted { seen } => seen,
            Attempt::Counted { n } => n,
        }
    }

    /// The attempt count a try that is given back records (a hold, a release, a snooze): it
    /// spent nothing.
    pub fn given_back(self) -> i32 {
        self.number() - 1
    }
}

/// A state change found the command overtaken: its attempt count is no longer the try's
/// [`Attempt::fence`] (another try of it recorded a result, or claimed it since). Nothing was
/// written.
fn overtaken(command_id: &str) -> sqlx::Error {
    sqlx::Error::Protocol(format!(
        "command {command_id} was overtaken by a newer attempt; nothing was written"
    ))
}

/// `Ok` when a fenced write changed the command row, else [`overtaken`].
fn fenced(command_id: &str, rows: u64) -> sqlx::Result<()> {
    if rows == 0 {
        Err(overtaken(command_id))
    } else {
        Ok(())
    }
}

/// What every audit row of one execution of a command says besides its item: the command, its
/// run and policy version, window, cutoff and actor, and the attempt it ran as.
#[derive(Debug, Clone, Copy)]
pub struct Execution<'a> {
    /// Seconds the try took.
    pub elapsed_seconds: f64,
    /// The policy.
    pub policy: &'a str,
    /// The run's pinned version.
    pub policy_version: &'a str,
    /// The run.
    pub run_id: &'a str,
    /// The run's window.
    pub window: DateTime<Utc>,
    /// The cutoff the items were judged by.
    pub cutoff: DateTime<Utc>,
    /// The run's own cutoff (`cutoff` is earlier when the current version's stricter one applied).
    pub pinned_cutoff: DateTime<Utc>,
    /// The policy's current version, when its stricter cutoff is the one items were judged by.
    pub current_version: Option<&'a str>,
    /// Who executed it (a token's `sub`, or the built-in queue).
    pub actor: &'a str,
}

/// A command that ran to its end, with one audit row per item.
#[derive(Debug)]
pub struct Audited<'a> {
    /// The execution the rows record.
    pub execution: Execution<'a>,
    /// Whether the run is a dry run.
    pub dry_run: bool,
    /// Item keys, in the command's order.
    pub keys: &'a [String],
    /// Their outcomes (`Outcome::as_str`).
    pub outcomes: &'a [&'a str],
    /// Their reasons.
    pub reasons: &'a [Option<String>],
    /// The recorded fields of their calls' answers (JSON text), where the action records any;
    /// shorter than `keys` (or empty) when the last items have none.
    pub recorded: &'a [Option<String>],
}

/// What closing a delete-rows command after its delete records (see
/// [`CommandTry::close_after_delete`]).
#[derive(Debug)]
pub struct AfterDelete<'a> {
    /// The execution the rows record.
    pub execution: Execution<'a>,
    /// It re-executes one item whose earlier outcome was `failed` (that outcome is superseded).
    pub item_redrive: bool,
    /// Count the run's other pending commands up to this many
    /// ([`super::runs::Recorded::others_pending`]).
    pub others_cap: i64,
}

/// The target's side of a delete-rows command (delete first, classify after: docs/design.md
/// §2.4), built by the policy layer; every value a bound parameter.
pub trait DeleteTarget {
    /// Pushes `delete from <table> where <key> in <keys> and <eligible> returning <key>::text`:
    /// every predicate in the delete's own WHERE, so PostgreSQL re-checks the newest version of a
    /// row another transaction changed, and nothing is locked beforehand. `skip_locked`: only
    /// the rows no other transaction holds locked (`FOR UPDATE SKIP LOCKED`), so a locked row
    /// delays only itself.
    fn push_delete_first(
        &self,
        q: &mut QueryBuilder<'static, Postgres>,
        keys: &[String],
        skip_locked: bool,
    );
    /// Pushes `select <key>::text as item_key, <old enough> as old_enough, <first exclusion> as
    /// reason, <first failed predicate> as not_eligible_reason from <table> where <key> in
    /// <keys>`, locking nothing: the classification of the keys a delete did not remove, read
    /// in a later statement's snapshot than the delete's.
    fn push_classify(&self, q: &mut QueryBuilder<'static, Postgres>, keys: &[String]);
    /// Pushes `select <pid>, <seconds its transaction has run> from …` for the sessions whose
    /// transactions hold rows of `keys` locked (found through each row's `xmax`); none when a
    /// row's lockers are several (a multixact).
    fn push_lockers(&self, q: &mut QueryBuilder<'static, Postgres>, keys: &[String]);
    /// Pushes `select <key>::text from <table> where <key> in <keys> for update skip locked`:
    /// the keys no other transaction holds locked (a row the delete left that no one else
    /// holds was kept by a trigger or a row security policy, not by a lock).
    fn push_unlocked(&self, q: &mut QueryBuilder<'static, Postgres>, keys: &[String]);
}

/// The outcomes an item of a delete-rows command ends in within the one statement (a failed
/// item needs the item-by-item path).
pub const DELETE_OUTCOMES: [super::Outcome; 4] = [
    super::Outcome::Deleted,
    super::Outcome::AlreadyAbsent,
    super::Outcome::Excluded,
    super::Outcome::NotEligible,
];

/// A try that failed, as the ledger records it.
#[derive(Debug)]
pub struct Failed<'a> {
    /// Its run.
    pub run_id: &'a str,
    /// Its policy.
    pub policy: &'a str,
    /// The attempt count to record (decided by [`crate::retry::decide`] from the try's number).
    /// The attempts it has counted.
    pub attempts: i32,
    /// Seconds the try took.
    pub elapsed_seconds: f64,
    /// The failure's message.
    pub error: &'a str,
    /// Its class (`FailureClass::as_str`).
    pub class: &'a str,
}

/// A try of one command, as the ledger counts it: created by the gate's lock of a delivery
/// ([`CommandTry::locked`]) or by the built-in queue's claim ([`CommandTry::claimed`]), and its methods are the only changes of the
/// command's state — each writes only while the row still holds the try's
/// [`Attempt::fence`], in its own `WHERE`, and records what [`Attempt`] says the try counts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandTry {
    command_id: String,
    attempt: Attempt,
}

impl CommandTry {
    fn new(command_id: &str, attempt: Attempt) -> Self {
        CommandTry {
            command_id: command_id.to_string(),
            attempt,
        }
    }

    /// A delivery's try of a command whose row it locked holding `seen` attempts (the gate's
    /// lock, `FOR UPDATE`, in the caller's transaction).
    pub fn locked(command_id: &str, seen: i32) -> Self {
        Self::new(command_id, Attempt::Uncounted { seen })
    }

    /// A claim of attempt `n` of the command, as [`super::queue::claim`] makes it (public so a
    /// test can hold the claim of a worker that was overtaken).
    pub fn claimed(command_id: &str, n: i32) -> Self {
        Self::new(command_id, Attempt::Counted { n })
    }

    /// The command.
    pub fn command_id(&self) -> &str {
        &self.command_id
    }

    /// The try's attempt.
    pub fn attempt(&self) -> Attempt {
        self.attempt
    }

    /// Locks the command's row again after this try failed (its transaction rolled back): what
    /// deciding the failure needs. `None` when the ledger has no such command.
    pub async fn lock_after_failure(
        &self,
        conn: &mut PgConnection,
    ) -> sqlx::Result<Option<FailedRow>> {
        let row = sqlx::query(
            "select c.state, c.attempts, c.run_id, r.policy,
                    extract(epoch from sweeper.now() - c.due_since)::float8 - c.age_credit_seconds
                        - coalesce(extract(epoch from sweeper.now() - c.held_seen_at)::float8, 0)
                        as age_seconds,
                    greatest(1, extract(epoch from c.next_attempt_at - sweeper.now()))::float8
                        as due_in_seconds
               from sweeper.commands c join sweeper.runs r using (run_id)
              where c.command_id = $1 for update of c",
        )
        .bind(&self.command_id)
        .fetch_optional(conn)
        .await?;
        Ok(row.map(|row| FailedRow {
            state: row.get("state"),
            attempts: row.get("attempts"),
            run_id: row.get("run_id"),
            policy: row.get("policy"),
            age_seconds: row.get("age_seconds"),
            due_in_seconds: row.get("due_in_seconds"),
        }))
    }

    /// The fence of a closing transaction: locks the command row (with this transaction's lock
    /// and statement timeouts, seconds) and says whether it is still leased to this try.
    pub async fn lock_if_leased(
        &self,
        conn: &mut PgConnection,
        lock_timeout_seconds: i64,
        statement_timeout_seconds: i64,
    ) -> sqlx::Result<bool> {
        let row: Option<(i32, String)> = sqlx::query_as(
            "select attempts, state from sweeper.commands
              where command_id = $1
                and set_config('lock_timeout', $2, true) is not null
                and set_config('statement_timeout', $3, true) is not null
              for update",
        )
        .bind(&self.command_id)
        .bind(format!("{lock_timeout_seconds}s"))
        .bind(format!("{statement_timeout_seconds}s"))
        .fetch_optional(conn)
        .await?;
        Ok(row.is_some_and(|(a, s)| {
            a == self.attempt.fence() && s == super::CommandState::Leased.as_str()
        }))
    }

    /// Leases the command to `owner` for `lease_seconds` as a delivery's attempt, for its external
    /// calls (counted before
    /// anything is called, so a delivery that kills the process every time still spends the
    /// budget). Returns the counted try.
    pub async fn lease_for_calls(
        &self,
        conn: &mut PgConnection,
        owner: uuid::Uuid,
        lease_seconds: f64,
    ) -> sqlx::Result<CommandTry> {
        let n: Option<i32> = sqlx::query_scalar(
            "update sweeper.commands
                set state = 'leased', attempts = $4, lease_owner = $2,
                    lease_until = sweeper.now() + make_interval(secs => $3)
              where command_id = $1 and attempts = $5
          returning attempts",
        )
        .bind(&self.command_id)
        .bind(owner)
        .bind(lease_seconds)
        .bind(self.attempt.number())
        .bind(self.attempt.fence())
        .fetch_optional(conn)
        .await?;
        n.map(|n| CommandTry::claimed(&self.command_id, n))
            .ok_or_else(|| overtaken(&self.command_id))
    }

    /// Marks that the command's external calls start now (counted by `max_concurrent_commands`).
    pub async fn mark_calling(&self, conn: &mut PgConnection) -> sqlx::Result<()> {
        sqlx::query(
            "update sweeper.commands set calling_since = sweeper.now() where command_id = $1",
        )
        .bind(&self.command_id)
        .execute(conn)
        .await?;
        Ok(())
    }

    /// One statement: the audit rows, the command `succeeded`, its attempt recorded, and a redriven
    /// dead letter of it (or of the item it re-executes) resolved. Both paths end here: the delete
    /// path in its one transaction, an external action's command once every item's effect closed.
    pub async fn succeed_with_audit(
        &self,
        conn: &mut PgConnection,
        a: &Audited<'_>,
    ) -> sqlx::Result<()> {
        let mut q = QueryBuilder::new("with ");
        push_items(&mut q, a);
        q.push(
            ", c as (
                 update sweeper.commands
                    set state = 'succeeded', attempts = ",
        );
        q.push_bind(self.attempt.number());
        q.push(format!(
            ", finished_at = sweeper.now(),
                        lease_until = null, lease_owner = null, last_error = null,
                        last_error_class = null, calling_since = null, {HOLD_CLEARED}
                  where command_id = "
        ));
        q.push_bind(self.command_id.clone());
        q.push(" and attempts = ");
        q.push_bind(self.attempt.fence());
        q.push(" returning attempts, redrive_of)");
        self.push_succeeded(&mut q, &a.execution, a.dry_run);
        q.push(" select attempts from c");
        let done: Option<i32> = q.build_query_scalar().fetch_optional(conn).await?;
        done.map(|_| ()).ok_or_else(|| overtaken(&self.command_id))
    }

    /// Pushes what follows a command's `c` CTE (`update … set state = 'succeeded' … returning
    /// attempts, redrive_of`) on both paths that end one: its audit ([`CommandTry::push_audit`]),
    /// its attempt row, and a redriven dead letter of it (or of the item it re-executes)
    /// resolved — each only if `c` changed the command.
    fn push_succeeded(&self, q: &mut QueryBuilder<'_, Postgres>, e: &Execution<'_>, dry_run: bool) {
        self.push_audit(q, e, dry_run, "exists (select 1 from c)");
        q.push(
            ", a as (
                 insert into sweeper.attempts (command_id, attempt_no, started_at, ended_at, outcome)
                 select ",
        );
        q.push_bind(self.command_id.clone());
        q.push(", c.attempts, sweeper.now() - make_interval(secs => ");
        q.push_bind(e.elapsed_seconds);
        q.push(
            "), sweeper.now(), 'succeeded' from c),
             dl as (
                 update sweeper.dead_letters d
                    set status = 'resolved', resolved_at = sweeper.now()
                  where d.status = 'redriven' and exists (select 1 from c)
                    and ((d.kind = 'command' and d.command_id = ",
        );
        q.push_bind(self.command_id.clone());
        q.push(") or d.dead_letter_id = (select redrive_of from c)))");
    }

    /// Pushes `, audit_ex as (…), audit_rows as (…)`: one execution of this command and one
    /// narrow row per item of the CTE `items` (`ord, item_key, outcome, reason`) whose outcome is
    /// decided, both written only when `when` holds and there is an item to write. Every command
    /// that ends writes its audit here (docs/design.md §2.9; a command's partial progress is
    /// [`CommandTry::append_audit`]): items carry their execution's id and `recorded_at`, so an
    /// item and its execution always fall in the same month.
    fn push_audit(
        &self,
        q: &mut QueryBuilder<'_, Postgres>,
        e: &Execution<'_>,
        dry_run: bool,
        when: &str,
    ) {
        q.push(
            ", audit_ex as (
                 insert into sweeper.audit_executions
                     (policy, policy_version, current_version, run_id, window_at, pinned_cutoff,
                      cutoff, command_id, attempt, actor, dry_run, recorded_at)
                 select ",
        );
        let mut v = q.separated(", ");
        v.push_bind(e.policy.to_string());
        v.push_bind(e.policy_version.to_string());
        v.push_bind(e.current_version.map(str::to_string));
        v.push_bind(e.run_id.to_string());
        v.push_bind(e.window);
        v.push_bind(e.pinned_cutoff);
        v.push_bind(e.cutoff);
        v.push_bind(self.command_id.clone());
        v.push_bind(self.attempt.number());
        v.push_bind(e.actor.to_string());
        v.push_bind(dry_run);
        q.push(format!(
            ", {RECORDED_AT}
                  where {when} and exists (select 1 from items where outcome is not null)
              returning execution_id, recorded_at),
             audit_rows as (
                 insert into sweeper.audit_items
                     (execution_id, recorded_at, item_key, outcome, reason, recorded)
                 select x.execution_id, x.recorded_at, i.item_key, i.outcome, i.reason, i.recorded
                   from audit_ex x cross join items i
                  where i.outcome is not null
                  order by i.ord)"
        ));
    }

    /// The statement that closes a delete-rows command after its delete (docs/design.md §2.4,
    /// delete first): the keys the delete did not remove are classified in this statement's
    /// snapshot, which sees every transaction committed since the delete's
    /// ([`super::outcome::Judgement::after_delete_sql`]); when every key has an outcome, one audit
    /// row per key in the command's order, the command `succeeded` with its counts and attempt, a
    /// redriven dead letter resolved. It returns one row `(deleted, already_absent, excluded,
    /// not_eligible, status, others_pending, closed, undecided)` with the run's status and its
    /// other pending commands counted up to the cap. `closed` false with `undecided` keys (rows
    /// locked, or changed twice while the delete ran): nothing was written, and the row carries
    /// every decided key with its outcome and reason (`item_keys`, `outcomes`, `reasons`) for
    /// [`CommandTry::append_audit`]. `closed` false with none undecided: the command was
    /// overtaken ([`Attempt::fence`]), and the caller's transaction rolls the delete back.
    pub fn close_after_delete(
        &self,
        target: &impl DeleteTarget,
        keys: &[String],
        deleted: &[String],
        d: &AfterDelete<'_>,
    ) -> QueryBuilder<'static, Postgres> {
        use super::outcome::Judgement;
        let gone: std::collections::HashSet<&str> = deleted.iter().map(String::as_str).collect();
        let left: Vec<String> = keys
            .iter()
            .filter(|k| !gone.contains(k.as_str()))
            .cloned()
            .collect();
        let mut q = QueryBuilder::new("with cand as (");
        if left.is_empty() {
            // Every key was deleted: nothing to classify. A statement that does not read the
            // target is one text for every command of the policy (a partitioned target's leaf
            // constraint is not in it), so it is parsed once per connection and its plan kept.
            q.push(
                "select null::text as item_key, null::boolean as old_enough, \
                 null::text as reason, null::text as not_eligible_reason where false",
            );
        } else {
            target.push_classify(&mut q, &left);
        }
        let (outcome, reason) = Judgement::after_delete_sql("d.item_key is not null");
        q.push(format!(
            "), items as (
                 select u.ord, u.item_key, {outcome} as outcome, {reason} as reason,
                        null::json as recorded
                   from unnest("
        ));
        q.push_bind(keys.to_vec());
        q.push("::text[]) with ordinality as u(item_key, ord) left join unnest(");
        q.push_bind(deleted.to_vec());
        q.push(
            "::text[]) as d(item_key) on d.item_key = u.item_key
                   left join cand c on c.item_key = u.item_key and d.item_key is null)",
        );
        self.push_succeed_after_delete(&mut q, d);
        q
    }

    /// The ledger's half of [`CommandTry::close_after_delete`], after `items` (one row per key:
    /// `ord`, `item_key`, `outcome`, `reason`; a NULL outcome is undecided).
    fn push_succeed_after_delete(&self, q: &mut QueryBuilder<'_, Postgres>, d: &AfterDelete<'_>) {
        // The outcomes a delete-rows command's items can end in; each is a count column.
        let tally = DELETE_OUTCOMES
            .iter()
            .map(|o| format!("count(*) filter (where outcome = '{0}') as {0}", o.as_str()))
            .collect::<Vec<_>>()
            .join(", ");
        q.push(format!(
            ", tally as (select {tally} from items),
             c as (
                 update sweeper.commands cm
                    set state = 'succeeded', finished_at = sweeper.now(),
                        lease_until = null, lease_owner = null, last_error = null,
                        last_error_class = null, calling_since = null, {HOLD_CLEARED},
                        deleted = cm.deleted + t.deleted,
                        already_absent = cm.already_absent + t.already_absent,
                        excluded = cm.excluded + t.excluded,
                        not_eligible = cm.not_eligible + t.not_eligible,
                        attempts = "
        ));
        q.push_bind(self.attempt.number());
        q.push(", failed = cm.failed - ");
        q.push_bind(d.item_redrive as i64);
        q.push(" from tally t where cm.command_id = ");
        q.push_bind(self.command_id.clone());
        q.push(" and cm.attempts = ");
        q.push_bind(self.attempt.fence());
        q.push(
            " and not exists (select 1 from items where outcome is null)
              returning cm.attempts, cm.redrive_of)",
        );
        self.push_succeeded(q, &d.execution, false);
        q.push(
            " select t.deleted, t.already_absent, t.excluded, t.not_eligible, r.status,
                    c.attempts is not null as closed,
                    (select coalesce(array_agg(item_key order by ord), '{}') from items
                      where outcome is null) as undecided,
                    case when c.attempts is null then
                        (select coalesce(array_agg(item_key order by ord), '{}') from items
                          where outcome is not null) end as item_keys,
                    case when c.attempts is null then
                        (select coalesce(array_agg(outcome order by ord), '{}') from items
                          where outcome is not null) end as outcomes,
                    case when c.attempts is null then
                        (select coalesce(array_agg(reason order by ord), '{}') from items
                          where outcome is not null) end as reasons,
                    (select count(*) from (select 1 from sweeper.commands o
                                            where o.run_id = r.run_id and o.command_id <> ",
        );
        q.push_bind(self.command_id.clone());
        q.push(" and o.state in ('pending', 'leased') limit ");
        q.push_bind(d.others_cap);
        q.push(
            ") x) as others_pending
               from tally t cross join sweeper.runs r left join c on true where r.run_id = ",
        );
        q.push_bind(d.execution.run_id.to_string());
    }

    /// The audit rows of the items of a command that is not done yet (an external action's command
    /// finishes its items over several attempts; a delete whose rows were locked finishes the
    /// others later). Written in the audit's first shape, one wide row per item in
    /// `sweeper.audit`, which the previous release reads too: a replica of it that resumes the
    /// command during a rolling upgrade must see these items as finished, or it would act on them
    /// again (an external call made twice). Readers of this release read both shapes. (The next
    /// release, once no replica older than this one can run, writes them lean.)
    pub async fn append_audit(&self, conn: &mut PgConnection, a: &Audited<'_>) -> sqlx::Result<()> {
        sqlx::query(&format!(
            "insert into sweeper.audit
                     (policy, policy_version, run_id, window_at, cutoff, command_id, item_key,
                      outcome, reason, actor, dry_run, recorded_at, recorded)
                 select $1, $2, $3, $4, $5, $6, u.item_key, u.outcome, u.reason, $7, $8,
                        {RECORDED_AT}, u.recorded::json
                   from unnest($9::text[], $10::text[], $11::text[], $12::text[])
                        as u(item_key, outcome, reason, recorded)"
        ))
        .bind(a.execution.policy)
        .bind(a.execution.policy_version)
        .bind(a.execution.run_id)
        .bind(a.execution.window)
        .bind(a.execution.cutoff)
        .bind(&self.command_id)
        .bind(a.execution.actor)
        .bind(a.dry_run)
        .bind(a.keys)
        .bind(a.outcomes)
        .bind(a.reasons)
        .bind(a.recorded)
        .execute(conn)
        .await?;
        Ok(())
    }

    /// Holds a command (docs/design.md §14): pending again, its try given back, checked
    /// again after `recheck_seconds`; the time since the last check is credited to its age budget.
    /// A push command is marked due for publishing: a queue must bring it back (the relay skips it
    /// while its hold lasts, see [`super::released`]). Returns whether the hold began now (the
    /// command was not held before).
    pub async fn hold(
        &self,
        conn: &mut PgConnection,
        recheck_seconds: f64,
        kind: &str,
        reason: &str,
    ) -> sqlx::Result<bool> {
        sqlx::query_scalar(
            "update sweeper.commands
                set state = 'pending', attempts = $2, lease_until = null, lease_owner = null,
                    calling_since = null,
                    next_attempt_at = sweeper.now() + make_interval(secs => $3),
                    publish_due = publish_due or transport <> 'builtin',
                    held_kind = $4, held_reason = $5,
                    held_since = coalesce(held_since, sweeper.now()),
                    age_credit_seconds = age_credit_seconds
                        + coalesce(extract(epoch from sweeper.now() - held_seen_at), 0),
                    held_seen_at = sweeper.now(),
                    last_error = $5, last_error_class = null
              where command_id = $1 and attempts = $6
              returning held_kind is distinct from (select o.held_kind from sweeper.commands o
                                                    where o.command_id = $1)",
        )
        .bind(&self.command_id)
        .bind(self.attempt.given_back())
        .bind(recheck_seconds)
        .bind(kind)
        .bind(reason)
        .bind(self.attempt.fence())
        .fetch_optional(conn)
        .await?
        .ok_or_else(|| overtaken(&self.command_id))
    }

    /// Schedules the next attempt `delay_seconds` from now after a failed try or a snooze, with the
    /// attempt row (outcome `failed` or `snoozed`) and its delay. A push command is marked due for
    /// publishing (whoever delivered this try), so the relay publishes it again when it is due.
    pub async fn schedule_retry(
        &self,
        conn: &mut PgConnection,
        f: &Failed<'_>,
        delay_seconds: f64,
        snooze: bool,
    ) -> sqlx::Result<()> {
        let rows = sqlx::query(&format!(
            "with c as (
                 update sweeper.commands
                    set state = 'pending', attempts = $2, lease_until = null, lease_owner = null, calling_since = null,
                        next_attempt_at = sweeper.now() + make_interval(secs => $3),
                        publish_due = publish_due or transport <> 'builtin',
                        last_error = $4, last_error_class = $5,
                        {HOLD_CLEARED}
                  where command_id = $1 and attempts = $8
              returning 1)
             insert into sweeper.attempts
                 (command_id, attempt_no, started_at, ended_at, outcome, class, error, delay_seconds)
             select $1, $2, sweeper.now() - make_interval(secs => $6), sweeper.now(), $7, $5, $4, $3
               from c"
        ))
        .bind(&self.command_id)
        .bind(f.attempts)
        .bind(delay_seconds)
        .bind(f.error)
        .bind(f.class)
        .bind(f.elapsed_seconds)
        .bind(if snooze { "snoozed" } else { "failed" })
        .bind(self.attempt.fence())
        .execute(conn)
        .await?;
        fenced(&self.command_id, rows.rows_affected())
    }

    /// Quarantines the command: its state, the attempt, and a dead letter with its attempt history
    /// (the open one counts one more failure if the command was quarantined before; a redrive's
    /// resolution is cleared, since it resolved nothing). A one-item redrive command of an item
    /// dead letter reopens that dead letter instead (its failure appended to its attempts): the
    /// item has one dead letter, whichever way its redrive failed.
    pub async fn quarantine(&self, conn: &mut PgConnection, f: &Failed<'_>) -> sqlx::Result<()> {
        sqlx::query_scalar(&format!(
            "with c as (
                 update sweeper.commands
                    set state = 'quarantined', attempts = $2, finished_at = sweeper.now(), calling_since = null,
                        {HOLD_CLEARED},
                        lease_until = null, lease_owner = null, last_error = $3, last_error_class = $4
                  where command_id = $1 and attempts = $8
              returning due_since, redrive_of),
             item as (
                 update sweeper.dead_letters d
                    set status = 'open', reason = $3, class = $4, last_failure_at = sweeper.now(),
                        failures = d.failures + 1,
                        attempts = d.attempts || jsonb_build_array(jsonb_build_object(
                            'attempt_no', d.failures + 1, 'started_at', sweeper.now(),
                            'ended_at', sweeper.now(), 'outcome', 'quarantined', 'class', $4,
                            'error', $3, 'delay_seconds', null, 'command_id', $1::text)),
                        resolved_at = null, resolved_by = null, resolution_reason = null
                   from c
                  where d.dead_letter_id = c.redrive_of and d.kind = 'item'
              returning d.dead_letter_id),
             a as (
                 insert into sweeper.attempts
                     (command_id, attempt_no, started_at, ended_at, outcome, class, error)
                 select $1, $2, sweeper.now() - make_interval(secs => $5), sweeper.now(),
                        'quarantined', $4, $3
                   from c
                 returning attempt_no, started_at, ended_at, outcome, class, error, delay_seconds),
             history as (
                 select coalesce(jsonb_agg(h order by h.started_at), '[]'::jsonb) as attempts
                   from (select attempt_no, started_at, ended_at, outcome, class, error, delay_seconds
                           from sweeper.attempts where command_id = $1
                         union all select * from a) h),
             dl as (
             insert into sweeper.dead_letters
                 (kind, run_id, policy, command_id, reason, class, attempts, first_failure_at,
                  last_failure_at)
             select 'command', $6, $7, $1, $3, $4, history.attempts,
                    coalesce((select min(started_at) from sweeper.attempts
                               where command_id = $1 and outcome <> 'succeeded'), sweeper.now()),
                    sweeper.now()
               from history
              where not exists (select 1 from item) and exists (select 1 from c)
             on conflict (command_id) where kind = 'command' and status in ('open', 'redriven')
             do update set status = 'open', reason = excluded.reason, class = excluded.class,
                           attempts = excluded.attempts, last_failure_at = excluded.last_failure_at,
                           failures = sweeper.dead_letters.failures + 1,
                           resolved_at = null, resolved_by = null, resolution_reason = null)
             select count(*) from c"
        ))
        .bind(&self.command_id)
        .bind(f.attempts)
        .bind(f.error)
        .bind(f.class)
        .bind(f.elapsed_seconds)
        .bind(f.run_id)
        .bind(f.policy)
        .bind(self.attempt.fence())
        .fetch_one(conn)
        .await
        .and_then(|n: i64| fenced(&self.command_id, n as u64))
    }
}

/// The command row, locked, with what the gate needs to know about its run and policy.
#[derive(Debug, sqlx::FromRow)]
pub struct Locked {
    /// Its state.
    pub state: String,
    /// Its items.
    pub item_keys: Vec<String>,
    /// The attempts it has counted.
    pub attempts: i32,
    /// Its run.
    pub run_id: String,
    /// The hold recorded on it, if any.
    pub held_kind: Option<String>,
    /// Why.
    pub held_reason: Option<String>,
    /// Seconds until its next attempt is due (0: due).
    pub due_in_seconds: f64,
    /// The dead letter it re-executes, if any.
    pub redrive_of: Option<i64>,
    /// The outcome that opened that dead letter (`failed` or `mismatched`): the outcome the
    /// redrive supersedes.
    pub redrive_outcome: Option<String>,
    /// The run's policy.
    pub policy: String,
    /// The version the run is pinned to.
    pub policy_version: String,
    /// The run's window.
    pub window_at: DateTime<Utc>,
    /// The run's cutoff.
    pub cutoff: DateTime<Utc>,
    /// Whether the run is a dry run.
    pub dry_run: bool,
    /// Seconds another execution's lease still runs (0: none).
    pub lease_left: f64,
    /// Whether the policy is suspended.
    pub suspended: bool,
    /// Why the identity guard holds every policy (NULL: it does not).
    pub identity_held: Option<String>,
    /// The blast-radius guard's decision on the run (NULL: not guarded).
    pub approval: Option<String>,
    /// The newest version any replica registered.
    pub current_version: String,
    /// Whether this transaction took one of the policy's `max_concurrent_commands` slots.
    pub slot_free: bool,
    /// The class of its last failure (`locked`: it waits for rows another transaction holds).
    pub last_error_class: Option<String>,
    /// Some of its items have outcomes already (its counts, read from the row's newest version
    /// once locked): an earlier attempt finished part of it; [`finished_keys`] says which.
    pub has_outcomes: bool,
    /// The partition constraint of the leaf its keys were planned in, while the leaf is still
    /// attached under the policy's target; `None`: the whole
    /// target.
    pub partition_constraint: Option<String>,
}

/// The keys of `command_id` an earlier attempt already audited (a command whose rows were locked,
/// or an action with external calls, finishes its items over several attempts; no item gains a
/// second outcome). `item_redrive`: the command re-executes an item whose `failed` or
/// `mismatched` outcome it supersedes, so such a row does not finish it. Read in its own statement once the gate holds
/// the command row: a statement that waited for that lock still reads other tables in the
/// snapshot it started with, which misses what the previous holder committed.
pub async fn finished_keys(
    conn: &mut PgConnection,
    command_id: &str,
    item_redrive: bool,
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "select distinct item_key from sweeper.audit_trail
          where command_id = $1 and not ($2 and outcome in ('failed', 'mismatched'))",
    )
    .bind(command_id)
    .bind(item_redrive)
    .fetch_all(conn)
    .await
}

/// The advisory-lock key (hashed with `hashtext`, the slot number as the second key) of
/// `policy`'s `max_concurrent_commands` slots. Public so a test can hold a slot as another
/// replica would.
pub fn slot_lock_key(policy: &str) -> String {
    format!("sweeper:{policy}")
}

/// What the gate's [`lock`] enforces besides the row lock: this transaction's lock and
/// statement timeouts (seconds) and each configured policy's concurrency slots.
#[derive(Debug)]
pub struct GateLimits<'a> {
    /// `lock_timeout` for the transaction.
    pub lock_timeout_seconds: i64,
    /// `statement_timeout` for the transaction.
    pub statement_timeout_seconds: i64,
    /// The configured policies.
    pub policies: &'a [&'a str],
    /// Their `max_concurrent_commands` slots, as this replica's governor scales them.
    pub slots: &'a [i32],
    /// Their targets, quoted (`"schema"."table"`): a command planned in a leaf partition is
    /// confined to it while the leaf is still attached under its policy's target.
    pub targets: &'a [String],
    /// The SQL expression that reads the partition constraint of the command's leaf: given the
    /// leaf's name as `c.partition` and the policy's target as `target`, a scalar subquery
    /// (written by the rules' owner, which knows what confines a statement to a leaf).
    pub partition_constraint: fn(leaf: &str, target: &str) -> String,
}

/// One statement: lock the command row; read its run, its policy's suspension and current
/// version; set this transaction's lock and statement timeouts; and take one of the policy's
/// `max_concurrent_commands` slots (transaction-scoped advisory locks shared by all replicas,
/// released at commit, rollback or crash). `None` when the ledger has no such command. Returns
/// the row and the try: `claim` when a built-in worker holds one, else a delivery's try of the
/// attempts the row holds ([`CommandTry::locked`]).
pub async fn lock(
    conn: &mut PgConnection,
    command_id: &str,
    claim: Option<&CommandTry>,
    limits: &GateLimits<'_>,
) -> sqlx::Result<Option<(Locked, CommandTry)>> {
    // The leaf's constraint takes the leaf's (and its parent's) ACCESS SHARE lock for the
    // transaction; it is read after the timeouts are set (the target list is evaluated in
    // order) but before the row lock (`FOR UPDATE` locks the rows the target list was computed
    // for), so a gate that waits on a running command's row holds it too, as that command does.
    // A DETACH that commits while the read waits fails the statement (transient, tried again).
    let partition = (limits.partition_constraint)(
        "c.partition",
        "(select pt.target from unnest($4::text[], $7::text[]) as pt(policy, target)
           where pt.policy = r.policy)",
    );
    let locked: Option<Locked> = sqlx::query_as(&format!(
        "select c.state, c.item_keys, c.attempts, c.run_id, c.held_kind, c.held_reason,
                greatest(0, extract(epoch from c.next_attempt_at - (select sweeper.now())))::float8
                    as due_in_seconds,
                c.redrive_of,
                (select coalesce(d.outcome, 'failed') from sweeper.dead_letters d
                  where d.dead_letter_id = c.redrive_of) as redrive_outcome,
                r.policy, r.policy_version, r.window_at, r.cutoff, r.dry_run,
                case when c.state = 'leased' and c.lease_until > sweeper.now()
                     then extract(epoch from c.lease_until - sweeper.now())::float8
                     else 0 end as lease_left,
                coalesce(ps.suspended, false) as suspended,
                (select i.held_detail from sweeper.database_identity i) as identity_held,
                r.approval,
                (select v.version from sweeper.policy_versions v where v.policy = r.policy
                  order by v.seq desc limit 1) as current_version,
                c.last_error_class,
                (c.deleted + c.already_absent + c.excluded + c.not_eligible + c.failed
                   + c.reconciled + c.called + c.mismatched) > 0 as has_outcomes,
                set_config('lock_timeout', $2, true) is not null as timeouts_set,
                set_config('statement_timeout', $3, true) is not null as timeouts_set2,
                exists (select 1
                          from generate_series(0, coalesce((select cap from unnest($4::text[], $5::int4[])
                                                                  as caps(policy, cap)
                                                             where caps.policy = r.policy), 1) - 1) s
                         where pg_try_advisory_xact_lock(hashtext($6 || r.policy), s))
                    as slot_free,
                {partition} as partition_constraint
           from sweeper.commands c join sweeper.runs r using (run_id)
           left join sweeper.policy_state ps on ps.policy = r.policy
          where c.command_id = $1
          for update of c"
    ))
    .bind(command_id)
    .bind(format!("{}s", limits.lock_timeout_seconds))
    .bind(format!("{}s", limits.statement_timeout_seconds))
    .bind(limits.policies)
    .bind(limits.slots)
    .bind(slot_lock_key(""))
    .bind(limits.targets)
    .fetch_optional(conn)
    .await?;
    Ok(locked.map(|l| {
        let command = match claim {
            Some(claim) => claim.clone(),
            None => CommandTry::locked(command_id, l.attempts),
        };
        (l, command)
    }))
}

/// The failed command's row, locked: its state and attempts, its run and policy, its age
/// against `max_age` (seconds, less the credit a redrive gave) and when it is next due.
#[derive(Debug)]
pub struct FailedRow {
    /// Its state.
    pub state: String,
    /// The attempts it has counted.
    pub attempts: i32,
    /// Its run.
    pub run_id: String,
    /// Its policy.
    pub policy: String,
    /// Its age against `max_age`, seconds.
    pub age_seconds: f64,
    /// Seconds until it is next due (at least 1).
    pub due_in_seconds: f64,
}
