-- A command whose rows are locked by another transaction does what it can and waits for the rest
-- without spending an attempt: its failure class is `locked` (a snooze whose time counts against
-- max_age). Widen the three class checks; the previous release never writes the new value.
-- NOT VALID then VALIDATE: the existing rows are checked without blocking writers.
alter table sweeper.commands drop constraint commands_last_error_class_check,
    add constraint commands_last_error_class_check
        check (last_error_class in ('transient', 'throttled', 'locked', 'permanent')) not valid;
alter table sweeper.commands validate constraint commands_last_error_class_check;
alter table sweeper.attempts drop constraint attempts_class_check,
    add constraint attempts_class_check
        check (class in ('transient', 'throttled', 'locked', 'permanent')) not valid;
alter table sweeper.attempts validate constraint attempts_class_check;
alter table sweeper.dead_letters drop constraint dead_letters_class_check,
    add constraint dead_letters_class_check
        check (class in ('transient', 'throttled', 'locked', 'permanent')) not valid;
alter table sweeper.dead_letters validate constraint dead_letters_class_check;
