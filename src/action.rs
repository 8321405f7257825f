//! Actions with external calls (DESIGN §2.3, §2.4, §9): `http` calls a dependency's API per item,
//! `object_store` deletes an object per item; afterwards the row is deleted, stamped, or left.
//!
//! This module holds their configuration and one call: it fills the templates from the item's
//! columns, sends the request through the dependency's guarded client, and classifies the answer.
//! The effect rows around the call (`calling` → `called` → closed) live in [`crate::effect`].

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use object_store::ObjectStoreExt;
use secrecy::ExposeSecret;
use serde::{Deserialize, Serialize};

use crate::consume::Outcome;
use crate::dependency::{DependencyKind, Refused, Runtime};
use crate::policy::Ident;
use crate::retry::{Failure, parse_retry_after};

/// What happens to the row after its call succeeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Then {
    /// Delete the row (`then = "delete_row"`).
    DeleteRow,
    /// Stamp a `timestamptz` column with the database clock (`then = { set = "reconciled_at" }`);
    /// the policy then excludes rows where it is not NULL.
    Set {
        /// The stamped column.
        column: Ident,
    },
    /// Leave the row (`then = "nothing"`): only for actions harmless to repeat.
    Nothing,
}

impl Then {
    /// The stamped column, if any.
    pub fn column(&self) -> Option<&Ident> {
        match self {
            Then::Set { column } => Some(column),
            _ => None,
        }
    }
}

/// When a 404 or 410 means "already absent": the status and a body or header pattern that only
/// the dependency's own "no such record" answer carries. Without a match a 404 is a permanent
/// misconfiguration (a wrong base URL must not turn into mass "already absent").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotFoundSignature {
    /// Statuses, among 404 and 410.
    pub status: Vec<u16>,
    /// A substring the body must contain.
    pub body_contains: Option<String>,
    /// A header that must be present (lowercase name).
    pub header: Option<String>,
    /// A substring that header's value must contain.
    pub header_contains: Option<String>,
}

/// `action = { kind = "http", ... }`, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpAction {
    /// The dependency called.
    pub dependency: String,
    /// `GET`, `POST`, `PUT`, `PATCH` or `DELETE`.
    pub method: String,
    /// Appended to the base URL; `{column}` is replaced by the item's value, percent-encoded as
    /// one path segment.
    pub path: String,
    /// Extra headers; `{column}` placeholders are filled verbatim.
    pub headers: BTreeMap<String, String>,
    /// The body; `{column}` placeholders are filled JSON-string-escaped (write them inside quotes).
    pub body: Option<String>,
    /// The header carrying the idempotency key `{policy}:{item}:{n}` on every call but `GET`.
    pub idempotency_header: String,
    /// Statuses meaning done.
    pub done: Vec<u16>,
    /// Statuses meaning "retry later" (429 and 503 with `Retry-After` always pause instead).
    pub retry: Vec<u16>,
    /// The not-found signature.
    pub not_found: Option<NotFoundSignature>,
    /// Afterwards.
    pub then: Then,
    /// Every column the templates read.
    pub columns: Vec<Ident>,
}

/// `action = { kind = "object_store", ... }`, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectStoreAction {
    /// The dependency (kind `s3`, `gcs`, `azure` or `local`).
    pub dependency: String,
    /// The column holding the object's path in the bucket.
    pub column: Ident,
    /// Afterwards.
    pub then: Then,
}

/// `then` as written: `"delete_row"`, `"nothing"` or `{ set = "column" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ThenConfig {
    /// `"delete_row"` or `"nothing"`.
    Word(String),
    /// `{ set = "column" }`.
    Set {
        /// The column.
        set: String,
    },
}

/// `not_found = { status = [404, 410], body_contains = "..." }` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotFoundConfig {
    /// Default `[404, 410]`.
    #[serde(default)]
    pub status: Option<Vec<u16>>,
    /// A substring of the body.
    #[serde(default)]
    pub body_contains: Option<String>,
    /// A header name.
    #[serde(default)]
    pub header: Option<String>,
    /// A substring of that header's value.
    #[serde(default)]
    pub header_contains: Option<String>,
}

