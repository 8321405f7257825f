//! Any bytes as a `/consume` body, with or without the unwrapped-push header: parsing never
//! panics, and an accepted envelope always names a storable command id. The QStash body-hash
//! check is total over the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (flags, body) = data.split_first().unwrap_or((&0, data));
    let mut headers = axum::http::HeaderMap::new();
    if flags & 1 == 1 {
        headers.insert("x-goog-pubsub-message-id", "1".parse().unwrap());
    }
    let push = sweeper::pubsub::parse_push(&headers, body);
    if let Ok(envelope) = sweeper::http::delivered_envelope(push.as_ref(), body) {
        let id = &envelope.command_id;
        assert!(!id.is_empty() && id.len() <= 512);
        assert!(!id.chars().any(char::is_control));
        assert_eq!(envelope.schema_version.unwrap_or(1), 1);
    }
    if let Ok(claim) = std::str::from_utf8(body) {
        let _ = sweeper::qstash::body_matches(claim, body);
    }
});
