//! Crash points for the crash tests (DESIGN §12): with the `failpoints` feature, a
//! `crash_point!("name")` aborts the process when `SWEEPER_CRASH_AT=name`. Without the feature
//! the macro compiles to nothing.

/// Aborts the process if `SWEEPER_CRASH_AT` names `point` (only with the `failpoints` feature).
pub fn hit(point: &str) {
    if cfg!(feature = "failpoints") && std::env::var("SWEEPER_CRASH_AT").as_deref() == Ok(point) {
        eprintln!("crash point {point}: aborting");
        std::process::abort();
    }
}

/// Marks a named crash point; see the module docs.
#[macro_export]
macro_rules! crash_point {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        $crate::failpoints::hit($name);
    };
}
