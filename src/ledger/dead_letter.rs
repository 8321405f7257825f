//! Dead letters: what was quarantined, why, with its attempt history; and the operator's two
//! acts on it, redrive and abandon (docs/design.md §2.13), each recorded in the operator log.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Postgres, Row, Transaction};

mod items;
pub use items::{ItemDeadLetter, record_items, reopen_item};

/// A dead letter as `GET /dead-letters/{id}` shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadLetter {
    /// Its id.
    pub dead_letter_id: i64,
    /// `command`, `item` or `envelope` (an unparseable delivery).
    pub kind: String,
    /// The run (absent for an envelope).
    pub run_id: Option<String>,
    /// The policy (absent for an envelope).
    pub policy: Option<String>,
    /// The command (absent for an envelope).
    pub command_id: Option<String>,
    /// The item (for `item`).
    pub item_key: Option<String>,
    /// The last failure's message.
    pub reason: String,
    /// `transient`, `throttled` or `permanent`.
    pub class: String,
    /// The command's attempt history when it was quarantined.
    pub attempts: sqlx::types::Json<serde_json::Value>,
    /// For an envelope: the first 8 KiB of the body, as text.
    pub raw_body: Option<String>,
    /// For an envelope: SHA-256 of the whole body, hex.
    pub raw_sha256: Option<String>,
    /// For an envelope: the size of the whole body, in bytes.
    pub raw_size: Option<i64>,
    /// First failure.
    pub first_failure_at: DateTime<Utc>,
    /// Last failure.
    pub last_failure_at: DateTime<Utc>,
    /// Failures recorded on this dead letter.
    pub failures: i32,
    /// `open`, `redriven` (re-queued, not yet done), `resolved` or `abandoned`.
    pub status: String,
    /// When it was redriven or abandoned.
    pub resolved_at: Option<DateTime<Utc>>,
    /// Who redrove or abandoned it (a token's `sub`).
    pub resolved_by: Option<String>,
    /// Their reason.
    pub resolution_reason: Option<String>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// Seconds since it was created.
    pub age_seconds: f64,
    /// For an item: the outcome that opened it, `failed` or `mismatched` (an answer that said
    /// the provider's record differs from ours).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// For an item whose call was answered: the answer's recorded fields, as written.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "super::audit::ser_raw_json"
    )]
    pub recorded: Option<String>,
}

pub(crate) const COLUMNS: &str =
    "dead_letter_id, kind, run_id, policy, command_id, item_key, reason, class,
    attempts, raw_body, raw_sha256, raw_size, first_failure_at, last_failure_at, failures, status,
    resolved_at, resolved_by, resolution_reason, created_at,
    extract(epoch from sweeper.now() - created_at)::float8 as age_seconds,
    case when kind = 'item' then coalesce(outcome, 'failed') end as outcome,
    recorded::text as recorded";

/// Filters of `GET /dead-letters`.
#[derive(Debug, Default)]
pub struct Filter<'a> {
    /// Only this run's.
    pub run_id: Option<&'a str>,
    /// Only this policy's.
    pub policy: Option<&'a str>,
    /// Only this class.
    pub class: Option<&'a str>,
    /// `open` (open or redriven), `resolved` (resolved or abandoned), or exactly `redriven`
    /// or `abandoned`; all when None.
    pub state: Option<&'a str>,
}

/// Lists dead letters, newest first, at most `limit`, before `before` (keyset on the id).
pub async fn list(
    pool: &PgPool,
    f: &Filter<'_>,
    before: Option<i64>,
    limit: i64,
) -> sqlx::Result<Vec<DeadLetter>> {
    let sql = format!(
        "select {COLUMNS} from sweeper.dead_letters
          where ($1::text is null or run_id = $1) and ($2::text is null or policy = $2)
            and ($3::text is null or class = $3)
            and ($4::text is null
                 or ($4 = 'open' and status in ('open', 'redriven'))
                 or ($4 = 'resolved' and status in ('resolved', 'abandoned'))
                 or ($4 in ('redriven', 'abandoned') and status = $4))
            and ($5::bigint is null or dead_letter_id < $5)
          order by dead_letter_id desc limit $6"
    );
    sqlx::query_as(&sql)
        .bind(f.run_id)
        .bind(f.policy)
        .bind(f.class)
        .bind(f.state)
        .bind(before)
        .bind(limit)
        .fetch_all(pool)
        .await
}

