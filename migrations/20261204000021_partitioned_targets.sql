-- Time-partitioned targets: planning walks one leaf partition at a time, in bound order, and each
-- command remembers the leaf its keys were planned in, so its statements prune to that leaf.
-- `planning_jobs.partitions` is the run's leaves (fixed on its first page; NULL for a table that
-- is not partitioned), `cursor_partition` the position in it of the leaf the cursor is in.
-- `commands.partition` names the leaf (schema-qualified, quoted as needed); NULL: the whole table.
-- Additive: the previous release neither reads nor writes the new columns.
alter table sweeper.planning_jobs
    add column partitions text[],
    add column cursor_partition integer not null default 0;
alter table sweeper.commands add column partition text;
