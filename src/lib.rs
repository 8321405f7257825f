//! sweeper: scheduled data-retention cleanup with a run ledger, idempotent execution and an
//! audit trail. See README.md for the picture and docs/design.md for the contract.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod app;
pub mod auth;
pub mod cli;
pub mod completion;
pub mod config;
pub mod dependency;
pub mod execute;
pub mod export_file;
pub mod failpoints;
pub mod governor;
pub mod holds;
pub mod http;
pub mod ledger;
pub mod metrics;
pub mod plan;
pub mod policy;
pub mod quickstart;
pub mod retire;
pub mod retry;
pub mod schedules;
pub mod settings;
pub mod state;
pub mod strict_json;
pub mod transport;
pub mod trigger;
pub mod window;
pub mod windows;
