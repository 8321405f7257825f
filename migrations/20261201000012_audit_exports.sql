-- What `ledger.audit_retention` did with each expired month of the audit: exported (file, rows,
-- SHA-256 of the file), detach pending, dropped. Kept for ever, like runs and the operator log:
-- it says where a dropped month's evidence went and how to check it.
create table sweeper.audit_exports (
    partition    text primary key,
    from_at      timestamptz,
    to_at        timestamptz not null,
    state        text not null check (state in ('exported', 'detach_pending', 'dropped')),
    rows         bigint not null,
    sha256       text not null,
    location     text not null,
    exported_at  timestamptz not null default sweeper.now(),
    dropped_at   timestamptz
);
