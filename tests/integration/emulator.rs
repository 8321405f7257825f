//! The Google Pub/Sub emulator (Java, on loopback) as a test peer: started on a free port,
//! stopped with the test.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

/// The emulator's launcher; `PUBSUB_EMULATOR_BIN` overrides it.
fn emulator_bin() -> String {
    std::env::var("PUBSUB_EMULATOR_BIN").unwrap_or_else(|_| {
        "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator".into()
    })
}

pub struct Emulator {
    child: Child,
    pub host: String,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        // The launcher script starts java as a child: end it first.
        let _ = Command::new("pkill")
            .args(["-TERM", "-P", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub async fn emulator() -> Emulator {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(emulator_bin())
        .args(["--host=127.0.0.1", &format!("--port={port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the Pub/Sub emulator (google-cloud-cli-pubsub-emulator) must be installed");
    let host = format!("127.0.0.1:{port}");
    let started = Instant::now();
    while reqwest::get(format!("http://{host}/v1/projects/test/topics"))
        .await
        .map(|r| !r.status().is_success())
        .unwrap_or(true)
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the emulator did not start"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Emulator { child, host }
}

/// Creates the topic and a push subscription to `{base}/consume` (with the query token from
/// `CARGO_PKG_DESCRIPTION`) with `ack_deadline` seconds.
pub async fn subscribe(em: &Emulator, base: &str, ack_deadline: u32) {
    let http = reqwest::Client::new();
    let r = http
        .put(format!(
            "http://{}/v1/projects/test/topics/sweeper",
            em.host
        ))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let secret = std::env::var("CARGO_PKG_DESCRIPTION").unwrap();
    let token: String = url::form_urlencoded::byte_serialize(secret.as_bytes()).collect();
    let r = http
        .put(format!(
            "http://{}/v1/projects/test/subscriptions/push",
            em.host
        ))
        .json(&json!({
            "topic": "projects/test/topics/sweeper",
            "pushConfig": {"pushEndpoint": format!("{base}/consume?token={token}")},
            "ackDeadlineSeconds": ack_deadline,
        }))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
}
