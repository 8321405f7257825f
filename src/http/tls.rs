//! HTTPS certificate reload: on SIGHUP and when the files change (docs/design.md §8 deploys rotate
//! certificates by replacing files, e.g. a Kubernetes secret volume or certbot).
//!
//! axum-server swaps the rustls configuration atomically for new handshakes; connections already
//! open keep the certificate they were established with. A failed reload keeps the old one.

use std::time::SystemTime;

use axum_server::tls_rustls::RustlsConfig;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::TlsConfig;

fn modified(files: &TlsConfig) -> Option<(SystemTime, SystemTime)> {
    let m = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    Some((m(&files.cert)?, m(&files.key)?))
}

/// Reloads `rustls` from `files` on SIGHUP and when either file's modification time changes,
/// until `shutdown`.
pub async fn reload_loop(rustls: RustlsConfig, files: TlsConfig, shutdown: CancellationToken) {
    let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            warn!(error = %e, "cannot listen for SIGHUP; certificate files are still watched");
            None
        }
    };
    let mut seen = modified(&files);
    loop {
        let why = tokio::select! {
            _ = shutdown.cancelled() => return,
            Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => None } } => "SIGHUP",
            _ = tokio::time::sleep(files.reload_check.std()) => {
                let now = modified(&files);
                if now == seen { continue; }
                "the files changed"
            }
        };
        match rustls.reload_from_pem_file(&files.cert, &files.key).await {
            Ok(()) => {
                seen = modified(&files);
                info!(reason = why, cert = %files.cert.display(), "TLS certificate reloaded");
            }
            Err(e) => {
                warn!(reason = why, error = %e, "TLS certificate reload failed; keeping the old one")
            }
        }
    }
}
