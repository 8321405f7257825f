//! Effect rows (docs/design.md §2.4): one per (policy, scope, item), opened `calling` before an external
//! call, `called` when it returned, and closed in the transaction that changes the row and writes
//! the audit. `scope` is `''` for an effect once per item — `n` grows only when an effect closes,
//! so the idempotency key `{policy}:{item}:{n}` is the same for every retry of one effect — and
//! the window for one once per window (key `{policy}:{window}:{item}`, one effect per window).

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Postgres, QueryBuilder};

/// The target's side of [`open`], built by the policy layer: pushes
/// `select <old enough> as old_enough, <first exclusion> as reason, <first failed select> as
/// not_eligible_reason, to_jsonb(t.*) as fields, md5(t.*::text) as row_digest from <table> t where
/// <key> = cast($key as <key type>)`, every value a bound parameter.
pub trait ItemQuery {
    /// Pushes the item's select for `key`.
    fn push_item(&self, q: &mut QueryBuilder<'_, Postgres>, key: &str);
}

/// Whose effect [`open`] opens.
#[derive(Debug)]
pub struct Opening<'a> {
    /// The policy.
    pub policy: &'a str,
    /// The item.
    pub item_key: &'a str,
    /// The run executing it.
    pub run_id: &'a str,
    /// The command executing it.
    pub command_id: &'a str,
    /// The effect's scope: `''` (once per item) or the window (once per window).
    pub scope: &'a str,
}

/// Re-checks one item and opens its effect, in one statement (autocommit): the item's row as
/// [`ItemQuery`] reads it, the effect's prior state, and — when the row qualifies and no effect
/// of this run was already `called` — the effect `calling` (a new one, a closed one reopened with
/// the next `n`, or this run's own `calling` one again). Returns the row `found, old_enough,
/// reason, not_eligible_reason, fields, prior_state, prior_run, prior_outcome, prior_recorded,
/// opened_n`.
pub async fn open(pool: &PgPool, item: &impl ItemQuery, o: &Opening<'_>) -> sqlx::Result<PgRow> {
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new("with item as (");
    item.push_item(&mut q, o.item_key);
    q.push("), prior as (select state, n, run_id, outcome, recorded from sweeper.effects where policy = ");
    q.push_bind(o.policy.to_string());
    q.push(" and item_key = ");
    q.push_bind(o.item_key.to_string());
    q.push(" and scope = ");
    q.push_bind(o.scope.to_string());
    q.push(
        "), opened as (
            insert into sweeper.effects
                (policy, scope, item_key, n, state, run_id, command_id, row_digest)
            select ",
    );
    q.push_bind(o.policy.to_string());
    q.push(", ");
    q.push_bind(o.scope.to_string());
    q.push(", ");
    q.push_bind(o.item_key.to_string());
    q.push(", 1, 'calling', ");
    q.push_bind(o.run_id.to_string());
    q.push(", ");
    q.push_bind(o.command_id.to_string());
    q.push(
        ", item.row_digest from item
              where item.reason is null and item.old_enough
                and not exists (select 1 from prior where prior.state = 'called' and prior.run_id = ",
    );
    q.push_bind(o.run_id.to_string());
    q.push(
        ")
            on conflict (policy, scope, item_key) do update
               set n = case when sweeper.effects.state = 'closed' then sweeper.effects.n + 1
                            else sweeper.effects.n end,
                   state = 'calling', run_id = excluded.run_id, command_id = excluded.command_id,
                   row_digest = excluded.row_digest, outcome = null, recorded = null,
                   started_at = sweeper.now(), called_at = null, closed_at = null
             where sweeper.effects.state = 'closed'
                or (sweeper.effects.state = 'calling' and sweeper.effects.run_id = excluded.run_id)
            returning n)
         select exists (select 1 from item) as found, item.old_enough, item.reason,
                item.not_eligible_reason, item.fields,
                prior.state as prior_state, prior.run_id as prior_run,
                prior.outcome as prior_outcome, prior.recorded::text as prior_recorded,
                (select n from opened) as opened_n
           from (select 1) one left join item on true left join prior on true",
    );
    q.build().fetch_one(pool).await
}

/// Marks the effect of `item_key` `called` with `outcome` and the answer's `recorded` fields
/// once its call returned (autocommit): a later attempt that finds it `called` audits them.
#[allow(clippy::too_many_arguments)]
pub async fn mark_called(
    pool: &PgPool,
    policy: &str,
    scope: &str,
    item_key: &str,
    run_id: &str,
    outcome: &str,
    recorded: Option<&str>,
) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.effects
            set state = 'called', called_at = sweeper.now(), outcome = $4, recorded = $6::json
          where policy = $1 and scope = $5 and item_key = $2 and run_id = $3
            and state = 'calling'",
    )
    .bind(policy)
    .bind(item_key)
    .bind(run_id)
    .bind(outcome)
    .bind(scope)
    .bind(recorded)
    .execute(pool)
    .await?;
    Ok(())
}

/// Closes the effects of `keys` (with their `outcomes` where none was recorded) in the
/// transaction that changes the rows and writes the audit.
pub async fn close(
    conn: &mut PgConnection,
    policy: &str,
    scope: &str,
    run_id: &str,
    keys: &[String],
    outcomes: &[&str],
) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.effects e
            set state = 'closed', closed_at = sweeper.now(), outcome = coalesce(e.outcome, u.outcome)
           from unnest($2::text[], $3::text[]) as u(item_key, outcome)
          where e.policy = $1 and e.scope = $5 and e.item_key = u.item_key and e.run_id = $4",
    )
    .bind(policy)
    .bind(keys)
    .bind(outcomes)
    .bind(run_id)
    .bind(scope)
    .execute(conn)
    .await?;
    Ok(())
}

/// Deletes closed effects once per window older than `horizon_seconds` (longer than every
/// redelivery horizon: the commands that could deliver them again are purged by then, and a
/// window's run id is never reused). Effects once per item are kept: their `n` is the item's
/// history of keys. Returns how many.
pub async fn purge_closed_window_effects(pool: &PgPool, horizon_seconds: f64) -> sqlx::Result<u64> {
    Ok(sqlx::query(
        "delete from sweeper.effects
          where scope <> '' and state = 'closed'
            and closed_at < sweeper.now() - make_interval(secs => $1)",
    )
    .bind(horizon_seconds)
    .execute(pool)
    .await?
    .rows_affected())
}
