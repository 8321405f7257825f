//! The dependencies at run time: each one's client, concurrency cap and rate limit (per
//! replica in memory, or global through the ledger), and the view of the shared pauses every
//! call is admitted against.

use super::*;

/// A dependency's per-replica runtime: its client or object store, its limits.
pub struct Runtime {
    /// The validated configuration.
    pub spec: Dependency,
    /// The HTTP client (kind `http`).
    pub http: Option<reqwest::Client>,
    /// The object store, built on first use (a local root must exist by then).
    pub store: tokio::sync::OnceCell<Arc<dyn object_store::ObjectStore>>,
    /// When a probe last confirmed the bucket exists.
    pub bucket_confirmed: std::sync::Mutex<Option<Instant>>,
    calls: Arc<Semaphore>,
    limiter: Option<DefaultDirectRateLimiter>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("name", &self.spec.name)
            .finish()
    }
}

/// The configured dependencies with their runtimes, and the shared pause view.
#[derive(Debug, Default)]
pub struct Dependencies {
    by_name: HashMap<String, Arc<Runtime>>,
    pauses: Mutex<PauseView>,
}

#[derive(Debug, Default)]
struct PauseView {
    fetched: Option<Instant>,
    /// Dependency → when its pause ends, on this process's monotonic clock.
    until: HashMap<String, Instant>,
}

/// How long a pause view may be reused (docs/design.md §9: at most one second old).
const PAUSE_VIEW_MAX_AGE: Duration = Duration::from_millis(900);

/// A call slot: hold it for the duration of the call.
#[derive(Debug)]
pub struct Admitted {
    _permit: OwnedSemaphorePermit,
}

impl Dependencies {
    /// Builds every dependency's runtime.
    pub fn build(deps: &[Dependency]) -> anyhow::Result<Dependencies> {
        let mut by_name = HashMap::new();
        for d in deps {
            let http = match d.kind {
                DependencyKind::Http { .. } => Some(http_client(d)?),
                _ => None,
            };
            let limiter = d
                .rate_limit
                .filter(|r| r.scope == RateScope::Replica)
                .map(|r| RateLimiter::direct(Quota::per_second(r.per_second).allow_burst(r.burst)));
            by_name.insert(
                d.name.clone(),
                Arc::new(Runtime {
                    spec: d.clone(),
                    http,
                    store: tokio::sync::OnceCell::new(),
                    bucket_confirmed: std::sync::Mutex::new(None),
                    calls: Arc::new(Semaphore::new(d.max_concurrent_calls as usize)),
                    limiter,
                }),
            );
        }
        Ok(Dependencies {
            by_name,
            pauses: Mutex::new(PauseView::default()),
        })
    }

    /// The runtime of dependency `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Runtime>> {
        self.by_name.get(name).cloned()
    }

    /// How long dependency `name` stays paused, from a view at most a second old (one query per
    /// second per replica at most). `Err` when the ledger cannot be read.
    pub async fn paused_for(&self, pool: &PgPool, name: &str) -> Result<Option<Duration>, Setback> {
        let mut view = self.pauses.lock().await;
        if view
            .fetched
            .is_none_or(|f| f.elapsed() >= PAUSE_VIEW_MAX_AGE)
        {
            let fetched = Instant::now();
            let rows: Vec<(String, f64)> = sqlx::query_as(
                "select dependency,
                        extract(epoch from paused_until - sweeper.now())::float8
                   from sweeper.dependency_pauses where paused_until > sweeper.now()",
            )
            .fetch_all(pool)
            .await
            .map_err(|e| Setback::from_db(&e))?;
            view.until = rows
                .into_iter()
                .map(|(d, s)| (d, fetched + Duration::from_secs_f64(s.max(0.0))))
                .collect();
            view.fetched = Some(fetched);
        }
        Ok(view
            .until
            .get(name)
            .and_then(|u| u.checked_duration_since(Instant::now()))
            .filter(|d| !d.is_zero()))
    }

    /// Stores a pause of `for_` for dependency `name` in the ledger (the later of this and any
    /// stored pause wins) and in this replica's view at once.
    pub async fn pause(
        &self,
        pool: &PgPool,
        name: &str,
        for_: Duration,
        reason: &str,
    ) -> Result<(), Setback> {
        crate::ledger::pauses::pause(pool, name, for_.as_secs_f64(), reason)
            .await
            .map_err(|e| Setback::from_db(&e))?;
        let until = Instant::now() + for_;
        let mut view = self.pauses.lock().await;
        let e = view.until.entry(name.to_string()).or_insert(until);
        *e = (*e).max(until);
        crate::metrics::dependency_paused(name);
        Ok(())
    }

    /// Admits one call to `rt`: a concurrency permit, a rate-limit slot (this replica's, or a
    /// reservation shared by every replica), then the pause check,
    /// in that order, so the pause is checked last before the call starts. A pause shorter than
    /// `pause_wait` is waited out (outside any transaction); a longer one is a throttled failure
    /// (the command snoozes until it ends).
    pub async fn admit(&self, pool: &PgPool, rt: &Runtime) -> Result<Admitted, Setback> {
        let permit = rt
            .calls
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Failure::transient("the dependency's call slots are closed"))?;
        if let Some(l) = &rt.limiter {
            l.until_ready().await;
        }
        if let Some(r) = rt.spec.rate_limit.filter(|r| r.scope == RateScope::Global) {
            // The instant every replica together left for this call; waited for here, outside
            // any transaction (the command's deadline bounds the wait).
            let wait = crate::ledger::pauses::reserve_call(
                pool,
                &rt.spec.name,
                r.per_second.get(),
                r.burst.get(),
            )
            .await
            .map_err(|e| Setback::from_db(&e))?;
            if wait > 0.0 {
                tokio::time::sleep(Duration::from_secs_f64(wait)).await;
            }
        }
        let mut waited = false;
        loop {
            match self.paused_for(pool, &rt.spec.name).await? {
                None => return Ok(Admitted { _permit: permit }),
                Some(left) if !waited && left <= rt.spec.pause_wait => {
                    waited = true;
                    tokio::time::sleep(left).await;
                }
                Some(left) => {
                    return Err(Failure::throttled(
                        chrono::Utc::now()
                            + chrono::TimeDelta::milliseconds(left.as_millis() as i64),
                        format!(
                            "dependency {} is paused for {:.1}s more",
                            rt.spec.name,
                            left.as_secs_f64()
                        ),
                    )
                    .into());
                }
            }
        }
    }
}
