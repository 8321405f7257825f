//! HTTPS: a real TLS client verifies the served chain; certificates are reloaded on SIGHUP and
//! when the files change, while an open connection keeps working.

use std::process::Command;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};

use crate::common::*;
use crate::kit::process::{Launch, Server};

/// A CA and a leaf for 127.0.0.1 signed by it: (ca pem, leaf cert pem, leaf key pem).
fn chain(name: &str) -> (String, String, String) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("sweeper test CA {name}"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    (ca.pem(), leaf.pem(), leaf_key.serialize_pem())
}

fn client(ca_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap()])
        .pool_idle_timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

async fn healthz(client: &reqwest::Client, url: &str) -> Result<reqwest::Version, String> {
    let r = client
        .get(format!("{url}/healthz"))
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    assert_eq!(r.status(), 200);
    Ok(r.version())
}

async fn start_with_setup(text: &str, db: &TestDb) -> Server {
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(TICKETS).execute(&pool).await.unwrap();
    Server::launch(
        text,
        Launch {
            ready_within: None,
            ..Default::default()
        },
    )
    .await
}

fn write(dir: &std::path::Path, leaf: &(String, String, String)) {
    // Write then rename, as a secret volume or certbot does: never a half-written file.
    for (name, body) in [("cert.pem", &leaf.1), ("key.pem", &leaf.2)] {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

async fn wait_ready(client: &reqwest::Client, url: &str) -> reqwest::Version {
    let started = Instant::now();
    loop {
        if let Ok(v) = healthz(client, url).await {
            return v;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the HTTPS server did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn sighup_swaps_the_certificate_for_new_connections_and_open_ones_keep_working() {
    let (a, b) = (chain("a"), chain("b"));
    let db = TestDb::create().await;
    let dir = std::env::temp_dir().join(format!("sweeper-tls-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    write(&dir, &a);
    let text = tls_config(&db, &dir, "1h");
    let server = start_with_setup(&text, &db).await;
    let url = server.base.replace("http://", "https://");

    let trusts_a = client(&a.0);
    let version = wait_ready(&trusts_a, &url).await;
    assert_eq!(version, reqwest::Version::HTTP_2, "ALPN offers h2");
    let trusts_b = client(&b.0);
    assert!(
        healthz(&trusts_b, &url).await.is_err(),
        "chain a is served, b is not trusted"
    );

    // Replace the files: nothing changes until SIGHUP (the file check is hourly here).
    write(&dir, &b);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(healthz(&client(&b.0), &url).await.is_err());
    let pid = server.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let started = Instant::now();
    while healthz(&client(&b.0), &url).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "SIGHUP did not reload"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // New connections see chain b; the connection opened under chain a keeps working.
    assert!(
        healthz(&client(&a.0), &url).await.is_err(),
        "new handshakes use b"
    );
    assert!(
        healthz(&trusts_a, &url).await.is_ok(),
        "the open connection still works"
    );
    drop(server);
    drop(db);
}

#[tokio::test]
async fn changed_files_are_reloaded_and_a_broken_file_keeps_the_old_certificate() {
    let (a, b) = (chain("a"), chain("b"));
    let db = TestDb::create().await;
    let dir = std::env::temp_dir().join(format!("sweeper-tls-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    write(&dir, &a);
    let text = tls_config(&db, &dir, "1s");
    let server = start_with_setup(&text, &db).await;
    let url = server.base.replace("http://", "https://");
    wait_ready(&client(&a.0), &url).await;

    // A broken certificate file: the old certificate stays.
    std::fs::write(
        dir.join("cert.pem"),
        "-----BEGIN CERTIFICATE-----\nbroken\n",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(
        healthz(&client(&a.0), &url).await.is_ok(),
        "a failed reload keeps a"
    );

    write(&dir, &b);
    let started = Instant::now();
    while healthz(&client(&b.0), &url).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the file change was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(healthz(&client(&a.0), &url).await.is_err());
    drop(server);
    drop(db);
}

fn tls_config(db: &TestDb, dir: &std::path::Path, reload_check: &str) -> String {
    config_toml(&db.url, 0, "", &ticket_policy(10)).replace(
        "\n[[auth.issuer]]",
        &format!(
            "\n[tls]\ncert = \"{}\"\nkey = \"{}\"\nreload_check = \"{reload_check}\"\n\n[[auth.issuer]]",
            dir.join("cert.pem").display(),
            dir.join("key.pem").display()
        ),
    )
}
