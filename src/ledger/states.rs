//! The states of the ledger's rows as types (docs/design.md §7): a command's state, a run's status
//! and the blast-radius guard's decision on a run.
//! SQL inside `ledger/` writes the same names; code outside reads them through these.

/// A command's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandState {
    /// Waiting for its next attempt (or its window).
    Pending,
    /// Claimed by a worker, or leased for its external calls.
    Leased,
    /// Done: every item has its outcome.
    Succeeded,
    /// Stopped by a permanent failure or a spent budget; a dead letter holds it.
    Quarantined,
    /// Stopped by an operator's cancel.
    Cancelled,
}

impl CommandState {
    /// Every state, in the order metrics and views list them.
    pub const ALL: [CommandState; 5] = [
        CommandState::Pending,
        CommandState::Leased,
        CommandState::Succeeded,
        CommandState::Quarantined,
        CommandState::Cancelled,
    ];

    /// The name stored in `sweeper.commands.state`.
    pub fn as_str(self) -> &'static str {
        match self {
            CommandState::Pending => "pending",
            CommandState::Leased => "leased",
            CommandState::Succeeded => "succeeded",
            CommandState::Quarantined => "quarantined",
            CommandState::Cancelled => "cancelled",
        }
    }

    /// The state named `s`, if any.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// Whether nothing more happens to the command (until an operator redrives it).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            CommandState::Succeeded | CommandState::Quarantined | CommandState::Cancelled
        )
    }
}

/// A run's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    /// Commands are still being planned.
    Planning,
    /// Planned; commands not all terminal.
    Running,
    /// Every command succeeded with no failed item.
    Completed,
    /// Done, with a dead letter that is not resolved.
    CompletedWithDeadLetters,
    /// Stopped by an operator.
    Cancelled,
    /// Executed nothing while a stage held it, and a later window's completed run of its policy
    /// covers its window (its later cutoff removed everything this one would have).
    Superseded,
}

impl RunStatus {
    /// Every status, in the order metrics and views list them.
    pub const ALL: [RunStatus; 6] = [
        RunStatus::Planning,
        RunStatus::Running,
        RunStatus::Completed,
        RunStatus::CompletedWithDeadLetters,
        RunStatus::Cancelled,
        RunStatus::Superseded,
    ];

    /// The name stored in `sweeper.runs.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Planning => "planning",
            RunStatus::Running => "running",
            RunStatus::Completed => "completed",
            RunStatus::CompletedWithDeadLetters => "completed_with_dead_letters",
            RunStatus::Cancelled => "cancelled",
            RunStatus::Superseded => "superseded",
        }
    }

    /// The status named `s`, if any.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// Whether the run is final (completed either way, cancelled or superseded).
    pub fn is_terminal(self) -> bool {
        !matches!(self, RunStatus::Planning | RunStatus::Running)
    }

    /// Whether it completed (with or without dead letters).
    pub fn is_completed(self) -> bool {
        matches!(
            self,
            RunStatus::Completed | RunStatus::CompletedWithDeadLetters
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_terminal_states_are_the_final_ones() {
        for s in CommandState::ALL {
            assert_eq!(CommandState::parse(s.as_str()), Some(s));
        }
        for r in RunStatus::ALL {
            assert_eq!(RunStatus::parse(r.as_str()), Some(r));
        }
        let terminal: Vec<&str> = CommandState::ALL
            .into_iter()
            .filter(|s| s.is_terminal())
            .map(CommandState::as_str)
            .collect();
        assert_eq!(terminal, ["succeeded", "quarantined", "cancelled"]);
        assert!(RunStatus::Cancelled.is_terminal() && !RunStatus::Cancelled.is_completed());
        assert_eq!(CommandState::parse("done"), None);
        assert!(RunStatus::Superseded.is_terminal() && !RunStatus::Superseded.is_completed());
        // A status a later release adds is final to this one: it never executes such a run.
        assert!(crate::ledger::is_terminal_run_status("archived"));
        assert!(!crate::ledger::is_terminal_run_status("running"));
    }
}

/// `('a', 'b')`: names of ours (never user input) as an SQL list, for `x in ...`.
pub(crate) fn sql_list<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let quoted: Vec<String> = names.map(|n| format!("'{n}'")).collect();
    format!("({})", quoted.join(", "))
}

/// The blast-radius guard's decision on a run (`runs.approval`; NULL: no guard, or a dry run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Approval {
    /// Planning is not done; the guard decides then. Nothing executes before.
    AwaitingPlan,
    /// The planned count crossed the guard: held until approved or cancelled.
    Required,
    /// An operator approved it.
    Approved,
    /// Under every limit of the guard.
    NotRequired,
}

impl Approval {
    /// Every decision.
    pub const ALL: [Approval; 4] = [
        Approval::AwaitingPlan,
        Approval::Required,
        Approval::Approved,
        Approval::NotRequired,
    ];

    /// The name stored in `sweeper.runs.approval`.
    pub fn as_str(self) -> &'static str {
        match self {
            Approval::AwaitingPlan => "awaiting_plan",
            Approval::Required => "required",
            Approval::Approved => "approved",
            Approval::NotRequired => "not_required",
        }
    }

    /// The decision named `s`, if any.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == s)
    }

    /// Whether it holds the run's commands (a hold of kind `approval`).
    pub fn holds(self) -> bool {
        matches!(self, Approval::AwaitingPlan | Approval::Required)
    }

    /// The decisions that hold, as an SQL list for `approval in ...`.
    pub(crate) fn holding_sql() -> String {
        sql_list(
            Self::ALL
                .into_iter()
                .filter(|a| a.holds())
                .map(Self::as_str),
        )
    }
}
