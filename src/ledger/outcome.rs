//! Item outcomes (docs/design.md §2.8) and their counts, as the audit and the runs record them.

use serde::Serialize;

/// One item's final outcome in a command (docs/design.md §2.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The row was deleted.
    Deleted,
    /// The row was already gone.
    AlreadyAbsent,
    /// An exclusion held the row (the reason names it).
    Excluded,
    /// The row is no longer older than the cutoff.
    NotEligible,
    /// The action failed for this item (the reason holds the error).
    Failed,
    /// A dry run would have deleted the row.
    WouldDelete,
    /// An external call succeeded and the row was stamped or left (not deleted).
    Reconciled,
    /// An external call once per window succeeded and the row was kept as it is (`then =
    /// "nothing"` on a POST/PUT/PATCH: the effect is the call).
    Called,
    /// A dry run would have made that call.
    WouldCall,
}

impl Outcome {
    /// Every outcome, in the audit's order.
    pub const ALL: [Outcome; 9] = [
        Outcome::Deleted,
        Outcome::AlreadyAbsent,
        Outcome::Excluded,
        Outcome::NotEligible,
        Outcome::Failed,
        Outcome::WouldDelete,
        Outcome::Reconciled,
        Outcome::Called,
        Outcome::WouldCall,
    ];

    /// The name stored in `sweeper.audit.outcome`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Deleted => "deleted",
            Outcome::AlreadyAbsent => "already_absent",
            Outcome::Excluded => "excluded",
            Outcome::NotEligible => "not_eligible",
            Outcome::Failed => "failed",
            Outcome::WouldDelete => "would_delete",
            Outcome::Reconciled => "reconciled",
            Outcome::Called => "called",
            Outcome::WouldCall => "would_call",
        }
    }
}

/// Outcome counts of one command, or of a run (the `sweeper.runs` columns of the same names).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq, sqlx::FromRow)]
pub struct Counts {
    /// Items deleted.
    pub deleted: i64,
    /// Items already gone.
    pub already_absent: i64,
    /// Items held by an exclusion.
    pub excluded: i64,
    /// Items no longer old enough.
    pub not_eligible: i64,
    /// Items that failed.
    pub failed: i64,
    /// Items a dry run would delete.
    pub would_delete: i64,
    /// Items reconciled by an external call.
    pub reconciled: i64,
    /// Items called once per window, rows kept.
    pub called: i64,
    /// Items a dry run would call.
    pub would_call: i64,
}

impl Counts {
    /// The count of outcome `o`.
    pub fn get(&self, o: Outcome) -> i64 {
        match o {
            Outcome::Deleted => self.deleted,
            Outcome::AlreadyAbsent => self.already_absent,
            Outcome::Excluded => self.excluded,
            Outcome::NotEligible => self.not_eligible,
            Outcome::Failed => self.failed,
            Outcome::WouldDelete => self.would_delete,
            Outcome::Reconciled => self.reconciled,
            Outcome::Called => self.called,
            Outcome::WouldCall => self.would_call,
        }
    }

    /// Counts one more item with outcome `o`.
    pub fn add(&mut self, o: Outcome) {
        match o {
            Outcome::Deleted => self.deleted += 1,
            Outcome::AlreadyAbsent => self.already_absent += 1,
            Outcome::Excluded => self.excluded += 1,
            Outcome::NotEligible => self.not_eligible += 1,
            Outcome::Failed => self.failed += 1,
            Outcome::WouldDelete => self.would_delete += 1,
            Outcome::Reconciled => self.reconciled += 1,
            Outcome::Called => self.called += 1,
            Outcome::WouldCall => self.would_call += 1,
        }
    }
}