/// One dead letter.
pub async fn get(pool: &PgPool, id: i64) -> sqlx::Result<Option<DeadLetter>> {
    let sql = format!("select {COLUMNS} from sweeper.dead_letters where dead_letter_id = $1");
    sqlx::query_as(&sql).bind(id).fetch_optional(pool).await
}

/// What an operator's act did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActResult {
    /// The dead letter was redriven: its command (or a command for its item) is queued.
    Redriven {
        /// The command that will run.
        command_id: String,
    },
    /// The dead letter was abandoned.
    Abandoned,
    /// Nothing to do: it was already redriven or resolved (a redrive is idempotent).
    NoOp {
        /// Its status.
        status: String,
    },
}

/// Why an act was refused.
#[derive(Debug, thiserror::Error)]
pub enum ActError {
    /// No such dead letter.
    #[error("no dead letter {0}")]
    NotFound(i64),
    /// The act does not apply to its state or kind.
    #[error("{0}")]
    Conflict(String),
    /// The ledger failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Appends an entry to the operator log (in the caller's transaction).
pub async fn log_operator_act(
    tx: &mut Transaction<'_, Postgres>,
    subject: &str,
    action: &str,
    target: &str,
    reason: &str,
    changed: bool,
    mut detail: serde_json::Value,
) -> sqlx::Result<()> {
    if let Some(d) = detail.as_object_mut() {
        d.insert("changed".into(), changed.into());
    }
    sqlx::query(
        "insert into sweeper.operator_log (subject, action, target, reason, detail)
         values ($1, $2, $3, $4, $5)",
    )
    .bind(subject)
    .bind(action)
    .bind(target)
    .bind(reason)
    .bind(detail)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Redrives dead letter `id`: same command identity and cutoff, a new publish generation, fresh
/// budgets; it really runs. A command dead letter re-queues its command; an item dead letter
/// queues a new one-item command of the same run (its command already succeeded). The run is
/// reopened until the redriven work finishes. Already redriven or resolved: a no-op.
// Over 80 lines: one transaction (lock the dead letter, decide, reopen the command or item, audit
// the act) whose steps share the locked rows.
pub async fn redrive(
    pool: &PgPool,
    id: i64,
    subject: &str,
    reason: &str,
) -> Result<ActResult, ActError> {
    let mut tx = pool.begin().await?;
    let row = sqlx::query(
        "select kind, status, run_id, command_id, item_key from sweeper.dead_letters
          where dead_letter_id = $1 for update",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(ActError::NotFound(id))?;
    let kind: String = row.get("kind");
    let status: String = row.get("status");
    match status.as_str() {
        "open" => {}
        "abandoned" => {
            return Err(ActError::Conflict(format!(
                "dead letter {id} was abandoned; it cannot be redriven"
            )));
        }
        _ => return Ok(ActResult::NoOp { status }),
    }
    let run_id: Option<String> = row.get("run_id");
    let command_id: Option<String> = row.get("command_id");
    let (Some(run_id), Some(command_id)) = (run_id, command_id) else {
        return Err(ActError::Conflict(format!(
            "dead letter {id} is an unparseable envelope: there is nothing to run; abandon it"
        )));
    };
    let queued = match kind.as_str() {
        "command" => {
            let n = sqlx::query(
                "update sweeper.commands
                    set state = 'pending', attempts = 0, next_attempt_at = sweeper.now(),
                        publish_due = transport <> 'builtin',
                        due_since = sweeper.now(), age_credit_seconds = 0,
                        publish_generation = publish_generation + 1, finished_at = null,
                        lease_until = null, lease_owner = null, held_kind = null,
                        held_reason = null, held_since = null, held_seen_at = null,
                        quarantined_commands = quarantined_commands - 1
                  where command_id = $1 and state = 'quarantined'",
            )
            .bind(&command_id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n == 0 {
                return Err(ActError::Conflict(format!(
                    "command {command_id} is no longer quarantined (purged or cancelled)"
                )));
            }
            reopen_run(&mut tx, &run_id, false).await?;
            command_id
        }
        "item" => {
            // The item runs in a one-item command of its own, `{run_id}:redrive-{id}` with batch
            // number -id: planning numbers batches from 0 up, so the two never collide, and a
            // second redrive of the same dead letter re-queues the same command.
            let item_key: String = row.get("item_key");
            // `xmax = 0`: the row was inserted, not updated (a second redrive of the same
            // dead letter re-queues its command: no new command for the run's total).
            let (new_id, inserted): (String, bool) = sqlx::query_as(
                "insert into sweeper.commands
                     (command_id, run_id, batch_no, item_keys, transport, next_attempt_at,
                      due_since, redrive_of, publish_due, partition)
                 select $1 || ':redrive-' || $3, $1, -$3::int, array[$2], t.transport,
                        sweeper.now(), sweeper.now(), $3, t.transport <> 'builtin', t.partition
                   from (select coalesce((select transport from sweeper.commands
                                           where command_id = $4), 'builtin') as transport,
                                (select partition from sweeper.commands
                                  where command_id = $4) as partition) t
                 on conflict (command_id) do update
                    set state = 'pending', attempts = 0, next_attempt_at = sweeper.now(),
                        publish_due = sweeper.commands.transport <> 'builtin',
                        due_since = sweeper.now(), age_credit_seconds = 0,
                        publish_generation = sweeper.commands.publish_generation + 1,
                        finished_at = null, lease_until = null, lease_owner = null,
                        last_error = null, last_error_class = null, held_kind = null,
                        held_reason = null, held_since = null, held_seen_at = null,
                        quarantined_commands = sweeper.commands.quarantined_commands
                            - case when sweeper.commands.state = 'quarantined' then 1 else 0 end
                 returning command_id, (xmax = 0) as inserted",
            )
            .bind(&run_id)
            .bind(&item_key)
            .bind(id)
            .bind(&command_id)
            .fetch_one(&mut *tx)
            .await?;
            reopen_run(&mut tx, &run_id, inserted).await?;
            new_id
        }
        other => {
            return Err(ActError::Conflict(format!(
                "dead letter {id} of kind {other} cannot be redriven"
            )));
        }
    };
    sqlx::query(
        "update sweeper.dead_letters
            set status = 'redriven', resolved_at = sweeper.now(), resolved_by = $2,
                resolution_reason = $3
          where dead_letter_id = $1",
    )
    .bind(id)
    .bind(subject)
    .bind(reason)
    .execute(&mut *tx)
    .await?;
    log_operator_act(
        &mut tx,
        subject,
        "redrive",
        &format!("dead_letter:{id}"),
        reason,
        true,
        serde_json::json!({ "command_id": queued, "run_id": run_id, "kind": kind }),
    )
    .await?;
    tx.commit().await?;
    Ok(ActResult::Redriven { command_id: queued })
}

/// One more pending command for a run (`new_command`: a command added, else one re-queued),
/// reopening it if it had completed. The quarantine a re-queued command lifts is given back on
/// the command's own row (its contribution to the run's counts).
async fn reopen_run(
    tx: &mut Transaction<'_, Postgres>,
    run_id: &str,
    new_command: bool,
) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.runs
            set commands_total = commands_total + case when $2 then 1 else 0 end,
                status = case when status in ('completed', 'completed_with_dead_letters')
                              then 'running' else status end,
                completed_at = case when status in ('completed', 'completed_with_dead_letters')
                                    then null else completed_at end,
                remaining_eligible = null, remaining_eligible_cap = null
          where run_id = $1",
    )
    .bind(run_id)
    .bind(new_command)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Abandons dead letter `id`: an operator closes it without running it again.
pub async fn abandon(
    pool: &PgPool,
    id: i64,
    subject: &str,
    reason: &str,
) -> Result<ActResult, ActError> {
    let mut tx = pool.begin().await?;
    let status: String = sqlx::query_scalar(
        "select status from sweeper.dead_letters where dead_letter_id = $1 for update",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(ActError::NotFound(id))?;
    match status.as_str() {
        "open" => {}
        "abandoned" => return Ok(ActResult::NoOp { status }),
        _ => {
            return Err(ActError::Conflict(format!(
                "dead letter {id} is {status}; only an open one can be abandoned"
            )));
        }
    }
    sqlx::query(
        "update sweeper.dead_letters
            set status = 'abandoned', resolved_at = sweeper.now(), resolved_by = $2,
                resolution_reason = $3
          where dead_letter_id = $1",
    )
    .bind(id)
    .bind(subject)
    .bind(reason)
    .execute(&mut *tx)
    .await?;
    // An effect the dead letter left open (a call that may have been made) would hold its item
    // in every later run; abandoning is the operator's decision about it, so it is closed. A
    // later run may act on the item again, with the next idempotency key.
    let effects_closed: Vec<String> = sqlx::query_scalar(
        "with dl as (select kind, run_id, policy, command_id, item_key
                       from sweeper.dead_letters where dead_letter_id = $1)
         update sweeper.effects e
            set state = 'closed', closed_at = sweeper.now()
           from dl
          where e.policy = dl.policy and e.run_id = dl.run_id and e.state <> 'closed'
            and ((dl.kind = 'item' and e.item_key = dl.item_key)
                 or (dl.kind = 'command' and e.command_id = dl.command_id))
         returning e.item_key",
    )
    .bind(id)
    .fetch_all(&mut *tx)
    .await?;
    // The run's last open dead letter abandoned: it no longer needs a look (its abandoned
    // count stays visible on `GET /runs/{id}`).
    sqlx::query(
        "update sweeper.runs r set status = 'completed'
           from sweeper.dead_letters dl
          where dl.dead_letter_id = $1 and r.run_id = dl.run_id
            and r.status = 'completed_with_dead_letters'
            and not exists (select 1 from sweeper.dead_letters o
                             where o.run_id = r.run_id and o.status in ('open', 'redriven'))",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    log_operator_act(
        &mut tx,
        subject,
        "abandon",
        &format!("dead_letter:{id}"),
        reason,
        true,
        serde_json::json!({ "effects_closed": effects_closed }),
    )
    .await?;
    tx.commit().await?;
    Ok(ActResult::Abandoned)
}

/// Redrives every open dead letter matching `run_id` and/or `class`, at most `limit` of them,
/// oldest first. The redriven commands are paced by the normal queue. Returns the ids redriven.
pub async fn redrive_many(
    pool: &PgPool,
    run_id: Option<&str>,
    class: Option<&str>,
    limit: i64,
    subject: &str,
    reason: &str,
) -> Result<Vec<i64>, ActError> {
    let ids: Vec<i64> = sqlx::query_scalar(
        "select dead_letter_id from sweeper.dead_letters
          where status = 'open' and kind in ('command', 'item')
            and ($1::text is null or run_id = $1) and ($2::text is null or class = $2)
          order by dead_letter_id limit $3",
    )
    .bind(run_id)
    .bind(class)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    let mut done = Vec::new();
    for id in ids {
        // One short transaction each, so a conflict on one does not undo the others.
        match redrive(pool, id, subject, reason).await {
            Ok(ActResult::Redriven { .. }) => done.push(id),
            // Redriven, resolved or abandoned meanwhile: not this call's to redo.
            Ok(_) | Err(ActError::NotFound(_)) | Err(ActError::Conflict(_)) => {}
            Err(e @ ActError::Db(_)) => return Err(e),
        }
    }
    Ok(done)
}

/// Quarantines an envelope (a delivery that can never succeed): its bounded raw body, the size
/// and SHA-256 (hex) of the whole body. The same body again while its dead letter is open
/// counts one more failure on it. Returns the dead letter's id.
pub async fn quarantine_envelope(
    pool: &PgPool,
    reason: &str,
    raw_body: &str,
    sha256: &str,
    size: i64,
) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "insert into sweeper.dead_letters
             (kind, reason, class, raw_body, raw_sha256, raw_size, first_failure_at,
              last_failure_at)
         values ('envelope', $1, 'permanent', $2, $3, $4, sweeper.now(), sweeper.now())
         on conflict (raw_sha256) where kind = 'envelope' and status = 'open'
         do update set last_failure_at = excluded.last_failure_at,
                       failures = sweeper.dead_letters.failures + 1
         returning dead_letter_id",
    )
    .bind(reason)
    .bind(raw_body)
    .bind(sha256)
    .bind(size)
    .fetch_one(pool)
    .await
}
