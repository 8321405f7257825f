//! Planning: turns a run into bounded commands, one keyset page per transaction (docs/design.md §2.11, §8).
//!
//! Each planning job is a leased ledger row any replica can pick up. A page reads at most
//! `planning.page_rows` rows of the target in key order after the persisted cursor, applies the
//! run's cutoff and every exclusion, writes the eligible keys as full commands of `batch_size`
//! keys (a remainder short of a command waits in the job row for the next page; the last page
//! writes it), adds the held rows per reason to the run, and moves the cursor past the page —
//! all in one transaction, so a
//! crash resumes from the last committed page and every eligible key lands in exactly one command.
//! The walk goes along one of two paths, chosen on the run's first page
//! ([`crate::policy::path::choose`]): in key order over every key (keys never change, so a key
//! is met once), or, when few rows are old enough and an index leads with the timestamp, over
//! `timestamp < cutoff` in (timestamp, key) order — a row whose timestamp moves forward past
//! the cursor is met again there, and the run's planned keys (written in the page's transaction)
//! keep it out of a second command. Either way every eligible key lands in at most one command;
//! a row whose timestamp moves back behind the timestamp walk's cursor is left to the closure
//! check and the next run (docs/design.md §14). A partitioned target is walked one leaf
//! partition at a time, each scan and each command confined to its leaf ([`leaf`],
//! [`crate::policy::partitions`]).

mod batches;
pub mod estimate;
mod guard;
mod leaf;
mod retire;
mod rules;
mod scan;

pub use batches::{cut_batches, fill_commands};
pub use retire::{CARVE_OUT_MAX_ROWS, carve_refusal, dependents_refusal};
pub use rules::{RunRef, run_rules};

use std::collections::BTreeMap;

use sqlx::{Postgres, QueryBuilder, Row};
use tracing::{info, warn};
use uuid::Uuid;

use crate::ledger;
use crate::policy::RuleSet;
use crate::policy::path::PlanningPath;
use crate::retry::Setback;
use crate::state::AppState;
use scan::{Cursor, scan_page};

/// Most bytes of item keys one planning page handles.
pub const PAGE_KEY_BYTES: usize = 16 * 1024 * 1024;
/// Most bytes of item keys in one command (besides `batch_size` keys).
pub const COMMAND_KEY_BYTES: usize = 1024 * 1024;

/// What one planning step did.
#[derive(Debug, PartialEq, Eq)]
pub enum PlanStep {
    /// No planning job was due.
    Idle,
    /// A page was planned; more remain.
    Page,
    /// The job's last page was planned.
    Done,
    /// The lease was lost to another replica (ours expired); nothing was written.
    LostLease,
}

/// Claims a due planning job (unleased, or with an expired lease) and plans it to the end,
/// renewing the lease with each page. Returns how the last step ended.
pub async fn plan_next_job(state: &AppState) -> Result<PlanStep, Setback> {
    plan_next_job_until(state, &tokio_util::sync::CancellationToken::new()).await
}

