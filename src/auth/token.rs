//! What every credential sweeper accepts must satisfy, whoever issued it: HS256 bearer tokens,
//! JWKS (RS256/ES256) bearer tokens and QStash's `Upstash-Signature` (docs/design.md §10).
//!
//! - **Shape.** A JWS compact serialization: three segments of the base64url alphabet
//!   (RFC 7515 §7.1), a header that is a JSON object with a string `alg`, and claims that are a
//!   JSON object. Anything else is a *malformed token*.
//! - **Time rule**, one for every issuer kind, with one leeway (`auth.leeway`, default 30 s): a
//!   token is refused when `exp` is more than the leeway in the past (RFC 7519 §4.1.4), or when
//!   `nbf` (§4.1.5) or `iat` (§4.1.6) is more than the leeway in the future. Each is a
//!   NumericDate (§2): a JSON number of seconds since the epoch, fractions allowed, between 0 and
//!   the end of year 9999; anything else makes the claim *unusable*.
//! - **One reading of every name.** A header or claims object (at any depth) that names a member
//!   twice is malformed: JSON parsers disagree on which copy wins (RFC 8259 §4), so a token whose
//!   meaning depends on the parser is refused before its signature is looked at (RFC 7515 §5.2,
//!   RFC 7519 §7.2: reject or use a parser that returns only the lexically last; we reject).
//! - **Refusals in sweeper's words.** [`Refusal`] is what the caller sees: a stable `reason` code
//!   and a short detail. The library's own error text goes to the log only.

use base64::Engine;
use serde_json::{Map, Value};

/// Largest NumericDate accepted: 9999-12-31T23:59:59Z, in seconds since the epoch.
pub const MAX_NUMERIC_DATE: f64 = 253_402_300_799.0;

/// Why a credential was refused. [`Refusal::code`] is stable (the problem's `reason` member);
/// [`Refusal::detail`] is the human text. Neither ever carries a library's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No credential was presented.
    Missing,
    /// Not a JWS compact serialization with JSON header and claims, or too long.
    Malformed,
    /// An algorithm no configured issuer accepts (`none`, HS512, an RS256 token without a JWKS
    /// issuer pinning RS256, ...).
    UnsupportedAlgorithm,
    /// The header's `kid` is missing or names no configured key.
    UnknownKey,
    /// The signature does not verify with the key the header names.
    BadSignature,
    /// `iss` is not the issuer's.
    WrongIssuer,
    /// `aud` is not (or does not contain) a configured audience.
    WrongAudience,
    /// `sub` is not the expected one (QStash: the URL the message was sent to).
    WrongSubject,
    /// A required claim is absent.
    MissingClaim(&'static str),
    /// A claim has the wrong type or an impossible value.
    ClaimUnusable(&'static str),
    /// `exp` is more than the leeway in the past.
    Expired,
    /// `nbf` is more than the leeway in the future.
    NotYetValid,
    /// `iat` is more than the leeway in the future.
    IssuedInFuture,
    /// A Google token without `email` and `email_verified: true`.
    EmailNotVerified,
    /// A QStash signature issued for other bytes than the body received.
    BodyMismatch,
}

impl Refusal {
    /// The stable code, e.g. `expired`, `claim-unusable`.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Missing => "missing-credentials",
            Refusal::Malformed => "malformed-token",
            Refusal::UnsupportedAlgorithm => "unsupported-algorithm",
            Refusal::UnknownKey => "unknown-key",
            Refusal::BadSignature => "bad-signature",
            Refusal::WrongIssuer => "wrong-issuer",
            Refusal::WrongAudience => "wrong-audience",
            Refusal::WrongSubject => "wrong-subject",
            Refusal::MissingClaim(_) => "missing-claim",
            Refusal::ClaimUnusable(_) => "claim-unusable",
            Refusal::Expired => "expired",
            Refusal::NotYetValid => "not-yet-valid",
            Refusal::IssuedInFuture => "issued-in-the-future",
            Refusal::EmailNotVerified => "email-not-verified",
            Refusal::BodyMismatch => "body-mismatch",
        }
    }

    /// A short human detail, e.g. "claim `nbf` unusable".
    pub fn detail(&self) -> String {
        match self {
            Refusal::Missing => {
                "missing credentials: send `Authorization: Bearer <jwt>`".to_string()
            }
            Refusal::Malformed => "malformed token".to_string(),
            Refusal::UnsupportedAlgorithm => "unsupported algorithm".to_string(),
            Refusal::UnknownKey => "unknown key".to_string(),
            Refusal::BadSignature => "signature does not verify".to_string(),
            Refusal::WrongIssuer => "wrong issuer".to_string(),
            Refusal::WrongAudience => "wrong audience".to_string(),
            Refusal::WrongSubject => "wrong subject".to_string(),
            Refusal::MissingClaim(c) => format!("missing claim `{c}`"),
            Refusal::ClaimUnusable(c) => format!("claim `{c}` unusable"),
            Refusal::Expired => "expired".to_string(),
            Refusal::NotYetValid => "not yet valid (nbf)".to_string(),
            Refusal::IssuedInFuture => "issued in the future (iat)".to_string(),
            Refusal::EmailNotVerified => {
                "a Google token needs `email` with `email_verified: true`".to_string()
            }
            Refusal::BodyMismatch => "signed for another body".to_string(),
        }
    }
}

