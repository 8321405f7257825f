//! The rules a run acts under, built from the ledger: planning's pages and housekeeping's
//! completion of a run a crash left open both need them.

use crate::ledger;
use crate::policy::RuleSet;
use crate::retry::Setback;
use crate::state::AppState;

/// What names a run's rules: the run, its policy and pinned version, its cutoff and window.
pub struct RunRef<'a> {
    /// The run.
    pub run_id: &'a str,
    /// Its policy.
    pub policy: &'a str,
    /// Its pinned version.
    pub pinned_version: &'a str,
    /// Its cutoff.
    pub cutoff: chrono::DateTime<chrono::Utc>,
    /// Its window.
    pub window: chrono::DateTime<chrono::Utc>,
}

/// The rules `run` acts under: the stricter of its pinned and current versions, over the
/// target's columns as this replica checked them.
pub async fn run_rules(
    state: &AppState,
    conn: &mut sqlx::PgConnection,
    run: &RunRef<'_>,
) -> Result<RuleSet, Setback> {
    let (pinned, current_version, current) =
        ledger::run_specs::<crate::policy::PolicySpec>(conn, run.policy, run.pinned_version)
            .await
            .map_err(|e| Setback::from_db(&e))?;
    let specs: Vec<&crate::policy::PolicySpec> = std::iter::once(&pinned).chain(&current).collect();
    let table = state.catalog.tables(&state.pool, &specs).await?;
    Ok(RuleSet::effective(
        &pinned,
        current.as_ref().map(|c| (current_version.as_str(), c)),
        run.cutoff,
        run.window,
        &table,
        state.checked_types.get(run.policy),
    )
    .map_err(Setback::from)?
    .with_effects(run.policy, run.run_id))
}
