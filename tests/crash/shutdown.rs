//! SIGTERM is bounded by `queue.drain` plus a few seconds, whatever other sessions hold: a row
//! lock on a command this replica leased, or a lock on the whole commands table.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use super::*;

const DRAIN_SECONDS: u64 = 3;

/// Starts a server whose only worker is stuck on a locked ticket (its command's lock wait is
/// longer than the drain) while it holds the leases of the commands claimed with it; `hold`
/// then takes its lock in another session; SIGTERM must end the process in time.
async fn sigterm_with(hold: &str) {
    let (db, pool, eligible) = prepare().await;
    let text = config_toml(
        &db.url,
        1,
        &format!(
            "drain = \"{DRAIN_SECONDS}s\"\nclaim_batch = 4\n[consume]\nlock_timeout = \"25s\""
        ),
        &ticket_policy(10),
    );
    let ticket = lock_ticket(&db.url, eligible[0]).await;
    let mut server = Server::start(&text).await;
    trigger(&server).await;
    // The worker claimed four commands and is waiting for the ticket of the first.
    let started = Instant::now();
    let leased: Vec<String> = loop {
        let leased: Vec<String> = sqlx::query_scalar(
            "select command_id from sweeper.commands where state = 'leased' order by batch_no",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        if leased.len() >= 2 {
            break leased;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "nothing leased"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut other = PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("begin").execute(&mut other).await.unwrap();
    let hold_sql = hold.to_string();
    let holder = tokio::spawn(async move {
        let hold = hold_sql;
        // The table lock queues behind the worker's transaction, and everything queues
        // behind it: that is the point.
        let mut q = sqlx::query(&hold);
        if hold.contains("$1") {
            q = q.bind(leased.last().unwrap());
        }
        let r = q.execute(&mut other).await;
        tokio::time::sleep(Duration::from_secs(60)).await;
        drop(r);
        other
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sigterm = Instant::now();
    server.terminate();
    let status = server
        .wait_exit(Duration::from_secs(DRAIN_SECONDS + 6))
        .await;
    assert!(status.success(), "{hold}: exit status {status}");
    eprintln!("{hold}: exited {:?} after SIGTERM", sigterm.elapsed());
    holder.abort();
    release_ticket(ticket).await;
}

#[tokio::test]
async fn sigterm_exits_within_the_drain_though_another_session_locks_a_leased_command() {
    sigterm_with("select 1 from sweeper.commands where command_id = $1 for update").await;
}

#[tokio::test]
async fn sigterm_exits_within_the_drain_though_another_session_locks_the_commands_table() {
    sigterm_with("lock table sweeper.commands in access exclusive mode").await;
}
