//! One time rule for every credential, the Bearer scheme in any case, NumericDates with
//! fractions, and refusals in sweeper's own words (never a library's message).

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

use crate::common::*;

fn now() -> f64 {
    chrono::Utc::now().timestamp_millis() as f64 / 1000.0
}

/// An HS256 token signed with the test issuer's key `k2`, `claims` overriding the defaults
/// (`null` removes a claim).
fn hs256(claims: Value) -> String {
    let mut c = json!({"sub": "probe", "iss": "sweeper-test", "aud": "sweeper",
                       "exp": now() as i64 + 600, "iat": now() as i64, "scope": "ops:read"});
    for (k, v) in claims.as_object().unwrap() {
        if v.is_null() {
            c.as_object_mut().unwrap().remove(k);
        } else {
            c[k] = v.clone();
        }
    }
    signed(&c)
}

/// `claims` exactly as given, signed with the test issuer's key `k2`.
fn signed(c: &Value) -> String {
    let mut h = Header::new(Algorithm::HS256);
    h.kid = Some("k2".into());
    jsonwebtoken::encode(
        &h,
        &c,
        &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
    )
    .unwrap()
}

async fn get_runs(app: &TestApp, authorization: &str) -> (u16, Value) {
    let r = app
        .client
        .get(format!("{}/runs", app.base))
        .header("authorization", authorization)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn an_hs256_token_issued_in_the_future_is_refused_like_every_other_kind() {
    let app = TestApp::spawn(Spawn::default()).await;
    let t = now() as i64;
    for ahead in [300, 86_400, 365 * 86_400] {
        let token = hs256(json!({"iat": t + ahead, "exp": t + ahead + 600}));
        let (status, body) = get_runs(&app, &format!("Bearer {token}")).await;
        assert_eq!(status, 401, "iat +{ahead}s: {body}");
        assert_eq!(body["reason"], "issued-in-the-future", "{body}");
        assert_eq!(body["type"], "urn:sweeper:problem:unauthenticated");
    }
    // Within the leeway (30 s by default) the clocks are allowed to disagree.
    let token = hs256(json!({"iat": t + 20, "nbf": t + 20}));
    assert_eq!(get_runs(&app, &format!("Bearer {token}")).await.0, 200);
    // nbf and exp obey the same leeway.
    let token = hs256(json!({"nbf": t + 300}));
    let (status, body) = get_runs(&app, &format!("Bearer {token}")).await;
    assert_eq!(
        (status, body["reason"].as_str()),
        (401, Some("not-yet-valid"))
    );
    let token = hs256(json!({"exp": t - 20}));
    assert_eq!(get_runs(&app, &format!("Bearer {token}")).await.0, 200);
    let token = hs256(json!({"exp": t - 60}));
    let (status, body) = get_runs(&app, &format!("Bearer {token}")).await;
    assert_eq!((status, body["reason"].as_str()), (401, Some("expired")));
}

#[tokio::test]
async fn the_leeway_is_one_configured_value() {
    let app = TestApp::spawn(Spawn {
        extra_toml: "[auth]\nleeway = \"2m\"".into(),
        ..Default::default()
    })
    .await;
    let t = now() as i64;
    for claims in [
        json!({"iat": t + 100}),
        json!({"nbf": t + 100}),
        json!({"exp": t - 100}),
    ] {
        let token = hs256(claims.clone());
        assert_eq!(
            get_runs(&app, &format!("Bearer {token}")).await.0,
            200,
            "{claims}"
        );
    }
    let token = hs256(json!({"iat": t + 200}));
    assert_eq!(get_runs(&app, &format!("Bearer {token}")).await.0, 401);
    let bad = sweeper::settings::Config::from_toml(&config_toml(
        "postgres://x@127.0.0.1/x",
        0,
        "[auth]\nleeway = \"1h\"",
        "",
    ))
    .unwrap_err()
    .to_string();
    assert!(bad.contains("auth.leeway"), "{bad}");
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive_and_numeric_dates_may_have_fractions() {
    let app = TestApp::spawn(Spawn::default()).await;
    let token = app.token(&["ops:read"]);
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        let (status, body) = get_runs(&app, &format!("{scheme} {token}")).await;
        assert_eq!(status, 200, "{scheme}: {body}");
    }
    let t = now();
    let token = hs256(json!({"exp": t + 600.5, "iat": t - 0.25, "nbf": t - 0.75}));
    let (status, body) = get_runs(&app, &format!("Bearer {token}")).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn refusals_are_in_our_own_words_with_a_stable_reason() {
    let app = TestApp::spawn(Spawn::default()).await;
    let b64 = |v: Value| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    };
    let valid = app.token(&["ops:read"]);
    let two_segments = valid.rsplit_once('.').unwrap().0.to_string();
    let alg_none = format!(
        "{}.{}.",
        b64(json!({"alg": "none", "kid": "k2"})),
        b64(json!({"sub": "x", "iss": "sweeper-test", "aud": "sweeper", "exp": 9_999_999_999u64}))
    );
    let hs512 = {
        let mut h = Header::new(Algorithm::HS512);
        h.kid = Some("k2".into());
        let c = json!({"sub": "x", "iss": "sweeper-test", "aud": "sweeper",
                       "exp": now() as i64 + 600});
        jsonwebtoken::encode(
            &h,
            &c,
            &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap()
    };
    let unknown_kid = {
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("nope".into());
        let c = json!({"sub": "x", "iss": "sweeper-test", "aud": "sweeper",
                       "exp": now() as i64 + 600});
        jsonwebtoken::encode(
            &h,
            &c,
            &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap()
    };
    let wrong_secret = {
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("k2".into());
        let c = json!({"sub": "x", "iss": "sweeper-test", "aud": "sweeper",
                       "exp": now() as i64 + 600});
        jsonwebtoken::encode(
            &h,
            &c,
            &EncodingKey::from_secret(OTHER_SECRET.as_bytes()).unwrap(),
        )
        .unwrap()
    };
    let cases: Vec<(&str, String, &str, &str)> = vec![
        (
            "valid token and trailing garbage",
            format!("Bearer {valid} extra"),
            "malformed-token",
            "malformed token",
        ),
        (
            "alg none",
            format!("Bearer {alg_none}"),
            "unsupported-algorithm",
            "unsupported algorithm",
        ),
        (
            "HS512",
            format!("Bearer {hs512}"),
            "unsupported-algorithm",
            "unsupported algorithm",
        ),
        (
            "two segments",
            format!("Bearer {two_segments}"),
            "malformed-token",
            "malformed token",
        ),
        (
            "nbf 1e30",
            format!("Bearer {}", hs256(json!({"nbf": 1e30}))),
            "claim-unusable",
            "claim `nbf` unusable",
        ),
        (
            "exp as a string",
            format!("Bearer {}", hs256(json!({"exp": "tomorrow"}))),
            "claim-unusable",
            "claim `exp` unusable",
        ),
        (
            "no exp",
            format!("Bearer {}", hs256(json!({"exp": null}))),
            "missing-claim",
            "missing claim `exp`",
        ),
        (
            "no aud",
            format!("Bearer {}", hs256(json!({"aud": null}))),
            "missing-claim",
            "missing claim `aud`",
        ),
        (
            "aud null",
            format!(
                "Bearer {}",
                signed(&json!({"sub": "x", "iss": "sweeper-test", "aud": null,
                               "exp": now() as i64 + 600, "scope": "ops:read"}))
            ),
            "claim-unusable",
            "claim `aud` unusable",
        ),
        (
            "wrong audience",
            format!("Bearer {}", hs256(json!({"aud": "elsewhere"}))),
            "wrong-audience",
            "wrong audience",
        ),
        (
            "wrong issuer",
            format!("Bearer {}", hs256(json!({"iss": "elsewhere"}))),
            "wrong-issuer",
            "wrong issuer",
        ),
        (
            "unknown kid",
            format!("Bearer {unknown_kid}"),
            "unknown-key",
            "unknown key",
        ),
        (
            "scope as a list",
            format!("Bearer {}", hs256(json!({"scope": ["ops:read"]}))),
            "claim-unusable",
            "claim `scope` unusable",
        ),
        (
            "bad signature",
            format!("Bearer {wrong_secret}"),
            "bad-signature",
            "signature does not verify",
        ),
        (
            "only the scheme",
            "Bearer".to_string(),
            "missing-credentials",
            "missing credentials",
        ),
    ];
    for (what, authorization, reason, detail) in cases {
        let (status, body) = get_runs(&app, &authorization).await;
        assert_eq!(status, 401, "{what}: {body}");
        assert_eq!(
            body["type"], "urn:sweeper:problem:unauthenticated",
            "{what}"
        );
        assert_eq!(body["reason"], reason, "{what}: {body}");
        let text = body["detail"].as_str().unwrap();
        assert!(text.starts_with(detail), "{what}: {body}");
        // Nothing of the library's vocabulary reaches the caller.
        for leak in [
            "Base64",
            "InvalidToken",
            "InvalidClaimFormat",
            "variant",
            "expected",
            "offset",
        ] {
            assert!(!text.contains(leak), "{what} leaks `{leak}`: {body}");
        }
    }
}

#[tokio::test]
async fn a_token_that_names_a_claim_twice_is_refused_whichever_copy_a_parser_would_keep() {
    let app = TestApp::spawn(Spawn::default()).await;
    let b64 = |s: &str| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
    };
    let exp = now() as i64 + 600;
    let sign = |header: &str, claims: String| {
        let input = format!("{}.{}", b64(header), b64(&claims));
        let key = EncodingKey::from_secret(SECRET.as_bytes()).unwrap();
        let sig = jsonwebtoken::crypto::sign(input.as_bytes(), &key, Algorithm::HS256).unwrap();
        format!("{input}.{sig}")
    };
    let header = r#"{"alg":"HS256","typ":"JWT","kid":"k2"}"#;
    let base = format!(r#""sub":"probe","iss":"sweeper-test","aud":"sweeper","exp":{exp}"#);
    // The same claims written once: the token is good, and ops:read alone may not trigger.
    let once = sign(header, format!(r#"{{{base},"scope":"ops:read"}}"#));
    assert_eq!(get_runs(&app, &format!("Bearer {once}")).await.0, 200);
    let (status, _) = trigger_with(&app, &once).await;
    assert_eq!(status, 403);
    let twice = [
        sign(
            header,
            format!(
                r#"{{{base},"scope":"ops:read","scope":"trigger:ticket-retention consume ops:read ops:write"}}"#
            ),
        ),
        sign(
            r#"{"alg":"HS256","typ":"JWT","kid":"k2","kid":"k2"}"#,
            format!(r#"{{{base},"scope":"trigger:ticket-retention"}}"#),
        ),
    ];
    for token in twice {
        let (status, body) = trigger_with(&app, &token).await;
        assert_eq!(status, 401, "{body}");
        assert_eq!(body["reason"], "malformed-token", "{body}");
    }
    let runs = app.get_json("/runs").await;
    assert_eq!(runs["runs"].as_array().map(Vec::len), Some(0), "{runs}");
}

async fn trigger_with(app: &TestApp, token: &str) -> (u16, Value) {
    let r = app
        .post(
            "/trigger/ticket-retention?window=2026-11-01T02:00:00Z",
            Some(token),
        )
        .await;
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}
