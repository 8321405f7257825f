//! One external call of an action (docs/design.md §2.3, §2.4, §9): it fills the templates from the
//! item's columns, sends the request through the dependency's guarded client, and classifies
//! the answer. The effect rows around the call (`calling` → `called` → closed) live in
//! [`super::external`].

use std::time::{Duration, SystemTime};

use secrecy::ExposeSecret;

use super::Outcome;
use crate::dependency::{DependencyKind, Refused, Runtime};
use crate::policy::action::{HttpAction, OncePer, Then, pieces, placeholders};
use crate::retry::{Failure, parse_reset, parse_retry_after};

/// How one call ended.
#[derive(Debug)]
pub enum CallResult {
    /// The effect happened (or the target was already absent, per the not-found signature), with
    /// the answer's recorded fields (see [`recorded_fields`]) when the action names any.
    Done(Outcome, Option<String>),
    /// This item cannot be done (a 4xx other than 404/410/429, a bad value): it becomes an item
    /// dead letter; its neighbours go on.
    ItemFailed(String),
    /// The dependency asked for a pause of this long (429, or 503 with `Retry-After`).
    Throttled {
        /// The pause; `None` when the answer named none usable (backoff decides).
        pause: Option<Duration>,
        /// Status and detail.
        reason: String,
    },
    /// Failed: transient (retry this item later) or permanent (misconfiguration: the command is
    /// quarantined without calling for its other items).
    Failed(Failure),
}

/// The item's outcome after a successful call of `action`: `called` for a call once per window
/// that keeps its row as it is (`then = "nothing"` on a POST/PUT/PATCH).
fn done_outcome(action: &HttpAction) -> Outcome {
    if action.method == "DELETE" || action.then == Then::DeleteRow {
        Outcome::Deleted
    } else if action.then == Then::Nothing && action.once_per == OncePer::Window {
        Outcome::Called
    } else {
        Outcome::Reconciled
    }
}

pub(super) fn field_text(fields: &serde_json::Value, column: &str) -> Result<String, String> {
    match fields.get(column) {
        None => Err(format!("column `{column}` is missing from the row")),
        Some(serde_json::Value::Null) => Err(format!("column `{column}` is NULL")),
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(v) => Ok(v.to_string()),
    }
}

/// Replaces each `{column}` of `template` with `encode(value)`.
fn fill(
    template: &str,
    fields: &serde_json::Value,
    encode: impl Fn(&str) -> String,
) -> Result<String, String> {
    let mut out = String::with_capacity(template.len());
    for (text, placeholder) in pieces(template) {
        if placeholder {
            out.push_str(&encode(&field_text(fields, text)?));
        } else {
            out.push_str(text);
        }
    }
    Ok(out)
}

const PATH_SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

fn json_escape(s: &str) -> String {
    let quoted = serde_json::to_string(s).expect("a string serializes");
    quoted[1..quoted.len() - 1].to_string()
}

/// Whether an error chain holds a refusal by the address guard or the redirect policy.
fn refused(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<Refused>() {
            return Some(r.0.clone());
        }
        cur = err.source();
    }
    None
}

/// The pause a throttling answer asks for: `Retry-After`, else the dependency's reset header in
/// its format, each parsed as untrusted (see [`parse_retry_after`], [`parse_reset`]).
fn pause_of(rt: &Runtime, headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let now = SystemTime::now();
    let cap = rt.spec.retry_after_cap;
    let text = |name: &reqwest::header::HeaderName| headers.get(name)?.to_str().ok();
    text(&reqwest::header::RETRY_AFTER)
        .and_then(|v| parse_retry_after(v, now, cap))
        .or_else(|| {
            let (name, format) = rt.spec.reset_header.as_ref()?;
            parse_reset(text(name)?, *format, now, cap)
        })
}

/// Calls `action` for one item whose columns are `fields` (the row as JSON), sending
/// `idempotency_key`. Runs outside any transaction.
pub async fn call_http(
    rt: &Runtime,
    action: &HttpAction,
    fields: &serde_json::Value,
    idempotency_key: &str,
) -> CallResult {
    let DependencyKind::Http { base_url } = &rt.spec.kind else {
        return CallResult::Failed(Failure::permanent(format!(
            "dependency {} is not an HTTP dependency",
            rt.spec.name
        )));
    };
    let url = match request_url(base_url, action, fields) {
        Ok(u) => u,
        Err(r) => return r,
    };
    if let Err(f) = rt.spec.check_url(&url) {
        return CallResult::Failed(f);
    }
    let req = match request(rt, action, fields, url, idempotency_key) {
        Ok(r) => r,
        Err(r) => return r,
    };
    match req.send().await {
        Ok(resp) => classify_answer(rt, action, resp).await,
        Err(e) => send_failure(rt, &e),
    }
}

