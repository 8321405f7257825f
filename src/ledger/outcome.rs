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
    /// An external call's answer said the provider's record differs from ours (the action's
    /// `mismatch` rule): the row was kept as it is and an item dead letter opened.
    Mismatched,
}

impl Outcome {
    /// Every outcome, in the audit's order.
    pub const ALL: [Outcome; 10] = [
        Outcome::Deleted,
        Outcome::AlreadyAbsent,
        Outcome::Excluded,
        Outcome::NotEligible,
        Outcome::Failed,
        Outcome::WouldDelete,
        Outcome::Reconciled,
        Outcome::Called,
        Outcome::WouldCall,
        Outcome::Mismatched,
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
            Outcome::Mismatched => "mismatched",
        }
    }

    /// The outcome named `s`, if any.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == s)
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
    /// Items whose call's answer was a mismatch.
    pub mismatched: i64,
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
            Outcome::Mismatched => self.mismatched,
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
            Outcome::Mismatched => self.mismatched += 1,
        }
    }
}

/// What the snapshot that acts on an item says of it, before its effect: the one derivation of
/// an item's outcome, shared by the delete-first path ([`Judgement::after_delete_sql`]), the
/// item-by-item and dry-run path, and an action with external calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judgement {
    /// No row with the key: `already_absent`.
    Absent,
    /// An exclusion holds the row: `excluded`, with the exclusion's name.
    Excluded(String),
    /// The row is not (or no longer) eligible: `not_eligible`, with the predicate it fails.
    NotEligible(Option<String>),
    /// The row qualifies: its outcome is the effect's.
    Eligible,
}

impl Judgement {
    /// The judgement of a row `found` or not, with its first exclusion `reason`, whether it is
    /// `old_enough` (and matches the selection), and the predicate it fails if not. An exclusion
    /// comes first: a held row is excluded whatever its age.
    pub fn of(
        found: bool,
        reason: Option<String>,
        old_enough: bool,
        not_eligible_reason: Option<String>,
    ) -> Self {
        match (found, reason, old_enough) {
            (false, ..) => Judgement::Absent,
            (true, Some(r), _) => Judgement::Excluded(r),
            (true, None, false) => Judgement::NotEligible(not_eligible_reason),
            (true, None, true) => Judgement::Eligible,
        }
    }

    /// The item's outcome and reason when an eligible item ends in `effect` (`deleted`,
    /// `would_delete`, ...).
    pub fn outcome(self, effect: Outcome) -> (Outcome, Option<String>) {
        match self {
            Judgement::Absent => (Outcome::AlreadyAbsent, None),
            Judgement::Excluded(r) => (Outcome::Excluded, Some(r)),
            Judgement::NotEligible(r) => (Outcome::NotEligible, r),
            Judgement::Eligible => (effect, None),
        }
    }

    /// The same derivation in SQL, after a delete that came first: `(outcome, reason)`
    /// expressions over whether the delete removed the item (`deleted`, an SQL condition) and,
    /// for an item it did not remove, its row `c` as a later snapshot classifies it
    /// (`c.item_key` NULL when no row has the key; `c.reason`, `c.old_enough`,
    /// `c.not_eligible_reason`). A row the delete left that is present, old enough and held by
    /// nothing gets no outcome (NULL): it was locked, or changed twice while the delete ran, and
    /// stays for a later attempt, never audited.
    pub(crate) fn after_delete_sql(deleted: &str) -> (String, String) {
        let outcome = format!(
            "case when {deleted} then '{effect}'
                  when c.item_key is null then '{absent}'
                  when c.reason is not null then '{excluded}'
                  when not c.old_enough then '{not_eligible}' end",
            effect = Outcome::Deleted.as_str(),
            absent = Outcome::AlreadyAbsent.as_str(),
            excluded = Outcome::Excluded.as_str(),
            not_eligible = Outcome::NotEligible.as_str(),
        );
        let reason =
            format!("case when not ({deleted}) then coalesce(c.reason, c.not_eligible_reason) end");
        (outcome, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exclusion_comes_before_age_and_a_missing_row_before_both() {
        let of = |found, reason: Option<&str>, old| {
            Judgement::of(found, reason.map(String::from), old, Some("select".into()))
                .outcome(Outcome::Deleted)
        };
        assert_eq!(
            of(false, Some("hold"), true),
            (Outcome::AlreadyAbsent, None)
        );
        assert_eq!(
            of(true, Some("hold"), false),
            (Outcome::Excluded, Some("hold".into()))
        );
        assert_eq!(
            of(true, None, false),
            (Outcome::NotEligible, Some("select".into()))
        );
        assert_eq!(of(true, None, true), (Outcome::Deleted, None));
        for o in Outcome::ALL {
            assert_eq!(Outcome::parse(o.as_str()), Some(o));
        }
    }
}
