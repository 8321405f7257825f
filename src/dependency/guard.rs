//! The address guard of the outbound client: IP literals and resolved addresses checked against
//! loopback, private, link-local, shared, unspecified, multicast and mapped ranges (docs/design.md §9).

use super::*;

/// True for addresses a dependency must not reach unless it allows private addresses: loopback,
/// RFC 1918 private, shared (100.64/10), link-local (incl. 169.254.169.254 metadata), unspecified,
/// `0/8`, broadcast, multicast, documentation and benchmarking ranges, IPv6 unique-local and
/// link-local, and IPv4-mapped, -compatible or NAT64-translated IPv6 addresses.
pub fn is_non_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            let o = a.octets();
            a.is_loopback()
                || a.is_private()
                || a.is_link_local()
                || a.is_unspecified()
                || a.is_broadcast()
                || a.is_multicast()
                || a.is_documentation()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
                || (o[0] == 198 && (o[1] & 0xfe) == 18)
                || o[0] >= 240
        }
        IpAddr::V6(a) => {
            let s = a.segments();
            a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || a.to_ipv4_mapped().is_some()
                || (s[0..6] == [0, 0, 0, 0, 0, 0])
                || (s[0] == 0x64 && s[1] == 0xff9b)
                || (s[0] == 0x2001 && s[1] == 0x0db8)
                // 6to4 and Teredo embed IPv4 addresses; fec0::/10 is the old site-local range.
                || s[0] == 0x2002
                || (s[0] == 0x2001 && s[1] == 0)
                || (s[0] & 0xffc0) == 0xfec0
        }
    }
}

/// The error a refused address or redirect surfaces as, found again in reqwest's error chain so
/// the call is classified permanent (a retry cannot make an address public).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// A resolver that drops non-public addresses, so the client connects only to addresses that
/// passed the check (no gap between check and connect for DNS rebinding to use).
struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let public: Vec<SocketAddr> =
                all.into_iter().filter(|a| !is_non_public(a.ip())).collect();
            if public.is_empty() {
                return Err(Box::new(Refused(format!(
                    "refused `{host}`: it resolves only to loopback, private, link-local or \
                     mapped addresses"
                )))
                    as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(public.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Builds the dependency's outbound client: rustls, no proxy, the timeout, the address guard,
/// and redirects followed only to the same scheme, host and port (at most 3).
pub(super) fn http_client(dep: &Dependency) -> reqwest::Result<reqwest::Client> {
    let policy = reqwest::redirect::Policy::custom(|attempt| {
        let first = attempt.previous().first().cloned();
        let same_origin = first.as_ref().is_some_and(|f| {
            f.scheme() == attempt.url().scheme()
                && f.host_str() == attempt.url().host_str()
                && f.port_or_known_default() == attempt.url().port_or_known_default()
        });
        if !same_origin {
            let to = attempt.url().host_str().unwrap_or("?").to_string();
            attempt.error(Refused(format!(
                "refused a redirect to another host ({to}); sweeper follows redirects only within the dependency's own origin"
            )))
        } else if attempt.previous().len() > 3 {
            attempt.error(Refused("more than 3 redirects".into()))
        } else {
            attempt.follow()
        }
    });
    let mut b = reqwest::Client::builder()
        .redirect(policy)
        .no_proxy()
        .timeout(dep.timeout)
        .connect_timeout(dep.timeout.min(Duration::from_secs(5)))
        .user_agent(concat!("sweeper/", env!("CARGO_PKG_VERSION")));
    if !dep.allow_private_addresses {
        b = b.dns_resolver(Arc::new(PublicOnly));
    }
    b.build()
}
