//! Crash and pause points for the crash and race tests (docs/design.md §12), only with the `failpoints`
//! feature; without it both macros compile to nothing.
//!
//! * `crash_point!("name")` aborts the process when `SWEEPER_CRASH_AT=name` (the crash tests
//!   run the real server as a child process).
//! * `pause_point!("name", command_id)` sleeps for as long as a test in this process asked with
//!   [`pause_at`] for that point and command — to put a deadline or a concurrent delivery
//!   exactly inside a window that is otherwise a millisecond wide.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Aborts the process if `SWEEPER_CRASH_AT` names `point` (only with the `failpoints` feature).
pub fn hit(point: &str) {
    if cfg!(feature = "failpoints") && std::env::var("SWEEPER_CRASH_AT").as_deref() == Ok(point) {
        eprintln!("crash point {point}: aborting");
        std::process::abort();
    }
}

/// Pauses asked for, by (point, command id). Keyed by command so tests running in parallel in
/// one process do not pause each other.
static PAUSES: Mutex<Option<HashMap<(String, String), Duration>>> = Mutex::new(None);

/// Makes every pass of `point` for `command_id` sleep `pause` (tests only).
pub fn pause_at(point: &str, command_id: &str, pause: Duration) {
    let mut pauses = PAUSES.lock().unwrap_or_else(|p| p.into_inner());
    pauses
        .get_or_insert_with(HashMap::new)
        .insert((point.to_string(), command_id.to_string()), pause);
}

/// The pause asked for `point` and `command_id`, if any.
pub fn pause_for(point: &str, command_id: &str) -> Option<Duration> {
    let pauses = PAUSES.lock().unwrap_or_else(|p| p.into_inner());
    pauses
        .as_ref()?
        .get(&(point.to_string(), command_id.to_string()))
        .copied()
}

/// Marks a named crash point; see the module docs.
#[macro_export]
macro_rules! crash_point {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        $crate::failpoints::hit($name);
    };
}

/// Marks a named pause point for one command (an `async` context); see the module docs.
#[macro_export]
macro_rules! pause_point {
    ($name:literal, $command_id:expr) => {
        #[cfg(feature = "failpoints")]
        if let Some(pause) = $crate::failpoints::pause_for($name, $command_id) {
            tokio::time::sleep(pause).await;
        }
    };
}
