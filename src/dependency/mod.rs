//! Downstream dependencies (docs/design.md §9): the services an action calls, each with allowed hosts, a
//! timeout, a concurrency cap (per replica), a rate limit (per replica, or across every replica
//! with `scope = "global"`), and a pause shared by all replicas through the ledger.
//!
//! Every call is admitted in this order: a concurrency permit, a rate-limit slot, then the pause
//! check against a view of `sweeper.dependency_pauses` at most one second old. A paused dependency
//! is never called: the command snoozes (docs/design.md §5) until the pause ends.
//!
//! The outbound HTTP client (rustls) refuses loopback, private, link-local, shared (100.64/10),
//! unspecified, multicast and IPv4-mapped/-translated addresses — as IP literals in the URL and as
//! resolved addresses — unless the dependency sets `allow_private_addresses`. It never follows a
//! redirect to another host and ignores proxy environment variables (a proxy would resolve names
//! past the guard).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use secrecy::{ExposeSecret, SecretString};
use sqlx::PgPool;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};
use url::{Host, Url};

use crate::config::DurationSpec;
use crate::policy::RetryConfig;
use crate::retry::{Failure, Setback};

mod guard;
mod limit;
mod runtime;
mod written;

pub use guard::*;
pub use limit::{RateLimit, RateScope};
pub use runtime::*;
pub use written::*;

/// What a dependency is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DependencyKind {
    /// An HTTP API under `base_url`.
    Http {
        /// The base URL.
        base_url: Url,
    },
    /// Amazon S3 or an S3-compatible store.
    S3 {
        /// The bucket.
        bucket: String,
        /// The region.
        region: String,
        /// A custom endpoint.
        endpoint: Option<Url>,
    },
    /// Google Cloud Storage (credentials from `GOOGLE_SERVICE_ACCOUNT` and friends).
    Gcs {
        /// The bucket.
        bucket: String,
    },
    /// Azure Blob Storage (credentials from `AZURE_STORAGE_*`).
    Azure {
        /// The container.
        container: String,
    },
    /// A local directory.
    Local {
        /// The directory.
        root: std::path::PathBuf,
    },
}

impl DependencyKind {
    /// Whether actions of kind `object_store` can use it.
    pub fn is_object_store(&self) -> bool {
        !matches!(self, DependencyKind::Http { .. })
    }
}

/// A validated dependency.
#[derive(Debug, Clone)]
pub struct Dependency {
    /// Its name.
    pub name: String,
    /// What it is.
    pub kind: DependencyKind,
    /// Hosts requests may go to (lowercase).
    pub allowed_hosts: Vec<String>,
    /// Whether non-public addresses are allowed.
    pub allow_private_addresses: bool,
    /// Per-call timeout.
    pub timeout: Duration,
    /// Calls in flight per replica.
    pub max_concurrent_calls: u32,
    /// Calls per second and burst, per replica or across every replica.
    pub rate_limit: Option<RateLimit>,
    /// `(header, value)` sent on every HTTP call.
    pub credential: Option<(reqwest::header::HeaderName, SecretString)>,
    /// S3 `(access key id, secret access key)`.
    pub s3_keys: Option<(SecretString, SecretString)>,
    /// Longest pause a `Retry-After` may impose.
    pub retry_after_cap: Duration,
    /// Pauses shorter than this are waited out in the request.
    pub pause_wait: Duration,
    /// A rate-limit reset header and how its value is written.
    pub reset_header: Option<(reqwest::header::HeaderName, crate::retry::ResetFormat)>,
    /// Retry overrides for the policies that call it.
    pub retry: Option<RetryConfig>,
}

