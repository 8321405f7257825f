//! PostgreSQL's own floor for sweeper's work, and the sparse table it is measured on.
//!
//! Three floors. The *thin* floor writes the least evidence one could call an audit — a row of
//! (run_id, command_id, item_id, outcome, policy, cutoff) into an unindexed table — and is the
//! yardstick the delete-first issue names. The *lean* floor is the thin one plus the one index a
//! history of an item needs (on the item key): the same evidence sweeper's lean audit keeps. The
//! *audit* floor writes sweeper's own audit (an execution row per batch and a row per item, its
//! tables, indexes and partitions), so the gap between them is the cost of the evidence, not of
//! sweeper.
//!
//! The floor is the least any correct tool must do per batch of `delete_rows` with an audit:
//! one transaction — `WITH d AS (DELETE … WHERE id = ANY($ids) AND closed_at < $cutoff AND NOT
//! legal_hold RETURNING id) INSERT INTO <audit> … FROM d; INSERT <done marker>; COMMIT` —
//! on batches cut before the clock starts, `conns` connections taking batches from one list. It
//! sets `recorded_at` itself (`now()`, once per statement) rather than pay the column's default,
//! sweeper's per-row clock function.

use std::time::Instant;

use sqlx::{Connection, PgConnection};
use tokio::sync::Mutex;

use super::kit;
use super::kit::db::database_url;

/// Where the floor finds its rows (the cut is not timed).
#[derive(Debug, Clone, Copy)]
pub enum Find {
    /// In key order over the table (the dense scenario).
    KeyOrder,
    /// Through the timestamp index, `closed_at < cutoff` in (closed_at, id) order (sparse).
    TimestampIndex,
}

/// What evidence the floor writes per deleted row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audit {
    /// Sweeper's own audit: an execution row per batch and a row per item (its indexes and
    /// partitions).
    Sweepers,
    /// A six-column row in an unindexed table (`public.thin_audit`).
    Thin,
    /// The thin row with an index on the item key (what an item's history needs).
    Lean,
}

/// The floor on database `db`: eligible ids found by `find`, cut into batches of `batch`, then
/// deleted and audited (`audit`) batch by batch on `conns` connections. Returns (items, seconds).
pub async fn floor(
    db: &str,
    cutoff: chrono::DateTime<chrono::Utc>,
    (find, audit): (Find, Audit),
    batch: usize,
    conns: usize,
) -> (i64, f64) {
    let url = database_url(db);
    let mut c = PgConnection::connect(&url).await.unwrap();
    let order = match find {
        Find::KeyOrder => "id",
        Find::TimestampIndex => "closed_at, id",
    };
    let ids: Vec<i64> = sqlx::query_scalar(&format!(
        "select id from demo.tickets where closed_at < $1 and not legal_hold order by {order}"
    ))
    .bind(cutoff)
    .fetch_all(&mut c)
    .await
    .unwrap();
    sqlx::raw_sql(
        "create table public.floor_done (batch_no integer primary key);
         create table public.thin_audit (run_id text, command_id text, item_id bigint,
                                         outcome text, policy text, cutoff timestamptz);",
    )
    .execute(&mut c)
    .await
    .unwrap();
    if audit == Audit::Lean {
        sqlx::query("create index thin_audit_by_item on public.thin_audit (item_id)")
            .execute(&mut c)
            .await
            .unwrap();
    }
    let insert = match audit {
        Audit::Sweepers => {
            ", x as (insert into sweeper.audit_executions
                          (policy, policy_version, run_id, window_at, pinned_cutoff, cutoff,
                           command_id, attempt, actor, dry_run, recorded_at)
                      select 'floor', 'v', 'floor', $2, $2, $2, 'floor:' || $3, 1, 'floor',
                             false, now()
                   returning execution_id, recorded_at)
             insert into sweeper.audit_items (execution_id, recorded_at, item_key, outcome)
             select x.execution_id, x.recorded_at, d.id::text, 'deleted' from x cross join d"
        }
        Audit::Thin | Audit::Lean => {
            "insert into public.thin_audit (run_id, command_id, item_id, outcome, policy, cutoff)
             select 'floor', 'floor:' || $3, d.id, 'deleted', 'floor', $2 from d"
        }
    };
    c.close().await.unwrap();
    let batches: Vec<(i32, Vec<i64>)> = ids
        .chunks(batch)
        .enumerate()
        .map(|(i, b)| (i as i32, b.to_vec()))
        .rev()
        .collect();
    let queue = std::sync::Arc::new(Mutex::new(batches));
    let mut sessions = Vec::new();
    for _ in 0..conns {
        sessions.push(PgConnection::connect(&url).await.unwrap());
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for mut s in sessions {
        let q = queue.clone();
        let insert = insert.to_string();
        tasks.push(tokio::spawn(async move {
            let mut deleted = 0u64;
            loop {
                let Some((no, ids)) = q.lock().await.pop() else {
                    return deleted;
                };
                let mut tx = s.begin().await.unwrap();
                deleted += sqlx::query(&format!(
                    "with d as (delete from demo.tickets
                                 where id = any($1) and closed_at < $2 and not legal_hold
                             returning id)
                     {insert}"
                ))
                .bind(&ids)
                .bind(cutoff)
                .bind(no)
                .execute(&mut *tx)
                .await
                .unwrap()
                .rows_affected();
                sqlx::query("insert into public.floor_done values ($1)")
                    .bind(no)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
        }));
    }
    let mut items = 0;
    for t in tasks {
        items += t.await.unwrap() as i64;
    }
    (items, started.elapsed().as_secs_f64())
}

