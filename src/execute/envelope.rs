//! Deliveries that can never succeed: an envelope that is not one, or too large, from an
//! authenticated sender, quarantined as a dead letter so the queue can be acknowledged.

use super::*;

/// The most of an unparseable body kept in its dead letter, in bytes.
pub const RAW_BODY_LIMIT: usize = 8 * 1024;

/// Quarantines an envelope that could not be parsed (from an authenticated sender): its bounded
/// raw body and the SHA-256 of the whole body become a dead letter, so the queue can be
/// acknowledged instead of redelivering a poison message for ever. The same body delivered again
/// counts on the same open dead letter. Returns its id.
///
/// `body` is the body as read (only its first [`RAW_BODY_LIMIT`] bytes are kept), `size` and
/// `sha256` (hex) those of the whole body.
pub async fn quarantine_envelope(
    state: &AppState,
    body: &[u8],
    size: usize,
    sha256: &str,
    error: &str,
    subject: &str,
) -> Result<i64, Setback> {
    let hash = sha256.to_string();
    let cut = &body[..body.len().min(RAW_BODY_LIMIT)];
    let raw = String::from_utf8_lossy(cut).replace('\0', "\u{FFFD}");
    let reason = crate::ledger::printable(
        &format!("invalid_payload: {error} (from {subject})"),
        crate::retry::MAX_ERROR_CHARS,
    );
    let id =
        ledger::dead_letter::quarantine_envelope(&state.pool, &reason, &raw, &hash, size as i64)
            .await
            .map_err(|e| Setback::from_db(&e))?;
    crate::metrics::quarantined(FailureClass::Permanent);
    Ok(id)
}