/// Validates `reset_header`: a header name, and a format among those [`crate::retry::ResetFormat`]
/// reads (a plain name means `auto`).
fn reset_header(
    c: &written::ResetHeaderConfig,
    errors: &mut Vec<String>,
) -> Option<(reqwest::header::HeaderName, crate::retry::ResetFormat)> {
    use crate::retry::ResetFormat;
    let (name, format) = match c {
        written::ResetHeaderConfig::Name(n) => (n, None),
        written::ResetHeaderConfig::Spec(s) => (&s.name, s.format.as_deref()),
    };
    let format = match format {
        None | Some("auto") => Some(ResetFormat::Auto),
        Some("delta") => Some(ResetFormat::Delta),
        Some("epoch") => Some(ResetFormat::Epoch),
        Some("epoch_ms") => Some(ResetFormat::EpochMs),
        Some("http_date") => Some(ResetFormat::HttpDate),
        Some(other) => {
            errors.push(format!(
                "reset_header.format: `{other}` is not one of delta, epoch, epoch_ms, http_date, auto"
            ));
            None
        }
    };
    let name = match reqwest::header::HeaderName::from_bytes(name.as_bytes()) {
        Ok(h) => Some(h),
        Err(_) => {
            errors.push(format!("reset_header: `{name}` is not a header name"));
            None
        }
    };
    Some((name?, format?))
}

fn env_secret(var: &str, field: &str, errors: &mut Vec<String>) -> Option<SecretString> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(SecretString::from(v)),
        _ => {
            errors.push(format!(
                "{field}: environment variable {var} is not set (credentials are read from the environment, never the file)"
            ));
            None
        }
    }
}