/// [`plan_next_job`], stopping between pages once `shutdown` is cancelled: the page in flight
/// commits, then the lease is given back so another replica plans on at once rather than when
/// the lease expires (a page dropped mid-statement could not be fenced against its own commit).
async fn plan_next_job_until(
    state: &AppState,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Result<PlanStep, Setback> {
    let lease = state.config.planning.lease.seconds();
    let token = Uuid::new_v4();
    let policies: Vec<String> = state
        .config
        .policies
        .iter()
        .map(|p| p.name.as_str().to_string())
        .collect();
    let claimed = ledger::planning::claim(&state.pool, token, lease as f64, &policies)
        .await
        .map_err(|e| Setback::from_db(&e))?;
    let Some(run_id) = claimed else {
        // A job no replica with its policy took: say so on the run rather than plan it with
        // defaults (its batch size, transport and guard are the policy's to decide).
        let marked =
            ledger::planning::mark_missing_policies(&state.pool, &policies, state.replica_id)
                .await
                .map_err(|e| Setback::from_db(&e))?;
        if marked > 0 {
            warn!(
                jobs = marked,
                "planning jobs of policies missing from this replica's configuration are held"
            );
        }
        return Ok(PlanStep::Idle);
    };
    loop {
        if shutdown.is_cancelled() {
            if let Err(e) = ledger::planning::release(&state.pool, token).await {
                warn!(run_id, error = %e, "giving back the planning lease failed; it expires");
            }
            return Ok(PlanStep::Idle);
        }
        if let Some(held) = guard::governor_hold(state, &run_id) {
            hold_job(state, &run_id, token, &held).await;
            return Err(held);
        }
        match plan_page(state, &run_id, token).await {
            Ok(PlanStep::Page) => {
                state.wake_workers.notify_waiters();
                crate::crash_point!("plan_after_page");
            }
            Ok(step) => {
                state.wake_workers.notify_waiters();
                return Ok(step);
            }
            Err(held @ Setback::Held { .. }) => {
                hold_job(state, &run_id, token, &held).await;
                return Err(held);
            }
            Err(Setback::Failed(f)) => {
                // Recorded on the job (shown on the run and in /metrics). A transient failure (a
                // lost connection, a lock timeout) also gives the lease back so the next round
                // retries soon; otherwise the lease's expiry paces the retries.
                let transient = f.class == crate::retry::FailureClass::Transient;
                let _ = ledger::planning::record_failure(
                    &state.pool,
                    &run_id,
                    token,
                    &f.message,
                    transient,
                )
                .await;
                warn!(run_id, error = %f.message, class = f.class.as_str(), "planning page failed; retrying");
                return Err(f.into());
            }
        }
    }
}

/// Records that planning `run_id` is held (its target's schema does not match, or the policy
/// changed its target): not a failure, so `failures` stays; the job is tried again after
/// [`crate::settings::Config::hold_recheck_seconds`], with the table's columns read afresh.
async fn hold_job(state: &AppState, run_id: &str, token: Uuid, held: &Setback) {
    let Setback::Held { kind, why } = held else {
        return;
    };
    let kind = *kind;
    if kind == crate::retry::HoldKind::Schema
        && let Some(p) = state.config.policy_by_command(run_id)
    {
        state.catalog.forget_all(&p.spec);
    }
    let recheck = state.config.hold_recheck_seconds();
    let r = ledger::planning::hold(
        &state.pool,
        run_id,
        token,
        kind.as_str(),
        why,
        recheck as f64,
    )
    .await;
    if let Err(e) = r {
        warn!(run_id, error = %e, "could not record that planning is held");
    }
    info!(run_id, kind = kind.as_str(), reason = %why, "planning held");
}

/// A planning job as its page reads it: the cursor, the next batch number and the run's fixed
/// inputs.
struct Job {
    cursor: Cursor,
    /// A partitioned target's leaves, in the order planning walks them (fixed on the run's
    /// first page), and the position of the one the cursor is in.
    partitions: Option<Vec<String>>,
    cursor_partition: usize,
    /// The run's path, once its first page chose it.
    path: Option<PlanningPath>,
    carry: Vec<String>,
    next_batch_no: i32,
    policy: String,
    pinned_version: String,
    window: chrono::DateTime<chrono::Utc>,
    cutoff: chrono::DateTime<chrono::Utc>,
    dry_run: bool,
}

/// Locks the planning job of `run_id` if `token` still holds its lease and it is not done.
async fn lock_job(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    run_id: &str,
    token: Uuid,
) -> sqlx::Result<Option<Job>> {
    let job = sqlx::query(
        "select j.cursor_key, j.cursor_timestamp::text as cursor_timestamp, j.path, j.carry_keys, j.next_batch_no, r.policy, r.policy_version, r.window_at, r.cutoff,
                r.dry_run, j.partitions, j.cursor_partition
           from sweeper.planning_jobs j join sweeper.runs r using (run_id)
          where j.run_id = $1 and j.lease_token = $2 and not j.done
          for update of j",
    )
    .bind(run_id)
    .bind(token)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(job.map(|job| Job {
        cursor: Cursor {
            key: job.get("cursor_key"),
            timestamp: job.get("cursor_timestamp"),
        },
        partitions: job.get("partitions"),
        cursor_partition: job.get::<i32, _>("cursor_partition").max(0) as usize,
        path: job
            .get::<Option<String>, _>("path")
            .as_deref()
            .and_then(PlanningPath::parse),
        carry: job.get("carry_keys"),
        next_batch_no: job.get("next_batch_no"),
        policy: job.get("policy"),
        pinned_version: job.get("policy_version"),
        window: job.get("window_at"),
        cutoff: job.get("cutoff"),
        dry_run: job.get("dry_run"),
    }))
}

/// Held rows per reason among the rows consumed: older than the cutoff but excluded, or never
/// eligible because their timestamp is NULL (`null_timestamp`: counted exactly on the
/// key-order walk, which visits every row with a key; the timestamp-index walk never meets
/// them and counts them at its end, [`held_at_end`]).
fn held_counts(consumed: &[&sqlx::postgres::PgRow]) -> BTreeMap<String, i64> {
    let mut held: BTreeMap<String, i64> = BTreeMap::new();
    for r in consumed {
        let old_enough: bool = r.get("old_enough");
        if r.get::<bool, _>("null_timestamp") {
            *held.entry(NULL_TIMESTAMP.to_string()).or_default() += 1;
        } else if let (true, Some(reason)) = (old_enough, r.get::<Option<String>, _>("reason")) {
            *held.entry(reason).or_default() += 1;
        }
    }
    held
}

/// The rules a page of `job` plans under: the stricter of its pinned and current versions.
async fn job_rules(
    state: &AppState,
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    job: &Job,
    run_id: &str,
) -> Result<RuleSet, Setback> {
    let run = RunRef {
        run_id,
        policy: &job.policy,
        pinned_version: &job.pinned_version,
        cutoff: job.cutoff,
        window: job.window,
    };
    run_rules(state, tx, &run).await
}

/// Plans one page of `run_id` if `token` still holds the job's lease: choose the path (first
/// page), scan, keep the keys not planned before, cut into commands, record the page (and, when
/// planning is done, the closure check) in one transaction.
// Over 80 lines: the steps of one planning transaction in order (lock, rules, path, scan, dedupe,
// cut, record, closure check).
pub async fn plan_page(state: &AppState, run_id: &str, token: Uuid) -> Result<PlanStep, Setback> {
    let db = |e: sqlx::Error| Setback::from_db(&e);
    let mut tx = state.pool.begin().await.map_err(db)?;
    let Some(job) = lock_job(&mut tx, run_id, token).await.map_err(db)? else {
        return Ok(PlanStep::LostLease);
    };
    let rules = job_rules(state, &mut tx, &job, run_id).await?;
    let configured = state.config.policy(&job.policy);
    let batch_size = configured.map(|p| p.batch_size).unwrap_or(250);
    let page_rows = state.config.planning.page_rows;
    // The path is chosen once, on the first page, and kept: switching walks mid-run would lose
    // what the cursor means.
    let chosen = match job.path {
        Some(_) => None,
        None => Some(
            crate::policy::path::choose(
                &mut tx,
                &rules.target,
                rules.cutoff,
                state.config.planning.path,
            )
            .await
            .map_err(db)?,
        ),
    };
    let path = job
        .path
        .or(chosen.as_ref().map(|c| c.path))
        .unwrap_or(PlanningPath::KeyOrder);

    // A cursor is an item key this walk wrote; one the key cannot read (its columns or types
    // changed under the run) would restart the walk and plan every row again: the job waits.
    if let Some(c) = &job.cursor.key
        && let Err(why) = rules.key().values(c)
    {
        return Err(Setback::held(
            crate::retry::HoldKind::Schema,
            format!(
                "the planning cursor names no key {} of the table now ({why}); restore the \
                 key's columns and types, or cancel the run",
                rules.key().names()
            ),
        ));
    }
    // A partitioned target is walked one leaf at a time (docs/design.md §14 "Partitioned
    // targets"): the leaves are fixed on the first page; a leaf detached since is passed over.
    let leaves = match (&job.partitions, job.path) {
        (Some(l), _) => Some(l.clone()),
        (None, None) => walked_leaves(state, &mut tx, &rules, run_id, &job).await?,
        (None, Some(_)) => None,
    };
    let mut walk = match &leaves {
        Some(leaves) => Some(
            leaf::LeafWalk::resume(&mut tx, &rules.target.table, leaves, job.cursor_partition)
                .await
                .map_err(db)?,
        ),
        None => None,
    };
    if let Some(w) = &walk
        && w.moved_on()
        && !job.carry.is_empty()
    {
        // Keys carried in a leaf detached since: their own command, in their leaf.
        return record_carry_of_detached_leaf(state, tx, run_id, &job, w, batch_size).await;
    }
    // A page reads up to `page_rows` rows (and PAGE_KEY_BYTES of keys): a leaf that ends before
    // them is followed by the next one in the same page, its commands still its own, so small
    // leaves do not cost a page (a transaction and its commit) each.
    let mut start = walk
        .as_ref()
        .map_or(job.cursor.clone(), |w| w.start(&job.cursor));
    let mut rows_left = page_rows;
    let mut bytes_left = PAGE_KEY_BYTES;
    let mut carry = job.carry.clone();
    let mut batches: Vec<Vec<String>> = Vec::new();
    let mut batch_leaves: Vec<Option<String>> = Vec::new();
    let mut held: BTreeMap<String, i64> = BTreeMap::new();
    let (cursor, cursor_partition, done) = loop {
        let scoped = match &walk {
            Some(w) => rules.clone().in_partition(w.constraint()),
            None => rules.clone(),
        };
        let page = match &walk {
            Some(w) if w.is_past_end() => scan::Scanned::empty(),
            _ => scan_page(&mut tx, &scoped, path, &start, rows_left, bytes_left)
                .await
                .map_err(db)?,
        };
        // The whole scan is consumed: the cursor moves past its last row, and its eligible keys
        // join those carried from earlier pages. On the timestamp walk a row met on an earlier
        // page (its timestamp moved forward past the cursor) was classified then: it is skipped.
        let mut cursor = page.cursor_after(path, &start);
        let old_enough = |r: &sqlx::postgres::PgRow| r.get::<bool, _>("old_enough");
        let rows: Vec<&sqlx::postgres::PgRow> = if path == PlanningPath::TimestampIndex {
            let met: Vec<String> = page
                .rows
                .iter()
                .filter(|r| old_enough(r))
                .map(|r| r.get("item_key"))
                .collect();
            let first = ledger::planning::first_seen(&mut tx, run_id, &met)
                .await
                .map_err(db)?;
            page.rows
                .iter()
                .filter(|r| first.contains(&r.get::<String, _>("item_key")))
                .collect()
        } else {
            page.rows.iter().collect()
        };
        for (reason, n) in held_counts(&rows) {
            *held.entry(reason).or_default() += n;
        }
        let found = rows
            .iter()
            .filter(|r| old_enough(r))
            .filter(|r| r.get::<Option<String>, _>("reason").is_none())
            .map(|r| r.get::<String, _>("item_key"));
        let mut keys = std::mem::take(&mut carry);
        keys.extend(found);
        // Commands are filled within one leaf, never across two: a leaf's last scan writes its
        // remainder; the walk is done after the last leaf.
        let leaf_done = page.end_of_walk;
        let (done, cursor_partition) = match &walk {
            Some(w) => w.after_page(leaf_done, &mut cursor),
            None => (leaf_done, 0),
        };
        let (filled, left) = fill_commands(keys, batch_size, COMMAND_KEY_BYTES, leaf_done);
        let leaf = walk.as_ref().and_then(|w| w.leaf()).map(String::from);
        batch_leaves.extend(std::iter::repeat_n(leaf, filled.len()));
        batches.extend(filled);
        carry = left;
        rows_left -= page.rows.len() as i64;
        bytes_left = bytes_left.saturating_sub(
            page.rows
                .iter()
                .map(|r| r.get::<String, _>("item_key").len())
                .sum(),
        );
        let Some(leaves) = &leaves else {
            break (cursor, cursor_partition, done);
        };
        if done || !leaf_done || rows_left <= 0 || bytes_left == 0 {
            break (cursor, cursor_partition, done);
        }
        walk = Some(
            leaf::LeafWalk::resume(&mut tx, &rules.target.table, leaves, cursor_partition)
                .await
                .map_err(db)?,
        );
        start = scan::Cursor::default();
    };
    let items: i64 = batches.iter().map(|b| b.len() as i64).sum();
    let cap = state.config.planning.closure_check_cap;
    if done {
        held_at_end(&mut tx, &rules, path, cap, &mut held)
            .await
            .map_err(db)?;
    }

    let page = ledger::planning::Page {
        run_id,
        batches: &batches,
        next_batch_no: job.next_batch_no,
        transport: configured
            .map(|p| p.transport)
            .unwrap_or(crate::policy::Transport::Builtin)
            .as_str(),
        path: chosen
            .as_ref()
            .map(|c| (c.path.as_str(), c.reason.as_str())),
        cursor: cursor.key.as_deref(),
        cursor_timestamp: cursor.timestamp.as_deref(),
        carry: &carry,
        items,
        held: &held,
        done,
        lease_seconds: state.config.planning.lease.seconds() as f64,
        batch_partitions: &batch_leaves,
        partitions: leaves.as_deref(),
        cursor_partition,
    };
    let status = ledger::planning::record_page(&mut tx, &page)
        .await
        .map_err(db)?;
    if done
        && let Some(p) = configured
        && let Some(guard) = &p.safety.guard
    {
        let table = p.spec.target.table.quoted();
        guard::guard_verdict(&mut tx, run_id, guard, &table, job.dry_run)
            .await
            .map_err(db)?;
    }
    tx.commit().await.map_err(db)?;
    if done {
        // Every command may already be terminal (or there are none): the run is complete if so,
        // decided after the commit like a command's end (see `execute::complete_after`).
        let rules = (!job.dry_run).then_some(&rules);
        if let Err(e) = crate::completion::complete_run(state, run_id, rules).await {
            warn!(run_id, error = %e, "completing the run failed; housekeeping will complete it");
        }
    }
    if let Some(c) = &chosen {
        info!(run_id, path = c.path.as_str(), reason = %c.reason, "planning path chosen");
    }
    if done {
        state.wake_retirer.notify_waiters();
        info!(run_id, status, "planning done");
        Ok(PlanStep::Done)
    } else {
        Ok(PlanStep::Page)
    }
}

/// The leaves of a partitioned target a run walks, in bound order, skipping those whose range on
/// the timestamp starts at or after the run's cutoff (no row in them is old enough); `None` for
/// a table that is not partitioned.
///
/// For a policy with `partitions = "drop"`, the leaves the run retires whole are recorded here
/// and left out of the walk ([`retire::choose`]).
async fn walked_leaves(
    state: &AppState,
    tx: &mut sqlx::PgConnection,
    rules: &RuleSet,
    run_id: &str,
    job: &Job,
) -> Result<Option<Vec<String>>, Setback> {
    let db = |e: sqlx::Error| Setback::from_db(&e);
    let target = &rules.target;
    let layout = crate::policy::partitions::layout(&mut *tx, &target.table)
        .await
        .map_err(db)?;
    if layout != crate::policy::partitions::Layout::Partitioned {
        return Ok(None);
    }
    let info = state.catalog.get(&state.pool, &target.table).await?;
    let Some(ts) = info.columns.get(target.timestamp.as_str()) else {
        return Ok(None);
    };
    let leaves = crate::policy::partitions::leaves(&mut *tx, target, &ts.type_sql)
        .await
        .map_err(db)?;
    let leaves: Vec<_> = leaves
        .into_iter()
        .filter(|l| !l.newer_than(rules.cutoff))
        .collect();
    let drops = state
        .config
        .policy(&job.policy)
        .is_some_and(|p| p.partitions == crate::policy::partitions::Retirement::Drop);
    let retiring = if drops {
        let chosen = retire::choose(&mut *tx, rules, &leaves).await.map_err(db)?;
        ledger::retirements::record_chosen(&mut *tx, run_id, job.dry_run, &chosen)
            .await
            .map_err(db)?
    } else {
        Vec::new()
    };
    Ok(Some(
        leaves
            .into_iter()
            .filter(|l| !retiring.contains(&l.name))
            .map(|l| l.name)
            .collect(),
    ))
}

/// A page that only writes the keys carried in a leaf detached since their page: their own
/// command, naming that leaf (its keys are `already_absent` unless the rows are still in the
/// target); the cursor moves to the start of the next attached leaf.
async fn record_carry_of_detached_leaf(
    state: &AppState,
    mut tx: sqlx::Transaction<'_, Postgres>,
    run_id: &str,
    job: &Job,
    walk: &leaf::LeafWalk,
    batch_size: usize,
) -> Result<PlanStep, Setback> {
    let db = |e: sqlx::Error| Setback::from_db(&e);
    let batches = cut_batches(job.carry.clone(), batch_size, COMMAND_KEY_BYTES);
    let configured = state.config.policy(&job.policy);
    let page = ledger::planning::Page {
        run_id,
        batches: &batches,
        next_batch_no: job.next_batch_no,
        transport: configured
            .map(|p| p.transport)
            .unwrap_or(crate::policy::Transport::Builtin)
            .as_str(),
        path: None,
        cursor: None,
        cursor_timestamp: None,
        carry: &[],
        items: job.carry.len() as i64,
        held: &BTreeMap::new(),
        done: false,
        lease_seconds: state.config.planning.lease.seconds() as f64,
        batch_partitions: &vec![
            walk.left_leaf(job.cursor_partition).map(String::from);
            batches.len()
        ],
        partitions: None,
        cursor_partition: walk.at(),
    };
    ledger::planning::record_page(&mut tx, &page)
        .await
        .map_err(db)?;
    tx.commit().await.map_err(db)?;
    Ok(PlanStep::Page)
}

/// Held rows counted once the walk is done: rows with a NULL key or, for a temporal key column,
/// one outside the years 0001–9999 (no command can name them), and, on the timestamp-index walk
/// (which never meets them), rows with a NULL timestamp — each up to `cap`, through the indexes.
async fn held_at_end(
    conn: &mut sqlx::PgConnection,
    rules: &RuleSet,
    path: PlanningPath,
    cap: i64,
    held: &mut BTreeMap<String, i64>,
) -> sqlx::Result<()> {
    let null_keys = count_unnamed(&mut *conn, rules, cap, |q| {
        rules.key().push_some_null(q, "");
    })
    .await?;
    if null_keys > 0 {
        held.insert(NULL_KEY.to_string(), null_keys);
    }
    if rules.key().has_temporal() {
        let out_of_range = count_unnamed(&mut *conn, rules, cap, |q| {
            q.push("not ");
            rules.key().push_some_null(q, "");
            q.push(" and not ");
            rules.push_has_key(q);
        })
        .await?;
        if out_of_range > 0 {
            held.insert(KEY_OUT_OF_RANGE.to_string(), out_of_range);
        }
    }
    if path == PlanningPath::TimestampIndex {
        let null_timestamps: i64 = rules
            .capped_count(cap, |q| {
                rules.push_has_key(q);
                q.push(" and ");
                rules.push_timestamp(q);
                q.push(" is null");
            })
            .build_query_scalar()
            .fetch_one(&mut *conn)
            .await?;
        if null_timestamps > 0 {
            held.insert(NULL_TIMESTAMP.to_string(), null_timestamps);
        }
    }
    Ok(())
}

/// The held reason of rows whose timestamp is NULL: never eligible (docs/design.md §2.3), kept.
pub const NULL_TIMESTAMP: &str = "null_timestamp";
/// The held reason of rows whose key is NULL (a nullable key column): no command can name them.
pub const NULL_KEY: &str = "null_key";
/// The held reason of rows whose temporal key column is `infinity`, `-infinity` or outside the
/// years 0001–9999: the item key text has no spelling for it, so no command can name them.
pub const KEY_OUT_OF_RANGE: &str = "key_out_of_range";

/// Counts, up to `cap`, the rows that would be eligible but whose key no item key text names
/// (`which` pushes the condition: a NULL, a value out of range). A unique index admits any number
/// of NULLs.
async fn count_unnamed(
    conn: &mut sqlx::PgConnection,
    rules: &RuleSet,
    cap: i64,
    which: impl FnOnce(&mut QueryBuilder<'_, Postgres>),
) -> sqlx::Result<i64> {
    rules
        .capped_count(cap, |q| {
            which(q);
            q.push(" and ");
            rules.push_eligible(q);
        })
        .build_query_scalar()
        .fetch_one(conn)
        .await
}

/// Runs planning jobs until `shutdown`; nudged by triggers, and polling as a fallback.
pub async fn planner_loop(state: AppState, shutdown: tokio_util::sync::CancellationToken) {
    while !shutdown.is_cancelled() {
        let notified = state.wake_planner.notified();
        // Not raced against `shutdown`: the job stops between pages and gives its lease back.
        let step = plan_next_job_until(&state, &shutdown).await;
        if matches!(step, Ok(PlanStep::Done) | Ok(PlanStep::LostLease)) {
            continue;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = notified => {}
            _ = tokio::time::sleep(state.config.queue.poll_interval.std()) => {}
        }
    }
}
