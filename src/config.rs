//! The configuration as written: durations and the settings sections, pure data at the bottom
//! of the layers (docs/design.md §14). Each domain module validates its own part; [`crate::settings`]
//! reads the file and assembles the validated whole.

use std::collections::HashMap;
use std::fmt;

use secrecy::SecretString;
use serde::Deserialize;

/// A duration written as a whole number and one unit: `s`, `m`, `h`, `d` (24 h) or `w` (7 d).
///
/// Durations are exact spans of UTC time (docs/design.md §2.2): `1d` is always 86 400 seconds, whatever
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

/// Default clock skew of the one time rule for every credential (`auth.leeway`), in seconds.
pub const DEFAULT_LEEWAY_SECONDS: i64 = 30;

fn default_leeway() -> DurationSpec {
    DurationSpec::from_seconds(DEFAULT_LEEWAY_SECONDS)
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

/// The built-in PostgreSQL queue (docs/design.md §8).
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

/// Planning: the keyset scan that turns a run into commands (docs/design.md §8).
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
    /// Which walk plans a run: `auto` (default) chooses per run from the planner's estimate of
    /// the eligible fraction; `key_order` or `timestamp_index` forces one (the timestamp walk
    /// still needs an index that leads with a `timestamptz` timestamp, else the key walk is used
    /// and the run says why). See [`crate::policy::path`].
    pub path: PathSetting,
}

/// `planning.path`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum PathSetting {
    /// Chosen per run from the estimated eligible fraction.
    #[default]
    Auto,
    /// Always the key-order walk.
    KeyOrder,
    /// The timestamp-index walk whenever an index allows it.
    TimestampIndex,
}

impl TryFrom<String> for PathSetting {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "auto" => Ok(PathSetting::Auto),
            "key_order" => Ok(PathSetting::KeyOrder),
            "timestamp_index" => Ok(PathSetting::TimestampIndex),
            _ => Err(format!(
                "must be \"auto\", \"key_order\" or \"timestamp_index\", not {s:?}"
            )),
        }
    }
}

impl Default for PlanningConfig {
    fn default() -> Self {
        Self {
            page_rows: 10_000,
            lease: DurationSpec::from_seconds(60),
            closure_check_cap: 100_000,
            path: PathSetting::Auto,
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

/// Ledger hygiene (docs/design.md §7).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LedgerConfig {
    /// Terminal commands without an open dead letter, and their attempts, are purged this long
    /// after they finished; past every redelivery horizon (a delivery of a purged command is a
    /// no-op only because its run is terminal): at least 8d (Pub/Sub keeps a message 7 days).
    pub command_retention: DurationSpec,
    /// Rows deleted per purge statement.
    pub purge_batch: i64,
    /// How often housekeeping runs.
    pub housekeeping_interval: DurationSpec,
    /// Work held longer than this (a schema that does not match, a changed target) is
    /// *overdue* (`held.overdue`, `sweeper_held_overdue`): held work spends no budget.
    pub hold_alert_after: DurationSpec,
    /// How long the audit keeps a month (unset: for ever; at least the longest `retain_for` +
    /// 30d): then it is exported, verified and dropped (see `app::audit_retention`).
    pub audit_retention: Option<DurationSpec>,
    /// Where expired months go: `sweeper-audit-{partition}.jsonl.gz` (JSON Lines, gzip).
    pub audit_export_dir: Option<std::path::PathBuf>,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            command_retention: DurationSpec::from_seconds(30 * 86_400),
            purge_batch: 1_000,
            housekeeping_interval: DurationSpec::from_seconds(60),
            hold_alert_after: DurationSpec::from_seconds(15 * 60),
            audit_retention: None,
            audit_export_dir: None,
        }
    }
}

/// Token issuers (docs/design.md §10).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Clock skew the time rule allows every credential (HS256 and JWKS tokens, QStash
    /// signatures): `exp` this much in the past, `nbf`/`iat` this much in the future. 0-5m;
    /// default 30s. See `auth::token`.
    #[serde(default = "default_leeway")]
    pub leeway: DurationSpec,
    /// HS256 issuers; each has one or more keys told apart by `kid`.
    #[serde(default)]
    pub issuer: Vec<IssuerConfig>,
    /// RS256/ES256 issuers verified against a JWKS (Google OIDC and others).
    #[serde(default)]
    pub jwks_issuer: Vec<JwksIssuerConfig>,
    /// Secrets accepted as `/consume?token=...` (scope `consume` only) for push systems that
    /// cannot send an Authorization header. Weaker than OIDC: URLs are often logged.
    #[serde(default)]
    pub query_token: Vec<QueryTokenConfig>,
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

/// `[[auth.jwks_issuer]]` as written.
///
/// ```toml
/// [[auth.jwks_issuer]]
/// iss = "https://accounts.google.com"
/// jwks_url = "https://www.googleapis.com/oauth2/v3/certs"
/// algorithms = ["RS256"]
/// audiences = ["https://sweeper.example.com"]
/// google = true
/// principals = { "scheduler@my-project.iam.gserviceaccount.com" = ["trigger:*"],
///                "pubsub-push@my-project.iam.gserviceaccount.com" = ["consume"] }
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwksIssuerConfig {
    /// The exact `iss`.
    pub iss: String,
    /// Where the key set is fetched (https; http only with `allow_http`).
    pub jwks_url: String,
    /// Pinned algorithms: `RS256` and/or `ES256`.
    pub algorithms: Vec<String>,
    /// Accepted audiences, each compared exactly.
    pub audiences: Vec<String>,
    /// Google OIDC: require `email` and `email_verified: true`; the email is the principal.
    #[serde(default)]
    pub google: bool,
    /// Allow an http JWKS URL (a key server on loopback in tests). Default false.
    #[serde(default)]
    pub allow_http: bool,
    /// Principal (verified email, or `sub`) → scopes.
    #[serde(default)]
    pub principals: HashMap<String, Vec<String>>,
}

/// `[[auth.query_token]]`: a secret accepted as `/consume?token=...`, for the `consume` scope only.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueryTokenConfig {
    /// Recorded as the actor.
    pub subject: String,
    /// The environment variable holding the secret (at least 32 bytes).
    pub token_env: String,
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
    fn planning_path_names_its_three_values_and_refuses_others_plainly() {
        for (s, p) in [
            ("auto", PathSetting::Auto),
            ("key_order", PathSetting::KeyOrder),
            ("timestamp_index", PathSetting::TimestampIndex),
        ] {
            assert_eq!(PathSetting::try_from(s.to_string()), Ok(p));
        }
        assert_eq!(
            PathSetting::try_from("fast".to_string()),
            Err(r#"must be "auto", "key_order" or "timestamp_index", not "fast""#.to_string())
        );
    }
}
