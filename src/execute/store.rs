//! One object-store effect of an action (docs/design.md §2.4): the store is built once per dependency
//! (credentials, endpoint checked against the dependency's guard), a missing object counts as
//! `already_absent` only after a probe confirmed its bucket exists, and the store's errors are
//! classified like HTTP answers.

use std::time::Duration;

use object_store::ObjectStoreExt;
use secrecy::ExposeSecret;

use super::Outcome;
use super::call::{CallResult, field_text};
use crate::dependency::{DependencyKind, Runtime};
use crate::policy::action::ObjectStoreAction;
use crate::retry::Failure;

/// How long a bucket probe's "it exists" is trusted.
const BUCKET_CONFIRMATION: Duration = Duration::from_secs(60);

async fn store(rt: &Runtime) -> Result<std::sync::Arc<dyn object_store::ObjectStore>, Failure> {
    rt.store
        .get_or_try_init(|| async { build_store(rt).await })
        .await
        .cloned()
}

// Over 80 lines: one arm per object-store kind, each its builder's settings.
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
            Ok(()) => CallResult::Done(Outcome::AlreadyAbsent, None),
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
        Ok(()) => CallResult::Done(Outcome::Deleted, None),
        Err(object_store::Error::NotFound { .. }) => absent(store).await,
        Err(e) => CallResult::Failed(classify_store_error(rt, e, false)),
    }
}