/// `action = { ... }` as written in a policy.
///
/// ```toml
/// action = { kind = "http", dependency = "payments", method = "POST",
///            path = "/v1/payments/{id}/reconcile", body = '{"payment_id": "{id}"}',
///            not_found = { status = [404], body_contains = "payment_not_found" },
///            then = { set = "reconciled_at" } }
/// action = { kind = "object_store", dependency = "uploads", column = "object_key",
///            then = "delete_row" }
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionConfig {
    /// `delete_rows` (default), `http` or `object_store`.
    pub kind: String,
    /// External actions: the dependency.
    #[serde(default)]
    pub dependency: Option<String>,
    /// `http`: the method.
    #[serde(default)]
    pub method: Option<String>,
    /// `http`: the path template.
    #[serde(default)]
    pub path: Option<String>,
    /// `http`: extra headers.
    #[serde(default)]
    pub headers: Option<BTreeMap<String, String>>,
    /// `http`: the body template.
    #[serde(default)]
    pub body: Option<String>,
    /// `http`: default `Idempotency-Key`.
    #[serde(default)]
    pub idempotency_header: Option<String>,
    /// `http`: default `[200, 201, 202, 204]`.
    #[serde(default)]
    pub done: Option<Vec<u16>>,
    /// `http`: default `[408, 425, 500, 502, 503, 504]`.
    #[serde(default)]
    pub retry: Option<Vec<u16>>,
    /// `http`: the not-found signature.
    #[serde(default)]
    pub not_found: Option<NotFoundConfig>,
    /// `object_store`: the column naming the object.
    #[serde(default)]
    pub column: Option<String>,
    /// External actions: what happens to the row afterwards (required).
    #[serde(default)]
    pub then: Option<ThenConfig>,
}

/// Splits a template into literal text and `{column}` placeholders. A placeholder is `{`, an
/// identifier (letters, digits, `_`, `$`, starting with a letter or `_`), `}`; every other brace
/// is literal text, so JSON bodies need no escaping.
fn pieces(template: &str) -> Vec<(&str, bool)> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let name_len = after
            .bytes()
            .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'$')
            .count();
        let starts_ok = after
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
        if starts_ok && after.as_bytes().get(name_len) == Some(&b'}') {
            out.push((&rest[..open], false));
            out.push((&after[..name_len], true));
            rest = &after[name_len + 1..];
        } else {
            out.push((&rest[..open + 1], false));
            rest = after;
        }
    }
    out.push((rest, false));
    out
}

/// The `{column}` placeholders of a template, in order.
pub fn placeholders(template: &str) -> Result<Vec<Ident>, String> {
    pieces(template)
        .into_iter()
        .filter(|(_, p)| *p)
        .map(|(name, _)| Ident::parse(name).map_err(|e| format!("`{template}`: placeholder {e}")))
        .collect()
}

