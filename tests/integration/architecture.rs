//! The layers of docs/design.md §14, checked on the source: every top-level module of `src/` has
//! a place in [`LAYERS`] and names only modules in layers below its own (never one beside or
//! above it), no import cycle, and `src/ledger/` the only code that writes the ledger's tables.
//! File and function length are a review habit, not a check.
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

/// The layers, top to bottom (docs/design.md §14 shows the same map). A module may name only
/// modules of the layers after its own.
const LAYERS: &[&[&str]] = &[
    &["cli"],
    &["quickstart"],
    &["app"],
    &["http"],
    &["windows", "retire"],
    &["trigger", "plan", "execute"],
    &["completion"],
    &["holds"],
    &["state"],
    &["settings", "schedules"],
    &["transport", "dependency"],
    &["auth"],
    &["policy"],
    &["governor", "metrics"],
    &["ledger"],
    &[
        "retry",
        "window",
        "strict_json",
        "failpoints",
        "export_file",
    ],
    &["config"],
];

/// The layer of `module` (0 is the top), if it has one.
fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// Every use of a module that is not below the user's layer: `user -> used` with both layers.
fn uses_against_the_layers(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut wrong = Vec::new();
    for (user, used) in graph {
        let Some(from) = layer_of(user) else {
            wrong.push(format!("{user} has no place in LAYERS"));
            continue;
        };
        // Names that are no module of `src/` (the failpoint macros) are left out.
        for u in used.iter().filter(|u| graph.contains_key(*u)) {
            match layer_of(u) {
                Some(to) if to > from => {}
                Some(to) => wrong.push(format!(
                    "{user} (layer {from}) uses {u} (layer {to}), which is not below it"
                )),
                None => wrong.push(format!("{u} has no place in LAYERS")),
            }
        }
    }
    wrong
}

#[test]
fn every_module_has_a_layer_and_uses_only_the_layers_below_it() {
    let graph = module_graph();
    assert!(graph.len() > 10, "{graph:?}");
    let wrong = uses_against_the_layers(&graph);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_direction_check_finds_a_use_sideways_and_upwards() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("plan".into()).or_default().insert("execute".into());
    g.entry("execute".into()).or_default();
    g.entry("metrics".into()).or_default().insert("http".into());
    g.entry("http".into()).or_default().insert("ledger".into());
    g.entry("ledger".into()).or_default();
    g.entry("unplaced".into()).or_default();
    let wrong = uses_against_the_layers(&g);
    assert_eq!(wrong.len(), 3, "{wrong:?}");
    assert!(wrong[0].starts_with("metrics (layer 13) uses http"));
    assert!(wrong[1].starts_with("plan (layer 5) uses execute"));
    assert_eq!(wrong[2], "unplaced has no place in LAYERS");
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
    assert!(!ledger_writes("insert into\n sweeper.audit_items").is_empty());
    assert!(ledger_writes("update demo.tickets set").is_empty());
}
