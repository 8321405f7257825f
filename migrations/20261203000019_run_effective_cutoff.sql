-- The stricter cutoff a run completed under (its policy's current version's, when that was
-- earlier than the run's own), recorded with the closure check so a finished run says which
-- cutoff it acted under. NULL: the run's own cutoff (or a run completed before this column).
alter table sweeper.runs add column stricter_cutoff timestamptz,
                         add column stricter_version text;
