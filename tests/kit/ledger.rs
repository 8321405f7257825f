//! The ledger as tests see it: read-only views for assertions, and the few named setters a test
//! may use to force a state that would otherwise take a crash or hours of wall time. Every write
//! a test makes to `sweeper.*` lives here, named for the state it forces.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::{Connection, PgConnection, PgPool};

// ---- views -----------------------------------------------------------------------------------

/// A run's status column (`sweeper.runs.status`).
pub async fn run_status(pool: &PgPool, run_id: &str) -> String {
    sqlx::query_scalar("select status from sweeper.runs where run_id = $1")
        .bind(run_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Whether a run status is terminal (docs/design.md §3: completed, completed_with_dead_letters,
/// cancelled).
pub fn is_terminal(status: &str) -> bool {
    matches!(
        status,
        "completed" | "completed_with_dead_letters" | "cancelled"
    )
}

/// Waits (up to `timeout`) until the run is terminal, reading the ledger directly (for tests
/// that have no server to ask, or whose server crashed); returns the status.
pub async fn wait_run_terminal(pool: &PgPool, run_id: &str, timeout: Duration) -> String {
    let started = Instant::now();
    loop {
        let status = run_status(pool, run_id).await;
        if is_terminal(&status) {
            return status;
        }
        assert!(
            started.elapsed() < timeout,
            "run {run_id} still {status} after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The distinct command states of a run, sorted.
pub async fn command_states(pool: &PgPool, run_id: &str) -> Vec<String> {
    sqlx::query_scalar(
        "select distinct state from sweeper.commands where run_id = $1 order by state",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A run's command ids in batch order.
pub async fn command_ids(pool: &PgPool, run_id: &str) -> Vec<String> {
    sqlx::query_scalar(
        "select command_id from sweeper.commands where run_id = $1 order by batch_no",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Every planned item key of a run (over all its commands), as integers, sorted.
pub async fn planned_int_keys(pool: &PgPool, run_id: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "select k::bigint from sweeper.commands, unnest(item_keys) k where run_id = $1 order by 1",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// One audit row: (item_key, outcome, reason).
pub type AuditRow = (String, String, Option<String>);

/// Every audit row of a run, in the order written.
pub async fn audit(pool: &PgPool, run_id: &str) -> Vec<AuditRow> {
    sqlx::query_as(
        "select item_key, outcome, reason from sweeper.audit_trail where run_id = $1 order by audit_id",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// How many item keys have more than one audit row (over the whole ledger): 0 when every item
/// has one outcome.
pub async fn items_with_several_outcomes(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from (select item_key from sweeper.audit_trail group by item_key
                                having count(*) > 1) d",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// How many attempts failed with the transient class (over the whole ledger).
pub async fn transient_failures(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from sweeper.attempts where outcome = 'failed' and class = 'transient'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits (up to 60 s) until some attempt has failed transiently.
pub async fn wait_transient_failure(pool: &PgPool) {
    let started = Instant::now();
    while transient_failures(pool).await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no attempt failed transiently"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The ledger's clock (`sweeper.now()`).
pub async fn ledger_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("select sweeper.now()")
        .fetch_one(pool)
        .await
        .unwrap()
}

// ---- named setters ---------------------------------------------------------------------------

/// Sets the ledger clock so that `sweeper.now()` reads `at` (approximately: the offset is taken
/// against the database clock now).
pub async fn set_clock(pool: &PgPool, at: DateTime<Utc>) {
    sqlx::query(
        "insert into sweeper.clock_offset (singleton, offset_seconds)
         values (true, extract(epoch from ($1::timestamptz - clock_timestamp())))
         on conflict (singleton) do update set offset_seconds = excluded.offset_seconds",
    )
    .bind(at)
    .execute(pool)
    .await
    .unwrap();
}

/// Moves the ledger clock `seconds` forward (past a lease, a backoff, a horizon).
pub async fn advance_clock(pool: &PgPool, seconds: i64) {
    let now = ledger_now(pool).await;
    set_clock(pool, now + chrono::TimeDelta::seconds(seconds)).await;
}

/// Forces what a worker that claimed `command_id` and died leaves behind: state `leased`,
/// `attempts` spent, the lease ending `lease_seconds` from the ledger's now (negative: expired),
/// owned by `owner` when given.
pub async fn force_claimed(
    pool: &PgPool,
    command_id: &str,
    attempts: i32,
    lease_seconds: i64,
    owner: Option<uuid::Uuid>,
) {
    sqlx::query(
        "update sweeper.commands
            set state = 'leased', attempts = $2, lease_owner = coalesce($4, lease_owner),
                lease_until = sweeper.now() + make_interval(secs => $3)
          where command_id = $1",
    )
    .bind(command_id)
    .bind(attempts)
    .bind(lease_seconds as f64)
    .bind(owner)
    .execute(pool)
    .await
    .unwrap();
}

/// Forces `command_id` of `run_id` into quarantine with an open dead letter (reason `test`,
/// class permanent), as a quarantine would leave the command, the run's counters and the queue.
pub async fn force_quarantined(pool: &PgPool, policy: &str, run_id: &str, command_id: &str) {
    sqlx::query(
        "update sweeper.commands set state = 'quarantined', finished_at = sweeper.now()
          where command_id = $1",
    )
    .bind(command_id)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "insert into sweeper.dead_letters (kind, run_id, policy, command_id, reason, class,
                                           first_failure_at, last_failure_at)
         values ('command', $1, $2, $3, 'test', 'permanent', sweeper.now(), sweeper.now())",
    )
    .bind(run_id)
    .bind(policy)
    .bind(command_id)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "update sweeper.commands set quarantined_commands = quarantined_commands + 1
          where command_id = $1",
    )
    .bind(command_id)
    .execute(pool)
    .await
    .unwrap();
}

/// Forces an open `envelope` dead letter whose raw body hashed to `sha256` (what a malformed
/// delivery leaves).
pub async fn force_envelope_dead_letter(pool: &PgPool, sha256: &str) {
    sqlx::query(
        "insert into sweeper.dead_letters (kind, reason, class, raw_sha256, first_failure_at,
                                           last_failure_at)
         values ('envelope', 'x', 'permanent', $1, sweeper.now(), sweeper.now())",
    )
    .bind(sha256)
    .execute(pool)
    .await
    .unwrap();
}

/// Forces every dead letter to `abandoned` (bypassing the endpoint's per-item audit).
pub async fn force_all_dead_letters_abandoned(pool: &PgPool) {
    sqlx::query("update sweeper.dead_letters set status = 'abandoned'")
        .execute(pool)
        .await
        .unwrap();
}

/// Forces `command_id` to be due `seconds` from the ledger's now.
pub async fn force_due_in(pool: &PgPool, command_id: &str, seconds: i64) {
    sqlx::query(
        "update sweeper.commands set next_attempt_at = sweeper.now() + make_interval(secs => $2)
          where command_id = $1",
    )
    .bind(command_id)
    .bind(seconds as f64)
    .execute(pool)
    .await
    .unwrap();
}

/// Takes concurrency slot `slot` of `policy` on a session of its own, as an executor in another
/// replica would (the key is the service's own, [`sweeper::execute::slot_lock_key`]); the slot
/// is held until the returned connection drops.
pub async fn hold_concurrency_slot(db_url: &str, policy: &str, slot: i32) -> PgConnection {
    let mut c = PgConnection::connect(db_url).await.unwrap();
    sqlx::query("select pg_advisory_lock(hashtext($1), $2)")
        .bind(sweeper::execute::slot_lock_key(policy))
        .bind(slot)
        .execute(&mut c)
        .await
        .unwrap();
    c
}

/// Puts `run_id` back to where the blast-radius guard waits for its plan (`awaiting_plan`), as a
/// run whose planning is not done would be.
pub async fn force_awaiting_plan(pool: &PgPool, run_id: &str) {
    sqlx::query("update sweeper.runs set approval = 'awaiting_plan' where run_id = $1")
        .bind(run_id)
        .execute(pool)
        .await
        .unwrap();
}
