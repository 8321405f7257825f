//! Planning jobs (docs/design.md §8): leased ledger rows any replica can pick up; each page writes its
//! commands, moves the job's cursor and adds to the run's counts in the page's transaction.

use std::collections::BTreeMap;

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// Claims a due planning job (not done; unleased, or with an expired lease) of one of
/// `policies` (those in this replica's configuration: a job of another policy is left to a
/// replica that has it), oldest first, leasing it to `token` for `lease_seconds`. Returns its
/// run.
pub async fn claim(
    pool: &PgPool,
    token: Uuid,
    lease_seconds: f64,
    policies: &[String],
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "update sweeper.planning_jobs
            set lease_token = $1, lease_until = (select sweeper.now()) + make_interval(secs => $2)
          where run_id = (select j.run_id from sweeper.planning_jobs j
                            join sweeper.runs r using (run_id)
                           where not j.done and r.policy = any($3)
                             and (j.lease_until is null or j.lease_until < (select sweeper.now()))
                           order by j.created_at
                           limit 1
                           for update of j skip locked)
          returning run_id",
    )
    .bind(token)
    .bind(lease_seconds)
    .bind(policies)
    .fetch_optional(pool)
    .await
}

/// Records on each due planning job whose policy is not among `policies` (this replica's
/// configuration lacks it) that it is held, kind `policy_changed`, naming `replica` and the
/// time; a job already held keeps its hold. The first page a replica that has the policy plans
/// clears it. Returns how many jobs were marked.
pub async fn mark_missing_policies(
    pool: &PgPool,
    policies: &[String],
    replica: Uuid,
) -> sqlx::Result<u64> {
    Ok(sqlx::query(
        "update sweeper.planning_jobs j
            set held_kind = 'policy_changed',
                held_reason = 'the policy is missing from the configuration of replica ' || $2
                              || ' (seen at ' || to_char(sweeper.now() at time zone 'UTC',
                                                         'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') || ')',
                held_since = sweeper.now()
           from sweeper.runs r
          where r.run_id = j.run_id and not j.done and j.held_kind is null
            and r.policy <> all($1)
            and (j.lease_until is null or j.lease_until < sweeper.now())",
    )
    .bind(policies)
    .bind(replica.to_string())
    .execute(pool)
    .await?
    .rows_affected())
}

/// Gives back the lease `token` holds on a planning job not done (a replica stopping mid-job),
/// so any replica may claim it at once. Returns whether one was held.
pub async fn release(pool: &PgPool, token: Uuid) -> sqlx::Result<bool> {
    Ok(sqlx::query(
        "update sweeper.planning_jobs set lease_until = null
          where lease_token = $1 and not done and held_kind is null",
    )
    .bind(token)
    .execute(pool)
    .await?
    .rows_affected()
        > 0)
}

/// Records a failed page on the job (shown on the run and in /metrics); a `transient` one also
/// gives the lease back so the next round retries soon. Fenced by the lease `token`.
pub async fn record_failure(
    pool: &PgPool,
    run_id: &str,
    token: Uuid,
    error: &str,
    transient: bool,
) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.planning_jobs
            set failures = failures + 1, last_error = $3, last_error_at = sweeper.now(),
                lease_until = case when $4 then null else lease_until end
          where run_id = $1 and lease_token = $2",
    )
    .bind(run_id)
    .bind(token)
    .bind(error)
    .bind(transient)
    .execute(pool)
    .await?;
    Ok(())
}

/// Records that the job is held (`kind`: `schema` or `policy_changed`; not a failure), tried
/// again after `recheck_seconds`. Fenced by the lease `token`.
pub async fn hold(
    pool: &PgPool,
    run_id: &str,
    token: Uuid,
    kind: &str,
    reason: &str,
    recheck_seconds: f64,
) -> sqlx::Result<()> {
    sqlx::query(
        "update sweeper.planning_jobs
            set held_kind = $3, held_reason = $4, held_since = coalesce(held_since, sweeper.now()),
                lease_until = sweeper.now() + make_interval(secs => $5)
          where run_id = $1 and lease_token = $2",
    )
    .bind(run_id)
    .bind(token)
    .bind(kind)
    .bind(reason)
    .bind(recheck_seconds)
    .execute(pool)
    .await?;
    Ok(())
}

/// Of `keys` (the old-enough rows a `timestamp_index` page met, eligible or held), those no
/// earlier page of the run met; records them as seen in the caller's transaction (one
/// statement). A row whose timestamp moved forward past the cursor is met again by the walk:
/// this keeps it out of a second command and out of a second held count.
pub async fn first_seen(
    conn: &mut PgConnection,
    run_id: &str,
    keys: &[String],
) -> sqlx::Result<std::collections::HashSet<String>> {
    if keys.is_empty() {
        return Ok(Default::default());
    }
    Ok(sqlx::query_scalar(
        "insert into sweeper.seen_keys (run_id, item_key)
         select $1, k from unnest($2::text[]) as k
         on conflict do nothing
         returning item_key",
    )
    .bind(run_id)
    .bind(keys)
    .fetch_all(conn)
    .await?
    .into_iter()
    .collect())
}

