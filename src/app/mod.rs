//! The application: shared state, start-up checks, and the sibling tasks (HTTP server, built-in
//! queue workers, planner) under one cancellation token.

use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::ledger;
use crate::policy::Catalog;
use crate::policy::check as policy_check;
use crate::settings::Config;
pub use crate::state::{AppState, connect, migrate};

pub mod audit_retention;
pub mod housekeeping;
pub mod job_lease;
pub mod relay;
pub mod worker;

/// A built application: its listener is bound (port 0 picks a free port) and its policies are
/// checked against the database, but nothing runs until [`Application::run_until`].
pub struct Application {
    listener: TcpListener,
    state: AppState,
    tls: Option<axum_server::tls_rustls::RustlsConfig>,
}

/// Checks every policy against the database: warnings and notes are logged, errors fail the
/// start with the same messages as `check-config`.
async fn check_policies_at_start(pool: &sqlx::PgPool, config: &Config) -> anyhow::Result<()> {
    let path = config.planning.path;
    let findings = policy_check::check_policies(pool, &config.policies, path).await?;
    let mut errors = Vec::new();
    for f in &findings {
        match f.level {
            policy_check::Level::Error => errors.push(f.to_string()),
            policy_check::Level::Warning => warn!(finding = %f, "policy check"),
            policy_check::Level::Info => info!(finding = %f, "policy check"),
        }
    }
    if !errors.is_empty() {
        anyhow::bail!(
            "policies do not match the database:\n  - {}",
            errors.join("\n  - ")
        );
    }
    Ok(())
}

/// The restore and clone guard at start and at every housekeeping round (see
/// [`ledger::identity`]): records the identity at the first serve, logs a failover, and warns
/// while every policy is held.
pub async fn check_identity(pool: &sqlx::PgPool, config: &Config) -> anyhow::Result<()> {
    use ledger::identity::Found;
    let found = ledger::identity::check(pool, &config.guard.max_silence, "sweeper:serve")
        .await
        .context("checking the database's identity (the restore and clone guard)")?;
    match found {
        Found::Recorded => info!("recorded the database's identity (restore and clone guard)"),
        Found::Same => {}
        Found::Failover {
            from,
            to,
            silence_seconds,
        } => warn!(
            from,
            to, silence_seconds, "timeline changed within guard.max_silence (a failover); not held"
        ),
        Found::Held(why) => {
            warn!(reason = %why, "every policy is held (kind identity) until POST /guard/accept");
            crate::metrics::hold_started(crate::ledger::HoldKind::Identity);
        }
        Found::StillHeld(why) => {
            warn!(reason = %why, "every policy is still held (kind identity) until POST /guard/accept");
        }
    }
    Ok(())
}

/// Once a second: the governor's reading (one query) and each policy's verdict, then the log
/// line and count of every policy-level hold that began or ended (governor, active hours).
async fn safety_loop(state: AppState, shutdown: CancellationToken) {
    let governed: Vec<crate::governor::Governed> = state
        .config
        .policies
        .iter()
        .map(|p| crate::governor::Governed {
            policy: p.name.to_string(),
            table: p.spec.target.table.quoted(),
            marks: p.safety.governor,
        })
        .collect();
    let any_governed = governed.iter().any(|g| g.marks.enabled);
    let mut seen = std::collections::HashMap::new();
    loop {
        if any_governed {
            state.governor.refresh(&state.pool, &governed).await;
        }
        crate::holds::watch(&state, &mut seen);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
        }
    }
}