/// The claim names the library may report, as `'static` names for [`Refusal`].
fn claim_name(name: &str) -> &'static str {
    match name {
        "exp" => "exp",
        "nbf" => "nbf",
        "iat" => "iat",
        "sub" => "sub",
        "iss" => "iss",
        "aud" => "aud",
        _ => "claims",
    }
}

/// What a token's header says, read without trusting it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawHeader {
    /// The `alg` member as written.
    pub alg: String,
    /// The `kid` member, when it is a string.
    pub kid: Option<String>,
}

/// Reads the header of `token` after checking its shape: exactly three segments of the
/// base64url alphabet, no longer than `max_bytes` in all, a JSON object header with a string
/// `alg`. The signature is not checked here.
pub fn read_header(token: &str, max_bytes: usize) -> Result<RawHeader, Refusal> {
    let segments: Vec<&str> = token.split('.').collect();
    let base64url = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if token.len() > max_bytes
        || segments.len() != 3
        || segments[0].is_empty()
        || segments[1].is_empty()
        || !segments.iter().all(|s| base64url(s))
    {
        return Err(Refusal::Malformed);
    }
    let header = decode_json_object(segments[0])?;
    // The claims are read here only for their shape; the library decodes them after the
    // signature, so a repeated name must be refused before it reads them.
    decode_json_object(segments[1])?;
    let alg = match header.get("alg") {
        Some(Value::String(a)) => a.clone(),
        _ => return Err(Refusal::Malformed),
    };
    let kid = match header.get("kid") {
        None => None,
        Some(Value::String(k)) => Some(k.clone()),
        Some(_) => return Err(Refusal::Malformed),
    };
    Ok(RawHeader { alg, kid })
}

fn decode_json_object(segment: &str) -> Result<Map<String, Value>, Refusal> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(segment)
        .map_err(|_| Refusal::Malformed)?;
    if crate::strict_json::repeats_a_name(&bytes) {
        return Err(Refusal::Malformed);
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(Refusal::Malformed),
    }
}

/// Maps a `jsonwebtoken` refusal to sweeper's words, logging the library's own text.
pub fn from_library(e: &jsonwebtoken::errors::Error) -> Refusal {
    use jsonwebtoken::errors::ErrorKind as K;
    let refusal = match e.kind() {
        K::InvalidSignature => Refusal::BadSignature,
        K::InvalidAudience => Refusal::WrongAudience,
        K::InvalidIssuer => Refusal::WrongIssuer,
        K::InvalidSubject => Refusal::WrongSubject,
        K::ExpiredSignature => Refusal::Expired,
        K::ImmatureSignature => Refusal::NotYetValid,
        K::MissingRequiredClaim(c) => Refusal::MissingClaim(claim_name(c)),
        K::InvalidClaimFormat(c) => Refusal::ClaimUnusable(claim_name(c)),
        K::InvalidAlgorithm
        | K::InvalidAlgorithmName
        | K::UnsupportedAlgorithm
        | K::MissingAlgorithm => Refusal::UnsupportedAlgorithm,
        K::InvalidKeyFormat | K::InvalidRsaKey(_) | K::InvalidEcdsaKey | K::InvalidEddsaKey => {
            Refusal::UnknownKey
        }
        _ => Refusal::Malformed,
    };
    tracing::info!(library_error = %e, reason = refusal.code(), "token refused");
    refusal
}

