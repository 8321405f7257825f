//! A typed client for sweeper's HTTP API: one method per endpoint, each asserting the status the
//! endpoint answers on success and returning the JSON body; [`Client::send`] for the answers a
//! test expects to be refusals. Tokens are real HS256 JWTs minted by the service's own code.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

/// Every scope sweeper knows (docs/design.md §9).
pub const ALL_SCOPES: [&str; 4] = ["trigger:*", "consume", "ops:read", "ops:write"];

/// A signed HS256 token from `iss` (key `kid` = `secret`) for `subject` with `scopes`, valid
/// `ttl_seconds`.
pub fn mint(
    iss: &str,
    kid: &str,
    secret: &str,
    subject: &str,
    scopes: &[&str],
    ttl_seconds: i64,
) -> String {
    let issuer = sweeper::auth::Issuer {
        iss: iss.into(),
        audience: "sweeper".into(),
        keys: vec![(kid.into(), secrecy::SecretString::from(secret.to_string()))],
    };
    let scopes: Vec<String> = scopes.iter().map(|s| s.to_string()).collect();
    sweeper::auth::mint(&issuer, subject, &scopes, ttl_seconds).unwrap()
}

/// An answer: status and JSON body (`null` when the body is not JSON).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

/// A client for one server, with one bearer token.
#[derive(Clone)]
pub struct Client {
    /// `http://127.0.0.1:{port}` (or `https://...`).
    pub base: String,
    pub http: reqwest::Client,
    pub token: String,
}

impl Client {
    pub fn new(base: &str, token: String) -> Client {
        Client {
            base: base.to_string(),
            http: reqwest::Client::new(),
            token,
        }
    }

    /// The same server with another token.
    pub fn with_token(&self, token: String) -> Client {
        Client {
            token,
            ..self.clone()
        }
    }

    /// Sends `method path` with the bearer token and an optional JSON body; whatever the status.
    pub async fn send(&self, method: Method, path: &str, body: Option<Value>) -> Answer {
        let mut r = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let r = r.send().await.unwrap();
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r.json().await.unwrap_or(Value::Null);
        Answer {
            status,
            headers,
            body,
        }
    }

