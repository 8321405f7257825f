//! The on-call runbook (`docs/on-call.md`), run verbatim with bash, curl and jq against a live
//! server: first with nothing to look at, then with a real failure (a foreign key that refuses
//! the delete of one eligible ticket), each answer checked.

use crate::common::*;

/// The commands of the fenced block after the `<!-- runbook: -->` marker of `docs/on-call.md`:
/// comment lines dropped, each remaining line one command (the block has no continuations).
fn runbook_commands() -> Vec<String> {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/on-call.md"))
        .expect("docs/on-call.md");
    let after = page
        .split_once("<!-- runbook:")
        .expect("docs/on-call.md marks its runbook")
        .1;
    let block = after
        .split_once("```sh\n")
        .expect("a sh block follows the marker")
        .1
        .split_once("\n```")
        .expect("the block ends")
        .0;
    block
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// Runs `script` with `bash -euo pipefail` against `app`, with `SWEEPER_URL`, a token of every
/// scope as `SWEEPER_TOKEN` and `RUN` (when given), off the runtime's thread (the server under
/// test answers on it); asserts it succeeded and returns its stdout.
async fn run_bash(app: &TestApp, script: &str, run: Option<&str>) -> String {
    let mut bash = std::process::Command::new("bash");
    bash.args(["-euo", "pipefail", "-c", script])
        .env("SWEEPER_URL", &app.base)
        .env("SWEEPER_TOKEN", app.ops_token());
    if let Some(run) = run {
        bash.env("RUN", run);
    }
    let out = tokio::task::spawn_blocking(move || bash.output())
        .await
        .unwrap()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[tokio::test]
async fn the_on_call_runbook_answers_which_run_why_whether_replay_is_safe_and_redrives() {
    let commands = runbook_commands();
    assert_eq!(commands.len(), 5, "{commands:#?}");
    assert!(
        commands
            .iter()
            .all(|c| !c.contains("$SWEEPER ") && !c.contains("$TOKEN")),
        "only SWEEPER_URL, SWEEPER_TOKEN and RUN: {commands:#?}"
    );

    let app = ticket_app("", "", TICKETS_WITH_CHILD).await;
    // Nothing to look at yet: the first command says so rather than printing nothing.
    let first = run_bash(&app, &commands[0], None).await;
    assert_eq!(first.trim(), "no run needs attention");
    let eligible = seed_mixed(&app.pool, 20, at("2026-09-01T02:00:00Z")).await;
    let (run_id, _) = run_with_blocked_item(&app, eligible[0]).await;

    // One shell for the whole block (KEY carries from one command to the next), a marker
    // after each command so each answer is checked on its own.
    let script: String = commands
        .iter()
        .map(|c| format!("{c}\necho '=== step'\n"))
        .collect();
    let stdout = run_bash(&app, &script, Some(&run_id)).await;
    let answers: Vec<&str> = stdout.split("=== step\n").collect();
    assert_eq!(answers.len(), 6, "{stdout}");

    // 1. The run, its status and why, on one line.
    let line = answers[0]
        .lines()
        .find(|l| l.starts_with(&run_id))
        .unwrap_or_else(|| panic!("{}", answers[0]));
    assert!(
        line.contains("completed_with_dead_letters")
            && line.contains("1 dead letter(s) open")
            && line.contains("SQLSTATE 23503"),
        "{line}"
    );
    // 2. The dead letter, safe to replay but still referenced.
    let run: serde_json::Value = serde_json::from_str(answers[1]).expect(answers[1]);
    let dl = &run["dead_letters"][0];
    assert_eq!(dl["item_key"], eligible[0].to_string());
    assert_eq!(
        (dl["safe"].as_bool(), dl["will_fail_again"].as_bool()),
        (Some(true), Some(true))
    );
    assert!(
        dl["cause"].as_str().unwrap().contains("demo.attachments"),
        "{dl}"
    );
    assert_eq!(run["progress"]["executed_fraction"], 1.0);
    // 3. The redrive names what it queued, and that it will fail again (still referenced).
    let redrive: serde_json::Value = serde_json::from_str(answers[2]).expect(answers[2]);
    let ids = serde_json::json!([dl["dead_letter_id"]]);
    assert_eq!(
        (&redrive["redriven"], &redrive["will_fail_again"]),
        (&ids, &ids)
    );
    // 4. KEY is set (no output); the record's history names the run, its cutoff and outcome.
    assert_eq!(answers[3], "");
    let history: serde_json::Value = serde_json::from_str(answers[4]).expect(answers[4]);
    assert_eq!(history["audit"][0]["run_id"], run_id.as_str(), "{history}");
    assert_eq!(history["audit"][0]["cutoff"], "2026-06-03T02:00:00Z");
    assert!(history["audit"][0]["outcome"].is_string());
    assert!(history["history_complete_since"].is_null());
}

/// The lines of the runbook's "More" block that look up one open dead letter of `$RUN`.
fn dead_letter_lookup() -> Vec<String> {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/on-call.md"))
        .expect("docs/on-call.md");
    let more = page.split_once("### More").expect("a More section").1;
    more.lines()
        .filter(|l| l.starts_with("DL=") || l.starts_with("if [ -z \"$DL\" ]"))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn the_dead_letter_lookup_says_when_a_run_has_none() {
    let lines = dead_letter_lookup();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    let app = ticket_app("", "", TICKETS).await;
    seed_mixed(&app.pool, 20, at("2026-09-01T02:00:00Z")).await;
    let (run_id, _) = app.planned_run().await;
    app.drain().await;
    app.wait_terminal(&run_id).await;
    let stdout = run_bash(&app, &lines.join("\n"), Some(&run_id)).await;
    assert_eq!(stdout.trim(), format!("no open dead letter in {run_id}"));
}