/// A NumericDate claim (RFC 7519 §2): seconds since the epoch, fractions allowed. `Ok(None)` when
/// absent; unusable when it is not a finite number between 0 and [`MAX_NUMERIC_DATE`].
pub fn numeric_date(
    claims: &Map<String, Value>,
    name: &'static str,
) -> Result<Option<f64>, Refusal> {
    match claims.get(name) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(v) if v.is_finite() && (0.0..=MAX_NUMERIC_DATE).contains(&v) => Ok(Some(v)),
            _ => Err(Refusal::ClaimUnusable(name)),
        },
        Some(_) => Err(Refusal::ClaimUnusable(name)),
    }
}

/// The one time rule (module docs): `exp` (always required) no more than `leeway` seconds in the
/// past, `nbf` and `iat` no more than `leeway` in the future; `nbf` required too when
/// `require_nbf`. `now` is seconds since the epoch.
pub fn check_times(
    claims: &Map<String, Value>,
    now: f64,
    leeway: u64,
    require_nbf: bool,
) -> Result<(), Refusal> {
    let leeway = leeway as f64;
    let exp = numeric_date(claims, "exp")?.ok_or(Refusal::MissingClaim("exp"))?;
    let nbf = numeric_date(claims, "nbf")?;
    let iat = numeric_date(claims, "iat")?;
    if require_nbf && nbf.is_none() {
        return Err(Refusal::MissingClaim("nbf"));
    }
    // RFC 7519 §4.1.4: not accepted "on or after" exp; the leeway extends that instant.
    if now >= exp + leeway {
        return Err(Refusal::Expired);
    }
    if nbf.is_some_and(|nbf| nbf > now + leeway) {
        return Err(Refusal::NotYetValid);
    }
    if iat.is_some_and(|iat| iat > now + leeway) {
        return Err(Refusal::IssuedInFuture);
    }
    Ok(())
}

/// Seconds since the epoch by the wall clock, with fractions.
pub fn now_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A `jsonwebtoken` validation that checks the signature, the algorithm, `iss`, `aud` (when
/// given) and `sub` (when given), but leaves `exp`/`nbf` to [`check_times`] and requires no
/// claim by name (the caller reads each one itself, with a precise refusal).
pub fn validation(
    alg: jsonwebtoken::Algorithm,
    iss: &str,
    audiences: Option<&[String]>,
) -> jsonwebtoken::Validation {
    let mut v = jsonwebtoken::Validation::new(alg);
    v.validate_exp = false;
    v.validate_nbf = false;
    v.leeway = 0;
    v.required_spec_claims = Default::default();
    v.set_issuer(&[iss]);
    match audiences {
        Some(a) => v.set_audience(a),
        None => v.validate_aud = false,
    }
    v
}

/// Reads a string claim: `Ok(None)` when absent, unusable when not a string.
pub fn string_claim<'a>(
    claims: &'a Map<String, Value>,
    name: &'static str,
) -> Result<Option<&'a str>, Refusal> {
    match claims.get(name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(Refusal::ClaimUnusable(name)),
    }
}

/// Reads a required string claim: absent → missing claim, another type → unusable.
pub fn required<'a>(
    claims: &'a Map<String, Value>,
    name: &'static str,
) -> Result<&'a str, Refusal> {
    string_claim(claims, name)?.ok_or(Refusal::MissingClaim(name))
}

/// Checks the shape of `aud` (RFC 7519 §4.1.3): one string, or an array of strings. `null`, an
/// empty array or any other type is unusable (the library treats `null` as absent and would
/// skip its audience check); its value is compared by the library.
pub fn audience_shape(claims: &Map<String, Value>) -> Result<(), Refusal> {
    match claims.get("aud") {
        None => Err(Refusal::MissingClaim("aud")),
        Some(Value::String(_)) => Ok(()),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => Ok(()),
        Some(_) => Err(Refusal::ClaimUnusable("aud")),
    }
}