/// The request URL: `base_url` plus the path template filled with the item's values, each a
/// percent-encoded path segment. An item whose values would address another resource (an
/// empty, `.` or `..` segment; a path that normalizes elsewhere) fails instead.
fn request_url(
    base_url: &url::Url,
    action: &HttpAction,
    fields: &serde_json::Value,
) -> Result<url::Url, CallResult> {
    for c in placeholders(&action.path).unwrap_or_default() {
        if let Ok(v) = field_text(fields, c.as_str())
            && matches!(v.as_str(), "" | "." | "..")
        {
            return Err(CallResult::ItemFailed(format!(
                "column `{}` is `{v}`, which cannot be a path segment",
                c.as_str()
            )));
        }
    }
    let path = fill(&action.path, fields, |v| {
        percent_encoding::utf8_percent_encode(v, PATH_SEGMENT).to_string()
    })
    .map_err(|e| CallResult::ItemFailed(format!("path: {e}")))?;
    let url = url::Url::parse(&format!(
        "{}{}",
        base_url.as_str().trim_end_matches('/'),
        path
    ))
    .map_err(|e| CallResult::ItemFailed(format!("path `{path}`: {e}")))?;
    let expected = format!("{}{}", base_url.path().trim_end_matches('/'), path);
    if url.path() != expected || url.query().is_some() || url.fragment().is_some() {
        return Err(CallResult::ItemFailed(format!(
            "the item's values change the request's path (`{}` instead of `{expected}`)",
            url.path()
        )));
    }
    Ok(url)
}

/// The request: method, filled headers, the idempotency key (not on GET), the dependency's
/// credential (marked sensitive), and the filled JSON body.
fn request(
    rt: &Runtime,
    action: &HttpAction,
    fields: &serde_json::Value,
    url: url::Url,
    idempotency_key: &str,
) -> Result<reqwest::RequestBuilder, CallResult> {
    let client = rt.http.as_ref().expect("http dependencies have a client");
    let method = reqwest::Method::from_bytes(action.method.as_bytes()).expect("validated method");
    let mut req = client.request(method, url);
    for (k, v) in &action.headers {
        let v = fill(v, fields, |s| s.to_string())
            .map_err(|e| CallResult::ItemFailed(format!("header {k}: {e}")))?;
        let v = reqwest::header::HeaderValue::from_str(&v).map_err(|_| {
            CallResult::ItemFailed(format!(
                "header {k}: the item's value holds characters a header cannot carry"
            ))
        })?;
        req = req.header(k.as_str(), v);
    }
    if action.method != "GET" {
        req = req.header(action.idempotency_header.as_str(), idempotency_key);
    }
    if let Some((h, v)) = &rt.spec.credential {
        let mut value =
            reqwest::header::HeaderValue::from_str(v.expose_secret()).map_err(|_| {
                CallResult::Failed(Failure::permanent(
                    "the credential is not a valid header value",
                ))
            })?;
        value.set_sensitive(true);
        req = req.header(h, value);
    }
    if let Some(b) = &action.body {
        let body = fill(b, fields, json_escape)
            .map_err(|e| CallResult::ItemFailed(format!("body: {e}")))?;
        if !action.headers.contains_key("content-type") {
            req = req.header("content-type", "application/json");
        }
        req = req.body(body);
    }
    Ok(req)
}

/// A request that got no answer: refused by the dependency's guard (permanent), else transient
/// (timed out, could not connect, failed).
fn send_failure(rt: &Runtime, e: &reqwest::Error) -> CallResult {
    if let Some(r) = refused(e) {
        return CallResult::Failed(Failure::permanent(r));
    }
    let what = if e.is_timeout() {
        format!("timed out after {:?}", rt.spec.timeout)
    } else if e.is_connect() {
        "could not connect".to_string()
    } else {
        "the request failed".to_string()
    };
    CallResult::Failed(Failure::transient(format!(
        "dependency {}: {what}",
        rt.spec.name
    )))
}

