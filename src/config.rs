//! Configuration: TOML file, then environment overrides, validated at start-up.
//!
//! Layering (later wins): built-in defaults → the TOML file → `SWEEPER_*` environment variables
//! (`__` separates nesting, e.g. `SWEEPER_QUEUE__WORKERS=8`) → `DATABASE_URL` for the database URL
//! when `SWEEPER_DATABASE_URL` is not set. Unknown fields are errors. Everything is checked before
//! the server starts, and every problem is reported with its path, all at once.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::policy::{Policy, PolicyConfig};

/// A duration written as a whole number and one unit: `s`, `m`, `h`, `d` (24 h) or `w` (7 d).
///
/// Durations are exact spans of UTC time (DESIGN §2.2): `1d` is always 86 400 seconds, whatever
/// the clocks of any time zone do that day. Other units (`ms`, `y`, `mo`) are rejected on purpose:
/// they are either too fine for a schedule or not a fixed length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DurationSpec {
    seconds: i64,
}

impl DurationSpec {
    /// The span in whole seconds.
    pub fn seconds(self) -> i64 {
        self.seconds
    }
    /// The span as a `chrono::TimeDelta`.
    pub fn delta(self) -> chrono::TimeDelta {
        chrono::TimeDelta::seconds(self.seconds)
    }
    /// The span as a `std::time::Duration`.
    pub fn std(self) -> std::time::Duration {
        std::time::Duration::from_secs(self.seconds as u64)
    }
    /// A span of `seconds` seconds (used for defaults).
    pub const fn from_seconds(seconds: i64) -> Self {
        Self { seconds }
    }
}

impl std::str::FromStr for DurationSpec {
    type Err = String;

    /// Parses `90d`, `5m`, `1h`, `30s`, `2w`. Errors name the input and the accepted units.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            format!(
                "bad duration `{s}`: write a whole number and one unit of s, m, h, d or w (e.g. `90d`, `5m`)"
            )
        };
        let s_trim = s.trim();
        let unit_at = s_trim.len().checked_sub(1).ok_or_else(bad)?;
        if !s_trim.is_char_boundary(unit_at) {
            return Err(bad());
        }
        let (digits, unit) = s_trim.split_at(unit_at);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let n: i64 = digits.parse().map_err(|_| bad())?;
        let per = match unit {
            "s" => 1,
            "m" => 60,
            "h" => 3_600,
            "d" => 86_400,
            "w" => 604_800,
            _ => return Err(bad()),
        };
        let seconds = n
            .checked_mul(per)
            .filter(|v| *v <= 100 * 366 * 86_400)
            .ok_or_else(|| format!("duration `{s}` is longer than 100 years"))?;
        Ok(Self { seconds })
    }
}

impl fmt::Display for DurationSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.seconds;
        for (unit, per) in [("w", 604_800), ("d", 86_400), ("h", 3_600), ("m", 60)] {
            if s != 0 && s % per == 0 {
                return write!(f, "{}{unit}", s / per);
            }
        }
        write!(f, "{s}s")
    }
}

impl<'de> Deserialize<'de> for DurationSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for DurationSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The `SWEEPER_*` variables that override settings: those naming a top-level setting or a field
/// of a section (`SWEEPER_QUEUE__WORKERS`). Others are ignored, so `SWEEPER_CONFIG` (the file's
/// path) and the `SWEEPER_SERVICE_HOST`-style variables Kubernetes injects for a Service named
/// `sweeper` do not count as unknown settings.
fn environment_overrides() -> config::Map<String, String> {
    const TOP: &[&str] = &["DATABASE_URL", "LISTEN", "MIGRATE_ON_START"];
    const SECTIONS: &[&str] = &["DATABASE__", "QUEUE__", "PLANNING__", "CONSUME__"];
    std::env::vars()
        .filter(|(k, _)| {
            k.strip_prefix("SWEEPER_").is_some_and(|rest| {
                TOP.contains(&rest) || SECTIONS.iter().any(|s| rest.starts_with(s))
            })
        })
        .collect()
}

