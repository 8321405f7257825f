//! `openapi.yaml` and the router describe the same endpoints.

use std::collections::BTreeSet;

use crate::common::*;
use serde_json::Value;

fn spec_operations() -> BTreeSet<(String, String)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.yaml"))
        .expect("openapi.yaml at the crate root");
    let doc: Value = yaml_serde::from_str(&text).expect("openapi.yaml parses");
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in ["get", "post", "put", "patch", "delete"] {
            if item.get(method).is_some() {
                ops.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    ops
}

#[test]
fn openapi_lists_exactly_the_routes_of_the_router() {
    let routes: BTreeSet<(String, String)> = sweeper::http::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    let spec = spec_operations();
    let missing: Vec<_> = routes.difference(&spec).collect();
    let extra: Vec<_> = spec.difference(&routes).collect();
    assert!(
        missing.is_empty(),
        "routes missing from openapi.yaml: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "openapi.yaml has operations the router lacks: {extra:?}"
    );
}

#[tokio::test]
async fn every_route_in_the_table_is_served() {
    let app = TestApp::spawn(Spawn::default()).await;
    let token = app.ops_token();
    for (method, path) in sweeper::http::ROUTES {
        let concrete = path
            .replace("{policy}", "ticket-retention")
            .replace("{run_id}", "ticket-retention:2026-01-01T02:00:00Z");
        let r = app
            .client
            .request(method.parse().unwrap(), format!("{}{concrete}", app.base))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        assert_ne!(status, 405, "{method} {path}");
        assert_ne!(
            body["type"], "urn:sweeper:problem:not-found",
            "{method} {path} hit the fallback"
        );
    }
    // And something that is not in the table is not served.
    let r = app.post("/runs", Some(&token)).await;
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let r = app
        .client
        .get(format!("{}/nope", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

/// The pinned schemathesis the contract check runs (PyPI).
const SCHEMATHESIS: &str = "schemathesis==4.32.5";

/// schemathesis, installed once into `target/contract-venv`.
fn schemathesis() -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = root.join("target/contract-venv");
    let bin = venv.join("bin/schemathesis");
    let version = SCHEMATHESIS.replace("==", ", version ");
    let installed = std::process::Command::new(&bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == version);
    if !installed {
        let run = |cmd: &mut std::process::Command| {
            let out = cmd.output().expect("python3 is on PATH");
            assert!(
                out.status.success(),
                "{cmd:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(std::process::Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv));
        run(std::process::Command::new(venv.join("bin/pip")).args(["install", "-q", SCHEMATHESIS]));
    }
    bin
}

/// The contract checked by a real peer: schemathesis, every operation of the served spec with
/// `--checks all`, a fixed seed and bounded examples, a token per scope, and a fresh database
/// and server for every operation that changes state (tests/contract/run.py). Any finding — a
/// schema-valid request refused, a schema-violating one accepted, an undocumented status or
/// body — fails.
#[test]
fn schemathesis_finds_nothing_against_a_live_server() {
    let schemathesis = schemathesis();
    // schemathesis's own python: it has PyYAML, which run.py reads the spec with.
    let python = schemathesis.with_file_name("python3");
    let out = std::process::Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/contract/run.py"
        ))
        .env("SCHEMATHESIS", &schemathesis)
        .env("SWEEPER_BIN", env!("CARGO_BIN_EXE_sweeper"))
        .env("DATABASE_URL", server_url())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("schemathesis: no findings"), "{stdout}");
}
