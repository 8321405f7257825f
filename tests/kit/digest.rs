//! The weekly digest policy the digest tests of both crates use: an `http` POST once per window
//! to every active customer of `crm.customers`, rows kept.

/// The `digests` dependency at `url` and the `support-digest` policy, `batch` customers per
/// command.
pub fn digest_policy(url: &str, batch: usize) -> String {
    format!(
        r#"
[[dependency]]
name = "digests"
base_url = "{url}"
allow_private_addresses = true

[[policy]]
name = "support-digest"
schedule = {{ cron = "0 9 * * 1", timezone = "UTC" }}
target = {{ table = "crm.customers", key = "id", timestamp = "created_at" }}
select = [ {{ column = "status", equals = "active" }} ]
batch_size = {batch}
[policy.action]
kind = "http"
dependency = "digests"
method = "POST"
path = "/digests/{{id}}"
body = '{{"to": "{{email}}"}}'
once_per = "window"
then = "nothing"
"#
    )
}