/// Validates an `action = { ... }`; errors are `field: message`.
pub fn from_config(a: &ActionConfig) -> Result<crate::policy::ActionSpec, Vec<String>> {
    use crate::policy::ActionSpec;
    let mut errors = Vec::new();
    let external = a.kind != "delete_rows";
    let dependency = match (&a.dependency, external) {
        (Some(d), true) if !d.is_empty() => d.clone(),
        (_, true) => {
            errors.push("dependency: required for this kind".into());
            String::new()
        }
        (Some(_), false) => {
            errors.push("dependency: delete_rows calls no dependency".into());
            String::new()
        }
        (None, false) => String::new(),
    };
    let then = match (&a.then, external) {
        (None, true) => {
            errors
                .push("then: required: \"delete_row\", { set = \"column\" } or \"nothing\"".into());
            None
        }
        (Some(_), false) => {
            errors.push("then: delete_rows already deletes the row".into());
            None
        }
        (None, false) => None,
        (Some(ThenConfig::Word(w)), true) => match w.as_str() {
            "delete_row" => Some(Then::DeleteRow),
            "nothing" => Some(Then::Nothing),
            other => {
                errors.push(format!(
                    "then: `{other}` is not one of \"delete_row\", {{ set = \"column\" }}, \"nothing\""
                ));
                None
            }
        },
        (Some(ThenConfig::Set { set }), true) => match Ident::parse(set) {
            Ok(column) => Some(Then::Set { column }),
            Err(e) => {
                errors.push(format!("then.set: {e}"));
                None
            }
        },
    };
    let http_only = [
        ("method", a.method.is_some()),
        ("path", a.path.is_some()),
        ("headers", a.headers.is_some()),
        ("body", a.body.is_some()),
        ("idempotency_header", a.idempotency_header.is_some()),
        ("done", a.done.is_some()),
        ("retry", a.retry.is_some()),
        ("not_found", a.not_found.is_some()),
    ];
    let spec = match a.kind.as_str() {
        "delete_rows" => {
            for (f, set) in http_only
                .iter()
                .chain([("column", a.column.is_some())].iter())
            {
                if *set {
                    errors.push(format!("{f}: not a field of delete_rows"));
                }
            }
            Some(ActionSpec::DeleteRows)
        }
        "http" => http_from_config(a, dependency, then.clone(), &mut errors)
            .map(|h| ActionSpec::Http(Box::new(h))),
        "object_store" => {
            for (f, set) in http_only {
                if set {
                    errors.push(format!("{f}: not a field of object_store"));
                }
            }
            let column = match a.column.as_deref().map(Ident::parse) {
                Some(Ok(c)) => Some(c),
                Some(Err(e)) => {
                    errors.push(format!("column: {e}"));
                    None
                }
                None => {
                    errors.push("column: required (the column naming the object)".into());
                    None
                }
            };
            match (column, then.clone()) {
                (Some(column), Some(then)) => Some(ActionSpec::ObjectStore(ObjectStoreAction {
                    dependency,
                    column,
                    then,
                })),
                _ => None,
            }
        }
        other => {
            errors.push(format!(
                "kind: `{other}` is not supported (supported: delete_rows, http, object_store)"
            ));
            None
        }
    };
    match spec {
        Some(s) if errors.is_empty() => Ok(s),
        _ => Err(errors),
    }
}

