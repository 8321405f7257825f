//! Integration tests: a real server on a real port, a real PostgreSQL, real JWTs.

mod architecture;
mod cli;
mod common;
mod consume;
mod contract;
mod emulator;
mod ext_common;
mod external;
mod failures;
mod hardening;
mod jwks;
mod planning;
mod pubsub;
mod push_bodies;
mod qstash;
mod schema_blip;
mod standin;
mod tokens;
mod trigger;
mod visibility;