impl Dependency {
    /// Validates a configured dependency; errors are `field: message` without a prefix.
    // Over 80 lines: validation field by field, collecting every error in one pass so check-config
    // names them all.
    pub fn from_config(c: DependencyConfig) -> Result<Dependency, Vec<String>> {
        let mut errors = Vec::new();
        if c.name.is_empty()
            || c.name.len() > 63
            || !c
                .name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        {
            errors.push(format!(
                "name: `{}` must be 1-63 characters of a-z, 0-9, - and _",
                c.name
            ));
        }
        let parse_url = |s: &str, errors: &mut Vec<String>| -> Option<Url> {
            match Url::parse(s) {
                Ok(u) if u.query().is_some() || u.fragment().is_some() => {
                    errors.push(format!(
                        "base_url: `{s}` must not have a query or fragment (paths are appended to it)"
                    ));
                    None
                }
                Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => Some(u),
                Ok(_) => {
                    errors.push(format!(
                        "base_url: `{s}` must be an http(s) URL with a host"
                    ));
                    None
                }
                Err(e) => {
                    errors.push(format!("base_url: `{s}`: {e}"));
                    None
                }
            }
        };
        let need = |v: &Option<String>, field: &str, errors: &mut Vec<String>| -> String {
            match v {
                Some(s) if !s.is_empty() => s.clone(),
                _ => {
                    errors.push(format!("{field}: required for this kind"));
                    String::new()
                }
            }
        };
        let kind = match c.kind.as_deref().unwrap_or("http") {
            "http" => {
                let s = need(&c.base_url, "base_url", &mut errors);
                parse_url(&s, &mut errors).map(|base_url| DependencyKind::Http { base_url })
            }
            "s3" => Some(DependencyKind::S3 {
                bucket: need(&c.bucket, "bucket", &mut errors),
                region: c.region.clone().unwrap_or_else(|| "us-east-1".into()),
                endpoint: c
                    .base_url
                    .as_deref()
                    .and_then(|s| parse_url(s, &mut errors)),
            }),
            "gcs" => Some(DependencyKind::Gcs {
                bucket: need(&c.bucket, "bucket", &mut errors),
            }),
            "azure" => Some(DependencyKind::Azure {
                container: need(&c.bucket, "bucket", &mut errors),
            }),
            "local" => Some(DependencyKind::Local {
                root: need(&c.root, "root", &mut errors).into(),
            }),
            other => {
                errors.push(format!(
                    "kind: `{other}` is not supported (supported: http, s3, gcs, azure, local)"
                ));
                None
            }
        };
        let base_host = match &kind {
            Some(DependencyKind::Http { base_url }) => base_url.host_str().map(str::to_lowercase),
            Some(DependencyKind::S3 {
                endpoint: Some(e), ..
            }) => e.host_str().map(str::to_lowercase),
            _ => None,
        };
        let allowed_hosts: Vec<String> = match &c.allowed_hosts {
            Some(h) => h.iter().map(|s| s.to_lowercase()).collect(),
            None => base_host.iter().cloned().collect(),
        };
        if let Some(h) = &base_host
            && !allowed_hosts.contains(h)
        {
            errors.push(format!(
                "allowed_hosts: the base URL's own host `{h}` is not in the list"
            ));
        }
        let timeout = c.timeout.unwrap_or(DurationSpec::from_seconds(10));
        if !(1..=600).contains(&timeout.seconds()) {
            errors.push("timeout: must be between 1s and 10m".into());
        }
        let max_concurrent_calls = c.max_concurrent_calls.unwrap_or(8);
        if !(1..=1_000).contains(&max_concurrent_calls) {
            errors.push("max_concurrent_calls: must be between 1 and 1000".into());
        }
        let rate_limit = c
            .rate_limit
            .as_ref()
            .and_then(|r| RateLimit::from_config(r).map_err(|e| errors.push(e)).ok());
        let mut credential = None;
        let mut s3_keys = None;
        if let Some(cr) = &c.credentials {
            if let Some(var) = &cr.env {
                let header = cr.header.as_deref().unwrap_or("Authorization");
                match reqwest::header::HeaderName::from_bytes(header.as_bytes()) {
                    Ok(h) => {
                        if let Some(secret) = env_secret(var, "credentials.env", &mut errors) {
                            let v = format!(
                                "{}{}",
                                cr.prefix.as_deref().unwrap_or(""),
                                secret.expose_secret()
                            );
                            credential = Some((h, SecretString::from(v)));
                        }
                    }
                    Err(_) => errors.push(format!(
                        "credentials.header: `{header}` is not a header name"
                    )),
                }
            }
            if let (Some(k), Some(s)) = (&cr.access_key_id_env, &cr.secret_access_key_env) {
                let k = env_secret(k, "credentials.access_key_id_env", &mut errors);
                let s = env_secret(s, "credentials.secret_access_key_env", &mut errors);
                if let (Some(k), Some(s)) = (k, s) {
                    s3_keys = Some((k, s));
                }
            } else if cr.access_key_id_env.is_some() || cr.secret_access_key_env.is_some() {
                errors.push(
                    "credentials: give both access_key_id_env and secret_access_key_env".into(),
                );
            }
        }
        let retry_after_cap = c
            .retry_after_cap
            .unwrap_or(DurationSpec::from_seconds(3_600));
        if retry_after_cap.seconds() < 1 {
            errors.push("retry_after_cap: must be at least 1s".into());
        }
        let pause_wait = c.pause_wait.unwrap_or(DurationSpec::from_seconds(1));
        if pause_wait.seconds() > 30 {
            errors.push("pause_wait: at most 30s (longer waits snooze the command)".into());
        }
        let reset_header = c
            .reset_header
            .as_ref()
            .and_then(|h| reset_header(h, &mut errors));
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(Dependency {
            name: c.name,
            kind: kind.expect("checked above"),
            allowed_hosts,
            allow_private_addresses: c.allow_private_addresses,
            timeout: timeout.std(),
            max_concurrent_calls,
            rate_limit,
            credential,
            s3_keys,
            retry_after_cap: retry_after_cap.std(),
            pause_wait: pause_wait.std(),
            reset_header,
            retry: c.retry,
        })
    }