/// Classifies an answer (docs/design.md §2.4): a `done` status is the effect; 429 (or 503 with
/// Retry-After) throttles; 404/410 is `already_absent` only with the action's not-found
/// signature, else permanent; `retry` statuses and 5xx are transient; redirects and 401/403 are
/// permanent; any other status fails the item.
async fn classify_answer(rt: &Runtime, action: &HttpAction, resp: reqwest::Response) -> CallResult {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let name = &rt.spec.name;
    if action.done.contains(&status) {
        return done(action, name, status, resp).await;
    }
    if status == 429 || (status == 503 && headers.contains_key(reqwest::header::RETRY_AFTER)) {
        return CallResult::Throttled {
            pause: pause_of(rt, &headers),
            reason: format!("dependency {name} answered {status}"),
        };
    }
    if status == 404 || status == 410 {
        // Read at most 64 KiB of the body to match the signature.
        let Ok(body) = read_bounded(resp, 64 * 1024).await else {
            return CallResult::Failed(Failure::transient(format!(
                "dependency {name} answered {status} but its body could not be read"
            )));
        };
        if let Some(sig) = &action.not_found
            && sig.status.contains(&status)
            && sig
                .body_contains
                .as_deref()
                .is_none_or(|p| body.contains(p))
            && sig.header.as_deref().is_none_or(|h| {
                headers
                    .get(h)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| sig.header_contains.as_deref().is_none_or(|p| v.contains(p)))
            })
        {
            return CallResult::Done(Outcome::AlreadyAbsent, None);
        }
        return CallResult::Failed(Failure::permanent(format!(
            "dependency {name} answered {status} without its not-found signature: a wrong \
             base URL or path? (no row was changed)"
        )));
    }
    if action.retry.contains(&status) || status >= 500 {
        return CallResult::Failed(Failure::transient(format!(
            "dependency {name} answered {status}"
        )));
    }
    if (300..400).contains(&status) {
        return CallResult::Failed(Failure::permanent(format!(
            "dependency {name} answered a redirect ({status}) that was not followed"
        )));
    }
    if status == 401 || status == 403 {
        return CallResult::Failed(Failure::permanent(format!(
            "dependency {name} answered {status}: check its credentials"
        )));
    }
    CallResult::ItemFailed(format!("dependency {name} answered {status}"))
}

/// The most of a `done` answer's body read to record its fields.
const RECORD_BODY_LIMIT: usize = 1024 * 1024;

/// The most the recorded fields' text takes before the rest are marked truncated.
pub const RECORDED_LIMIT: usize = 1024;

/// The fields of a `done` answer's JSON `body` at `pointers`, as compact JSON text: an object of
/// each pointer and its value, in the action's order (`{"/status":"match","/amount":1250}`). Once
/// the text would pass [`RECORDED_LIMIT`], the value of that field and of every one after it is
/// `{"truncated":true}` (the markers may take the text a little past the limit). With the parsed
/// answer, for the mismatch rule. `Err`: why the item fails instead (the body is not JSON, or lacks a
/// pointer), worded to follow "dependency D answered S ".
pub(super) fn recorded_fields(
    pointers: &[String],
    body: &str,
) -> Result<(String, serde_json::Value), String> {
    let answer: serde_json::Value = serde_json::from_str(body).map_err(|e| {
        format!(
            "with a body that is not JSON ({e}): the action records {}",
            pointers.join(", ")
        )
    })?;
    let mut out = String::from("{");
    let mut truncated = false;
    for (i, p) in pointers.iter().enumerate() {
        let value = answer
            .pointer(p)
            .ok_or_else(|| format!("without the field {p}, which the action records"))?;
        let key = serde_json::to_string(p).expect("a string serializes");
        let mut text = serde_json::to_string(value).expect("a JSON value serializes");
        // The closing brace counts, and so does the comma before a later field.
        if !truncated
            && out.len() + key.len() + 1 + text.len() + 1 + usize::from(i > 0) > RECORDED_LIMIT
        {
            truncated = true;
        }
        if truncated {
            text = r#"{"truncated":true}"#.to_string();
        }
        if i > 0 {
            out.push(',');
        }
        out.push_str(&key);
        out.push(':');
        out.push_str(&text);
    }
    out.push('}');
    Ok((out, answer))
}

