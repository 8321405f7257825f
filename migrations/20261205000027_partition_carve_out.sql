-- The partition sweep, part 2 (docs/design.md §14 "Carve-out"): an expired partition with a few
-- held rows is still retired whole. In one transaction the retirer copies its held rows into a
-- new table shaped like it, detaches it and attaches the new table for the same bounds under the
-- partition's name; the old table, renamed, then retires as in part 1 (its keys but the carried
-- ones exported, a manifest, the drop):
--   planned → carved → dropped (or awaiting_drop → dropped)
--
-- Additive for a rolling upgrade: the previous release claims only `planned`, `detaching` and
-- `detached` retirements, so it never acts on a `carved` one (whose table has another name). A
-- `planned` carve-out it claims first is detached whole, finds its held rows in the detached
-- table and is attached again and kept, as part 1 does: nothing is lost, the next run carves it.

-- The rows planning found held (and carves out); null for a partition retired whole.
alter table sweeper.partition_retirements add column held_rows bigint;
-- After the swap: the old table's new name (it is detached), the rows carried over into the new
-- partition, and their item keys (the export leaves them out).
alter table sweeper.partition_retirements add column detached_as text;
alter table sweeper.partition_retirements add column carried_rows bigint;
alter table sweeper.partition_retirements add column carried_keys text[];
alter table sweeper.partition_retirements drop constraint partition_retirements_state_check;
alter table sweeper.partition_retirements add constraint partition_retirements_state_check
    check (state in ('would_drop', 'planned', 'detaching', 'detached', 'carved', 'awaiting_drop',
                     'dropped', 'kept', 'gone'));
-- The retirer's claim, `carved` included.
create index partition_retirements_due_carved on sweeper.partition_retirements (created_at)
    where state in ('planned', 'detaching', 'detached', 'carved');
