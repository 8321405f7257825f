//! Configuration: TOML file, then environment overrides, validated at start-up.
//!
//! Layering (later wins): built-in defaults → the TOML file → `SWEEPER_*` environment variables
//! (`__` separates nesting, e.g. `SWEEPER_QUEUE__WORKERS=8`) → `DATABASE_URL` for the database URL
//! when `SWEEPER_DATABASE_URL` is not set. Unknown fields are errors. Everything is checked before
//! the server starts, and every problem is reported with its path, all at once. The sections
//! themselves are [`crate::config`]'s data; each part is validated by its own module (policies,
//! dependencies, credentials, transports) and assembled here.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::config::*;
use crate::policy::{Policy, PolicyConfig};

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
    pubsub: Option<crate::transport::pubsub::PubsubConfig>,
    #[serde(default)]
    qstash: Option<crate::transport::qstash::QstashConfig>,
    #[serde(default)]
    auth: AuthConfig,
    #[serde(default)]
    dependency: Vec<crate::dependency::DependencyConfig>,
    #[serde(default)]
    policy: Vec<PolicyConfig>,
    #[serde(default)]
    governor: crate::governor::MarksConfig,
    #[serde(default)]
    guard: crate::ledger::identity::IdentityGuardConfig,
}

fn default_listen() -> String {
    "127.0.0.1:8080".into()
}
fn default_true() -> bool {
    true
}

/// A validated configuration: a `Config` that exists is a usable one.
#[derive(Debug, Clone)]
pub struct Config {
    /// The PostgreSQL URL of the database holding both the ledger and the target tables.
    pub database_url: SecretString,
    /// The environment variable whose URL replaced the one the configuration file sets, if any.
    pub database_url_overridden_by: Option<&'static str>,
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
    pub pubsub: Option<crate::transport::pubsub::PubsubConfig>,
    /// The QStash transport and signature verification, with its secrets resolved.
    pub qstash: Option<crate::transport::qstash::Qstash>,
    /// Every way to authenticate, with secrets resolved.
    pub credentials: crate::auth::Credentials,
    /// The downstream dependencies, validated (docs/design.md §9).
    pub dependencies: Vec<crate::dependency::Dependency>,
    /// The policies, validated.
    pub policies: Vec<Policy>,
    /// `[governor]`'s marks (a policy's, overrides applied, are `policy.safety.governor`).
    pub governor: crate::governor::Marks,
    /// The restore and clone guard (`[guard]`).
    pub guard: crate::ledger::identity::IdentityGuardConfig,
}

/// Every problem found in a configuration, one line each with its path.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub struct ConfigError(pub Vec<String>);

impl Config {
    /// Seconds between two checks of held work: `consume.retry_after`, at least 5 s (every check
    /// is a claim, a catalog read and a rollback; a push command is republished each time).
    pub fn hold_recheck_seconds(&self) -> u64 {
        (self.consume.retry_after.seconds() as u64).max(5)
    }

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
        let file = || config::File::from_str(text, config::FileFormat::Toml);
        let mut builder = config::Config::builder().add_source(file());
        // Which variable of the environment replaces a database_url the file sets: said at start,
        // since the file's URL is then not the one used.
        let mut overridden_by = None;
        if with_environment {
            let in_file = config::Config::builder()
                .add_source(file())
                .build()
                .is_ok_and(|c| c.get_string("database_url").is_ok());
            overridden_by = ["SWEEPER_DATABASE_URL", "DATABASE_URL"]
                .into_iter()
                .find(|v| in_file && std::env::var_os(v).is_some());
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
        let mut config = Self::validate(raw)?;
        config.database_url_overridden_by = overridden_by;
        Ok(config)
    }

    fn validate(mut raw: RawConfig) -> Result<Config, ConfigError> {
        let mut errors = Vec::new();
        let database_url = match raw.database_url.take() {
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
        check_limits(&raw, &mut errors);

        let credentials = crate::auth::Credentials::from_config(&raw.auth, &mut errors);

        let dependencies = crate::dependency::all_from_config(raw.dependency, &mut errors);

        let mut policies = policies_from(raw.policy, &dependencies, &mut errors);
        let governor =
            crate::policy::safety::resolve_marks(&raw.governor, &mut policies, &mut errors);
        raw.guard
            .validate(&raw.ledger.housekeeping_interval, &mut errors);

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
        let qstash = raw.qstash.and_then(|q| {
            crate::transport::qstash::Qstash::from_config(q, publishes_qstash, &mut errors)
        });
        audit_retention_rules(&raw.ledger, &policies, &mut errors);
        for p in policies
            .iter()
            .filter(|p| p.partitions == crate::policy::partitions::Retirement::Drop)
        {
            if raw.ledger.audit_export_dir.is_none() {
                errors.push(format!(
                    "policy[{}]: partitions = \"drop\" needs ledger.audit_export_dir: a partition's \
                     keys are exported and verified there before it is dropped",
                    p.name
                ));
            }
        }
        if !errors.is_empty() {
            return Err(ConfigError(errors));
        }
        Ok(Config {
            database_url,
            database_url_overridden_by: None,
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
            governor,
            guard: raw.guard,
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

/// Cross-field and range checks of the settings sections, each problem pushed onto `errors`:
/// a lease longer than a command's statements and deadline, retention past every redelivery
/// horizon, the request timeout past the command deadline, intervals of at least a second.
// Over 80 lines: one bounds check per setting, collecting every error in one pass.
fn check_limits(raw: &RawConfig, errors: &mut Vec<String>) {
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
}

/// The policies, validated; names must be unique, a dependency's retry settings fill what the
/// policy leaves unset, and an action's dependency must exist and be of the action's kind.
fn policies_from(
    raw: Vec<PolicyConfig>,
    dependencies: &[crate::dependency::Dependency],
    errors: &mut Vec<String>,
) -> Vec<Policy> {
    let mut names = HashSet::new();
    let mut policies = Vec::new();
    for (i, mut p) in raw.into_iter().enumerate() {
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
    errors.extend(crate::policy::stages::check(&policies));
    policies
}

/// `ledger.audit_retention`: at least the longest `retain_for` plus 30 days (a row's audit must
/// outlive the row's own retention, with a month to notice a failed export), and an export
/// directory to write the months to.
fn audit_retention_rules(
    ledger: &crate::config::LedgerConfig,
    policies: &[Policy],
    errors: &mut Vec<String>,
) {
    let Some(retention) = ledger.audit_retention else {
        return;
    };
    let longest = policies
        .iter()
        .map(|p| p.spec.retain_for_seconds)
        .max()
        .unwrap_or(0);
    let floor = longest + 30 * 86_400;
    if retention.seconds() < floor {
        errors.push(format!(
            "ledger.audit_retention ({retention}) must be at least the longest retain_for plus 30d \
             ({}d): an item's audit must outlive the item's own retention",
            (floor + 86_399) / 86_400
        ));
    }
    if ledger.audit_export_dir.is_none() {
        errors.push(
            "ledger.audit_retention needs ledger.audit_export_dir: an expired month is exported \
             before it is dropped"
                .into(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
