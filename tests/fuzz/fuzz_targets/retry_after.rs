//! Any `Retry-After` value a downstream or a queue API may send: parsing never panics and never
//! asks for a wait above the cap.
#![no_main]

use std::time::{Duration, SystemTime};

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = std::str::from_utf8(data) {
        let cap = Duration::from_secs(3_600);
        if let Some(wait) = sweeper::retry::parse_retry_after(value, SystemTime::now(), cap) {
            assert!(wait <= cap, "{value:?} gave {wait:?}");
        }
    }
});
