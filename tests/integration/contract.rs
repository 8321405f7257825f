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
