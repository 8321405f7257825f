//! The built-in queue's claims (DESIGN §8): a due built-in command is leased to one replica with
//! its next attempt number, which fences everything its execution writes, and given back when it
//! cannot run now.

use sqlx::PgPool;

/// Claims up to `limit` due built-in commands (pending and due, or leased with an expired
/// lease; their policy not suspended) in one statement, `FOR UPDATE SKIP LOCKED`: each gets a
/// lease of `lease_seconds` owned by `owner` and its attempt number. Returns
/// `(command_id, attempt)`.
pub async fn claim(
    pool: &PgPool,
    owner: uuid::Uuid,
    lease_seconds: f64,
    limit: i64,
) -> sqlx::Result<Vec<(String, i32)>> {
    sqlx::query_as(
        "update sweeper.commands c
            set state = 'leased', attempts = c.attempts + 1, lease_owner = $2, calling_since = null,
                lease_until = (select sweeper.now()) + make_interval(secs => $1)
          where c.command_id in (
                select q.command_id from sweeper.commands q
                 where q.transport = 'builtin'
                   and ((q.state = 'pending' and q.next_attempt_at <= (select sweeper.now()))
                     or (q.state = 'leased' and q.lease_until < (select sweeper.now())))
                   and not exists (
                        select 1 from sweeper.runs r join sweeper.policy_state ps using (policy)
                         where r.run_id = q.run_id and ps.suspended)
                 order by q.next_attempt_at
                 limit $3
                 for update of q skip locked)
          returning c.command_id, c.attempts",
    )
    .bind(lease_seconds)
    .bind(owner)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Gives a claimed command back without spending its attempt (suspended, held, this replica's
/// configuration behind): pending again, due no earlier than `retry_after_seconds`, `last_error`
/// saying why (not a failure: the class stays null). Fenced by `attempt`.
pub async fn release(
    pool: &PgPool,
    command_id: &str,
    attempt: i32,
    retry_after_seconds: f64,
    reason: &str,
) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.commands
            set state = 'pending', lease_until = null, lease_owner = null, attempts = attempts - 1,
                next_attempt_at = greatest(next_attempt_at,
                                           sweeper.now() + make_interval(secs => $3)),
                last_error = $4
          where command_id = $1 and state = 'leased' and attempts = $2",
    )
    .bind(command_id)
    .bind(attempt)
    .bind(retry_after_seconds)
    .bind(reason)
    .execute(pool)
    .await?;
    Ok(())
}

/// Puts a claimed command back for a retry in a second, keeping its spent attempt (its try could
/// not record a result). Fenced by `attempt`.
pub async fn give_back(pool: &PgPool, command_id: &str, attempt: i32) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.commands
            set state = 'pending', lease_until = null, lease_owner = null,
                next_attempt_at = sweeper.now() + interval '1 second'
          where command_id = $1 and state = 'leased' and attempts = $2",
    )
    .bind(command_id)
    .bind(attempt)
    .execute(pool)
    .await?;
    Ok(())
}

/// Gives back every command `owner` holds a lease on, without spending their attempts (its
/// workers stopped), so another replica picks them up at once. Returns how many.
pub async fn release_all(pool: &PgPool, owner: uuid::Uuid) -> sqlx::Result<u64> {
    Ok(sqlx::query(
        "update sweeper.commands
            set state = 'pending', lease_until = null, lease_owner = null, attempts = attempts - 1
          where lease_owner = $1 and state = 'leased'",
    )
    .bind(owner)
    .execute(pool)
    .await?
    .rows_affected())
}
