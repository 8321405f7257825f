//! Actions with external calls (docs/design.md §2.3, §2.4, §9), as configured and validated: `http` calls
//! a dependency's API per item, `object_store` deletes an object per item; afterwards the row is
//! deleted, stamped, or left. The calls themselves are [`crate::execute::call`]'s.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::policy::Ident;
pub(crate) use crate::policy::template::pieces;
pub use crate::policy::template::placeholders;

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
    /// Once per item for ever (the default) or once per (window, item). Left out of the
    /// version's JSON when `item`, so actions written before it keep their version.
    #[serde(default, skip_serializing_if = "OncePer::is_item")]
    pub once_per: OncePer,
    /// JSON pointers (RFC 6901) into a `done` answer's JSON body whose values are recorded with
    /// the item's audit row, in this order (at most [`MAX_RECORDED_FIELDS`]). Left out of the
    /// version's JSON when empty, so actions written before it keep their version.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub record: Vec<String>,
    /// When a `done` answer's field says the provider's record differs from ours: the item is
    /// `mismatched` instead of done. Left out of the version's JSON when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mismatch: Option<Mismatch>,
}

/// `mismatch = { pointer = "/status", in = ["mismatch", "unknown"] }`: a `done` answer whose
/// value at `pointer` equals one of `values` (JSON equality: `1` is not `"1"`) is a mismatch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    /// A JSON pointer into the answer.
    pub pointer: String,
    /// The values that mean a mismatch.
    #[serde(rename = "in")]
    pub values: Vec<serde_json::Value>,
}

impl HttpAction {
    /// The answer's fields kept as evidence: `record`, then the mismatch rule's field when
    /// `record` does not name it (a mismatch's dead letter always shows what decided it).
    pub fn recorded_pointers(&self) -> Vec<String> {
        let mut pointers = self.record.clone();
        if let Some(m) = &self.mismatch
            && !pointers.contains(&m.pointer)
        {
            pointers.push(m.pointer.clone());
        }
        pointers
    }
}

/// At most this many response fields are recorded per item.
pub const MAX_RECORDED_FIELDS: usize = 8;

/// How often an external action's effect happens for one item.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OncePer {
    /// Once per (policy, item): idempotency key `{policy}:{item}:{n}`, `n` growing only when an
    /// effect closed and the item qualifies again (`once_per = "item"`, the default).
    #[default]
    Item,
    /// Once per (policy, window, item): idempotency key `{policy}:{window}:{item}` (the window
    /// as run ids write it); an open effect blocks only its own window (`once_per = "window"`).
    Window,
}

impl OncePer {
    /// Whether it is the default, once per item.
    pub fn is_item(&self) -> bool {
        *self == OncePer::Item
    }
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
    /// `http`: `"item"` (default) or `"window"`.
    #[serde(default)]
    pub once_per: Option<String>,
    /// `http`: JSON pointers of the answer's fields to record, e.g. `["/status", "/amount"]`.
    #[serde(default)]
    pub record: Option<Vec<String>>,
    /// `http`: `{ pointer = "/status", in = ["mismatch", "unknown"] }`.
    #[serde(default)]
    pub mismatch: Option<MismatchConfig>,
}

/// `mismatch = { pointer = "/status", in = ["mismatch"] }` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MismatchConfig {
    /// A JSON pointer into the answer.
    pub pointer: String,
    /// The values meaning a mismatch.
    #[serde(rename = "in")]
    pub values: Vec<serde_json::Value>,
}

/// Validates an `action = { ... }`; errors are `field: message`.
// Over 80 lines: validation field by field, collecting every error in one pass so check-config
// names them all.
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
        ("once_per", a.once_per.is_some()),
        ("record", a.record.is_some()),
        ("mismatch", a.mismatch.is_some()),
    ];
    let spec = match a.kind.as_str() {
        "delete_rows" => {
            for (f, set) in http_only
                .iter()
                .chain([("column", a.column.is_some())].iter())
            {
                if *set && *f == "once_per" {
                    errors.push(
                        "once_per: delete_rows makes no external call to make once per item or \
                         window (it is a field of http actions)"
                            .into(),
                    );
                } else if *set {
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

// Over 80 lines: validation field by field, collecting every error in one pass so check-config
// names them all.
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
    let once_per = match a.once_per.as_deref() {
        None | Some("item") => OncePer::Item,
        Some("window") => OncePer::Window,
        Some(other) => {
            errors.push(format!(
                "once_per: `{other}` is not one of \"item\", \"window\""
            ));
            OncePer::Item
        }
    };
    if once_per == OncePer::Window && !matches!(method.as_str(), "POST" | "PUT" | "PATCH") {
        errors.push(format!(
            "once_per: \"window\" is for POST, PUT or PATCH calls (a {method} carries no \
             effect to make once per window)"
        ));
    }
    if then == Some(Then::Nothing) && method != "DELETE" && once_per != OncePer::Window {
        errors.push(format!(
            "then: \"nothing\" is allowed only for actions harmless to repeat (DELETE calls, \
             object deletes) or with once_per = \"window\"; a {method} would be sent again by \
             every later run"
        ));
    }
    let record = a.record.clone().unwrap_or_default();
    if record.len() > MAX_RECORDED_FIELDS {
        errors.push(format!(
            "record: {} fields; at most {MAX_RECORDED_FIELDS} response fields are recorded",
            record.len()
        ));
    }
    for (i, p) in record.iter().enumerate() {
        if !p.starts_with('/') {
            errors.push(format!(
                "record[{i}]: `{p}` is not a JSON pointer into the answer (RFC 6901: it starts \
                 with `/`, e.g. \"/status\")"
            ));
        } else if record[..i].contains(p) {
            errors.push(format!("record[{i}]: `{p}` is named twice"));
        }
    }
    let mismatch = a.mismatch.as_ref().map(|m| {
        if !m.pointer.starts_with('/') {
            errors.push(format!(
                "mismatch.pointer: `{}` is not a JSON pointer into the answer (RFC 6901: it \
                 starts with `/`, e.g. \"/status\")",
                m.pointer
            ));
        }
        if m.values.is_empty() {
            errors.push("mismatch.in: list the values that mean a mismatch".into());
        }
        Mismatch {
            pointer: m.pointer.clone(),
            values: m.values.clone(),
        }
    });
    if let Some(m) = &mismatch
        && !record.contains(&m.pointer)
        && record.len() >= MAX_RECORDED_FIELDS
    {
        errors.push(format!(
            "record: the mismatch rule's field {} is recorded too, so `record` may name at \
                 most {} others",
            m.pointer,
            MAX_RECORDED_FIELDS - 1
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
        once_per,
        record,
        mismatch,
    })
}
