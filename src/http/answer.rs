//! docs/design.md §5's answer table as a pure function: what `/consume` answers for each outcome, on the
//! generic envelope (plain HTTP semantics) and on push transports (every "not now" is a
//! republish the execution committed, plus an acknowledgement; every delivery that can never
//! succeed an acknowledgement). The HTTP layer only turns an [`Answer`] into a response; it
//! writes nothing to the ledger.

use serde_json::{Value, json};

use crate::execute::ConsumeOutcome;

/// What `/consume` answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// 200 with this body.
    Ok(Value),
    /// A push delivery that is "not now": the execution committed a republish due in
    /// `retry_after_seconds`; answer 200 with `body`.
    Republish {
        /// The 200 body.
        body: Value,
        /// When the command is due again.
        retry_after_seconds: u64,
    },
    /// A generic-envelope delivery that is "not now": 503 `not-now` with `Retry-After`.
    NotNow {
        /// Why, for the problem's `detail`.
        reason: String,
        /// `Retry-After` in seconds.
        retry_after_seconds: u64,
    },
    /// A generic-envelope delivery of a command the ledger does not know: 404 `unknown-command`.
    UnknownCommand {
        /// The command id as delivered.
        command_id: String,
    },
}

/// The answer to `outcome` of the delivery of `command_id`, for a push (`push`: an authenticated
/// push credential, or a Pub/Sub push body) or a generic envelope.
pub fn answer(command_id: &str, outcome: ConsumeOutcome, push: bool) -> Answer {
    match outcome {
        ConsumeOutcome::Executed {
            command_id,
            counts,
            run_status,
        } => Answer::Ok(json!({"command_id": command_id, "result": "executed",
                               "counts": counts, "run_status": run_status})),
        ConsumeOutcome::Duplicate { command_id, state } => {
            Answer::Ok(json!({"command_id": command_id, "result": "duplicate", "state": state}))
        }
        ConsumeOutcome::Quarantined { command_id, error } => {
            Answer::Ok(json!({"command_id": command_id, "result": "quarantined", "error": error}))
        }
        ConsumeOutcome::UnknownOfTerminalRun { command_id } => Answer::Ok(
            json!({"command_id": command_id, "result": "unknown_command_of_terminal_run"}),
        ),
        // A push of a command the ledger does not know can never succeed: redelivering it
        // helps no one, so it is acknowledged (logged and counted by the caller).
        ConsumeOutcome::Unknown { command_id } if push => {
            Answer::Ok(json!({"command_id": command_id, "result": "unknown_command"}))
        }
        ConsumeOutcome::Unknown { command_id } => Answer::UnknownCommand { command_id },
        ConsumeOutcome::NotNow {
            reason,
            retry_after_seconds,
        } if push => Answer::Republish {
            body: json!({"command_id": command_id, "result": "not_now", "reason": reason,
                         "republish_in_seconds": retry_after_seconds}),
            retry_after_seconds,
        },
        ConsumeOutcome::NotNow {
            reason,
            retry_after_seconds,
        } => Answer::NotNow {
            reason,
            retry_after_seconds,
        },
        // A delivery is never stale (only a claim is): the variant has no value here.
        ConsumeOutcome::Stale(never) => match never {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn not_now() -> ConsumeOutcome {
        ConsumeOutcome::NotNow {
            reason: "later".into(),
            retry_after_seconds: 7,
        }
    }

    fn unknown() -> ConsumeOutcome {
        ConsumeOutcome::Unknown {
            command_id: "p:w:0".into(),
        }
    }

    #[test]
    fn a_push_is_acknowledged_for_everything_the_ledger_decided() {
        assert!(matches!(
            answer("p:w:0", not_now(), true),
            Answer::Republish {
                retry_after_seconds: 7,
                ..
            }
        ));
        assert_eq!(
            answer("p:w:0", unknown(), true),
            Answer::Ok(json!({"command_id": "p:w:0", "result": "unknown_command"}))
        );
        let quarantined = ConsumeOutcome::Quarantined {
            command_id: "c".into(),
            error: "e".into(),
        };
        assert!(matches!(answer("c", quarantined, true), Answer::Ok(_)));
    }

    #[test]
    fn the_generic_envelope_keeps_plain_http_semantics() {
        assert_eq!(
            answer("p:w:0", not_now(), false),
            Answer::NotNow {
                reason: "later".into(),
                retry_after_seconds: 7
            }
        );
        assert_eq!(
            answer("p:w:0", unknown(), false),
            Answer::UnknownCommand {
                command_id: "p:w:0".into()
            }
        );
        let dup = ConsumeOutcome::Duplicate {
            command_id: "c".into(),
            state: "succeeded".into(),
        };
        assert!(matches!(answer("c", dup, false), Answer::Ok(_)));
    }
}
