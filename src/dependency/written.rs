//! Dependencies as written in the TOML file (`[[dependency]]` and its inline tables): plain
//! data read with `deny_unknown_fields`; [`super::Dependency::from_config`] validates it.

use serde::Deserialize;

use crate::config::DurationSpec;
use crate::policy::RetryConfig;

/// `[[dependency]]` as written in the TOML file.
///
/// ```toml
/// [[dependency]]
/// name = "payments"
/// base_url = "https://api.payments.example"
/// timeout = "10s"
/// max_concurrent_calls = 8          # per replica
/// rate_limit = { per_second = 20, burst = 5 }   # per replica; scope = "global": all replicas
/// credentials = { env = "PAYMENTS_TOKEN", header = "Authorization", prefix = "Bearer " }
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DependencyConfig {
    /// The name actions refer to.
    pub name: String,
    /// `http` (default), `s3`, `gcs`, `azure` or `local`.
    #[serde(default)]
    pub kind: Option<String>,
    /// `http`: the base URL every path is appended to. `s3`: an optional endpoint (for
    /// S3-compatible stores).
    #[serde(default)]
    pub base_url: Option<String>,
    /// Object stores: the bucket (S3, GCS) or container (Azure).
    #[serde(default)]
    pub bucket: Option<String>,
    /// `s3`: the region (default `us-east-1`).
    #[serde(default)]
    pub region: Option<String>,
    /// `local`: the directory objects live in.
    #[serde(default)]
    pub root: Option<String>,
    /// Hosts a request may go to; defaults to the base URL's host.
    #[serde(default)]
    pub allowed_hosts: Option<Vec<String>>,
    /// Allow loopback, private, link-local and mapped addresses (default false). For stand-ins
    /// on loopback and for services on a private network.
    #[serde(default)]
    pub allow_private_addresses: bool,
    /// Per-call timeout, default `10s`.
    #[serde(default)]
    pub timeout: Option<DurationSpec>,
    /// Calls in flight at once, per replica (default 8).
    #[serde(default)]
    pub max_concurrent_calls: Option<u32>,
    /// Calls per second, per replica (default: unlimited).
    #[serde(default)]
    pub rate_limit: Option<RateLimitConfig>,
    /// Credentials, by reference to environment variables (never inline).
    #[serde(default)]
    pub credentials: Option<CredentialsConfig>,
    /// Longest pause a `Retry-After` may impose (default `1h`).
    #[serde(default)]
    pub retry_after_cap: Option<DurationSpec>,
    /// A pause shorter than this is waited out in the request instead of snoozing the command
    /// (default `1s`; `0s` turns it off). Never inside a transaction.
    #[serde(default)]
    pub pause_wait: Option<DurationSpec>,
    /// A documented rate-limit reset header read when a 429 lacks a usable `Retry-After`:
    /// `"X-RateLimit-Reset"` (format `auto`) or `{ name = "X-RateLimit-Reset", format = "epoch" }`.
    #[serde(default)]
    pub reset_header: Option<ResetHeaderConfig>,
    /// Retry settings for the commands of policies that call this dependency, where the policy
    /// sets none itself.
    #[serde(default)]
    pub retry: Option<RetryConfig>,
}

/// `reset_header = "name"` or `reset_header = { name = "name", format = "epoch" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ResetHeaderConfig {
    /// Only the name: the value's format is told by the value (`auto`).
    Name(String),
    /// The name and how its value is written.
    Spec(ResetHeaderSpec),
}

/// `{ name = "X-RateLimit-Reset", format = "epoch" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResetHeaderSpec {
    /// The header's name.
    pub name: String,
    /// `delta`, `epoch`, `epoch_ms`, `http_date` or `auto` (the default).
    #[serde(default)]
    pub format: Option<String>,
}

/// `rate_limit = { per_second = 20, burst = 5 }` (per replica), or with `scope = "global"`
/// shared by every replica through the ledger.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Sustained calls per second.
    pub per_second: u32,
    /// Calls allowed at once after a quiet spell (default 1); with `scope = "global"`, calls
    /// allowed at the start of each second.
    #[serde(default)]
    pub burst: Option<u32>,
    /// `replica` (default: each replica keeps `per_second` on its own) or `global` (every
    /// replica together keeps it).
    #[serde(default)]
    pub scope: Option<String>,
}

/// `credentials = { ... }`: names of environment variables, read at start-up.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialsConfig {
    /// `http`: the variable holding the secret sent in `header`.
    #[serde(default)]
    pub env: Option<String>,
    /// `http`: the header (default `Authorization`).
    #[serde(default)]
    pub header: Option<String>,
    /// `http`: text before the secret, e.g. `Bearer `.
    #[serde(default)]
    pub prefix: Option<String>,
    /// `s3`: the variable holding the access key id.
    #[serde(default)]
    pub access_key_id_env: Option<String>,
    /// `s3`: the variable holding the secret access key.
    #[serde(default)]
    pub secret_access_key_env: Option<String>,
}
