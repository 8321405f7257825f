//! The layers of docs/design.md §14, checked on the source: no import cycle between the top-level
//! modules of `src/`, `src/ledger/` the only code that writes the ledger's tables, and no file
//! over 500 lines nor function over 80 without a one-line reason (`// Over 80 lines: ...`).
//! (`cargo test --features failpoints --test integration architecture` is the command.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module → the top-level modules its code (tests and comments aside) names as
/// `crate::{module}`.
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap();
            let top = rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            if top == "lib" || top == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            let deps = graph.entry(top.clone()).or_default();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for part in line.split("crate::").skip(1) {
                    let name: String = part
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() && name != top {
                        deps.insert(name);
                    }
                }
            }
        }
    }
    graph
}

/// A cycle in `graph`, if there is one, as the modules along it.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut cycle = path[i..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for d in graph.get(m).into_iter().flatten() {
            if graph.contains_key(d)
                && let Some(c) = visit(d, graph, path, done)
            {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_top_level_module_imports_one_that_imports_it_back() {
    let graph = module_graph();
    assert!(graph.len() > 10, "{graph:?}");
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import cycle: {}", cycle.join(" -> "));
    }
}

#[test]
fn the_cycle_check_finds_a_cycle() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        find_cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    g.get_mut("c").unwrap().clear();
    assert_eq!(find_cycle(&g), None);
}

/// Every `.rs` file under `src/` with its text.
fn sources() -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(&src)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.push((rel, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    out
}

/// `insert into sweeper.x`, `update sweeper.x`, `delete from sweeper.x` in `text`
/// (case-insensitive, any whitespace).
fn ledger_writes(text: &str) -> Vec<String> {
    let words: Vec<String> = text
        .split(|c: char| c.is_whitespace() || c == '"' || c == '(')
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect();
    let mut found = Vec::new();
    for w in words.windows(3) {
        let target = match (w[0].as_str(), w[1].as_str()) {
            ("insert", "into") | ("delete", "from") => &w[2],
            ("update", t) if t.starts_with("sweeper.") => &w[1],
            _ => continue,
        };
        if target.starts_with("sweeper.") {
            found.push(format!("{} {}", w[0], target));
        }
    }
    found
}

#[test]
fn only_the_ledger_module_writes_ledger_tables() {
    let mut outside = Vec::new();
    for (file, text) in sources() {
        if file.starts_with("ledger/") {
            continue;
        }
        for w in ledger_writes(&text) {
            outside.push(format!("src/{file}: {w}"));
        }
    }
    assert!(
        outside.is_empty(),
        "ledger writes outside src/ledger/:\n{}",
        outside.join("\n")
    );
    assert!(!ledger_writes("UPDATE  sweeper.commands set").is_empty());
    assert!(!ledger_writes("insert into\n sweeper.audit").is_empty());
    assert!(ledger_writes("update demo.tickets set").is_empty());
}

/// The functions of `text` longer than `limit` lines that carry no `// Over 80 lines: ...`
/// reason on the lines just above them: (name, first line, length). Lengths are counted from the
/// `fn` line to its closing brace (braces in strings and comments are rare enough in our code to
/// ignore).
fn long_functions_without_a_reason(text: &str, limit: usize) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        if t.starts_with("//") {
            continue;
        }
        let Some(after) = t
            .split_once("fn ")
            .filter(|(before, _)| {
                before.is_empty()
                    || before
                        .split_whitespace()
                        .all(|w| w.starts_with("pub") || w == "async" || w == "const")
            })
            .map(|(_, a)| a)
        else {
            continue;
        };
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let (mut depth, mut opened, mut end) = (0i32, false, i);
        for (j, l) in lines.iter().enumerate().skip(i) {
            for c in l.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            end = j;
            if (opened && depth == 0) || (!opened && l.trim_end().ends_with(';')) {
                break;
            }
        }
        let length = end - i + 1;
        let reasoned = lines[..i]
            .iter()
            .rev()
            .take_while(|l| {
                let t = l.trim_start();
                t.starts_with("//") || t.starts_with("#[")
            })
            .any(|l| l.contains("// Over 80 lines:"));
        if length > limit && !reasoned {
            found.push((name, i + 1, length));
        }
    }
    found
}

#[test]
fn no_file_over_500_lines_and_no_function_over_80_without_a_reason() {
    let mut problems = Vec::new();
    for (path, text) in sources() {
        let n = text.lines().count();
        if n > 500 {
            problems.push(format!("{path}: {n} lines"));
        }
        for (name, line, length) in long_functions_without_a_reason(&text, 80) {
            problems.push(format!("{path}:{line}: fn {name} is {length} lines"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_length_check_finds_a_long_function() {
    let body = "    let x = 1;\n".repeat(81);
    let text = format!("/// Doc.\npub async fn long() {{\n{body}}}\n");
    assert_eq!(long_functions_without_a_reason(&text, 80).len(), 1);
    let reasoned =
        format!("/// Doc.\n// Over 80 lines: a reason.\npub async fn long() {{\n{body}}}\n");
    assert!(long_functions_without_a_reason(&reasoned, 80).is_empty());
}