impl Application {
    /// Connects, migrates (when `migrate_on_start`), checks every policy against the database
    /// (an error in any policy fails the start, with the same messages as `check-config`),
    /// registers policy versions, and binds the listener.
    pub async fn build(config: Config) -> anyhow::Result<Application> {
        // Install the process recorder now (counters incremented before it exists are lost),
        // with every counter at 0.
        crate::metrics::register(
            &config
                .dependencies
                .iter()
                .map(|d| d.name.clone())
                .collect::<Vec<_>>(),
            &config
                .policies
                .iter()
                .map(|p| p.name.as_str().to_string())
                .collect::<Vec<_>>(),
        );
        if config.migrate_on_start {
            migrate(&config).await?;
        }
        let pool = connect(&config).await?;
        ledger::audit::ensure_partitions(&pool)
            .await
            .context("creating the audit's partitions ahead of the clock")?;
        check_policies_at_start(&pool, &config).await?;
        ledger::register_policy_versions(
            &pool,
            config
                .policies
                .iter()
                .map(|p| (p.name.as_str(), p.version.as_str(), &p.spec)),
        )
        .await?;
        check_identity(&pool, &config).await?;
        let mut checked_types = std::collections::HashMap::new();
        for p in &config.policies {
            checked_types.insert(
                p.name.to_string(),
                crate::policy::checked_types(&pool, &p.spec).await?,
            );
        }
        // One crypto provider for every rustls user (aws-lc-rs, crates.md §0).
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let tls = match &config.tls {
            Some(t) => Some(
                axum_server::tls_rustls::RustlsConfig::from_pem_file(&t.cert, &t.key)
                    .await
                    .with_context(|| {
                        format!(
                            "reading the TLS certificate {} and key {}",
                            t.cert.display(),
                            t.key.display()
                        )
                    })?,
            ),
            None => None,
        };
        let dependencies = crate::dependency::Dependencies::build(&config.dependencies)
            .context("building the dependencies' clients")?;
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        Ok(Application {
            listener,
            tls,
            state: AppState {
                pool,
                config: Arc::new(config),
                catalog: Arc::new(Catalog::default()),
                checked_types: Arc::new(checked_types),
                specs: Arc::new(ledger::SpecCache::default()),
                wake_workers: Arc::new(Notify::new()),
                wake_planner: Arc::new(Notify::new()),
                wake_retirer: Arc::new(Notify::new()),
                replica_id: uuid::Uuid::new_v4(),
                dependencies: Arc::new(dependencies),
                governor: crate::governor::Governor::default(),
            },
        })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.listener.local_addr().map(|a| a.port()).unwrap_or(0)
    }

    /// The shared state (tests drive the queue through it).
    pub fn state(&self) -> AppState {
        self.state.clone()
    }

