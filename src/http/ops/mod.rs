//! On-call endpoints: runs, their audit trail, policies, health (docs/design.md §4). Thin handlers over
//! [`crate::ledger`] and [`crate::audit`].

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::http::{Caller, NoQuery, Params, Problem, QueryParams, Segments};
use crate::ledger;
use crate::ledger::audit;
use crate::state::AppState;

mod acts;
mod attention;
mod dead_letters;
mod items;
mod operator_log;
mod probes;
mod replay;
mod runs;
mod safety;
mod windows;

pub use acts::{accept_identity, approve_run, cancel_run, resume_policy, suspend_policy};
pub use dead_letters::{
    abandon_dead_letter, get_dead_letter, list_dead_letters, redrive_dead_letter,
    redrive_dead_letters,
};
pub use items::item_history;
pub use operator_log::list_operator_log;
pub use probes::{healthz, metrics, policies, readyz};
pub use runs::{get_run, list_runs, run_items};
pub use safety::{governor, guard};
pub use windows::{backfill, policy_windows};

// Helpers the endpoint groups share.
#[allow(unused_imports)]
use acts::{BulkRedriveBody, HasReason, ReasonBody, json_integer, reason_of, require_policy};
#[allow(unused_imports)]
use dead_letters::{CLASSES, act_problem, unknown_dead_letter};
#[allow(unused_imports)]
use replay::{replay_verdict, with_verdicts};
#[allow(unused_imports)]
use runs::{PlanningState, StoppedCommand, audit_page, bad_query, policy_filter, unknown_run};
