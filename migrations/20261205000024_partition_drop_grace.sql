-- The partition sweep's grace period (docs/design.md §14 "Partition sweep", `drop_grace` on a
-- policy): a retired partition may stay detached, its keys exported and its manifest recorded,
-- for a while before it is dropped. Its retirement waits in the new state `awaiting_drop` until
-- `drop_after`:
--   planned → detaching → detached → awaiting_drop → dropped
-- or `kept` when it was attached again during its grace (an operator's undo).
--
-- Additive for a rolling upgrade: the previous release claims only `planned`, `detaching` and
-- `detached` retirements, and a run waits only for those, so it neither drops an awaiting
-- partition early nor holds its run open; it never writes `awaiting_drop`.
alter table sweeper.partition_retirements add column drop_after timestamptz;
-- The table the evidence describes (its oid when the manifest was recorded): the drop after the
-- grace drops that table only, never another one given its name meanwhile.
alter table sweeper.partition_retirements add column relid bigint;
alter table sweeper.partition_retirements drop constraint partition_retirements_state_check;
alter table sweeper.partition_retirements add constraint partition_retirements_state_check
    check (state in ('would_drop', 'planned', 'detaching', 'detached', 'awaiting_drop',
                     'dropped', 'kept', 'gone'));
-- The retirer's claim of the drops whose grace has passed.
create index partition_retirements_awaiting_drop on sweeper.partition_retirements (drop_after)
    where state = 'awaiting_drop';
