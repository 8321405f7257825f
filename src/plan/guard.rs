//! Holds at planning (docs/design.md §14 "Holds"): the governor holds planning pages too (they read the
//! target table), and the blast-radius guard judges a guarded run's planned count at the end of
//! planning, before anything executes.

use tracing::{info, warn};

use crate::ledger;
use crate::retry::{HoldKind, Setback};
use crate::state::AppState;

/// The governor's hold on planning `run_id`'s next page, if this replica's governor holds its
/// policy.
pub(super) fn governor_hold(state: &AppState, run_id: &str) -> Option<Setback> {
    let p = state.config.policy_by_command(run_id)?;
    let (_, why) = state.governor.held(p.name.as_str())?;
    Some(Setback::held(
        HoldKind::Governor,
        format!("the database-health governor: {why}"),
    ))
}

/// The blast-radius guard's verdict on `run_id`, planned in full, recorded in `tx` (see
/// [`ledger::runs::record_guard_verdict`]); a run it holds is logged.
pub(super) async fn guard_verdict(
    tx: &mut sqlx::PgConnection,
    run_id: &str,
    guard: &crate::policy::safety::BlastGuard,
    table: &str,
    dry_run: bool,
) -> sqlx::Result<()> {
    let (planned, median, rows) =
        ledger::runs::guard_inputs(tx, run_id, table, crate::policy::safety::GUARD_HISTORY_RUNS)
            .await?;
    let why = guard.verdict(planned, median, rows);
    let verdict = serde_json::json!({
        "would_be_held": why.is_some(), "reason": why, "planned": planned,
        "median_of_last_completed": median, "table_estimated_rows": rows,
        "max_items": guard.max_items, "max_ratio": guard.max_ratio,
        "ratio_floor": guard.ratio_floor, "max_fraction": guard.max_fraction,
    });
    match &why {
        Some(why) if !dry_run => {
            warn!(run_id, reason = %why, "the blast-radius guard holds the run for approval");
            crate::metrics::hold_started(crate::ledger::HoldKind::Approval);
        }
        Some(why) => {
            info!(run_id, reason = %why, "the blast-radius guard would hold this run's live run")
        }
        None => {}
    }
    ledger::runs::record_guard_verdict(tx, run_id, &verdict, why.is_some()).await
}