/// Seeds database `name` with `rows` tickets of ~200 bytes of which about `eligible` are older
/// than the cutoff (spread over the ten days before it, ~2 % of them on legal hold, so not
/// eligible); the rest were closed in the 89 days after it. Indexed on `closed_at`, vacuumed
/// and analysed, like the dense seed.
pub async fn seed_sparse(
    name: &str,
    rows: i64,
    eligible: i64,
    window: chrono::DateTime<chrono::Utc>,
) {
    let pool = kit::db::create_migrated(name).await;
    let mut c = pool.acquire().await.unwrap();
    create_tickets(&mut c, 0.29).await;
    let old_fraction = eligible as f64 / rows as f64 / 0.98;
    let mut start = 1i64;
    while start <= rows {
        let end = (start + 1_000_000 - 1).min(rows);
        sqlx::query(
            "insert into demo.tickets
             select g, 1 + g % 50000, 'closed', random() < 0.02,
                    case when random() < $4
                         then $3::timestamptz - interval '91 days' - random() * interval '10 days'
                         else $3::timestamptz - random() * interval '89 days' end,
                    'Ticket ' || g || ': refund request for order', repeat('x', 120)
               from generate_series($1::bigint, $2::bigint) g",
        )
        .bind(start)
        .bind(end)
        .bind(window)
        .bind(old_fraction)
        .execute(&mut *c)
        .await
        .unwrap();
        start = end + 1;
    }
    for stmt in [
        "create index tickets_closed_at on demo.tickets (closed_at)",
        "vacuum analyze demo.tickets",
    ] {
        sqlx::query(stmt).execute(&mut *c).await.unwrap();
    }
    drop(c);
    pool.close().await;
}

/// Creates the benchmark's `demo.tickets` (~200-byte rows) on `c` and seeds the session's
/// random generator with `seed`, so the rows that follow are the same on every run.
pub async fn create_tickets(c: &mut sqlx::PgConnection, seed: f64) {
    for stmt in [
        "create schema demo",
        "create table demo.tickets (id bigint primary key, customer_id bigint not null,
             status text not null, legal_hold boolean not null, closed_at timestamptz,
             subject text not null, body text not null)",
    ] {
        sqlx::query(stmt).execute(&mut *c).await.unwrap();
    }
    sqlx::query("select setseed($1)")
        .bind(seed)
        .execute(&mut *c)
        .await
        .unwrap();
}
