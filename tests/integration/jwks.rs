//! RS256/ES256 tokens against a JWKS served on loopback (Google OIDC rules), the JWT attack
//! suite, and the query-string token for push systems without headers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

use crate::common::*;

const ISS: &str = "https://accounts.google.com";
const AUD: &str = "https://sweeper.test/consume";
const PUSHER: &str = "pusher@proj.iam.gserviceaccount.com";
const SCHEDULER: &str = "scheduler@proj.iam.gserviceaccount.com";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name),
    )
    .unwrap()
}

struct Jwks {
    fetches: Arc<AtomicUsize>,
    url: String,
    _task: tokio::task::JoinHandle<()>,
}

async fn jwks_server() -> Jwks {
    let fetches = Arc::new(AtomicUsize::new(0));
    let f = fetches.clone();
    let body = String::from_utf8(fixture("jwks-a.json")).unwrap();
    let app = axum::Router::new().route(
        "/certs",
        axum::routing::get(move || {
            f.fetch_add(1, Ordering::SeqCst);
            let body = body.clone();
            async move { ([("cache-control", "public, max-age=300")], body) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/certs", listener.local_addr().unwrap());
    let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Jwks {
        fetches,
        url,
        _task: task,
    }
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

fn google_claims(email: &str) -> Value {
    json!({"iss": ISS, "aud": AUD, "sub": "1234567890", "email": email, "email_verified": true,
           "iat": now(), "exp": now() + 600})
}

fn sign(alg: Algorithm, kid: &str, claims: &Value) -> String {
    let mut h = Header::new(alg);
    h.kid = Some(kid.into());
    let key = match alg {
        Algorithm::RS256 => EncodingKey::from_rsa_der(&fixture(&format!("{kid}.der"))),
        Algorithm::ES256 => EncodingKey::from_ec_der(&fixture(&format!("{kid}.der"))),
        _ => unreachable!(),
    };
    jsonwebtoken::encode(&h, claims, &key).unwrap()
}

async fn app_with_jwks(jwks_url: &str) -> TestApp {
    let extra = format!(
        r#"[[auth.jwks_issuer]]
iss = "{ISS}"
jwks_url = "{jwks_url}"
allow_http = true
algorithms = ["RS256", "ES256"]
audiences = ["{AUD}"]
google = true
principals = {{ "{PUSHER}" = ["consume"], "{SCHEDULER}" = ["trigger:*"] }}

[[auth.query_token]]
subject = "pubsub-emulator"
token_env = "CARGO_PKG_DESCRIPTION"
"#
    );
    TestApp::spawn(Spawn {
        extra_toml: extra,
        ..Default::default()
    })
    .await
}

/// The status `/consume` answers for `token`: 200 means accepted (an authenticated push of a
/// command the ledger does not know is acknowledged, docs/design.md §5).
async fn consume_status(app: &TestApp, token: &str) -> u16 {
    app.client
        .post(format!("{}/consume", app.base))
        .bearer_auth(token)
        .json(&json!({"command_id": "nothing:here:0"}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test]
async fn google_tokens_verify_against_the_jwks_and_attacks_do_not() {
    let jwks = jwks_server().await;
    let app = app_with_jwks(&jwks.url).await;

    // Good tokens: RS256 and ES256, mapped to `consume` by their verified email.
    let good = sign(Algorithm::RS256, "rsa-a", &google_claims(PUSHER));
    assert_eq!(consume_status(&app, &good).await, 200, "accepted");
    assert_eq!(
        consume_status(
            &app,
            &sign(Algorithm::ES256, "ec-a", &google_claims(PUSHER))
        )
        .await,
        200
    );
    assert_eq!(
        jwks.fetches.load(Ordering::SeqCst),
        1,
        "the key set is cached (max-age)"
    );
    // The scheduler's account holds trigger:* only.
    assert_eq!(
        consume_status(
            &app,
            &sign(Algorithm::RS256, "rsa-a", &google_claims(SCHEDULER))
        )
        .await,
        403
    );
    // An unknown account holds nothing.
    assert_eq!(
        consume_status(
            &app,
            &sign(Algorithm::RS256, "rsa-a", &google_claims("x@evil.example"))
        )
        .await,
        403
    );

    let mut attacks: Vec<(&str, String)> = Vec::new();
    // alg none.
    let parts: Vec<&str> = good.split('.').collect();
    let b64 = |v: &Value| base64_url(v.to_string().as_bytes());
    attacks.push((
        "alg none",
        format!(
            "{}.{}.",
            b64(&json!({"alg": "none", "kid": "rsa-a"})),
            parts[1]
        ),
    ));
    // HS256 with the RSA public key as the secret.
    let mut h = Header::new(Algorithm::HS256);
    h.kid = Some("rsa-a".into());
    attacks.push((
        "HS256 signed with the RSA public key",
        jsonwebtoken::encode(
            &h,
            &google_claims(PUSHER),
            &EncodingKey::from_secret(&fixture("rsa-a.pub.pem")).unwrap(),
        )
        .unwrap(),
    ));
    // Right key, another issuer.
    let mut c = google_claims(PUSHER);
    c["iss"] = json!("https://evil.example");
    attacks.push(("another issuer", sign(Algorithm::RS256, "rsa-a", &c)));
    // Audiences that are not exactly ours.
    for (what, aud) in [
        ("aud with a trailing slash", json!(format!("{AUD}/"))),
        ("aud with a query string", json!(format!("{AUD}?x=1"))),
        ("aud as an array", json!([AUD])),
    ] {
        let mut c = google_claims(PUSHER);
        c["aud"] = aud;
        attacks.push((what, sign(Algorithm::RS256, "rsa-a", &c)));
    }
    // Expired beyond the leeway; issued in the future; email not verified.
    let mut c = google_claims(PUSHER);
    c["exp"] = json!(now() - 120);
    attacks.push((
        "expired beyond the leeway",
        sign(Algorithm::RS256, "rsa-a", &c),
    ));
    let mut c = google_claims(PUSHER);
    c["iat"] = json!(now() + 3_600);
    c["exp"] = json!(now() + 7_200);
    attacks.push(("iat in the future", sign(Algorithm::RS256, "rsa-a", &c)));
    let mut c = google_claims(PUSHER);
    c["email_verified"] = json!(false);
    attacks.push(("email_verified false", sign(Algorithm::RS256, "rsa-a", &c)));
    // A 64 KiB token.
    let mut c = google_claims(PUSHER);
    c["pad"] = json!("x".repeat(64 * 1024));
    attacks.push(("a 64 KiB token", sign(Algorithm::RS256, "rsa-a", &c)));
    for (what, token) in &attacks {
        assert_eq!(consume_status(&app, token).await, 401, "{what}");
    }
    let before = jwks.fetches.load(Ordering::SeqCst);

    // Expired within the leeway is still accepted.
    let mut c = google_claims(PUSHER);
    c["exp"] = json!(now() - 10);
    assert_eq!(
        consume_status(&app, &sign(Algorithm::RS256, "rsa-a", &c)).await,
        200
    );

    // An unknown kid: one refresh of the key set, then 401; a second one within a minute does
    // not fetch again.
    let rotated = sign(Algorithm::RS256, "rsa-b", &google_claims(PUSHER));
    assert_eq!(consume_status(&app, &rotated).await, 401);
    assert_eq!(jwks.fetches.load(Ordering::SeqCst), before + 1);
    assert_eq!(consume_status(&app, &rotated).await, 401);
    assert_eq!(
        jwks.fetches.load(Ordering::SeqCst),
        before + 1,
        "at most one refresh a minute"
    );
}

fn base64_url(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for i in 0..=chunk.len() {
            out.push(T[(n >> (18 - 6 * i)) as usize & 63] as char);
        }
    }
    out
}

#[tokio::test]
async fn a_query_string_token_authenticates_consume_only() {
    let jwks = jwks_server().await;
    let app = app_with_jwks(&jwks.url).await;
    let secret = std::env::var("CARGO_PKG_DESCRIPTION").unwrap();
    let post = |path: String| {
        app.client
            .post(format!("{}{path}", app.base))
            .json(&json!({"command_id": "nothing:here:0"}))
            .send()
    };
    let enc: String = url::form_urlencoded::byte_serialize(secret.as_bytes()).collect();
    assert_eq!(
        post(format!("/consume?token={enc}"))
            .await
            .unwrap()
            .status(),
        200,
        "accepted"
    );
    assert_eq!(
        post("/consume?token=wrong-token-wrong-token-wrong-token".into())
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(post("/consume".into()).await.unwrap().status(), 401);
    // Nowhere else, and never beyond `consume`.
    assert_eq!(
        post(format!("/trigger/ticket-retention?token={enc}"))
            .await
            .unwrap()
            .status(),
        401
    );
    let r = app
        .client
        .get(format!("{}/runs?token={enc}", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}
