//! The partition sweep's retirer (docs/design.md §14 "Partition sweep"): takes one partition a
//! run chose to retire through its steps, each idempotent, under a lease on its ledger row.
//!
//! 1. **Detach.** With a default partition beside it, a plain `DETACH` under `lock_timeout`
//!    (`CONCURRENTLY` is not allowed then), retried with backoff; otherwise `DETACH …
//!    CONCURRENTLY` on a connection without `statement_timeout`, recorded as `detaching` first so
//!    that after a crash the next try finishes PostgreSQL's "detach pending" with `FINALIZE`.
//!    From here no statement on the target reaches the partition's rows.
//! 2. **Evidence, then the drop, in one transaction** holding the detached table's ACCESS
//!    EXCLUSIVE lock: its rows are checked again against the run's rules (a row the run must
//!    keep — a hold set since planning — attaches the table again and leaves it to the next
//!    run); its keys, sorted bytewise, are written to a gzip JSON Lines export, synced and
//!    re-read to verify; an execution row and a manifest row go into the audit; the run counts
//!    the rows `deleted`; the table is dropped. A crash anywhere in it rolls it all back and the
//!    next try writes the export again: no table is dropped without its verified export and
//!    manifest, and none twice.
//! 3. **With a grace period** (`drop_grace`), step 2 records the evidence but leaves the table
//!    detached (`awaiting_drop`); once the grace has passed the table is dropped, unless it was
//!    attached again or changed meanwhile.
//!
//! A partition planning found with a few held rows is first swapped for a new partition holding
//! only them ([`carve`]); its old table, detached, then goes through step 2 with its keys but the
//! carried ones.
//!
//! The retirer works only on runs whose planning is done and that no hold keeps (the guard's
//! approval, a suspension, active hours, the governor), like a command; the pace does not apply
//! (a drop removes no row one by one).

use std::path::Path;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};
use sqlx::{Postgres, QueryBuilder};
use tracing::{info, warn};
use uuid::Uuid;

use crate::export_file::{self, verify};
use crate::ledger;
use crate::ledger::retirements::{Manifest, Retirement};
use crate::plan::RunRef;
use crate::policy::{RuleSet, TableName};
use crate::state::AppState;

mod carve;

/// Keys handed from the fetch to the export's writer at a time.
const CHUNK_KEYS: usize = 10_000;

/// Claims one retirement due and takes it as far as it goes. Returns whether one was claimed.
pub async fn retire_next(state: &AppState) -> anyhow::Result<bool> {
    // Every configured policy: a retirement begun under `partitions = "drop"` is finished after
    // the setting changed back to "rows".
    let policies: Vec<String> = state
        .config
        .policies
        .iter()
        .map(|p| p.name.to_string())
        .collect();
    let token = Uuid::new_v4();
    let held = crate::holds::held_policies(state);
    let lease = state.config.planning.lease.seconds() as f64;
    let Some(r) = ledger::retirements::claim(&state.pool, token, lease, &policies, &held).await?
    else {
        return Ok(false);
    };
    // A stage's upstream runs hold it as they hold the run's commands.
    let mut conn = state.pool.acquire().await?;
    if let Some(why) = crate::holds::after_hold(state, &mut conn, &r.policy, r.window_at).await? {
        drop(conn);
        let recheck = state.config.hold_recheck_seconds() as f64;
        ledger::retirements::record_failure(
            &state.pool,
            &r,
            token,
            &format!("held (after): {why}"),
            recheck,
        )
        .await?;
        return Ok(true);
    }
    drop(conn);
    if let Err(e) = retire(state, &r, token).await {
        let retry = 2f64.powi(r.attempts.clamp(0, 6)).min(60.0);
        warn!(run_id = r.run_id, partition = r.partition, error = %format!("{e:#}"), retry_seconds = retry, "retiring a partition failed; retrying");
        ledger::retirements::record_failure(&state.pool, &r, token, &format!("{e:#}"), retry)
            .await?;
    }
    Ok(true)
}