fn http_from_config(
    a: &ActionConfig,
    dependency: String,
    then: Option<Then>,
    errors: &mut Vec<String>,
) -> Option<HttpAction> {
    if a.column.is_some() {
        errors.push("column: not a field of http (use {column} in path or body)".into());
    }
    let method = a.method.clone().unwrap_or_default().to_uppercase();
    if !matches!(method.as_str(), "GET" | "POST" | "PUT" | "PATCH" | "DELETE") {
        errors.push(format!(
            "method: `{method}` must be GET, POST, PUT, PATCH or DELETE"
        ));
    }
    let path = a.path.clone().unwrap_or_default();
    if !path.starts_with('/') {
        errors.push(format!("path: `{path}` must start with /"));
    }
    let mut columns = Vec::new();
    let headers: BTreeMap<String, String> = a
        .headers
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k.to_lowercase(), v))
        .collect();
    let mut templates: Vec<(&str, &str)> = vec![("path", &path)];
    if let Some(b) = &a.body {
        templates.push(("body", b));
    }
    for (k, v) in &headers {
        if reqwest::header::HeaderName::from_bytes(k.as_bytes()).is_err() {
            errors.push(format!("headers: `{k}` is not a header name"));
        }
        if reqwest::header::HeaderValue::from_str(v).is_err() {
            errors.push(format!(
                "headers: the value of `{k}` holds characters a header cannot carry"
            ));
        }
        templates.push(("headers", v));
    }
    for (field, t) in templates {
        match placeholders(t) {
            Ok(cs) => {
                for c in cs {
                    if !columns.contains(&c) {
                        columns.push(c);
                    }
                }
            }
            Err(e) => errors.push(format!("{field}: {e}")),
        }
    }
    let idempotency_header = a
        .idempotency_header
        .clone()
        .unwrap_or_else(|| "Idempotency-Key".into())
        .to_lowercase();
    if reqwest::header::HeaderName::from_bytes(idempotency_header.as_bytes()).is_err() {
        errors.push("idempotency_header: not a header name".into());
    }
    let done = a.done.clone().unwrap_or_else(|| vec![200, 201, 202, 204]);
    let retry = a
        .retry
        .clone()
        .unwrap_or_else(|| vec![408, 425, 500, 502, 503, 504]);
    for s in done.iter().chain(&retry) {
        if !(100..=599).contains(s) {
            errors.push(format!("done/retry: {s} is not an HTTP status"));
        }
    }
    if done.is_empty() || done.iter().any(|s| !(200..=299).contains(s)) {
        errors.push("done: list one or more 2xx statuses".into());
    }
    if let Some(s) = done
        .iter()
        .find(|s| retry.contains(s) || [404, 410, 429].contains(*s))
    {
        errors.push(format!(
            "done: {s} cannot mean done (it is in retry, or 404/410/429, which have their own rules)"
        ));
    }
    let not_found = a.not_found.as_ref().map(|n| {
        let status = n.status.clone().unwrap_or_else(|| vec![404, 410]);
        if status.is_empty() || status.iter().any(|s| ![404, 410].contains(s)) {
            errors.push("not_found.status: only 404 and 410 can mean already absent".into());
        }
        if n.body_contains.as_deref().is_none_or(str::is_empty) && n.header.is_none() {
            errors.push(
                "not_found: give body_contains or header: a bare 404 (a wrong path) must not \
                 count as already absent"
                    .into(),
            );
        }
        if let Some(h) = &n.header
            && (h.is_empty() || reqwest::header::HeaderName::from_bytes(h.as_bytes()).is_err())
        {
            errors.push(format!("not_found.header: `{h}` is not a header name"));
        }
        if n.header_contains.is_some() && n.header.is_none() {
            errors.push("not_found.header_contains: needs header".into());
        }
        NotFoundSignature {
            status,
            body_contains: n.body_contains.clone(),
            header: n.header.as_ref().map(|h| h.to_lowercase()),
            header_contains: n.header_contains.clone(),
        }
    });
    if then == Some(Then::Nothing) && method != "DELETE" {
        errors.push(format!(
            "then: \"nothing\" is allowed only for actions harmless to repeat (DELETE calls, \
             object deletes); a {method} would be sent again by every later run"
        ));
    }
    Some(HttpAction {
        dependency,
        method,
        path,
        headers,
        body: a.body.clone(),
        idempotency_header,
        done,
        retry,
        not_found,
        then: then?,
        columns,
    })
}

