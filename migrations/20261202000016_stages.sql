-- Stages (`after = [...]`): a command waits, held with kind `after`, until the runs it follows
-- for its window completed.
alter table sweeper.commands drop constraint commands_held_kind_check,
    add constraint commands_held_kind_check check (held_kind in
        ('schema', 'policy_changed', 'identity', 'approval', 'after', 'active_hours', 'governor',
         'pace'));
