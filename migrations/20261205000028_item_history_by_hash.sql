-- An item's history finds its lean audit rows by a 64-bit hash of the item key
-- (`hashtextextended`, the function PostgreSQL's hash partitioning uses), not by the key itself:
-- an index entry is 16 bytes whatever the key's length, where a composite or uuid key made it as
-- long as the key text (docs/design.md §7; BENCHMARKS.md "The item history index keyed by a
-- hash"). A reader asks for both the hash and the key, so a hash collision costs a filtered row,
-- never a wrong one.
--
-- Building the index takes each month's `audit_items` table in SHARE mode: commands wait to
-- write their audit rows until it is built (about a second per million rows); dropping the old
-- one then takes them in ACCESS EXCLUSIVE mode until this migration commits, a moment after.
-- ANALYZE gives the planner the new expression's statistics on months no longer written to
-- (autovacuum does not analyze them again). Additive for a rolling upgrade: no query names an
-- index; the previous release's item history, which asks for the key alone, finds the same rows
-- while both releases run, by scanning every lean month's items (docs/upgrading.md).
create index audit_items_by_item_hash on sweeper.audit_items (hashtextextended(item_key, 0));
drop index sweeper.audit_items_by_item;
analyze sweeper.audit_items;