    /// [`Client::send`], asserting `status`; returns the body.
    pub async fn expect(
        &self,
        status: u16,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Value {
        let what = format!("{method} {path}");
        let a = self.send(method, path, body).await;
        assert_eq!(a.status, status, "{what}: {}", a.body);
        a.body
    }

    /// `POST /trigger/{policy}{query}` (`query` starts with `?` or is empty): 202 for a new run,
    /// 200 for the run this window already has, a problem otherwise.
    pub async fn trigger(&self, policy: &str, query: &str) -> Answer {
        self.send(Method::POST, &format!("/trigger/{policy}{query}"), None)
            .await
    }

    /// [`Client::trigger`], asserting a new run (202); returns its `run_id`.
    pub async fn trigger_new(&self, policy: &str, query: &str) -> String {
        let a = self.trigger(policy, query).await;
        assert_eq!(a.status, 202, "trigger {policy}{query}: {}", a.body);
        a.body["run_id"].as_str().unwrap().to_string()
    }

    /// `POST /consume` `{"command_id"}` (the generic envelope); whatever the status.
    pub async fn consume(&self, command_id: &str) -> Answer {
        self.send(
            Method::POST,
            "/consume",
            Some(json!({ "command_id": command_id })),
        )
        .await
    }

    /// `GET /runs{query}` (200).
    pub async fn runs(&self, query: &str) -> Value {
        self.expect(200, Method::GET, &format!("/runs{query}"), None)
            .await
    }

    /// `GET /runs/{run_id}` (200).
    pub async fn run(&self, run_id: &str) -> Value {
        self.expect(200, Method::GET, &format!("/runs/{run_id}"), None)
            .await
    }

    /// `GET /runs/{run_id}/items{query}` (200).
    pub async fn run_items(&self, run_id: &str, query: &str) -> Value {
        self.expect(
            200,
            Method::GET,
            &format!("/runs/{run_id}/items{query}"),
            None,
        )
        .await
    }

    /// `POST /runs/{run_id}/cancel` `{"reason"}` (200).
    pub async fn cancel_run(&self, run_id: &str, reason: &str) -> Value {
        let body = json!({ "reason": reason });
        self.expect(
            200,
            Method::POST,
            &format!("/runs/{run_id}/cancel"),
            Some(body),
        )
        .await
    }

    /// `GET /policies` (200).
    pub async fn policies(&self) -> Value {
        self.expect(200, Method::GET, "/policies", None).await
    }

    /// `POST /policies/{policy}/suspend` `{"reason"}` (200).
    pub async fn suspend(&self, policy: &str, reason: &str) -> Value {
        let body = json!({ "reason": reason });
        self.expect(
            200,
            Method::POST,
            &format!("/policies/{policy}/suspend"),
            Some(body),
        )
        .await
    }

    /// `POST /policies/{policy}/resume` `{"reason"}` (200).
    pub async fn resume(&self, policy: &str, reason: &str) -> Value {
        let body = json!({ "reason": reason });
        self.expect(
            200,
            Method::POST,
            &format!("/policies/{policy}/resume"),
            Some(body),
        )
        .await
    }

    /// `GET /policies/{policy}/windows{query}` (200).
    pub async fn windows(&self, policy: &str, query: &str) -> Value {
        self.expect(
            200,
            Method::GET,
            &format!("/policies/{policy}/windows{query}"),
            None,
        )
        .await
    }

    /// `POST /policies/{policy}/backfill` with `body` (a `reason` is added when absent).
    pub async fn backfill(&self, policy: &str, mut body: Value) -> Answer {
        if body.get("reason").is_none() {
            body["reason"] = json!("the scheduler skipped it");
        }
        self.send(
            Method::POST,
            &format!("/policies/{policy}/backfill"),
            Some(body),
        )
        .await
    }

    /// `GET /dead-letters{query}` (200): the `dead_letters` array.
    pub async fn dead_letters(&self, query: &str) -> Vec<Value> {
        let body = self
            .expect(200, Method::GET, &format!("/dead-letters{query}"), None)
            .await;
        body["dead_letters"].as_array().unwrap().clone()
    }

    /// `GET /dead-letters/{id}` (200).
    pub async fn dead_letter(&self, id: i64) -> Value {
        self.expect(200, Method::GET, &format!("/dead-letters/{id}"), None)
            .await
    }

    /// `POST /dead-letters/{id}/redrive` `{"reason"}` (200).
    pub async fn redrive(&self, id: i64, reason: &str) -> Value {
        let body = json!({ "reason": reason });
        self.expect(
            200,
            Method::POST,
            &format!("/dead-letters/{id}/redrive"),
            Some(body),
        )
        .await
    }

    /// `POST /dead-letters/redrive` with `filter` (`reason` plus `run_id`/`class`/`limit`) (200).
    pub async fn redrive_many(&self, filter: Value) -> Value {
        self.expect(200, Method::POST, "/dead-letters/redrive", Some(filter))
            .await
    }

    /// `POST /dead-letters/{id}/abandon` `{"reason"}` (200).
    pub async fn abandon(&self, id: i64, reason: &str) -> Value {
        let body = json!({ "reason": reason });
        self.expect(
            200,
            Method::POST,
            &format!("/dead-letters/{id}/abandon"),
            Some(body),
        )
        .await
    }

    /// `GET /healthz` (200).
    pub async fn healthz(&self) -> Value {
        self.expect(200, Method::GET, "/healthz", None).await
    }

    /// `GET /readyz`; whatever the status (503 while not ready).
    pub async fn readyz(&self) -> Answer {
        self.send(Method::GET, "/readyz", None).await
    }

    /// `GET /metrics` (200): the Prometheus text.
    pub async fn metrics(&self) -> String {
        let r = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "GET /metrics");
        r.text().await.unwrap()
    }

    /// Polls `GET /runs/{run_id}` (every 50 ms, up to 120 s: the whole suite runs in parallel on
    /// two cores, with Java emulators starting) until `done` holds; returns the run.
    pub async fn wait_run(&self, run_id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let started = Instant::now();
        loop {
            let r = self.run(run_id).await;
            if done(&r) {
                return r;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "run {run_id} not {what} after 120 s: {r}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the run is terminal; returns it.
    pub async fn wait_terminal(&self, run_id: &str) -> Value {
        self.wait_run(run_id, "terminal", |r| {
            r["status"]
                .as_str()
                .is_some_and(crate::kit::ledger::is_terminal)
        })
        .await
    }
}