/// What one planned page writes.
#[derive(Debug)]
pub struct Page<'a> {
    /// The run.
    pub run_id: &'a str,
    /// Its new commands' keys, in batch order.
    pub batches: &'a [Vec<String>],
    /// The batch number of the first of them.
    pub next_batch_no: i32,
    /// Their transport (`builtin`, `pubsub`, `qstash`); push commands are due for publishing.
    pub transport: &'a str,
    /// The path and its reason, on the page that chose them (the run's first).
    pub path: Option<(&'a str, &'a str)>,
    /// The job's cursor after this page: the last key planned ...
    pub cursor: Option<&'a str>,
    /// ... and, on the `timestamp_index` path, its row's timestamp, as PostgreSQL's text of a
    /// `timestamptz` (so `-infinity` round-trips).
    pub cursor_timestamp: Option<&'a str>,
    /// Eligible keys behind the cursor not yet in a command (fewer than a command's worth),
    /// carried to the next page.
    pub carry: &'a [String],
    /// Items put into the commands.
    pub items: i64,
    /// Rows held on this page, per reason.
    pub held: &'a BTreeMap<String, i64>,
    /// Whether this was the job's last page.
    pub done: bool,
    /// The renewed lease.
    pub lease_seconds: f64,
    /// The leaf partition each new command's keys were planned in (a partitioned target), in
    /// batch order.
    pub batch_partitions: &'a [Option<String>],
    /// A partitioned target's leaves in walk order, on the run's first page.
    pub partitions: Option<&'a [String]>,
    /// The position in them of the leaf the cursor is in after this page.
    pub cursor_partition: usize,
}

/// Writes a page in the caller's transaction (which locked the job row): the commands (due at
/// the window instant, never before), the job's cursor, carried keys and renewed lease, and the
/// run's counts; on the last page the run becomes `running` (whether it is already complete is
/// decided after the commit, by [`super::runs::complete_if_done`]). Returns the run's status.
pub async fn record_page(conn: &mut PgConnection, p: &Page<'_>) -> sqlx::Result<String> {
    let n_commands = p.batches.len() as i32;
    if n_commands > 0 {
        sqlx::query(
            "insert into sweeper.commands
                 (command_id, run_id, batch_no, item_keys, transport, next_attempt_at, due_since,
                  publish_due, partition)
             select $1 || ':' || (b.ord - 1 + $3), $1, b.ord - 1 + $3,
                    array(select jsonb_array_elements_text(b.keys)), $4, r.window_at,
                    greatest(r.window_at, sweeper.now()), $4 <> 'builtin', ($5::text[])[b.ord]
               from jsonb_array_elements($2) with ordinality as b(keys, ord),
                    sweeper.runs r
              where r.run_id = $1",
        )
        .bind(p.run_id)
        .bind(sqlx::types::Json(p.batches))
        .bind(p.next_batch_no)
        .bind(p.transport)
        .bind(p.batch_partitions)
        .execute(&mut *conn)
        .await?;
    }
    sqlx::query(
        "update sweeper.planning_jobs
            set cursor_key = $2, next_batch_no = next_batch_no + $3, pages_done = pages_done + 1,
                failures = 0, held_kind = null, held_reason = null, held_since = null,
                done = $4, lease_until = (select sweeper.now()) + make_interval(secs => $5),
                carry_keys = $6, cursor_timestamp = $7::timestamptz,
                path = coalesce(path, $8), path_reason = coalesce(path_reason, $9),
                partitions = coalesce(partitions, $10), cursor_partition = $11
          where run_id = $1",
    )
    .bind(p.run_id)
    .bind(p.cursor)
    .bind(n_commands)
    .bind(p.done)
    .bind(p.lease_seconds)
    .bind(p.carry)
    .bind(p.cursor_timestamp)
    .bind(p.path.map(|(path, _)| path))
    .bind(p.path.map(|(_, reason)| reason))
    .bind(p.partitions)
    .bind(p.cursor_partition as i32)
    .execute(&mut *conn)
    .await?;
    if p.done {
        // Planning is over: no key of this run can be met again.
        sqlx::query("delete from sweeper.seen_keys where run_id = $1")
            .bind(p.run_id)
            .execute(&mut *conn)
            .await?;
    }
    sqlx::query_scalar(&format!(
        "update sweeper.runs
            set commands_total = commands_total + $2,
                eligible_planned = eligible_planned + $3,
                held_at_planning = {held},
                planning_done = $5,
                planned_at = case when $5 then sweeper.now() end,
                status = case when status <> 'planning' then status
                              when $5 then 'running'
                              else 'planning' end
          where run_id = $1
          returning status",
        held = merged_held("$4")
    ))
    .bind(p.run_id)
    .bind(n_commands)
    .bind(p.items)
    .bind(sqlx::types::Json(p.held))
    .bind(p.done)
    .fetch_one(conn)
    .await
}

/// The run's `held_at_planning` with the counts per reason of the JSON object `param` added.
fn merged_held(param: &str) -> String {
    format!(
        "(select coalesce(jsonb_object_agg(k, v), '{{}}'::jsonb)
            from (select k, sum(v)::bigint as v
                    from (select key as k, value::bigint as v
                            from jsonb_each_text(held_at_planning)
                          union all
                          select key, value::bigint from jsonb_each_text({param})) s
                   group by k) t)"
    )
}

/// Adds `held` (rows per reason) to `run_id`'s `held_at_planning`: the held rows of a partition
/// retired with them carved out, counted as the row path counts the rows it walks.
pub async fn add_held(
    conn: &mut PgConnection,
    run_id: &str,
    held: &std::collections::BTreeMap<String, i64>,
) -> sqlx::Result<()> {
    sqlx::query(&format!(
        "update sweeper.runs set held_at_planning = {} where run_id = $1",
        merged_held("$2")
    ))
    .bind(run_id)
    .bind(sqlx::types::Json(held))
    .execute(conn)
    .await?;
    Ok(())
}
