//! The test kit shared by `tests/integration`, `tests/crash` and `benches/`: one way to make a
//! database ([`db`]), one way to start the `sweeper` binary ([`process`]), one HTTP client with a
//! method per endpoint that asserts the status ([`client`]), and read-only views of the ledger
//! plus the few named setters a test may use to force a state ([`ledger`]).
//!
//! Each test crate includes it with `#[path = ".../kit/mod.rs"] mod kit;`; a crate uses only part
//! of it, hence the `dead_code` allowance at each include.

pub mod client;
pub mod cluster;
pub mod db;
pub mod digest;
pub mod ledger;
pub mod process;
