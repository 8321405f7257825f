//! Dependency pauses (docs/design.md §9): a dependency's "no calls before T", shared by all replicas.

use sqlx::PgPool;

/// Stores a pause of `seconds` for dependency `name` (the later of this and any stored pause
/// wins), counting it.
pub async fn pause(pool: &PgPool, name: &str, seconds: f64, reason: &str) -> sqlx::Result<()> {
    sqlx::query(
        "insert into sweeper.dependency_pauses (dependency, paused_until, reason, paused_at)
         values ($1, sweeper.now() + make_interval(secs => $2), $3, sweeper.now())
         on conflict (dependency) do update
            set paused_until = greatest(sweeper.dependency_pauses.paused_until,
                                        excluded.paused_until),
                reason = excluded.reason, paused_at = excluded.paused_at,
                pauses = sweeper.dependency_pauses.pauses + 1",
    )
    .bind(name)
    .bind(seconds)
    .bind(reason)
    .execute(pool)
    .await?;
    Ok(())
}

/// Reserves one call of dependency `name` at `per_second` calls a second across every replica,
/// `burst` of them allowed at a second's start (`sweeper.reserve_dependency_call`, a
/// `rate_limit` with `scope = "global"`). One statement of its own, never inside an effect's
/// transaction. Returns the seconds until the call may start (≤ 0: now).
pub async fn reserve_call(
    pool: &PgPool,
    name: &str,
    per_second: u32,
    burst: u32,
) -> sqlx::Result<f64> {
    sqlx::query_scalar("select sweeper.reserve_dependency_call($1, $2, $3)")
        .bind(name)
        .bind(per_second as i32)
        .bind(burst as i32)
        .fetch_one(pool)
        .await
}
