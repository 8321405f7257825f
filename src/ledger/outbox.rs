//! The outbox of the push transports (docs/design.md §8): which commands are due for publishing, marking
//! them published, and the decisions that make them due again (a push answered "not now", a
//! publish older than the transport's `republish_after`).

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// A command due for publishing, read by the relay.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Due {
    /// The command.
    pub command_id: String,
    /// Its run.
    pub run_id: String,
    /// The generation the message carries: the command's own at the first publish, the next one
    /// at a republish, the same one at the relay's retry of a publish it could not confirm.
    pub generation: i32,
    /// Its `next_attempt_at` when read (ledger clock).
    pub next_attempt_at: DateTime<Utc>,
    /// Seconds until it is due (0 when due).
    pub due_in_seconds: f64,
}

/// At most `limit` commands of `transport` due for publishing within `horizon_seconds`,
/// soonest first (pending, or leased with an expired lease; not held: see
/// [`super::released`], with `held_policies` those this replica's governor or active hours hold).
pub async fn due(
    pool: &PgPool,
    transport: &str,
    limit: i64,
    horizon_seconds: f64,
    held_policies: &[String],
) -> sqlx::Result<Vec<Due>> {
    sqlx::query_as(&format!(
        "select c.command_id, c.run_id,
                case when c.published_generation is null then c.publish_generation
                     else greatest(c.publish_generation, c.published_generation + 1) end
                    as generation,
                c.next_attempt_at,
                greatest(0, extract(epoch from c.next_attempt_at - sweeper.now()))::float8
                    as due_in_seconds
           from sweeper.commands c join sweeper.runs r using (run_id)
          where c.transport = $2 and c.publish_due
            and c.next_attempt_at <= sweeper.now() + make_interval(secs => $3)
            and (c.state = 'pending' or (c.state = 'leased' and c.lease_until < sweeper.now()))
            and {released}
          order by c.next_attempt_at
          limit $1",
        released = super::released("$4")
    ))
    .bind(limit)
    .bind(transport)
    .bind(horizon_seconds)
    .bind(held_policies)
    .fetch_all(pool)
    .await
}

/// Marks `published` (what the queue accepted) published with their generations; a decision
/// committed since they were read (it moves `next_attempt_at`) keeps a command due.
pub async fn mark_published(pool: &PgPool, published: &[&Due]) -> sqlx::Result<()> {
    let ids: Vec<&str> = published.iter().map(|d| d.command_id.as_str()).collect();
    let gens: Vec<i32> = published.iter().map(|d| d.generation).collect();
    let nexts: Vec<DateTime<Utc>> = published.iter().map(|d| d.next_attempt_at).collect();
    sqlx::query(
        "update sweeper.commands c
            set publish_due = case when c.next_attempt_at = u.next then false
                                   else c.publish_due end,
                published_at = sweeper.now(), published_generation = u.generation,
                publish_generation = greatest(c.publish_generation, u.generation)
           from unnest($1::text[], $2::int4[], $3::timestamptz[]) as u(command_id, generation, next)
          where c.command_id = u.command_id",
    )
    .bind(&ids)
    .bind(&gens)
    .bind(&nexts)
    .execute(pool)
    .await?;
    Ok(())
}

/// Commits "publish this command again when it is due, and not before `not_before_seconds`"
/// for a push delivery answered "not now". Returns whether it was recorded: not when the command
/// is gone or terminal, and not when its row stays locked for longer than
/// [`REPUBLISH_LOCK_WAIT`] — then an execution holds it, and that execution commits its own
/// decision: every failure, snooze or hold of a push command marks it due for publishing by
/// itself ([`crate::ledger::commands`]), so nothing is left for no queue to deliver.
///
/// It waits for the lock rather than skipping a locked row: short ledger writes lock the row
/// too (the relay marking the command published, another delivery's gate), and skipping one of
/// those lost the request — the relay's mark then found `next_attempt_at` unchanged and cleared
/// `publish_due`, leaving a pending command that no queue would bring back.
pub async fn request_republish(
    pool: &PgPool,
    command_id: &str,
    not_before_seconds: u64,
) -> sqlx::Result<bool> {
    let mut tx = pool.begin().await?;
    sqlx::query("select set_config('lock_timeout', $1, true)")
        .bind(format!("{}ms", REPUBLISH_LOCK_WAIT.as_millis()))
        .execute(&mut *tx)
        .await?;
    let updated = sqlx::query(
        "update sweeper.commands c
            set publish_due = true,
                next_attempt_at = greatest(c.next_attempt_at,
                                           sweeper.now() + make_interval(secs => $2))
          where c.command_id = $1 and c.state in ('pending', 'leased')",
    )
    .bind(command_id)
    .bind(not_before_seconds.clamp(1, 86_400) as f64)
    .execute(&mut *tx)
    .await;
    match updated {
        Ok(r) => {
            tx.commit().await?;
            Ok(r.rows_affected() > 0)
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => Ok(false),
        Err(e) => Err(e),
    }
}

/// Longest [`request_republish`] waits for the command's row: longer than any short ledger
/// write holds it, short enough not to keep a push delivery waiting behind an execution.
pub const REPUBLISH_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Housekeeping: due, non-terminal commands of `transport` never published, or whose last
/// publish (or, when later, their due time: QStash may hold a message until then) is older than
/// `after_seconds`, are published again. Returns how many were marked.
pub async fn mark_stale_for_republish(
    pool: &PgPool,
    transport: &str,
    after_seconds: i64,
) -> sqlx::Result<u64> {
    Ok(sqlx::query(
        "update sweeper.commands
            set publish_due = true
          where transport = $1 and not publish_due
            and (state = 'pending' or (state = 'leased' and lease_until < sweeper.now()))
            and next_attempt_at <= sweeper.now()
            and (published_at is null
                 or greatest(published_at, next_attempt_at)
                    < sweeper.now() - make_interval(secs => $2))",
    )
    .bind(transport)
    .bind(after_seconds as f64)
    .execute(pool)
    .await?
    .rows_affected())
}
