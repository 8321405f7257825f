//! Integration tests: a real server on a real port, a real PostgreSQL, real JWTs.

mod architecture;
mod audit;
mod cli;
mod command_states;
mod common;
mod composite_keys;
mod consume;
mod contract;
mod digest;
mod emulator;
mod ext_common;
mod external;
mod failures;
mod hardening;
mod jwks;
#[allow(dead_code)]
#[path = "../kit/mod.rs"]
mod kit;
mod leases;
mod least_privilege;
mod locked_rows;
mod on_call;
mod partition_sweep;
mod partitioned;
mod planning;
mod planning_paths;
mod pubsub;
mod push_bodies;
mod qstash;
mod recorded;
mod refusals;
mod related_holds;
mod runbook;
mod safety;
mod scenarios;
mod schedules;
mod schema_blip;
mod selection;
mod stages;
mod standby;
mod standin;
mod tokens;
mod trigger;
mod upgrade;
mod visibility;
mod windows;
