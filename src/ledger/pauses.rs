//! Dependency pauses (DESIGN §9): a dependency's "no calls before T", shared by all replicas.

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
