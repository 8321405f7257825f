//! One external call of an action (DESIGN §2.3, §2.4, §9): it fills the templates from the
//! item's columns, sends the request through the dependency's guarded client, and classifies
//! the answer. The effect rows around the call (`calling` → `called` → closed) live in
//! [`super::external`].

use std::time::{Duration, SystemTime};

use object_store::ObjectStoreExt;
use secrecy::ExposeSecret;

use super::Outcome;
use crate::dependency::{DependencyKind, Refused, Runtime};
use crate::policy::action::{HttpAction, ObjectStoreAction, Then, pieces, placeholders};
use crate::retry::{Failure, parse_retry_after};

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
