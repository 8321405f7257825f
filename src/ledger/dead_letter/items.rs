//! Item dead letters: an item that failed inside a command that otherwise succeeded.

/// One entry of an item dead letter's `attempts`: the item's failure in `command_id` (an item
/// fails inside a command that succeeds, so it has no attempt row of its own). `$n` binds are
/// the failure number, the command and the reason.
fn item_attempt(n: &str, command: &str, reason: &str) -> String {
    format!(
        "jsonb_build_array(jsonb_build_object(
             'attempt_no', {n}, 'started_at', sweeper.now(), 'ended_at', sweeper.now(),
             'outcome', 'failed', 'class', 'permanent', 'error', {reason},
             'delay_seconds', null, 'command_id', {command}))"
    )
}

/// One item dead letter to open: the item, why, the outcome that opened it (`failed`, or
/// `mismatched` for an answer that said the provider's record differs), and the answer's
/// recorded fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemDeadLetter {
    /// The item.
    pub item_key: String,
    /// Why.
    pub reason: String,
    /// `Failed` or `Mismatched`.
    pub outcome: crate::ledger::Outcome,
    /// The call's answer's recorded fields (JSON text), if any.
    pub recorded: Option<String>,
}

impl ItemDeadLetter {
    /// An item that failed with `reason`.
    pub fn failed(item_key: &str, reason: &str) -> Self {
        ItemDeadLetter {
            item_key: item_key.to_string(),
            reason: reason.to_string(),
            outcome: crate::ledger::Outcome::Failed,
            recorded: None,
        }
    }
}

/// Reopens the item dead letter `dead_letter_id` whose redrive (in `command_id`) ended in `item`
/// again: `open` again with its reason, outcome and recorded fields, the failure appended to its
/// attempts, and the redrive's resolution cleared (it did not resolve anything; the operator log
/// keeps who redrove it).
pub async fn reopen_item(
    conn: &mut sqlx::PgConnection,
    dead_letter_id: i64,
    command_id: &str,
    item: &ItemDeadLetter,
) -> sqlx::Result<()> {
    sqlx::query(&format!(
        "update sweeper.dead_letters
            set status = 'open', reason = $2, last_failure_at = sweeper.now(),
                failures = failures + 1, attempts = attempts || {},
                resolved_at = null, resolved_by = null, resolution_reason = null,
                outcome = $4, recorded = $5::json
          where dead_letter_id = $1",
        item_attempt("failures + 1", "$3", "$2")
    ))
    .bind(dead_letter_id)
    .bind(&item.reason)
    .bind(command_id)
    .bind(item.outcome.as_str())
    .bind(&item.recorded)
    .execute(conn)
    .await?;
    Ok(())
}

/// Item dead letters for the items of `command_id` that failed or mismatched: one per item (a
/// live one counts one more failure).
pub async fn record_items(
    conn: &mut sqlx::PgConnection,
    run_id: &str,
    policy: &str,
    command_id: &str,
    items: &[ItemDeadLetter],
) -> sqlx::Result<()> {
    let keys: Vec<&str> = items.iter().map(|i| i.item_key.as_str()).collect();
    let reasons: Vec<&str> = items.iter().map(|i| i.reason.as_str()).collect();
    let outcomes: Vec<&str> = items.iter().map(|i| i.outcome.as_str()).collect();
    let recorded: Vec<Option<&str>> = items.iter().map(|i| i.recorded.as_deref()).collect();
    sqlx::query(&format!(
        "insert into sweeper.dead_letters
             (kind, run_id, policy, command_id, item_key, reason, class, attempts,
              first_failure_at, last_failure_at, outcome, recorded)
         select 'item', $1, $2, $3, u.item_key, u.reason, 'permanent', {}, sweeper.now(),
                sweeper.now(), u.outcome, u.recorded::json
           from unnest($4::text[], $5::text[], $6::text[], $7::text[])
                as u(item_key, reason, outcome, recorded)
         on conflict (command_id, item_key) where kind = 'item' and status in ('open', 'redriven')
         do update set reason = excluded.reason, last_failure_at = excluded.last_failure_at,
                       failures = sweeper.dead_letters.failures + 1, status = 'open',
                       attempts = sweeper.dead_letters.attempts || {},
                       resolved_at = null, resolved_by = null, resolution_reason = null,
                       outcome = excluded.outcome, recorded = excluded.recorded",
        item_attempt("1", "$3::text", "u.reason"),
        item_attempt(
            "sweeper.dead_letters.failures + 1",
            "$3::text",
            "excluded.reason"
        ),
    ))
    .bind(run_id)
    .bind(policy)
    .bind(command_id)
    .bind(&keys)
    .bind(&reasons)
    .bind(&outcomes)
    .bind(&recorded)
    .execute(conn)
    .await?;
    Ok(())
}