/// The presented credential of an `Authorization` header: the token of the `Bearer` scheme,
/// matched case-insensitively (RFC 9110 §11.1), after one or more spaces. `None` for another
/// scheme or an empty token.
pub fn bearer(authorization: &str) -> Option<&str> {
    let (scheme, rest) = authorization.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim_matches(' ');
    (!token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claims(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn the_time_rule_refuses_outside_the_leeway_on_every_claim() {
        let now = 1_000_000.0;
        let ok = |v| check_times(&claims(v), now, 30, false);
        assert_eq!(ok(json!({"exp": now + 600.5})), Ok(()));
        assert_eq!(ok(json!({"exp": now - 29.0})), Ok(()));
        assert_eq!(ok(json!({"exp": now - 30.0})), Err(Refusal::Expired));
        assert_eq!(ok(json!({"exp": now + 600.0, "nbf": now + 30.0})), Ok(()));
        assert_eq!(
            ok(json!({"exp": now + 600.0, "nbf": now + 31.0})),
            Err(Refusal::NotYetValid)
        );
        assert_eq!(ok(json!({"exp": now + 600.0, "iat": now + 30.0})), Ok(()));
        for ahead in [300.0, 86_400.0, 365.0 * 86_400.0] {
            assert_eq!(
                ok(json!({"exp": now + 600.0, "iat": now + ahead})),
                Err(Refusal::IssuedInFuture)
            );
        }
        assert_eq!(ok(json!({})), Err(Refusal::MissingClaim("exp")));
        assert_eq!(
            check_times(&claims(json!({"exp": now + 1.0})), now, 30, true),
            Err(Refusal::MissingClaim("nbf"))
        );
    }

    #[test]
    fn numeric_dates_out_of_range_or_of_another_type_are_unusable() {
        let now = 1_000_000.0;
        for bad in [
            json!(1e30),
            json!(-1),
            json!("1000600"),
            json!(null),
            json!([1]),
        ] {
            assert_eq!(
                check_times(
                    &claims(json!({"exp": now + 600.0, "nbf": bad})),
                    now,
                    30,
                    false
                ),
                Err(Refusal::ClaimUnusable("nbf"))
            );
        }
    }

    #[test]
    fn headers_of_the_wrong_shape_are_malformed() {
        let h = |v: Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
        let good = format!("{}.e30.c2ln", h(json!({"alg": "HS256", "kid": "k"})));
        assert_eq!(
            read_header(&good, 8192),
            Ok(RawHeader {
                alg: "HS256".into(),
                kid: Some("k".into())
            })
        );
        for bad in [
            format!("{good} extra"),
            "a.b".to_string(),
            format!("{good}.d"),
            format!("{}.e30.x", h(json!(["alg"]))),
            format!("{}.e30.x", h(json!({"alg": 1}))),
            format!("{}.e30.x", h(json!({"alg": "HS256", "kid": 7}))),
            "!!!.e30.x".to_string(),
        ] {
            assert_eq!(read_header(&bad, 8192), Err(Refusal::Malformed), "{bad}");
        }
        assert_eq!(read_header(&good, 10), Err(Refusal::Malformed));
    }

    #[test]
    fn a_name_written_twice_in_the_header_or_the_claims_is_malformed() {
        let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let header = b(r#"{"alg":"HS256","kid":"k"}"#);
        let ok = format!("{header}.{}.c2ln", b(r#"{"scope":"ops:read","a":{"b":1}}"#));
        assert!(read_header(&ok, 8192).is_ok());
        for (h, c) in [
            (
                r#"{"alg":"HS256","kid":"k"}"#,
                r#"{"scope":"ops:read","scope":"consume"}"#,
            ),
            (r#"{"alg":"HS256","alg":"HS256","kid":"k"}"#, r#"{}"#),
            (r#"{"alg":"HS256","kid":"k"}"#, r#"{"a":[{"b":1,"b":2}]}"#),
            (
                r#"{"alg":"HS256","kid":"k"}"#,
                r#"{"scope":"x","\u0073cope":"y"}"#,
            ),
        ] {
            let token = format!("{}.{}.c2ln", b(h), b(c));
            assert_eq!(
                read_header(&token, 8192),
                Err(Refusal::Malformed),
                "{h} {c}"
            );
        }
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("BEARER  abc "), Some("abc"));
        assert_eq!(bearer("bEaReR abc"), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
        assert_eq!(bearer("Bearerabc"), None);
    }
}