    /// Serves HTTP and runs the built-in workers and the planner until `shutdown` is cancelled
    /// (or one of them exits, which cancels the others). In-flight requests finish; workers stop
    /// after their current command.
    // Over 80 lines: the start-up and shutdown order of every background task, kept in one place so
    // the order can be read.
    pub async fn run_until(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let Application {
            listener,
            state,
            tls,
        } = self;
        let mut tasks = tokio::task::JoinSet::new();
        let router = crate::http::router(state.clone());
        let token = shutdown.clone();
        // A connection must complete its first request within header_read_timeout (axum-server's
        // first-request timeout: a client that connects and sends nothing, or only an HTTP/2
        // preface, is closed), and each later request's header block too (hyper's HTTP/1 header
        // read timeout; axum-server installs the timer it needs).
        let header_read_timeout = state.config.http.header_read_timeout.std();
        let handle = axum_server::Handle::new();
        let (h, drain) = (handle.clone(), state.config.queue.drain.std());
        tokio::spawn(async move {
            token.cancelled().await;
            h.graceful_shutdown(Some(drain));
        });
        let mut server = axum_server::from_tcp(listener.into_std()?)?
            .first_request_timeout(header_read_timeout)
            .handle(handle);
        server
            .http_builder()
            .http1()
            .header_read_timeout(header_read_timeout);
        let service = router.into_make_service();
        match (tls, state.config.tls.clone()) {
            (Some(rustls), Some(files)) => {
                let (r, t) = (rustls.clone(), shutdown.clone());
                tasks.spawn(async move {
                    crate::http::tls::reload_loop(r, files, t).await;
                    ("tls reload", Ok(()))
                });
                let acceptor = axum_server::tls_rustls::RustlsAcceptor::new(rustls)
                    .handshake_timeout(header_read_timeout);
                let server = server.acceptor(acceptor);
                tasks.spawn(async move {
                    let r = server.serve(service).await;
                    ("https server", r.map_err(anyhow::Error::from))
                });
            }
            _ => {
                tasks.spawn(async move {
                    let r = server.serve(service).await;
                    ("http server", r.map_err(anyhow::Error::from))
                });
            }
        }
        for n in 0..state.config.queue.workers {
            let (s, t) = (state.clone(), shutdown.clone());
            tasks.spawn(async move {
                worker::worker_loop(s, n, t).await;
                ("built-in worker", Ok(()))
            });
        }
        let mut publishers = Vec::new();
        if let Some(p) = &state.config.pubsub {
            publishers.push(crate::transport::Publisher::Pubsub(
                crate::transport::pubsub::Publisher::new(p)?,
            ));
        }
        // The QStash relay runs only where a policy publishes through it; a [qstash] section
        // may exist just to verify signed schedule calls to /trigger.
        if let Some(q) = &state.config.qstash
            && state
                .config
                .policies
                .iter()
                .any(|p| p.transport == crate::policy::Transport::Qstash)
        {
            publishers.push(crate::transport::Publisher::Qstash(
                crate::transport::qstash::Publisher::new(q)?,
            ));
        }
        for publisher in publishers {
            let (s, t) = (state.clone(), shutdown.clone());
            tasks.spawn(async move {
                crate::app::relay::relay_loop(s, publisher, t).await;
                ("push relay", Ok(()))
            });
        }
        let (s, t) = (state.clone(), shutdown.clone());
        tasks.spawn(async move {
            crate::plan::planner_loop(s, t).await;
            ("planner", Ok(()))
        });
        let (s, t) = (state.clone(), shutdown.clone());
        tasks.spawn(async move {
            crate::retire::retirer_loop(s, t).await;
            ("partition retirer", Ok(()))
        });
        let (s, t) = (state.clone(), shutdown.clone());
        tasks.spawn(async move {
            housekeeping::housekeeping_loop(s, t).await;
            ("housekeeping", Ok(()))
        });
        let (s, t) = (state.clone(), shutdown.clone());
        tasks.spawn(async move {
            safety_loop(s, t).await;
            ("governor", Ok(()))
        });
        let mut first_error = None;
        let drain = state.config.queue.drain.std();
        loop {
            // Before shutdown: wait for any task. After: wait at most `queue.drain` for the rest.
            let joined = if shutdown.is_cancelled() {
                match tokio::time::timeout(drain, tasks.join_next()).await {
                    Ok(j) => j,
                    Err(_) => {
                        warn!(drain = %state.config.queue.drain, "drain timed out; aborting in-flight work");
                        tasks.abort_all();
                        while tasks.join_next().await.is_some() {}
                        None
                    }
                }
            } else {
                tasks.join_next().await
            };
            let Some(joined) = joined else { break };
            if !shutdown.is_cancelled() {
                match &joined {
                    Ok((name, r)) => {
                        warn!(task = name, ok = r.is_ok(), "task exited; shutting down")
                    }
                    Err(e) => error!(error = %e, "task panicked; shutting down"),
                }
                shutdown.cancel();
            }
            if let Ok((name, Err(e))) = joined {
                error!(task = name, error = %e, "task failed");
                first_error.get_or_insert(e);
            }
        }
        release_leases(&state).await;
        // A connection still checked out (by a task outside the JoinSet) would make close()
        // wait for ever; the process is exiting, and PostgreSQL ends abandoned sessions.
        if tokio::time::timeout(POOL_CLOSE_WAIT, state.pool.close())
            .await
            .is_err()
        {
            warn!("database connections still in use; exiting without them");
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Longest the lease release at shutdown may take, after the drain; a lease it cannot release in
/// time (another session holds the row, or the whole table) simply expires.
pub const LEASE_RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// Longest the pool may take to close at exit.
const POOL_CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Gives back this replica's job leases and the leases of its unfinished commands, so another
/// replica takes over at once; bounded by [`LEASE_RELEASE_WAIT`] whatever other sessions hold.
async fn release_leases(state: &AppState) {
    let release = async {
        if let Err(e) = ledger::release_job_leases(&state.pool, state.replica_id).await {
            warn!(error = %e, "could not release job leases; they expire on their own");
        }
        match worker::release_own_leases(state).await {
            Ok(0) => {}
            Ok(n) => info!(
                released = n,
                "released leases of unfinished commands for other replicas"
            ),
            Err(f) => {
                warn!(error = %f.message(), "could not release leases; they expire on their own")
            }
        }
    };
    if tokio::time::timeout(LEASE_RELEASE_WAIT, release)
        .await
        .is_err()
    {
        warn!(
            "releasing leases took too long (another session holds them); they expire on their own"
        );
    }
}

/// Waits for Ctrl-C or SIGTERM, then cancels `token` (`serve` and `quickstart`).
pub async fn shutdown_on_signal(token: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    info!("shutdown requested");
    token.cancel();
}