/// How one call ended.
#[derive(Debug)]
pub enum CallResult {
    /// The effect happened (or the target was already absent, per the not-found signature).
    Done(Outcome),
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

/// The item's outcome after a successful call of `action`.
fn done_outcome(method: &str, then: &Then) -> Outcome {
    if method == "DELETE" || *then == Then::DeleteRow {
        Outcome::Deleted
    } else {
        Outcome::Reconciled
    }
}

fn field_text(fields: &serde_json::Value, column: &str) -> Result<String, String> {
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

/// The pause a throttling answer asks for: `Retry-After`, else the dependency's reset header,
/// each parsed as untrusted (see [`parse_retry_after`]).
fn pause_of(rt: &Runtime, headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let read = |name: &reqwest::header::HeaderName| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now(), rt.spec.retry_after_cap))
    };
    read(&reqwest::header::RETRY_AFTER).or_else(|| rt.spec.reset_header.as_ref().and_then(read))
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
    let client = rt.http.as_ref().expect("http dependencies have a client");
    // A value that is empty, `.` or `..` would address another resource once the URL is
    // normalized (the collection, the parent): the item fails instead.
    for c in placeholders(&action.path).unwrap_or_default() {
        if let Ok(v) = field_text(fields, c.as_str())
            && matches!(v.as_str(), "" | "." | "..")
        {
            return CallResult::ItemFailed(format!(
                "column `{}` is `{v}`, which cannot be a path segment",
                c.as_str()
            ));
        }
    }
    let path = match fill(&action.path, fields, |v| {
        percent_encoding::utf8_percent_encode(v, PATH_SEGMENT).to_string()
    }) {
        Ok(p) => p,
        Err(e) => return CallResult::ItemFailed(format!("path: {e}")),
    };
    let url = match url::Url::parse(&format!(
        "{}{}",
        base_url.as_str().trim_end_matches('/'),
        path
    )) {
        Ok(u) => u,
        Err(e) => return CallResult::ItemFailed(format!("path `{path}`: {e}")),
    };
    let expected = format!("{}{}", base_url.path().trim_end_matches('/'), path);
    if url.path() != expected || url.query().is_some() || url.fragment().is_some() {
        return CallResult::ItemFailed(format!(
            "the item's values change the request's path (`{}` instead of `{expected}`)",
            url.path()
        ));
    }
    if let Err(f) = rt.spec.check_url(&url) {
        return CallResult::Failed(f);
    }
    let method = reqwest::Method::from_bytes(action.method.as_bytes()).expect("validated method");
    let mut req = client.request(method, url);
    for (k, v) in &action.headers {
        match fill(v, fields, |s| s.to_string()) {
            Ok(v) => match reqwest::header::HeaderValue::from_str(&v) {
                Ok(v) => req = req.header(k.as_str(), v),
                Err(_) => {
                    return CallResult::ItemFailed(format!(
                        "header {k}: the item's value holds characters a header cannot carry"
                    ));
                }
            },
            Err(e) => return CallResult::ItemFailed(format!("header {k}: {e}")),
        }
    }
    if action.method != "GET" {
        req = req.header(action.idempotency_header.as_str(), idempotency_key);
    }
    if let Some((h, v)) = &rt.spec.credential {
        let mut value = match reqwest::header::HeaderValue::from_str(v.expose_secret()) {
            Ok(v) => v,
            Err(_) => {
                return CallResult::Failed(Failure::permanent(
                    "the credential is not a valid header value",
                ));
            }
        };
        value.set_sensitive(true);
        req = req.header(h, value);
    }
    if let Some(b) = &action.body {
        match fill(b, fields, json_escape) {
            Ok(body) => {
                if !action.headers.contains_key("content-type") {
                    req = req.header("content-type", "application/json");
                }
                req = req.body(body);
            }
            Err(e) => return CallResult::ItemFailed(format!("body: {e}")),
        }
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            if let Some(r) = refused(&e) {
                return CallResult::Failed(Failure::permanent(r));
            }
            let what = if e.is_timeout() {
                format!("timed out after {:?}", rt.spec.timeout)
            } else if e.is_connect() {
                "could not connect".to_string()
            } else {
                "the request failed".to_string()
            };
            return CallResult::Failed(Failure::transient(format!(
                "dependency {}: {what}",
                rt.spec.name
            )));
        }
    };
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let name = &rt.spec.name;
    if action.done.contains(&status) {
        return CallResult::Done(done_outcome(&action.method, &action.then));
    }
    if status == 429 || (status == 503 && headers.contains_key(reqwest::header::RETRY_AFTER)) {
        return CallResult::Throttled {
            pause: pause_of(rt, &headers),
            reason: format!("dependency {name} answered {status}"),
        };
    }
    if status == 404 || status == 410 {
        // Read at most 64 KiB of the body to match the signature.
        let body = match read_bounded(resp, 64 * 1024).await {
            Ok(b) => b,
            Err(_) => {
                return CallResult::Failed(Failure::transient(format!(
                    "dependency {name} answered {status} but its body could not be read"
                )));
            }
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
            return CallResult::Done(Outcome::AlreadyAbsent);
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

/// How long a bucket probe's "it exists" is trusted.
const BUCKET_CONFIRMATION: Duration = Duration::from_secs(60);

async fn store(rt: &Runtime) -> Result<std::sync::Arc<dyn object_store::ObjectStore>, Failure> {
    rt.store
        .get_or_try_init(|| async { build_store(rt).await })
        .await
        .cloned()
}

async fn build_store(
    rt: &Runtime,
) -> Result<std::sync::Arc<dyn object_store::ObjectStore>, Failure> {
    use object_store::{ClientOptions, RetryConfig};
    let spec = &rt.spec;
    let mut options = ClientOptions::new()
        .with_timeout(spec.timeout)
        .with_connect_timeout(spec.timeout.min(Duration::from_secs(5)));
    // Our classifier owns retries: the store's own retries would multiply them.
    let retry = RetryConfig {
        max_retries: 0,
        ..RetryConfig::default()
    };
    let perm =
        |e: object_store::Error| Failure::permanent(format!("dependency {}: {e}", spec.name));
    let store: std::sync::Arc<dyn object_store::ObjectStore> = match &spec.kind {
        DependencyKind::S3 {
            bucket,
            region,
            endpoint,
        } => {
            let mut b = object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_region(region)
                .with_retry(retry);
            // An endpoint from the environment (AWS_ENDPOINT) is checked like a configured one.
            let from_env = b
                .get_config_value(&object_store::aws::AmazonS3ConfigKey::Endpoint)
                .and_then(|e| url::Url::parse(&e).ok());
            if let (None, Some(e)) = (endpoint, &from_env) {
                spec.check_url(e).map_err(|_| {
                    Failure::permanent(format!(
                        "dependency {}: the endpoint {e} from the environment is not allowed; \
                         set base_url (and allowed_hosts) instead",
                        spec.name
                    ))
                })?;
                check_resolved(rt, e).await?;
            }
            if let Some(e) = endpoint {
                spec.check_url(e)?;
                check_resolved(rt, e).await?;
                // Plain http only when the configured endpoint says so (a local S3 server).
                options = options.with_allow_http(e.scheme() == "http");
                b = b
                    .with_endpoint(e.as_str().trim_end_matches('/'))
                    .with_virtual_hosted_style_request(false);
            }
            if let Some((k, s)) = &spec.s3_keys {
                b = b
                    .with_access_key_id(k.expose_secret())
                    .with_secret_access_key(s.expose_secret());
            }
            std::sync::Arc::new(b.with_client_options(options).build().map_err(perm)?)
        }
        DependencyKind::Gcs { bucket } => std::sync::Arc::new(
            object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry)
                .with_client_options(options)
                .build()
                .map_err(perm)?,
        ),
        DependencyKind::Azure { container } => std::sync::Arc::new(
            object_store::azure::MicrosoftAzureBuilder::from_env()
                .with_container_name(container)
                .with_retry(retry)
                .with_client_options(options)
                .build()
                .map_err(perm)?,
        ),
        DependencyKind::Local { root } => std::sync::Arc::new(
            object_store::local::LocalFileSystem::new_with_prefix(root).map_err(|e| {
                Failure::permanent(format!(
                    "dependency {}: directory {} is not usable: {e}",
                    spec.name,
                    root.display()
                ))
            })?,
        ),
        DependencyKind::Http { .. } => {
            return Err(Failure::permanent(format!(
                "dependency {} is not an object store",
                spec.name
            )));
        }
    };
    Ok(store)
}

/// The object store's own client resolves names itself, so its endpoint's addresses are checked
/// once, when the store is built (the endpoint comes from configuration, not from item data).
async fn check_resolved(rt: &Runtime, url: &url::Url) -> Result<(), Failure> {
    if rt.spec.allow_private_addresses {
        return Ok(());
    }
    let host = url.host_str().unwrap_or_default();
    let port = url.port_or_known_default().unwrap_or(443);
    let addrs: Vec<_> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| Failure::transient(format!("resolving {host}: {e}")))?
        .collect();
    if addrs
        .iter()
        .any(|a| crate::dependency::is_non_public(a.ip()))
    {
        return Err(Failure::permanent(format!(
            "refused `{host}`: it resolves to a loopback, private, link-local or mapped address"
        )));
    }
    Ok(())
}