/// A `done` answer: the action's outcome, or `mismatched` when its mismatch rule matches, with
/// the answer's recorded fields. An answer whose fields cannot be read fails its item (the effect
/// stays open: a redrive asks again with the same idempotency key).
async fn done(action: &HttpAction, name: &str, status: u16, resp: reqwest::Response) -> CallResult {
    let pointers = action.recorded_pointers();
    if pointers.is_empty() {
        return CallResult::Done(done_outcome(action), None);
    }
    let body = match read_bounded(resp, RECORD_BODY_LIMIT + 1).await {
        Ok(body) if body.len() > RECORD_BODY_LIMIT => {
            return CallResult::ItemFailed(format!(
                "dependency {name} answered {status} with a body over {} KiB: the fields the \
                 action records were not read",
                RECORD_BODY_LIMIT / 1024
            ));
        }
        Ok(body) => body,
        Err(_) => {
            return CallResult::Failed(Failure::transient(format!(
                "dependency {name} answered {status} but its body could not be read"
            )));
        }
    };
    match recorded_fields(&pointers, &body) {
        Ok((recorded, answer)) => {
            let mismatched = action.mismatch.as_ref().is_some_and(|m| {
                answer
                    .pointer(&m.pointer)
                    .is_some_and(|v| m.values.contains(v))
            });
            let outcome = if mismatched {
                Outcome::Mismatched
            } else {
                done_outcome(action)
            };
            CallResult::Done(outcome, Some(recorded))
        }
        Err(why) => CallResult::ItemFailed(format!("dependency {name} answered {status} {why}")),
    }
}

async fn read_bounded(mut resp: reqwest::Response, limit: usize) -> reqwest::Result<String> {
    let mut buf = Vec::new();
    while buf.len() < limit {
        match resp.chunk().await? {
            Some(c) => buf.extend_from_slice(&c[..c.len().min(limit - buf.len())]),
            None => break,
        }
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_fields_keep_the_actions_order_and_mark_what_does_not_fit() {
        let pointers = ["/status".to_string(), "/amount".into(), "/ref/id".into()];
        let body = r#"{"amount": 1250, "status": "match", "ref": {"id": "pi_1"}, "x": 1}"#;
        assert_eq!(
            recorded_fields(&pointers, body).unwrap().0,
            r#"{"/status":"match","/amount":1250,"/ref/id":"pi_1"}"#
        );
        let long = format!(
            r#"{{"status": "{}", "amount": 1, "ref": {{"id": "x"}}}}"#,
            "a".repeat(2000)
        );
        let recorded = recorded_fields(&pointers, &long).unwrap().0;
        assert_eq!(
            recorded,
            r#"{"/status":{"truncated":true},"/amount":{"truncated":true},"/ref/id":{"truncated":true}}"#
        );
        let near = format!(
            r#"{{"status": "{}", "amount": 1, "ref": {{"id": "x"}}}}"#,
            "a".repeat(990)
        );
        let recorded = recorded_fields(&pointers, &near).unwrap().0;
        assert!(recorded.contains(&"a".repeat(990)));
        assert!(
            recorded.ends_with(r#""/ref/id":{"truncated":true}}"#),
            "{recorded}"
        );
        serde_json::from_str::<serde_json::Value>(&recorded).unwrap();
        assert!(
            recorded_fields(&pointers, "<html>")
                .unwrap_err()
                .starts_with("with a body that is not JSON")
        );
        assert_eq!(
            recorded_fields(&pointers, r#"{"status": "match"}"#).unwrap_err(),
            "without the field /amount, which the action records"
        );
    }

    #[test]
    fn templates_name_their_columns_and_fill_safely() {
        let cols: Vec<String> = placeholders("/v1/{id}/x/{tenant_id}")
            .unwrap()
            .iter()
            .map(|c| c.as_str().to_string())
            .collect();
        assert_eq!(cols, ["id", "tenant_id"]);
        // Braces that do not enclose an identifier are text (JSON bodies).
        assert!(placeholders("/v1/{id").unwrap().is_empty());
        assert!(placeholders(r#"{"a": {"b": "{id}"}}"#).unwrap().len() == 1);
        assert!(placeholders("/v1/{a b}").unwrap().is_empty());
        let fields = serde_json::json!({"id": "a/b c", "n": 7, "q": "say \"hi\"", "z": null});
        let path = fill("/p/{id}/{n}", &fields, |v| {
            percent_encoding::utf8_percent_encode(v, PATH_SEGMENT).to_string()
        })
        .unwrap();
        assert_eq!(path, "/p/a%2Fb%20c/7");
        let body = fill(r#"{"q": "{q}"}"#, &fields, json_escape).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&body).unwrap()["q"],
            "say \"hi\""
        );
        assert!(
            fill("/{z}", &fields, |v| v.to_string())
                .unwrap_err()
                .contains("NULL")
        );
    }
}