/// Takes `r` through its remaining steps.
async fn retire(state: &AppState, r: &Retirement, token: Uuid) -> anyhow::Result<()> {
    if r.state == "awaiting_drop" {
        // Claimed once its grace has passed; its run completed when its evidence was recorded.
        drop_after_grace(state, r, token).await?;
        return Ok(());
    }
    let mut r = r.clone();
    if r.state == "planned" && r.held_rows.is_some() {
        r.state = carve::carve(state, &mut r, token).await?;
    }
    if matches!(r.state.as_str(), "planned" | "detaching") {
        let began = std::time::Instant::now();
        r.state = detach(state, &r, token).await?;
        if r.state == "detached" {
            let seconds = began.elapsed().as_secs_f64();
            info!(
                run_id = r.run_id,
                partition = r.partition,
                seconds,
                "partition detached"
            );
        }
        crate::crash_point!("retire_after_detach");
    }
    if matches!(r.state.as_str(), "detached" | "carved") {
        r.state = drop_with_evidence(state, &r, token).await?;
    }
    if matches!(
        r.state.as_str(),
        "awaiting_drop" | "dropped" | "kept" | "gone"
    ) {
        // The run may be complete now; the closure check needs the run's rules.
        let rules = rules_of(state, &r).await.ok();
        if let Err(e) = crate::completion::complete_run(state, &r.run_id, rules.as_ref()).await {
            warn!(run_id = r.run_id, error = %e, "completing the run failed; housekeeping will complete it");
        }
    }
    Ok(())
}

/// The run's rules (the stricter of its pinned and current versions).
async fn rules_of(state: &AppState, r: &Retirement) -> anyhow::Result<RuleSet> {
    let mut conn = state.pool.acquire().await?;
    let run = RunRef {
        run_id: &r.run_id,
        policy: &r.policy,
        pinned_version: &r.policy_version,
        cutoff: r.cutoff,
        window: r.window_at,
    };
    crate::plan::run_rules(state, &mut conn, &run)
        .await
        .map_err(|f| anyhow::anyhow!(f.message().to_string()))
}