/// Confirms the bucket (or directory) exists, at most once a minute: only then is a missing
/// object "already absent". A missing bucket or a wrong endpoint is a permanent failure.
async fn confirm_bucket(
    rt: &Runtime,
    store: &dyn object_store::ObjectStore,
) -> Result<(), Failure> {
    if rt
        .bucket_confirmed
        .lock()
        .expect("probe lock")
        .is_some_and(|t| t.elapsed() < BUCKET_CONFIRMATION)
    {
        return Ok(());
    }
    match store.list_with_delimiter(None).await {
        Ok(_) => {
            *rt.bucket_confirmed.lock().expect("probe lock") = Some(std::time::Instant::now());
            Ok(())
        }
        Err(e) => Err(classify_store_error(rt, e, true)),
    }
}

fn classify_store_error(rt: &Runtime, e: object_store::Error, probing: bool) -> Failure {
    let text = e.to_string();
    let name = &rt.spec.name;
    let missing = matches!(e, object_store::Error::NotFound { .. })
        || text.contains("NoSuchBucket")
        || text.contains("ContainerNotFound")
        || text.contains("404");
    match e {
        _ if probing && missing => Failure::permanent(format!(
            "dependency {name}: the bucket does not exist (or the endpoint is wrong): {text}"
        )),
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. }
        | object_store::Error::NotSupported { .. }
        | object_store::Error::NotImplemented { .. }
        | object_store::Error::UnknownConfigurationKey { .. } => {
            Failure::permanent(format!("dependency {name}: {text}"))
        }
        _ => Failure::transient(format!("dependency {name}: {text}")),
    }
}

