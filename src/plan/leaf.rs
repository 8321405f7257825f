//! Walking a partitioned target one leaf at a time (docs/design.md §14 "Partitioned targets"): which leaf a page
//! scans, the constraint that confines its scan, and where the cursor goes after it.

use super::scan::Cursor;
use crate::policy::TableName;
use crate::policy::partitions;

/// Where a page of a partitioned target's walk stands.
pub(super) struct LeafWalk {
    leaves: Vec<String>,
    /// The leaf this page scans (`leaves.len()`: every leaf is walked or gone).
    at: usize,
    /// The leaf the job's cursor was in was detached (or dropped) since: the walk moved on.
    moved_on: bool,
    /// `leaves[at]`'s partition constraint, read in this transaction.
    constraint: Option<String>,
}

impl LeafWalk {
    /// Resumes at the job's leaf, or at the first one after it still attached under `target`.
    pub(super) async fn resume(
        conn: &mut sqlx::PgConnection,
        target: &TableName,
        leaves: &[String],
        cursor_partition: usize,
    ) -> sqlx::Result<LeafWalk> {
        let from = cursor_partition.min(leaves.len());
        let (at, constraint) = match partitions::next_attached(conn, target, leaves, from).await? {
            Some((at, c)) => (at, Some(c)),
            None => (leaves.len(), None),
        };
        Ok(LeafWalk {
            leaves: leaves.to_vec(),
            at,
            moved_on: at > from,
            constraint,
        })
    }

    /// Whether the job's leaf was detached since and the walk moved past it.
    pub(super) fn moved_on(&self) -> bool {
        self.moved_on
    }

    /// The leaf the job's cursor was in.
    pub(super) fn left_leaf(&self, cursor_partition: usize) -> Option<&str> {
        self.leaves.get(cursor_partition).map(String::as_str)
    }

    /// The constraint confining this page's scan.
    pub(super) fn constraint(&self) -> Option<String> {
        self.constraint.clone()
    }

    /// Whether no leaf is left to walk.
    pub(super) fn is_past_end(&self) -> bool {
        self.at >= self.leaves.len()
    }

    /// The leaf this page scans, which its commands name.
    pub(super) fn leaf(&self) -> Option<&str> {
        self.leaves.get(self.at).map(String::as_str)
    }

    /// Where this page's scan starts: the job's cursor in its leaf, the start of a leaf the
    /// walk moved on to.
    pub(super) fn start(&self, job_cursor: &Cursor) -> Cursor {
        if self.moved_on {
            Cursor::default()
        } else {
            job_cursor.clone()
        }
    }

    /// After a page that did (`leaf_done`) or did not finish its leaf: whether the walk is done,
    /// and the position of the leaf the cursor is in now (its key reset at a new leaf).
    pub(super) fn after_page(&self, leaf_done: bool, cursor: &mut Cursor) -> (bool, usize) {
        if !leaf_done {
            return (false, self.at);
        }
        if self.at + 1 >= self.leaves.len() {
            return (true, self.at.min(self.leaves.len()));
        }
        *cursor = Cursor::default();
        (false, self.at + 1)
    }

    /// The position of the leaf this page scans.
    pub(super) fn at(&self) -> usize {
        self.at
    }
}
