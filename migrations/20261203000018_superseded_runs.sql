-- A run held by a stage (`after`) that executed nothing becomes `superseded` once a later
-- window's run of its policy completed (its later cutoff covered the window). Additive: the
-- status check only widens; a replica of the previous release reads an unknown status as not
-- terminal, but a superseded run's commands are cancelled in the same transaction, so it finds
-- nothing to execute.
alter table sweeper.runs drop constraint runs_status_check;
alter table sweeper.runs add constraint runs_status_check
    check (status in ('planning', 'running', 'completed', 'completed_with_dead_letters',
                      'cancelled', 'superseded')) not valid;
alter table sweeper.runs validate constraint runs_status_check;