/// Deletes the object named by `action.column` in `fields`. A missing object is
/// `already_absent` only after a probe confirmed its bucket exists.
pub async fn delete_object(
    rt: &Runtime,
    action: &ObjectStoreAction,
    fields: &serde_json::Value,
) -> CallResult {
    let raw = match field_text(fields, action.column.as_str()) {
        Ok(v) => v,
        Err(e) => return CallResult::ItemFailed(e),
    };
    let path = match object_store::path::Path::parse(&raw) {
        Ok(p) if !raw.is_empty() => p,
        Ok(_) => return CallResult::ItemFailed("the object path is empty".into()),
        Err(e) => return CallResult::ItemFailed(format!("object path `{raw}`: {e}")),
    };
    let store = match store(rt).await {
        Ok(s) => s,
        Err(f) => return CallResult::Failed(f),
    };
    let absent = |store: std::sync::Arc<dyn object_store::ObjectStore>| async move {
        match confirm_bucket(rt, store.as_ref()).await {
            Ok(()) => CallResult::Done(Outcome::AlreadyAbsent),
            Err(f) => CallResult::Failed(f),
        }
    };
    // HEAD first: S3 answers a delete of a missing object with success, so only a HEAD tells
    // "deleted" from "already absent".
    match store.head(&path).await {
        Ok(_) => {}
        Err(object_store::Error::NotFound { .. }) => return absent(store).await,
        Err(e) => return CallResult::Failed(classify_store_error(rt, e, false)),
    }
    match store.delete(&path).await {
        Ok(()) => CallResult::Done(Outcome::Deleted),
        Err(object_store::Error::NotFound { .. }) => absent(store).await,
        Err(e) => CallResult::Failed(classify_store_error(rt, e, false)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
