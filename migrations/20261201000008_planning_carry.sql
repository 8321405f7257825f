-- Full commands across planning pages (issue 13): eligible keys a page found that do not fill a
-- command yet wait here, in the job row, until the next page (or the last) completes one. They
-- are written in the same transaction as the cursor that moved past them, so a crash neither
-- loses nor repeats them.
alter table sweeper.planning_jobs
    add column carry_keys text[] not null default '{}';
