//! One scenario list, run against every transport that can deliver commands: the built-in
//! PostgreSQL queue, Pub/Sub (the real emulator pushing to `/consume`) and QStash (the stand-in
//! speaking its publish and signed-delivery protocol). A scenario asserts what must hold whoever
//! delivers; a transport's own test module adds what only that transport can show, starting from
//! the scenario's end state.

use crate::common::*;
use crate::emulator::{Emulator, emulator, subscribe};
use crate::qstash::{Qstash, qstash_policy, qstash_toml};

/// What delivers the commands.
pub enum Transport {
    /// The built-in queue, two workers polling every second.
    Builtin,
    /// Pub/Sub via the emulator (push with the query-string token).
    PubSub(Emulator),
    /// QStash via the protocol stand-in (signed pushes).
    Qstash(Qstash),
}

impl Transport {
    /// The Pub/Sub transport on a fresh emulator.
    pub async fn pubsub() -> Transport {
        Transport::PubSub(emulator().await)
    }

    /// The QStash transport on a fresh stand-in.
    pub async fn qstash() -> Transport {
        Transport::Qstash(Qstash::start().await)
    }

    /// The QStash stand-in, for a QStash test's own assertions.
    pub fn qstash_stand_in(&self) -> &Qstash {
        match self {
            Transport::Qstash(q) => q,
            _ => panic!("not the QStash transport"),
        }
    }

    /// The ticket policy (batches of 10, every eligible row on one of 20 commands) routed over
    /// this transport, the clock at the window 2026-09-01T02:00Z, a lock wait of 1 s.
    pub async fn ticket_app(&self) -> TestApp {
        self.app_with(TICKETS, |p| p).await
    }

    /// [`Transport::ticket_app`] on the tables of `setup_sql`, its policy text passed through
    /// `rewrite` (another table, another key).
    pub async fn app_with(
        &self,
        setup_sql: &'static str,
        rewrite: impl Fn(String) -> String,
    ) -> TestApp {
        let (workers, policies, extra_toml) = match self {
            Transport::Builtin => (
                2,
                ticket_policy(10).replace(
                    "batch_size = 10",
                    "batch_size = 10\n\
                     retry = { max_attempts = 10, base = \"1s\", cap = \"1s\", max_age = \"1h\" }",
                ),
                "[consume]\nlock_timeout = \"1s\"\n".to_string(),
            ),
            Transport::PubSub(em) => (
                0,
                ticket_policy(10).replace(
                    "batch_size = 10",
                    "batch_size = 10\ntransport = \"pubsub\"\n\
                     retry = { max_attempts = 10, base = \"1s\", cap = \"1s\", max_age = \"1h\" }",
                ),
                crate::pubsub::pubsub_toml(em),
            ),
            Transport::Qstash(q) => (
                0,
                qstash_policy(10),
                qstash_toml(free_port(), &q.url(), r#"["consume"]"#),
            ),
        };
        let app = TestApp::spawn(Spawn {
            now: Some(at("2026-09-01T02:01:00Z")),
            policies: rewrite(policies),
            extra_toml,
            workers,
            setup_sql,
        })
        .await;
        if let Transport::PubSub(em) = self {
            subscribe(em, &app.base, 10).await;
        }
        app
    }
}

/// Where a scenario ended, for a transport's own assertions.
pub struct Ended {
    pub app: TestApp,
    pub run_id: String,
    pub eligible: Vec<i64>,
}

/// A run of 200 tickets, one eligible row whose delete fails transiently (SQLSTATE 40001) until a
/// delivery has failed on it: the failure is a committed decision, the command comes back, and the
/// run completes with every eligible row deleted and one audit outcome per item.
pub async fn a_transient_failure_converges(t: &Transport) -> Ended {
    let app = t.ticket_app().await;
    let eligible = seed_mixed(&app.pool, 200, at("2026-09-01T02:00:00Z")).await;
    let held = eligible[eligible.len() / 2];
    fail_ticket_deletes(&app.pool, held).await;
    let run_id = app.api.trigger_new("ticket-retention", "").await;
    // Released once a delivery has failed on it (not after a fixed time: throttled publishes
    // make the first delivery's arrival vary).
    wait_transient_failure(&app.pool).await;
    heal_ticket_deletes(&app.pool, held).await;

    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"].as_i64().unwrap(), eligible.len() as i64);
    let remaining: i64 = sqlx::query_scalar("select count(*) from demo.tickets where id = any($1)")
        .bind(&eligible)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(remaining, 0, "every eligible row deleted");
    assert_eq!(
        crate::kit::ledger::items_with_several_outcomes(&app.pool).await,
        0,
        "one outcome per item"
    );
    assert_eq!(app.audit(&run_id).await.len(), eligible.len());
    assert!(
        crate::kit::ledger::transient_failures(&app.pool).await >= 1,
        "the held row made an attempt fail"
    );
    Ended {
        app,
        run_id,
        eligible,
    }
}

/// A dry run over the transport: every eligible key is recorded `would_delete`, nothing is
/// deleted, and the run completes.
pub async fn a_dry_run_deletes_nothing(t: &Transport) -> Ended {
    let app = t.ticket_app().await;
    let eligible = seed_mixed(&app.pool, 60, at("2026-09-01T02:00:00Z")).await;
    let before = app.ticket_ids().await;
    let run_id = app
        .api
        .trigger_new("ticket-retention", "?dry_run=true")
        .await;
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(app.ticket_ids().await, before, "a dry run deletes nothing");
    let mut would: Vec<i64> = app
        .audit(&run_id)
        .await
        .into_iter()
        .filter(|(_, o, _)| o == "would_delete")
        .map(|(k, _, _)| k.parse().unwrap())
        .collect();
    would.sort();
    assert_eq!(would, eligible, "every eligible key recorded would_delete");
    Ended {
        app,
        run_id,
        eligible,
    }
}

#[tokio::test]
async fn builtin_a_transient_failure_converges() {
    a_transient_failure_converges(&Transport::Builtin).await;
}

#[tokio::test]
async fn builtin_a_dry_run_deletes_nothing() {
    a_dry_run_deletes_nothing(&Transport::Builtin).await;
}

#[tokio::test]
async fn pubsub_a_dry_run_deletes_nothing() {
    a_dry_run_deletes_nothing(&Transport::pubsub().await).await;
}

#[tokio::test]
async fn qstash_a_dry_run_deletes_nothing() {
    a_dry_run_deletes_nothing(&Transport::qstash().await).await;
}