/// The file as written: every field the TOML may hold. Converted to [`Config`] by [`Config::load`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    database_url: Option<SecretString>,
    #[serde(default = "default_listen")]
    listen: String,
    #[serde(default = "default_true")]
    migrate_on_start: bool,
    #[serde(default)]
    database: DatabaseConfig,
    #[serde(default)]
    queue: QueueConfig,
    #[serde(default)]
    planning: PlanningConfig,
    #[serde(default)]
    consume: ConsumeConfig,
    #[serde(default)]
    ledger: LedgerConfig,
    #[serde(default)]
    http: HttpConfig,
    #[serde(default)]
    tls: Option<TlsConfig>,
    #[serde(default)]
    pubsub: Option<crate::pubsub::PubsubConfig>,
    #[serde(default)]
    qstash: Option<crate::qstash::QstashConfig>,
    #[serde(default)]
    auth: AuthConfig,
    #[serde(default)]
    dependency: Vec<crate::dependency::DependencyConfig>,
    #[serde(default)]
    policy: Vec<PolicyConfig>,
}

fn default_leeway() -> DurationSpec {
    DurationSpec::from_seconds(crate::auth::token::DEFAULT_LEEWAY_SECONDS as i64)
}

fn default_listen() -> String {
    "127.0.0.1:8080".into()
}
fn default_true() -> bool {
    true
}

/// Connection pool settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Most connections the pool opens. Keep it above `queue.workers` + 2 so the trigger and the
    /// ops endpoints always get one.
    pub max_connections: u32,
    /// How long a request waits for a pooled connection before it is answered 503.
    pub acquire_timeout: DurationSpec,
    /// `lock_timeout` of every session sweeper opens: no statement (planning, relay,
    /// housekeeping, the ops endpoints, the lease release at shutdown) waits longer than this for
    /// a lock another session holds. A command's own transaction uses `consume.lock_timeout`.
    pub lock_timeout: DurationSpec,
    /// `statement_timeout` of every session sweeper opens (a command's transaction uses
    /// `consume.statement_timeout`). Migrations run on a connection of their own without either
    /// bound.
    pub statement_timeout: DurationSpec,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            max_connections: 10,
            acquire_timeout: DurationSpec::from_seconds(5),
            lock_timeout: DurationSpec::from_seconds(5),
            statement_timeout: DurationSpec::from_seconds(30),
        }
    }
}

/// The built-in PostgreSQL queue (DESIGN §8).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// Worker tasks per replica; 0 disables the built-in queue on this replica.
    pub workers: usize,
    /// How long a claimed command stays leased to its worker before another may reclaim it.
    /// Must exceed `consume.statement_timeout` (the longest a command's statements may run).
    pub lease: DurationSpec,
    /// How often idle workers look for due commands when nothing nudges them.
    pub poll_interval: DurationSpec,
    /// On SIGTERM, how long in-flight commands may take to finish; what is still leased then is
    /// released for another replica.
    pub drain: DurationSpec,
    /// Commands a worker claims per claim transaction (1-100). More amortize the claim's commit;
    /// fewer spread a backlog more evenly across replicas. Each is leased for `lease`, so keep
    /// `claim_batch × consume.command_deadline` under `lease`.
    pub claim_batch: u32,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            workers: 2,
            lease: DurationSpec::from_seconds(300),
            poll_interval: DurationSpec::from_seconds(1),
            drain: DurationSpec::from_seconds(30),
            claim_batch: 4,
        }
    }
}

/// Planning: the keyset scan that turns a run into commands (DESIGN §8).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlanningConfig {
    /// Rows of the target table one planning page reads, in key order. Bounds every planning
    /// statement whatever the backlog.
    pub page_rows: i64,
    /// Lease on a planning job; another replica resumes a job whose lease expired.
    pub lease: DurationSpec,
    /// The closure check counts rows still eligible after a run completes, up to this many.
    pub closure_check_cap: i64,
}

