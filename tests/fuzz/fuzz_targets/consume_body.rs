//! Any bytes as a `/consume` body, with or without the unwrapped-push header: parsing never
//! panics, an accepted envelope always names a storable command id, and a refusal's reason is
//! bounded and printable. The QStash body-hash check is total over the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (flags, body) = data.split_first().unwrap_or((&0, data));
    let mut headers = axum::http::HeaderMap::new();
    if flags & 1 == 1 {
        headers.insert("x-goog-pubsub-message-id", "1".parse().unwrap());
    }
    let push = sweeper::transport::pubsub::parse_push(&headers, body);
    match sweeper::transport::delivered_envelope(push.as_ref(), body) {
        Ok(envelope) => {
            let id = &envelope.command_id;
            assert!(!id.is_empty() && id.len() <= 512);
            assert!(!id.chars().any(char::is_control));
            assert_eq!(envelope.schema_version.unwrap_or(1), 1);
        }
        // The reason is stored and shown: bounded and printable.
        Err(why) => {
            assert!(why.chars().count() <= sweeper::transport::MAX_REASON_CHARS + 1);
            assert!(!why.chars().any(char::is_control), "{why:?}");
        }
    }
    if let Ok(claim) = std::str::from_utf8(body) {
        let _ = sweeper::transport::qstash::body_matches(claim, body);
    }
});
