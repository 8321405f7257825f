//! Shared by the external-action tests here and the process tests in tests/crash.

use crate::common::TestApp;

/// Payments and uploads; 2026-09-02 02:01 on the ledger clock.
pub const EXT: &str = "
create schema ext;
create table ext.payments (
    id bigint primary key,
    status text not null default 'closed',
    closed_at timestamptz,
    reconciled_at timestamptz
);
create table ext.uploads (
    id bigint primary key,
    object_key text,
    legal_hold boolean not null default false,
    expired_at timestamptz
)";

pub const NOW: &str = "2026-09-02T02:01:00Z";

pub fn dependency(name: &str, url: &str, extra: &str) -> String {
    format!(
        "[[dependency]]\nname = \"{name}\"\nbase_url = \"{url}\"\nallow_private_addresses = true\n{extra}\n"
    )
}

/// A daily payment-reconciliation policy calling `dep`.
pub fn payments_policy(
    name: &str,
    dep: &str,
    batch: usize,
    action_extra: &str,
    extra: &str,
) -> String {
    format!(
        r#"
[[policy]]
name = "{name}"
schedule = {{ cron = "0 2 * * *", timezone = "UTC" }}
target = {{ table = "ext.payments", key = "id", timestamp = "closed_at" }}
retain_for = "1d"
exclude = [ {{ column = "status", in = ["disputed"] }} ]
batch_size = {batch}
retry = {{ max_attempts = 5, base = "1s", cap = "1s", max_age = "1h" }}
action = {{ kind = "http", dependency = "{dep}", method = "POST", path = "/pay/{{id}}", body = '{{"payment_id": "{{id}}"}}', not_found = {{ body_contains = "payment_not_found" }}, then = {{ set = "reconciled_at" }}{action_extra} }}
{extra}
"#
    )
}

pub async fn seed_payments(app: &TestApp, n: i64) {
    seed_payments_in(&app.pool, n).await;
}

pub async fn seed_payments_in(pool: &sqlx::PgPool, n: i64) {
    sqlx::query(
        "insert into ext.payments (id, closed_at)
         select g, timestamptz '2026-08-01' from generate_series(1, $1) g",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}