impl Default for PlanningConfig {
    fn default() -> Self {
        Self {
            page_rows: 10_000,
            lease: DurationSpec::from_seconds(60),
            closure_check_cap: 100_000,
        }
    }
}

/// Limits applied to each command's transaction.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsumeConfig {
    /// `lock_timeout` for a command's transaction: a row locked longer than this by someone else
    /// makes the attempt fail as transient (retried later), never hang.
    pub lock_timeout: DurationSpec,
    /// `statement_timeout` for a command's statements; exceeding it is transient.
    pub statement_timeout: DurationSpec,
    /// The `Retry-After` (seconds) sent with 503 answers when nothing better is known.
    pub retry_after: DurationSpec,
    /// The longest one try of a command may take, start to answer; a try that exceeds it is
    /// rolled back and counts as transient. At least `statement_timeout`, shorter than
    /// `queue.lease`, and it must stay below the push queue's attempt deadline (Pub/Sub's ack
    /// deadline, Cloud Tasks' dispatch deadline) when one delivers to `/consume`.
    pub command_deadline: DurationSpec,
    /// Most `/consume` requests handled at once by this process (default 64). More are shed
    /// at once with 503 + `Retry-After` (the queue redelivers them) instead of queueing without
    /// bound; keep it near `database.max_connections`, which bounds useful parallelism anyway.
    pub max_in_flight: u32,
}

impl Default for ConsumeConfig {
    fn default() -> Self {
        Self {
            lock_timeout: DurationSpec::from_seconds(5),
            statement_timeout: DurationSpec::from_seconds(30),
            retry_after: DurationSpec::from_seconds(5),
            command_deadline: DurationSpec::from_seconds(60),
            max_in_flight: 64,
        }
    }
}

/// `[http]`: connection and request time limits of the server.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// A client must send a request's complete header block within this (default `10s`), or the
    /// connection is closed (hyper's HTTP/1 `header_read_timeout`); a slow-header client cannot
    /// hold a connection open.
    pub header_read_timeout: DurationSpec,
    /// Every request, body included, is answered within this (default `90s`): past it the
    /// request is dropped (its transaction rolls back) and answered 503 `timeout` with
    /// `Retry-After`. A backstop above `consume.command_deadline`, which it must exceed.
    pub request_timeout: DurationSpec,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: DurationSpec::from_seconds(10),
            request_timeout: DurationSpec::from_seconds(90),
        }
    }
}

/// `[tls]`: serve HTTPS (HTTP/1.1 and HTTP/2 by ALPN) with a PEM certificate chain and key.
///
/// The files are read again on SIGHUP and when their modification time changes (checked every
/// `reload_check`); new handshakes use the new certificate, open connections keep theirs. A
/// reload that fails (a half-written file) keeps the old certificate and logs why.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain, leaf first.
    pub cert: std::path::PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: std::path::PathBuf,
    /// How often the files' modification times are checked (default `10s`).
    #[serde(default = "default_reload_check")]
    pub reload_check: DurationSpec,
}

fn default_reload_check() -> DurationSpec {
    DurationSpec::from_seconds(10)
}

/// Ledger hygiene (DESIGN §7).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LedgerConfig {
    /// Terminal commands without an open dead letter, and their attempts, are purged this long
    /// after they finished. Must exceed every redelivery horizon in use: a delivery of a purged
    /// command is acknowledged as a no-op only because its run is terminal. At least 8d (Pub/Sub
    /// retains an unacknowledged message for up to 7 days).
    pub command_retention: DurationSpec,
    /// Rows deleted per purge statement.
    pub purge_batch: i64,
    /// How often housekeeping runs.
    pub housekeeping_interval: DurationSpec,
    /// Work held longer than this (a command or planning job whose target's schema does not
    /// match, or whose policy changed its target) is *overdue*: `held.overdue` on the run and
    /// `sweeper_held_overdue`, so an alert fires though held work spends no budget.
    pub hold_alert_after: DurationSpec,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            command_retention: DurationSpec::from_seconds(30 * 86_400),
            purge_batch: 1_000,
            housekeeping_interval: DurationSpec::from_seconds(60),
            hold_alert_after: DurationSpec::from_seconds(15 * 60),
        }
    }
}

