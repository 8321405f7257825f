-- schema.sql: the two example tables of upload-retention.toml and payment-reconciliation.toml.
--
--   psql "$DATABASE_URL" -f deploy/examples/schema.sql
--   sweeper check-config --config deploy/examples/upload-retention.toml
--
-- Keys are unique (sweeper requires a unique index on the key), timestamps are timestamptz, and
-- each timestamp column has an index (the closure check after each run counts the rows still
-- eligible by it; check-config warns without one).

create schema if not exists app;

create table if not exists app.uploads (
    id           bigint generated always as identity primary key,
    owner_id     bigint not null,
    -- The object's path inside the bucket (no leading /), e.g. 'u/42/2026/11/report.pdf'.
    object_key   text not null unique,
    content_type text,
    size_bytes   bigint not null default 0,
    uploaded_at  timestamptz not null default now(),
    -- When the upload stopped being needed; NULL while it is live (never eligible).
    expired_at   timestamptz,
    -- Rows on legal hold are never deleted, and neither are their objects.
    legal_hold   boolean not null default false
);
create index if not exists uploads_expired_at on app.uploads (expired_at);

create schema if not exists billing;

create table if not exists billing.payments (
    -- The payment provider's id, e.g. 'pay_3Nf8Kx2eZvKYlo2C'; sent in the call's path and body.
    id            text primary key,
    customer_id   bigint not null,
    amount_cents  bigint not null,
    currency      char(3) not null,
    -- e.g. 'settled', 'refunded', 'disputed'; disputed payments are never reconciled.
    status        text not null,
    -- When the payment was closed; NULL while it is open (never eligible).
    closed_at     timestamptz,
    -- Stamped by sweeper (database clock) once the payments API confirmed the reconciliation;
    -- a stamped row is never selected again.
    reconciled_at timestamptz null
);
create index if not exists payments_closed_at on billing.payments (closed_at);