/// Detaches the partition from its parent; returns its state after (`detached`, or `gone` when
/// it no longer exists).
async fn detach(state: &AppState, r: &Retirement, token: Uuid) -> anyhow::Result<String> {
    let pool = &state.pool;
    let (exists, pending, partition_elsewhere, default_beside): (bool, Option<bool>, bool, bool) =
        sqlx::query_as(
            "select to_regclass($2) is not null,
                (select i.inhdetachpending from pg_inherits i
                  where i.inhparent = to_regclass($1) and i.inhrelid = to_regclass($2)),
                coalesce((select c.relispartition from pg_class c where c.oid = to_regclass($2)),
                         false),
                exists (select 1 from pg_inherits i join pg_class c on c.oid = i.inhrelid
                         where i.inhparent = to_regclass($1)
                           and pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT')",
        )
        .bind(&r.parent)
        .bind(&r.partition)
        .fetch_one(pool)
        .await?;
    let mut conn = pool.acquire().await?;
    let next = match (exists, pending) {
        (false, _) => {
            let why = "the partition was dropped or renamed outside sweeper before its retirement";
            ledger::retirements::set_state(&mut conn, r, token, "gone", Some(why)).await?;
            warn!(run_id = r.run_id, partition = r.partition, "{why}");
            return Ok("gone".into());
        }
        // Not attached under its parent any more: detached by an earlier try of ours, or, when
        // none began, by someone else (pg_partman keeping the table, an operator), whose table
        // is left as it is.
        (true, None) if partition_elsewhere => {
            let why = "the partition is attached under another parent than the one it was \
                       planned under (renamed, or moved): left as it is";
            ledger::retirements::set_state(&mut conn, r, token, "gone", Some(why)).await?;
            warn!(run_id = r.run_id, partition = r.partition, "{why}");
            return Ok("gone".into());
        }
        (true, None) if r.state == "planned" => {
            let why = "the partition was detached outside sweeper before its retirement; its \
                       table is left as it is";
            ledger::retirements::set_state(&mut conn, r, token, "gone", Some(why)).await?;
            warn!(run_id = r.run_id, partition = r.partition, "{why}");
            return Ok("gone".into());
        }
        (true, None) => "detached",
        (true, Some(pending)) if default_beside && !pending => {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            sqlx::query(&format!(
                "alter table {} detach partition {}",
                r.parent, r.partition
            ))
            .execute(&mut *tx)
            .await
            .context("detaching (plain DETACH: the table has a default partition)")?;
            if !ledger::retirements::set_state(&mut tx, r, token, "detached", None).await? {
                bail!("the retirement's lease was lost; the detach is rolled back");
            }
            tx.commit().await?;
            return Ok("detached".into());
        }
        (true, Some(pending)) => {
            if !ledger::retirements::set_state(&mut conn, r, token, "detaching", None).await? {
                bail!("the retirement's lease was lost");
            }
            // DETACH ... CONCURRENTLY waits for every transaction that could see the partition:
            // no statement_timeout on this connection, which is closed afterwards.
            conn.close_on_drop();
            sqlx::query("set statement_timeout = 0")
                .execute(&mut *conn)
                .await?;
            // Its second phase waits, as a lock wait, for every transaction that began before
            // the first: `lock_timeout` would fail it behind a long application transaction.
            sqlx::query("set lock_timeout = 0")
                .execute(&mut *conn)
                .await?;
            let how = if pending { "finalize" } else { "concurrently" };
            let detaching = async {
                sqlx::query(&format!(
                    "alter table {} detach partition {} {how}",
                    r.parent, r.partition
                ))
                .execute(&mut *conn)
                .await
                .with_context(|| format!("detaching (DETACH PARTITION ... {})", how.to_uppercase()))
            };
            // It may wait long for older transactions: the lease is renewed meanwhile, and a
            // lost one does not interrupt it (the statement runs on in the server anyway).
            renewing(state, r, token, detaching, Lost::Continue).await?;
            "detached"
        }
    };
    let mut conn = pool.acquire().await?;
    if !ledger::retirements::set_state(&mut conn, r, token, next, None).await? {
        bail!("the retirement's lease was lost");
    }
    Ok(next.into())
}

/// Checks the detached table against the run's rules, writes and verifies its key export, records
/// the manifest and drops it, in one transaction; returns the state after (`dropped`, `kept`).
async fn drop_with_evidence(
    state: &AppState,
    r: &Retirement,
    token: Uuid,
) -> anyhow::Result<String> {
    let dir = state
        .config
        .ledger
        .audit_export_dir
        .clone()
        .context("partitions = \"drop\" needs ledger.audit_export_dir")?;
    let table = detached_table(r)?;
    let rules = rules_of(state, r).await?.on_table(table);
    let carried = r.carried_keys.clone();
    let mut tx = state.pool.begin().await?;
    let exists: bool = sqlx::query_scalar("select to_regclass($1) is not null")
        .bind(rules.table_sql())
        .fetch_one(&mut *tx)
        .await?;
    if !exists {
        let why = "the detached partition was dropped or renamed outside sweeper before its drop";
        ledger::retirements::set_state(&mut tx, r, token, "gone", Some(why)).await?;
        tx.commit().await?;
        warn!(run_id = r.run_id, partition = r.partition, "{why}");
        return Ok("gone".into());
    }
    sqlx::query(&format!(
        "lock table {} in access exclusive mode",
        rules.table_sql()
    ))
    .execute(&mut *tx)
    .await?;
    let lease = state.config.planning.lease.seconds() as f64;
    // A policy no longer configured is not claimed; one whose setting changed since keeps it.
    let grace = state
        .config
        .policy(&r.policy)
        .map_or(0, |p| p.drop_grace_seconds);
    let name = export_name(&r.policy, &r.run_id, &r.partition);
    let path = dir.join(&name);
    let partial = path.with_extension("gz.partial");
    let began = std::time::Instant::now();
    let kept = kept_rows(&mut tx, &rules, carried.as_deref()).await?;
    if kept > 0 {
        // An export an earlier try left (it crashed before its commit) stands for nothing.
        remove_export(&[&path, &partial]);
        if carried.is_some() {
            // Carved: a row held since the swap (a related table's hold on a row now detached)
            // is carried over too, in a transaction of its own (it updates the retirement's
            // row, which the lease's renewals update too); then this step is tried again.
            tx.rollback().await?;
            carve::carry_over(state, r, token, &rules).await?;
            bail!(
                "{kept} rows of the detached table were held since the swap: carried over into \
                 the new partition; the drop is tried again"
            );
        }
        let because =
            format!("{kept} of its rows are kept since planning (an exclusion or the selection)");
        return keep(tx, r, token, &because).await.map(|()| "kept".into());
    }
    if carried.is_none() {
        // A view or function created on it since planning (which needed only ACCESS SHARE, so
        // not before this lock) would make the drop fail on every try: attached again instead.
        let leaf = rules.table_sql();
        if let Some(why) = crate::plan::dependents_refusal(&mut tx, &leaf).await? {
            let because = format!("{why} since planning (its drop would fail)");
            return keep(tx, r, token, &because).await.map(|()| "kept".into());
        }
    }
    if !ledger::retirements::renew(&state.pool, r, token, lease).await? {
        bail!("the retirement's lease was lost");
    }
    // Everything up to the commit is rolled back on a failure, and the export it wrote goes too
    // (a retry writes it again, or keeps the partition and needs none).
    let prepared = async {
        // The export reads the whole table in one statement: bounded by the lease (renewed
        // while it runs; a lost one stops it), not by the pool's statement_timeout, which is
        // set again for what follows.
        sqlx::query("set local statement_timeout = 0")
            .execute(&mut *tx)
            .await?;
        let written = write_export(
            state,
            &mut tx,
            (&rules, carried.as_deref()),
            (r, token),
            &partial,
        )
        .await?;
        sqlx::query(&format!(
            "set local statement_timeout = '{}s'",
            state.config.database.statement_timeout.seconds()
        ))
        .execute(&mut *tx)
        .await?;
        let sha256 = export_file::finish(Some(written.out), &partial, &path, &dir).await?;
        let manifest = Manifest {
            policy: r.policy.clone(),
            run_id: r.run_id.clone(),
            partition: r.partition.clone(),
            parent: r.parent.clone(),
            bound: r.bound.clone(),
            timestamp_from: r.timestamp_from,
            timestamp_to: r.timestamp_to,
            rows: written.rows,
            first_key: written.first_key,
            last_key: written.last_key,
            digest: hex::encode(written.digest.finalize()),
            export_location: path.display().to_string(),
            export_sha256: sha256,
            carried_rows: r.carried_rows,
            detached_as: r.detached_as.clone(),
        };
        verify(Path::new(&path), manifest.rows, &manifest.export_sha256).await?;
        crate::crash_point!("retire_after_export");
        // A hold committed while the keys were exported (the related tables are not locked) is
        // seen here, as close to the drop as it can be: tried again, the partition is kept.
        if kept_rows(&mut tx, &rules, carried.as_deref()).await? > 0 {
            bail!("a row of the partition became held while its keys were exported; tried again");
        }
        if !ledger::retirements::renew(&state.pool, r, token, lease).await?
            || !ledger::retirements::record_drop(&mut tx, r, token, &manifest, grace).await?
        {
            bail!("the retirement's lease was lost; nothing is dropped");
        }
        if grace == 0 {
            sqlx::query(&format!("drop table {}", rules.table_sql()))
                .execute(&mut *tx)
                .await?;
        }
        anyhow::Ok(manifest)
    }
    .await;
    let manifest = match prepared {
        Ok(m) => m,
        Err(e) => {
            remove_export(&[&path, &partial]);
            return Err(e);
        }
    };
    // A failed commit keeps the export: the server may have committed before the connection
    // broke, and then the manifest names this file. A retry that finds the table still there
    // writes it again.
    tx.commit().await?;
    let rows = manifest.rows;
    crate::crash_point!("retire_after_drop");
    // A dropped partition's rows are deleted items like any command's (its manifest is their
    // audit): counted in sweeper_items_total.
    crate::metrics::items_recorded(
        &r.policy,
        &ledger::Counts {
            deleted: rows,
            ..Default::default()
        },
    );
    info!(
        run_id = r.run_id,
        partition = r.partition,
        rows = manifest.rows,
        export = manifest.export_location,
        sha256 = manifest.export_sha256,
        seconds = began.elapsed().as_secs_f64(),
        grace_seconds = grace,
        "partition exported and recorded{}",
        if grace == 0 {
            ", and dropped"
        } else {
            "; dropped after its grace"
        }
    );
    Ok(if grace == 0 {
        "dropped"
    } else {
        "awaiting_drop"
    }
    .into())
}

/// Drops a partition whose grace has passed, in one transaction holding its ACCESS EXCLUSIVE
/// lock, when it is still the table the manifest describes: the same table (not another given
/// its name), detached, with the manifest's row count, none of its rows held since, and no later
/// run retiring it. Otherwise it is left as it is, `kept` (attached again: an operator's undo;
/// changed; held; retired again by a later run) or `gone`, with the reason. Its manifest and the
/// run's counts stand in every case: they record the rows that left the target with the detach.
async fn drop_after_grace(state: &AppState, r: &Retirement, token: Uuid) -> anyhow::Result<String> {
    let table = detached_table(r)?;
    let name = table.quoted();
    let carried = r.carried_keys.as_deref();
    let mut tx = state.pool.begin().await?;
    // The count and the held rows' check read the whole table: bounded by the lease, which is
    // renewed meanwhile, not by the pool's statement_timeout.
    sqlx::query("set local statement_timeout = 0")
        .execute(&mut *tx)
        .await?;
    let decided = async {
        let before = ledger::retirements::grace_target(&mut tx, r).await?;
        if !before.exists || !before.same_table {
            return anyhow::Ok(("gone", Some(gone_reason(before.exists))));
        }
        // Taken before anything is judged: an ATTACH still validating holds this lock, and its
        // catalog change is seen only once it committed.
        sqlx::query(&format!("lock table {name} in access exclusive mode"))
            .execute(&mut *tx)
            .await?;
        let now = ledger::retirements::grace_target(&mut tx, r).await?;
        if !now.exists || !now.same_table {
            return Ok(("gone", Some(gone_reason(now.exists))));
        }
        if now.attached {
            return Ok((
                "kept",
                Some(
                    "attached again during its grace: left as it is (its manifest still records \
                     the detach)"
                        .to_string(),
                ),
            ));
        }
        if let Some(run) = now.later_run {
            return Ok((
                "kept",
                Some(format!(
                    "retired again by run {run} (it was attached again during its grace): left \
                     to that run"
                )),
            ));
        }
        let rows: i64 = sqlx::query_scalar(&format!("select count(*) from {name}"))
            .fetch_one(&mut *tx)
            .await?;
        // A carved table also holds the rows carried over (copied, not moved), those without a
        // key an item key names among them.
        let expected = r.rows + r.carried_rows.unwrap_or(0);
        if rows != expected {
            return Ok((
                "kept",
                Some(format!(
                    "its rows changed during its grace ({rows} rows; its manifest names {}{}): \
                     not dropped; drop it by hand once its rows are accounted for",
                    r.rows,
                    if carried.is_some() {
                        " and the carried rows"
                    } else {
                        ""
                    }
                )),
            ));
        }
        // The rules last: a table found gone or attached is judged without them.
        let rules = rules_of(state, r).await?.on_table(table);
        let held = kept_rows(&mut tx, &rules, carried).await?;
        if held > 0 {
            return Ok((
                "kept",
                Some(format!(
                    "{held} of its rows became held during its grace (an exclusion or the \
                     selection): not dropped; the detached table {} keeps them ({} returns them \
                     to the table)",
                    name,
                    format_args!(
                        "alter table {} attach partition {} {}",
                        r.parent, r.partition, r.bound
                    )
                )),
            ));
        }
        // A view or function created on it during its grace (the lock above keeps others out).
        if let Some(why) = crate::plan::dependents_refusal(&mut tx, &name).await? {
            return Ok((
                "kept",
                Some(format!(
                    "{why}, since its detach: not dropped (its drop would fail); drop that first \
                     and then the detached table {name} by hand, or return it to the table with \
                     {}",
                    format_args!(
                        "alter table {} attach partition {} {}",
                        r.parent, r.partition, r.bound
                    )
                )),
            ));
        }
        sqlx::query(&format!("drop table {name}"))
            .execute(&mut *tx)
            .await?;
        Ok(("dropped", None))
    };
    let (next, why) = renewing(state, r, token, decided, Lost::Stop).await?;
    if !ledger::retirements::end_grace(&mut tx, r, token, next, why.as_deref()).await? {
        bail!("the retirement's lease was lost; nothing is dropped");
    }
    tx.commit().await?;
    match &why {
        None => info!(
            run_id = r.run_id,
            partition = r.partition,
            "partition dropped after its grace"
        ),
        Some(why) => {
            warn!(run_id = r.run_id, partition = r.partition, reason = %why, "partition not dropped after its grace")
        }
    }
    Ok(next.into())
}

/// Why a retirement awaiting its drop is `gone`: its table no longer exists, or another table
/// has its name.
fn gone_reason(exists: bool) -> String {
    if exists {
        "another table has its name since its evidence was recorded (renamed, and a new one \
         made): left as it is"
            .into()
    } else {
        "dropped or renamed outside sweeper during its grace".into()
    }
}

/// Removes an export file and its partial file if they exist (a drop that did not commit).
fn remove_export(paths: &[&Path]) {
    for path in paths {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                warn!(path = %path.display(), error = %e, "removing the export of a drop that did not commit failed")
            }
        }
    }
}