/// Token issuers (DESIGN §10).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Clock skew the time rule allows every credential (HS256 and JWKS tokens, QStash
    /// signatures): `exp` this much in the past, `nbf`/`iat` this much in the future. 0-5m;
    /// default 30s. See [`crate::token`].
    #[serde(default = "default_leeway")]
    pub leeway: DurationSpec,
    /// HS256 issuers; each has one or more keys told apart by `kid`.
    #[serde(default)]
    pub issuer: Vec<IssuerConfig>,
    /// RS256/ES256 issuers verified against a JWKS (Google OIDC and others).
    #[serde(default)]
    pub jwks_issuer: Vec<crate::auth::jwks::JwksIssuerConfig>,
    /// Secrets accepted as `/consume?token=...` (scope `consume` only) for push systems that
    /// cannot send an Authorization header. Weaker than OIDC: URLs are often logged.
    #[serde(default)]
    pub query_token: Vec<crate::auth::query_token::QueryTokenConfig>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            leeway: default_leeway(),
            issuer: Vec::new(),
            jwks_issuer: Vec::new(),
            query_token: Vec::new(),
        }
    }
}

/// One HS256 issuer: tokens whose `iss` is `iss` and whose `aud` contains `audience`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IssuerConfig {
    /// The expected `iss` claim.
    pub iss: String,
    /// The expected `aud` claim (exact match).
    pub audience: String,
    /// Keys, newest first; `sweeper token` signs with the first. Keep the old key listed until
    /// every token signed with it has expired, then remove it (rotation).
    pub keys: Vec<KeyConfig>,
}

/// One HS256 secret, named by `kid`. Exactly one of `secret` and `secret_env` is given.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// The key id sent in the JWT header.
    pub kid: String,
    /// The secret itself (prefer `secret_env`: files get copied around).
    pub secret: Option<SecretString>,
    /// The name of an environment variable holding the secret.
    pub secret_env: Option<String>,
}

impl fmt::Debug for KeyConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyConfig")
            .field("kid", &self.kid)
            .field("secret", &self.secret.as_ref().map(|_| "[redacted]"))
            .field("secret_env", &self.secret_env)
            .finish()
    }
}

/// A validated configuration: a `Config` that exists is a usable one.
#[derive(Debug, Clone)]
pub struct Config {
    /// The PostgreSQL URL of the database holding both the ledger and the target tables.
    pub database_url: SecretString,
    /// Address the HTTP server binds (`127.0.0.1:0` picks a free port).
    pub listen: SocketAddr,
    /// Apply pending migrations when `serve` starts.
    pub migrate_on_start: bool,
    /// Pool settings.
    pub database: DatabaseConfig,
    /// Built-in queue settings.
    pub queue: QueueConfig,
    /// Planning settings.
    pub planning: PlanningConfig,
    /// Per-command transaction limits.
    pub consume: ConsumeConfig,
    /// Ledger hygiene.
    pub ledger: LedgerConfig,
    /// Server time limits.
    pub http: HttpConfig,
    /// HTTPS; `None` serves plain HTTP (behind a TLS-terminating platform).
    pub tls: Option<TlsConfig>,
    /// The Pub/Sub transport, for policies with `transport = "pubsub"`.
    pub pubsub: Option<crate::pubsub::PubsubConfig>,
    /// The QStash transport and signature verification, with its secrets resolved.
    pub qstash: Option<crate::qstash::Qstash>,
    /// Every way to authenticate, with secrets resolved.
    pub credentials: crate::auth::Credentials,
    /// The downstream dependencies, validated (DESIGN §9).
    pub dependencies: Vec<crate::dependency::Dependency>,
    /// The policies, validated.
    pub policies: Vec<Policy>,
}

/// Every problem found in a configuration, one line each with its path.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub struct ConfigError(pub Vec<String>);

