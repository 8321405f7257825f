//! The built-in queue's claims (docs/design.md §8): a due built-in command is leased to one replica with
//! its next attempt number, which fences everything its execution writes, and given back when it
//! cannot run now.

use sqlx::PgPool;

use super::commands::CommandTry;

/// Claims up to `limit` due built-in commands (pending and due, or leased with an expired
/// lease; their run not held by the identity guard, a suspension or an approval, their policy not
/// in `held_policies`, which this replica's governor or active hours hold) in one statement,
/// `FOR UPDATE SKIP LOCKED`: each gets a lease of `lease_seconds` owned by `owner` and its
/// attempt number. Returns each claim's [`CommandTry`].
///
/// The claim commits with `synchronous_commit = off` (docs/design.md §2.4): it is visible to
/// every session at once (a process that dies mid-command has still spent the attempt), and only
/// a crash of the database server can lose it — which returns the command to the queue. The
/// next synchronous commit flushes it: the effect's own, or, for an action with external calls,
/// the one that marks the command calling before any call. So a command waits for one WAL flush,
/// not two.
pub async fn claim(
    pool: &PgPool,
    owner: uuid::Uuid,
    lease_seconds: f64,
    limit: i64,
    held_policies: &[String],
) -> sqlx::Result<Vec<CommandTry>> {
    let claimed: Vec<(String, i32, bool)> = sqlx::query_as(&format!(
        "update sweeper.commands c
            set state = 'leased', attempts = c.attempts + 1, lease_owner = $2, calling_since = null,
                lease_until = (select sweeper.now()) + make_interval(secs => $1)
          where c.command_id in (
                select q.command_id from sweeper.commands q
                  join sweeper.runs r on r.run_id = q.run_id
                 where q.transport = 'builtin'
                   and ((q.state = 'pending' and q.next_attempt_at <= (select sweeper.now()))
                     or (q.state = 'leased' and q.lease_until < (select sweeper.now())))
                   and {released}
                 order by q.next_attempt_at
                 limit $3
                 for update of q skip locked)
          returning c.command_id, c.attempts,
                    set_config('synchronous_commit', 'off', true) is not null as async_commit",
        released = super::released("$4")
    ))
    .bind(lease_seconds)
    .bind(owner)
    .bind(limit)
    .bind(held_policies)
    .fetch_all(pool)
    .await?;
    Ok(claimed
        .into_iter()
        .map(|(id, n, _)| CommandTry::claimed(&id, n))
        .collect())
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

/// Reserves `command_id`'s key count of `policy`'s pace of `per_second` items a second (across
/// replicas; see `sweeper.reserve_pace`) in its own statement, never in the effect's
/// transaction. Returns the instant it may start (`None`: no such command) and the seconds until
/// then (≤ 0: now).
pub async fn reserve_pace(
    pool: &PgPool,
    command_id: &str,
    policy: &str,
    per_second: u32,
) -> sqlx::Result<Option<(chrono::DateTime<chrono::Utc>, f64)>> {
    let row: (Option<chrono::DateTime<chrono::Utc>>, Option<f64>) = sqlx::query_as(
        "select s, extract(epoch from s - sweeper.now())::float8
           from (select sweeper.reserve_pace($1, $2, $3) as s) r",
    )
    .bind(command_id)
    .bind(policy)
    .bind(per_second as i32)
    .fetch_one(pool)
    .await?;
    Ok(row.0.zip(row.1))
}

impl CommandTry {
    /// Gives a claimed command back without spending its attempt (suspended, held, this replica's
    /// configuration behind): pending again, due no earlier than `retry_after_seconds`, `last_error`
    /// saying why (not a failure: the class stays null). Fenced by `attempt`.
    pub async fn release(
        &self,
        pool: &PgPool,
        retry_after_seconds: f64,
        reason: &str,
    ) -> sqlx::Result<()> {
        sqlx::query(
            "update sweeper.commands
                set state = 'pending', lease_until = null, lease_owner = null, attempts = $5,
                    next_attempt_at = greatest(next_attempt_at,
                                               sweeper.now() + make_interval(secs => $3)),
                    last_error = $4
              where command_id = $1 and state = 'leased' and attempts = $2",
        )
        .bind(self.command_id())
        .bind(self.attempt().fence())
        .bind(retry_after_seconds)
        .bind(reason)
        .bind(self.attempt().given_back())
        .execute(pool)
        .await?;
        Ok(())
    }

    /// Puts a claimed command back for a retry in a second, keeping its spent attempt (its try could
    /// not record a result). Fenced by `attempt`.
    pub async fn give_back(&self, pool: &PgPool) -> sqlx::Result<()> {
        sqlx::query(
            "update sweeper.commands
                set state = 'pending', lease_until = null, lease_owner = null,
                    next_attempt_at = sweeper.now() + interval '1 second'
              where command_id = $1 and state = 'leased' and attempts = $2",
        )
        .bind(self.command_id())
        .bind(self.attempt().fence())
        .execute(pool)
        .await?;
        Ok(())
    }
}