/// The table a retirement exports and drops: the partition, detached; for a carve-out, the old
/// table under the name the swap gave it.
fn detached_table(r: &Retirement) -> anyhow::Result<TableName> {
    let name = r.detached_as.as_deref().unwrap_or(&r.partition);
    TableName::parse(&name.replace('"', ""))
        .map_err(|e| anyhow::anyhow!("the partition's name: {e}"))
}

/// The detached table's rows the run must not remove (held by an exclusion, not selected, not
/// old enough, or with a key no item key names); for a carve-out (`carried`), only those not
/// carried over.
async fn kept_rows(
    tx: &mut sqlx::PgConnection,
    rules: &RuleSet,
    carried: Option<&[String]>,
) -> anyhow::Result<i64> {
    let mut q = QueryBuilder::<Postgres>::new("select count(*) from ");
    q.push(rules.table_sql());
    q.push(" where not (");
    rules.push_has_key(&mut q);
    q.push(" and ");
    rules.push_eligible(&mut q);
    q.push(")");
    if let Some(carried) = carried {
        q.push(" and ");
        carve::push_not_carried(&mut q, rules, carried);
    }
    Ok(q.build_query_scalar().fetch_one(&mut *tx).await?)
}

/// Keeps a detached partition the run must not drop (`because`: rows it must not remove, or an
/// object that depends on it): attached again for its bound (the next run sweeps it row by row)
/// and recorded `kept`, committing `tx`. When it cannot be attached again (rows inserted in its
/// range meanwhile went to a default partition), it is left detached, and the reason says so and
/// what to do.
async fn keep(
    mut tx: sqlx::Transaction<'_, Postgres>,
    r: &Retirement,
    token: Uuid,
    because: &str,
) -> anyhow::Result<()> {
    let mut attach = sqlx::Connection::begin(&mut *tx).await?;
    let attached = sqlx::query(&format!(
        "alter table {} attach partition {} {}",
        r.parent, r.partition, r.bound
    ))
    .execute(&mut *attach)
    .await;
    let why = match attached {
        Ok(_) => {
            attach.commit().await?;
            format!("{because}: attached again; the next run sweeps it row by row")
        }
        // Only a row of its range found in the default partition (23514) keeps it detached; any
        // other failure (a lock timeout, a lost connection) is tried again.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("23514") => {
            attach.rollback().await?;
            format!(
                "{because}, and it could not be attached again ({e}): the detached table {} \
                 holds its rows; attach it by hand ({} once the conflicting rows are moved)",
                r.partition,
                format_args!(
                    "alter table {} attach partition {} {}",
                    r.parent, r.partition, r.bound
                )
            )
        }
        Err(e) => return Err(anyhow::Error::new(e).context("attaching the partition again")),
    };
    if !ledger::retirements::set_state(&mut tx, r, token, "kept", Some(&why)).await? {
        bail!("the retirement's lease was lost");
    }
    tx.commit().await?;
    info!(run_id = r.run_id, partition = r.partition, reason = %why, "partition kept");
    Ok(())
}

