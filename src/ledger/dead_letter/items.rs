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

/// Reopens the item dead letter `dead_letter_id` whose redrive (in `command_id`) failed again,
/// with `reason`: `open` again, the failure appended to its attempts, and the redrive's
/// resolution cleared (it did not resolve anything; the operator log keeps who redrove it).
pub async fn reopen_item(
    conn: &mut sqlx::PgConnection,
    dead_letter_id: i64,
    command_id: &str,
    reason: &str,
) -> sqlx::Result<()> {
    sqlx::query(&format!(
        "update sweeper.dead_letters
            set status = 'open', reason = $2, last_failure_at = sweeper.now(),
                failures = failures + 1, attempts = attempts || {},
                resolved_at = null, resolved_by = null, resolution_reason = null
          where dead_letter_id = $1",
        item_attempt("failures + 1", "$3", "$2")
    ))
    .bind(dead_letter_id)
    .bind(reason)
    .bind(command_id)
    .execute(conn)
    .await?;
    Ok(())
}

/// Item dead letters for the items of `command_id` that failed, `(item_key, reason)`: one per
/// item (a live one counts one more failure).
pub async fn record_items(
    conn: &mut sqlx::PgConnection,
    run_id: &str,
    policy: &str,
    command_id: &str,
    failed: &[(String, String)],
) -> sqlx::Result<()> {
    let keys: Vec<&str> = failed.iter().map(|(k, _)| k.as_str()).collect();
    let reasons: Vec<&str> = failed.iter().map(|(_, r)| r.as_str()).collect();
    sqlx::query(&format!(
        "insert into sweeper.dead_letters
             (kind, run_id, policy, command_id, item_key, reason, class, attempts,
              first_failure_at, last_failure_at)
         select 'item', $1, $2, $3, u.item_key, u.reason, 'permanent', {}, sweeper.now(),
                sweeper.now()
           from unnest($4::text[], $5::text[]) as u(item_key, reason)
         on conflict (command_id, item_key) where kind = 'item' and status in ('open', 'redriven')
         do update set reason = excluded.reason, last_failure_at = excluded.last_failure_at,
                       failures = sweeper.dead_letters.failures + 1, status = 'open',
                       attempts = sweeper.dead_letters.attempts || {},
                       resolved_at = null, resolved_by = null, resolution_reason = null",
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
    .execute(conn)
    .await?;
    Ok(())
}
