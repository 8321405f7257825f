-- The partition sweep (docs/design.md §14 "Partition sweep"): a policy with `partitions = "drop"`
-- retires each leaf partition of its target whose whole range is older than the run's cutoff and
-- whose rows are all eligible, by detaching it, exporting its keys (verified), writing a manifest
-- into the audit and dropping it — instead of deleting its rows one command at a time.
--
-- One row per partition a run retires (or, for a dry run, would retire). Planning writes it on the
-- run's first page; the retirer moves it along, one step per transaction:
--   planned → detaching (DETACH ... CONCURRENTLY under way) → detached → dropped
-- or `kept` when it holds a row the run must not remove (found at planning: it is swept row by
-- row; found in the detached table: it is attached again and left to the next run), or `gone`
-- when it was dropped or renamed outside sweeper before its turn. `would_drop`: a dry run's
-- report.
create table sweeper.partition_retirements (
    run_id          text not null references sweeper.runs (run_id),
    -- The leaf as planning named it (schema-qualified, quoted as needed) and its parent then.
    partition       text not null,
    parent          text not null,
    -- Its bound as PostgreSQL printed it, and its range on the policy's timestamp.
    bound           text not null,
    timestamp_from  timestamptz,
    timestamp_to    timestamptz not null,
    -- Rows counted at planning; at the drop, the rows the manifest names.
    rows            bigint not null,
    state           text not null
                    check (state in ('would_drop', 'planned', 'detaching', 'detached', 'dropped',
                                     'kept', 'gone')),
    -- Why it was kept.
    reason          text,
    -- The drop's evidence: the manifest in the audit and the key export it names.
    manifest_id     bigint,
    export_location text,
    export_sha256   text,
    digest          text,
    lease_token     uuid,
    lease_until     timestamptz,
    attempts        integer not null default 0,
    last_error      text,
    created_at      timestamptz not null default sweeper.now(),
    finished_at     timestamptz,
    primary key (run_id, partition)
);
-- One run at a time retires a partition.
create unique index partition_retirements_one_at_a_time on sweeper.partition_retirements (partition)
    where state in ('planned', 'detaching', 'detached');
-- The retirer's claim.
create index partition_retirements_due on sweeper.partition_retirements (created_at)
    where state in ('planned', 'detaching', 'detached');
-- A key's manifest is found among its policy's (one per retired partition: few), without reading
-- the audit's items: GET /policies/{policy}/items/{key} for a key in a dropped partition.
create index audit_manifests_by_policy on sweeper.audit_manifests ((detail ->> 'policy'));