/// The export file's name: the policy, the run and the partition, each made safe for a file
/// name.
fn export_name(policy: &str, run_id: &str, partition: &str) -> String {
    let safe = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    format!(
        "sweeper-partition-{}-{}-{}.jsonl.gz",
        safe(policy),
        safe(run_id),
        safe(partition)
    )
}

/// What writing an export produced.
struct Written {
    out: export_file::Encoder,
    rows: i64,
    first_key: Option<String>,
    last_key: Option<String>,
    /// SHA-256 of the keys, each followed by `\n`, in the order written.
    digest: Sha256,
}

/// Writes the detached table's keys (for a carve-out, but the `carried` ones), sorted bytewise,
/// to `partial`: one line
/// `{"policy","run_id","partition","item_key"}` each, read from one streamed statement.
/// The keys are fetched on this task while a blocking thread hashes, formats and compresses the
/// chunk before (PostgreSQL's sort and transfer overlap the compression). The retirement's lease
/// is renewed throughout (a large partition may take longer than a lease to export); a lease
/// lost stops the export.
async fn write_export(
    state: &AppState,
    tx: &mut sqlx::PgConnection,
    (rules, carried): (&RuleSet, Option<&[String]>),
    (r, token): (&Retirement, Uuid),
    partial: &Path,
) -> anyhow::Result<Written> {
    // gzip's fastest level: a partition's key lines repeat their policy, run and partition, which
    // compress well at any level, and the default level would be most of a drop's time.
    let out = export_file::create(partial, flate2::Compression::fast())?;
    // Each line is this prefix, the key as a JSON string, and `}`.
    let prefix = {
        let mut p = serde_json::to_vec(&serde_json::json!({
            "policy": r.policy, "run_id": r.run_id, "partition": r.partition,
        }))?;
        p.pop();
        p.extend_from_slice(b",\"item_key\":");
        p
    };
    // One chunk waiting beside the one being written and the one being gathered.
    let (chunks, mut received) = tokio::sync::mpsc::channel::<Vec<String>>(1);
    let writer = tokio::task::spawn_blocking(move || -> anyhow::Result<Written> {
        let mut w = Written {
            out,
            rows: 0,
            first_key: None,
            last_key: None,
            digest: Sha256::new(),
        };
        let mut lines = Vec::new();
        while let Some(keys) = received.blocking_recv() {
            lines.clear();
            for key in &keys {
                w.digest.update(key.as_bytes());
                w.digest.update(b"\n");
                lines.extend_from_slice(&prefix);
                serde_json::to_writer(&mut lines, key)?;
                lines.extend_from_slice(b"}\n");
            }
            std::io::Write::write_all(&mut w.out, &lines)?;
            w.rows += keys.len() as i64;
            if w.first_key.is_none() {
                w.first_key = keys.first().cloned();
            }
            w.last_key = keys.into_iter().next_back();
        }
        Ok(w)
    });
    let fetched = async {
        // One statement, streamed: PostgreSQL sends the sorted keys as fast as they are read,
        // with no round trip per chunk (a cursor's FETCH loop took 8 % longer a retirement).
        // The key text is computed once, as the sort key (sorting by the expression again under
        // another collation computed it twice: 40 % of the statement). Its rows go to the
        // writer CHUNK_KEYS at a time.
        let key_sql = format!(
            "select ({key}) collate \"C\" as item_key from {table}",
            key = rules.key_text_sql(),
            table = rules.table_sql()
        );
        let mut q = match carried {
            None => QueryBuilder::<Postgres>::new(key_sql),
            // A carve-out's: the key text computed once here too, then filtered (`offset 0`
            // keeps the subquery from being flattened, which computed it again in the filter:
            // +58 % on a 250,000-row month).
            Some(carried) => {
                let mut q = QueryBuilder::<Postgres>::new(format!(
                    "select item_key from ({key_sql} where "
                ));
                rules.push_has_key(&mut q);
                q.push(" offset 0) k where not coalesce(item_key in (select unnest(");
                q.push_bind(carried.to_vec());
                q.push("::text[])), false)");
                q
            }
        };
        q.push(" order by 1");
        let mut stream = q.build_query_scalar::<String>().fetch(&mut *tx);
        let mut keys = Vec::with_capacity(CHUNK_KEYS);
        while let Some(key) = futures_util::TryStreamExt::try_next(&mut stream).await? {
            keys.push(key);
            if keys.len() == CHUNK_KEYS {
                let full = std::mem::replace(&mut keys, Vec::with_capacity(CHUNK_KEYS));
                if chunks.send(full).await.is_err() {
                    // The writer stopped: its error is the one to report.
                    break;
                }
            }
        }
        drop(stream);
        if !keys.is_empty() {
            let _ = chunks.send(keys).await;
        }
        anyhow::Ok(())
    };
    // A large partition's sort alone may outlast a lease: renewed throughout, and a lost lease
    // stops the export.
    let fetched = renewing(state, r, token, fetched, Lost::Stop).await;
    drop(chunks);
    let written = writer.await.context("the export's writer")?;
    fetched?;
    written
}