impl Config {
    /// Loads `path` (TOML), applies environment overrides and validates the result.
    ///
    /// Errors list every problem with its path, e.g.
    /// `policy[ticket-retention].retain_for: bad duration ...`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(vec![format!("{}: {e}", path.display())]))?;
        Self::build(&text, true)
    }

    /// Parses and validates TOML text alone, ignoring the environment (the quick start and the
    /// tests build their configuration this way, so a `DATABASE_URL` in the environment cannot
    /// point them at another database).
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        Self::build(text, false)
    }

    fn build(text: &str, with_environment: bool) -> Result<Config, ConfigError> {
        let mut builder = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml));
        if with_environment {
            builder = builder.add_source(
                config::Environment::with_prefix("SWEEPER")
                    .prefix_separator("_")
                    .separator("__")
                    .source(Some(environment_overrides())),
            );
            if std::env::var_os("SWEEPER_DATABASE_URL").is_none()
                && let Ok(url) = std::env::var("DATABASE_URL")
            {
                builder = builder
                    .set_override("database_url", url)
                    .map_err(|e| ConfigError(vec![e.to_string()]))?;
            }
        }
        let raw: RawConfig = builder
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(|e| ConfigError(vec![e.to_string()]))?;
        Self::validate(raw)
    }

    fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
        let mut errors = Vec::new();
        let database_url = match raw.database_url {
            Some(url) if !url.expose_secret().trim().is_empty() => url,
            _ => {
                errors.push(
                    "database_url: missing (set it in the file, SWEEPER_DATABASE_URL or DATABASE_URL)"
                        .into(),
                );
                SecretString::from("")
            }
        };
        let listen = raw.listen.parse().unwrap_or_else(|_| {
            errors.push(format!(
                "listen: `{}` is not an address like 127.0.0.1:8080",
                raw.listen
            ));
            SocketAddr::from(([127, 0, 0, 1], 8080))
        });
        if raw.database.max_connections < 2 {
            errors.push("database.max_connections: must be at least 2".into());
        }
        if raw.queue.lease <= raw.consume.statement_timeout {
            errors.push(format!(
                "queue.lease ({}) must be longer than consume.statement_timeout ({}): a lease that \
                 expires mid-command lets a second worker run it",
                raw.queue.lease, raw.consume.statement_timeout
            ));
        }
        if !(1..=100).contains(&raw.queue.claim_batch)
            || raw.consume.command_deadline.seconds() * raw.queue.claim_batch as i64
                >= raw.queue.lease.seconds()
        {
            errors.push(format!(
                "queue.claim_batch ({}) must be 1-100, and claim_batch × consume.command_deadline ({}) \
                 shorter than queue.lease ({}): a claimed command must not outlive its lease",
                raw.queue.claim_batch, raw.consume.command_deadline, raw.queue.lease
            ));
        }
        if raw.consume.command_deadline < raw.consume.statement_timeout
            || raw.consume.command_deadline >= raw.queue.lease
        {
            errors.push(format!(
                "consume.command_deadline ({}) must be at least consume.statement_timeout ({}) and \
                 shorter than queue.lease ({})",
                raw.consume.command_deadline, raw.consume.statement_timeout, raw.queue.lease
            ));
        }
        if raw.ledger.command_retention.seconds() < 8 * 86_400
            || raw.ledger.command_retention <= raw.queue.lease
        {
            errors.push(format!(
                "ledger.command_retention ({}) must be at least 8d and longer than queue.lease: \
                 a command may be redelivered until every transport's horizon has passed",
                raw.ledger.command_retention
            ));
        }
        if !(1..=10_000).contains(&raw.consume.max_in_flight) {
            errors.push("consume.max_in_flight: must be between 1 and 10000".into());
        }
        if !(1..=100_000).contains(&raw.ledger.purge_batch) {
            errors.push("ledger.purge_batch: must be between 1 and 100000".into());
        }
        if raw.planning.page_rows < 1 || raw.planning.page_rows > 1_000_000 {
            errors.push("planning.page_rows: must be between 1 and 1000000".into());
        }
        if raw.planning.closure_check_cap < 1 {
            errors.push("planning.closure_check_cap: must be at least 1".into());
        }
        for (name, d) in [
            ("consume.lock_timeout", raw.consume.lock_timeout),
            ("consume.statement_timeout", raw.consume.statement_timeout),
            ("consume.retry_after", raw.consume.retry_after),
            ("queue.poll_interval", raw.queue.poll_interval),
            ("planning.lease", raw.planning.lease),
            ("database.acquire_timeout", raw.database.acquire_timeout),
            ("database.lock_timeout", raw.database.lock_timeout),
            ("database.statement_timeout", raw.database.statement_timeout),
            ("queue.drain", raw.queue.drain),
            (
                "ledger.housekeeping_interval",
                raw.ledger.housekeeping_interval,
            ),
            ("ledger.hold_alert_after", raw.ledger.hold_alert_after),
        ] {
            if d.seconds() < 1 {
                errors.push(format!("{name}: must be at least 1s"));
            }
        }

        let credentials = crate::auth::Credentials::from_config(&raw.auth, &mut errors);

        let mut dependencies: Vec<crate::dependency::Dependency> = Vec::new();
        for (i, d) in raw.dependency.into_iter().enumerate() {
            let label = if d.name.is_empty() {
                format!("dependency[{i}]")
            } else {
                format!("dependency[{}]", d.name)
            };
            if dependencies.iter().any(|x| x.name == d.name) {
                errors.push(format!(
                    "{label}: a dependency of this name is defined twice"
                ));
                continue;
            }
            match crate::dependency::Dependency::from_config(d) {
                Ok(dep) => dependencies.push(dep),
                Err(es) => errors.extend(es.into_iter().map(|e| format!("{label}.{e}"))),
            }
        }

        let mut names = HashSet::new();
        let mut policies = Vec::new();
        for (i, mut p) in raw.policy.into_iter().enumerate() {
            let label = if p.name.is_empty() {
                format!("policy[{i}]")
            } else {
                format!("policy[{}]", p.name)
            };
            if !names.insert(p.name.clone()) {
                errors.push(format!("{label}: a policy of this name is defined twice"));
                continue;
            }
            // The dependency's retry settings fill what the policy leaves unset.
            let dep = p
                .action
                .as_ref()
                .and_then(|a| a.dependency.as_deref())
                .and_then(|d| dependencies.iter().find(|x| x.name == d));
            if let Some(dr) = dep.and_then(|d| d.retry.clone()) {
                let pr = p.retry.take();
                let pick = |a: Option<DurationSpec>, b: Option<DurationSpec>| a.or(b);
                p.retry = Some(crate::policy::RetryConfig {
                    max_attempts: pr.as_ref().and_then(|r| r.max_attempts).or(dr.max_attempts),
                    base: pick(pr.as_ref().and_then(|r| r.base), dr.base),
                    cap: pick(pr.as_ref().and_then(|r| r.cap), dr.cap),
                    max_age: pick(pr.as_ref().and_then(|r| r.max_age), dr.max_age),
                });
            }
            match Policy::from_config(p) {
                Ok(policy) => {
                    if let Some(d) = policy.spec.action.dependency() {
                        let object = matches!(
                            policy.spec.action,
                            crate::policy::ActionSpec::ObjectStore(_)
                        );
                        match dependencies.iter().find(|x| x.name == d) {
                            None => errors.push(format!(
                                "{label}.action.dependency: no [[dependency]] is named `{d}`"
                            )),
                            Some(x) if x.kind.is_object_store() != object => errors.push(format!(
                                "{label}.action.dependency: `{d}` is {} dependency, the action needs {}",
                                if x.kind.is_object_store() { "an object-store" } else { "an http" },
                                if object { "an object store" } else { "an http one" }
                            )),
                            Some(_) => {}
                        }
                    }
                    policies.push(policy)
                }
                Err(es) => errors.extend(es.into_iter().map(|e| format!("{label}.{e}"))),
            }
        }

        if raw.http.header_read_timeout.seconds() < 1
            || raw.http.request_timeout <= raw.consume.command_deadline
        {
            errors.push(format!(
                "http: header_read_timeout must be at least 1s and request_timeout ({}) longer \
                 than consume.command_deadline ({})",
                raw.http.request_timeout, raw.consume.command_deadline
            ));
        }
        if raw
            .tls
            .as_ref()
            .is_some_and(|t| t.reload_check.seconds() < 1)
        {
            errors.push("tls.reload_check: must be at least 1s".into());
        }
        if raw
            .pubsub
            .as_ref()
            .is_some_and(|p| p.relay_interval.seconds() < 1 || p.republish_after.seconds() < 60)
        {
            errors.push(
                "pubsub: relay_interval must be at least 1s and republish_after at least 1m".into(),
            );
        }
        if raw.pubsub.is_none()
            && let Some(p) = policies
                .iter()
                .find(|p| p.transport == crate::policy::Transport::Pubsub)
        {
            errors.push(format!(
                "policy[{}].transport: pubsub needs a [pubsub] section (project, topic)",
                p.name
            ));
        }
        let publishes_qstash = policies
            .iter()
            .any(|p| p.transport == crate::policy::Transport::Qstash);
        if raw.qstash.is_none() && publishes_qstash {
            errors.push(
                "policy transport qstash needs a [qstash] section (public_url, signing keys)"
                    .into(),
            );
        }
        let qstash = raw
            .qstash
            .and_then(|q| crate::qstash::Qstash::from_config(q, publishes_qstash, &mut errors));
        if !errors.is_empty() {
            return Err(ConfigError(errors));
        }
        Ok(Config {
            database_url,
            listen,
            migrate_on_start: raw.migrate_on_start,
            database: raw.database,
            queue: raw.queue,
            planning: raw.planning,
            consume: raw.consume,
            ledger: raw.ledger,
            http: raw.http,
            tls: raw.tls,
            pubsub: raw.pubsub,
            qstash,
            credentials,
            dependencies,
            policies,
        })
    }

    /// The policy named `name`, if configured.
    pub fn policy(&self, name: &str) -> Option<&Policy> {
        self.policies.iter().find(|p| p.name.as_str() == name)
    }

    /// The policy a command id (`{policy}:{window}:{batch_no}`) belongs to, if configured.
    pub fn policy_by_command(&self, command_id: &str) -> Option<&Policy> {
        self.policy(command_id.split(':').next()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_accept_only_the_five_units() {
        assert_eq!(
            "90d".parse::<DurationSpec>().unwrap().seconds(),
            90 * 86_400
        );
        assert_eq!("5m".parse::<DurationSpec>().unwrap().seconds(), 300);
        assert_eq!("2w".parse::<DurationSpec>().unwrap().seconds(), 1_209_600);
        assert_eq!("1h".parse::<DurationSpec>().unwrap().seconds(), 3_600);
        assert_eq!("30s".parse::<DurationSpec>().unwrap().seconds(), 30);
        for bad in [
            "",
            "d",
            "5",
            "5ms",
            "1y",
            "1mo",
            "-5m",
            "1.5h",
            "5 m",
            "99999999999999999999w",
        ] {
            assert!(
                bad.parse::<DurationSpec>().is_err(),
                "{bad} must be rejected"
            );
        }
        assert_eq!("90d".parse::<DurationSpec>().unwrap().to_string(), "90d");
        assert_eq!("1440m".parse::<DurationSpec>().unwrap().to_string(), "1d");
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_name() {
        let err = Config::from_toml("database_url = 'postgres://x/y'\nlisen = '1.2.3.4:1'\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("lisen"), "{err}");
    }

    #[test]
    fn lease_must_exceed_statement_timeout() {
        let err = Config::from_toml(
            "database_url = 'postgres://x/y'\n[queue]\nlease = '10s'\n[consume]\nstatement_timeout = '30s'\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("queue.lease"), "{err}");
    }
}