    /// Refuses a URL whose host is not allowed, or is an IP literal outside the public internet
    /// (unless `allow_private_addresses`). Resolved names are checked by the client's resolver.
    pub fn check_url(&self, url: &Url) -> Result<(), Failure> {
        let host = url
            .host_str()
            .ok_or_else(|| Failure::permanent(format!("refused {url}: no host")))?
            .to_lowercase();
        if !self.allowed_hosts.contains(&host) {
            return Err(Failure::permanent(format!(
                "refused a call to host `{host}`: not in dependency {}'s allowed_hosts",
                self.name
            )));
        }
        let ip = match url.host() {
            Some(Host::Ipv4(a)) => Some(IpAddr::V4(a)),
            Some(Host::Ipv6(a)) => Some(IpAddr::V6(a)),
            _ => None,
        };
        if let Some(ip) = ip
            && !self.allow_private_addresses
            && is_non_public(ip)
        {
            return Err(Failure::permanent(format!(
                "refused a call to {ip}: a loopback, private, link-local or mapped address \
                 (dependency {} does not set allow_private_addresses)",
                self.name
            )));
        }
        Ok(())
    }
}

/// The dependencies, validated; names must be unique.
pub fn all_from_config(raw: Vec<DependencyConfig>, errors: &mut Vec<String>) -> Vec<Dependency> {
    let mut dependencies: Vec<Dependency> = Vec::new();
    for (i, d) in raw.into_iter().enumerate() {
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
        match Dependency::from_config(d) {
            Ok(dep) => dependencies.push(dep),
            Err(es) => errors.extend(es.into_iter().map(|e| format!("{label}.{e}"))),
        }
    }
    dependencies
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    #[test]
    fn non_public_addresses_are_recognised() {
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "0.1.2.3",
            "255.255.255.255",
            "::1",
            "::",
            "fc00::1",
            "fd12::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:8.8.8.8",
            "64:ff9b::a00:1",
            "2002:7f00:1::",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "fec0::1",
        ] {
            assert!(is_non_public(a.parse().unwrap()), "{a}");
        }
        for a in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "100.128.0.1"] {
            assert!(!is_non_public(a.parse().unwrap()), "{a}");
        }
    }

    pub(super) fn dep(extra: &str) -> Result<Dependency, Vec<String>> {
        let text = format!("name = 'api'\n{extra}");
        let c: DependencyConfig = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Toml))
            .build()
            .unwrap()
            .try_deserialize()
            .unwrap();
        Dependency::from_config(c)
    }

    #[test]
    fn urls_are_checked_against_hosts_and_literal_addresses() {
        let d = dep("base_url = 'https://api.example.com/v1'").unwrap();
        assert!(
            d.check_url(&"https://api.example.com/v1/x".parse().unwrap())
                .is_ok()
        );
        assert!(
            d.check_url(&"https://evil.example.com/x".parse().unwrap())
                .is_err()
        );
        let d = dep("base_url = 'http://2130706433/'").unwrap();
        let e = d
            .check_url(&"http://2130706433/x".parse().unwrap())
            .unwrap_err();
        assert!(e.message.contains("127.0.0.1"), "{}", e.message);
        let d = dep("base_url = 'http://[::ffff:169.254.169.254]/'").unwrap();
        assert!(d.check_url(&d_url(&d)).is_err());
        let d = dep("base_url = 'http://127.0.0.1:9/'\nallow_private_addresses = true").unwrap();
        assert!(d.check_url(&d_url(&d)).is_ok());
        assert!(dep("kind = 'ftp'").unwrap_err()[0].starts_with("kind"));
        assert!(dep("base_url = 'x'").is_err());
        assert!(dep("base_url = 'https://a.example/v1?token=x'").is_err());
        assert!(
            dep("base_url = 'https://a.example'\nallowed_hosts = ['b.example']").unwrap_err()[0]
                .starts_with("allowed_hosts")
        );
    }

    fn d_url(d: &Dependency) -> Url {
        match &d.kind {
            DependencyKind::Http { base_url } => base_url.clone(),
            _ => unreachable!(),
        }
    }
}