/// What [`renewing`] does when the lease is lost.
#[derive(Clone, Copy, PartialEq)]
enum Lost {
    /// Ends the work with an error (the work is dropped).
    Stop,
    /// Logs it and lets the work finish (a statement the server would run on anyway).
    Continue,
}

/// Runs `work` while renewing the retirement's lease every quarter of it.
async fn renewing<T>(
    state: &AppState,
    r: &Retirement,
    token: Uuid,
    work: impl std::future::Future<Output = anyhow::Result<T>>,
    lost: Lost,
) -> anyhow::Result<T> {
    let lease = state.config.planning.lease.seconds() as f64;
    let mut every = tokio::time::interval(std::time::Duration::from_secs_f64(lease / 4.0));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    tokio::pin!(work);
    let mut reported = false;
    loop {
        tokio::select! {
            done = &mut work => return done,
            _ = every.tick() => {
                let held = match ledger::retirements::renew(&state.pool, r, token, lease).await {
                    Ok(held) => held,
                    Err(e) => {
                        // Tried again at the next tick; the lease has three more to go.
                        warn!(run_id = r.run_id, partition = r.partition, error = %e, "renewing the retirement's lease failed");
                        true
                    }
                };
                if held || reported {
                    continue;
                }
                if lost == Lost::Stop {
                    bail!("the retirement's lease was lost; stopped");
                }
                warn!(run_id = r.run_id, partition = r.partition, "the retirement's lease was lost while its statement runs; letting it finish");
                reported = true;
            }
        }
    }
}

/// Runs the retirer until `shutdown`: a retirement after another while there are some; otherwise
/// it waits for a run's planning to end, polling as a fallback.
pub async fn retirer_loop(state: AppState, shutdown: tokio_util::sync::CancellationToken) {
    while !shutdown.is_cancelled() {
        let notified = state.wake_retirer.notified();
        let worked = match retire_next(&state).await {
            Ok(worked) => worked,
            Err(e) => {
                warn!(error = %format!("{e:#}"), "the partition retirer failed; retrying");
                false
            }
        };
        if worked {
            continue;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = notified => {}
            _ = tokio::time::sleep(state.config.queue.poll_interval.std()) => {}
        }
    }
}
