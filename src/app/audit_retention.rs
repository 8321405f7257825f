//! `ledger.audit_retention`: the audit stops growing. Each month whose partition ended longer
//! ago than the retention is exported (JSON Lines, gzip, one file per month in
//! `ledger.audit_export_dir`), the file is re-read to verify its row count and SHA-256, both are
//! recorded in the ledger (`sweeper.audit_exports`), and only then is the partition detached
//! (`DETACH … CONCURRENTLY`) and dropped. A month holding rows of a run that is not terminal is
//! skipped. Every step can be repeated: a crash after the export re-verifies the file and goes
//! on; a crash in the detach is finished by the next pass (`FINALIZE`).
//!
//! A month is one row of `sweeper.audit_partitions` and four tables: the audit's first shape and
//! the lean one (executions, items, manifests), exported to one file and dropped together.
//! Memory and statement size stay bounded whatever the month holds: rows of the first shape are
//! read in keyset pages of [`PAGE_ROWS`], lean rows [`PAGE_EXECUTIONS`] executions at a time (at
//! most their batch sizes' worth of rows: 5,000 at the default batch of 250, 200,000 at the largest
//! batch), and compressed as they come, off the async runtime. Each line is self-contained: the
//! item with its execution's fields.

use std::path::Path;

use anyhow::{Context, bail};
use tracing::info;

use super::job_lease::HeldJob;
use crate::export_file::{self, Encoder, verify, write_lines};
use crate::ledger;
use crate::ledger::audit::{Export, Partition};
use crate::state::AppState;

/// Audit rows of the first shape read per statement while exporting.
pub const PAGE_ROWS: i64 = 10_000;

/// Executions read per statement while exporting, with all their items (a command's items are
/// at most its batch size, at most 10,000).
pub const PAGE_EXECUTIONS: i64 = 20;

/// One pass: every expired month, oldest first, exported, verified, detached and dropped.
/// Returns how many months were dropped. Nothing happens when `ledger.audit_retention` is unset.
pub async fn audit_retention_pass(state: &AppState, lease: &HeldJob) -> anyhow::Result<u64> {
    let (Some(retention), Some(dir)) = (
        state.config.ledger.audit_retention,
        state.config.ledger.audit_export_dir.as_deref(),
    ) else {
        return Ok(0);
    };
    let mut dropped = 0;
    for (p, export) in ledger::audit::expired_partitions(&state.pool, retention.seconds()).await? {
        if ledger::audit::holds_open_runs(&state.pool, &p).await? {
            info!(
                partition = p.partition,
                "audit month kept: it holds rows of a run that is not terminal"
            );
            continue;
        }
        let export = match export {
            Some(e) => {
                // An earlier pass exported it: the file must still be what it recorded.
                verify(Path::new(&e.location), e.rows, &e.sha256).await?;
                e
            }
            None => export_month(state, &p, dir).await?,
        };
        // Rows added to the month after its export (only a clock moved back could) are not in
        // the file: such a month is never dropped.
        let now_rows = ledger::audit::partition_rows(&state.pool, &p).await?;
        if now_rows != export.rows {
            bail!(
                "audit partition {} holds {now_rows} rows, its export {}: not dropped",
                p.partition,
                export.rows
            );
        }
        crate::crash_point!("audit_after_export");
        if !lease.held() {
            bail!(
                "another replica took over audit retention; {} is left to it",
                p.partition
            );
        }
        ledger::audit::detach(&state.pool, &p)
            .await
            .with_context(|| format!("detaching audit partition {}", p.partition))?;
        ledger::audit::drop_partition(&state.pool, &p).await?;
        info!(
            partition = p.partition,
            rows = export.rows,
            sha256 = export.sha256,
            location = export.location,
            "audit month exported, verified and dropped"
        );
        dropped += 1;
    }
    Ok(dropped)
}

/// Writes `p` to `dir` (through a `.partial` file renamed when complete), re-reads it to verify,
/// and records it.
async fn export_month(state: &AppState, p: &Partition, dir: &Path) -> anyhow::Result<Export> {
    let path = dir.join(format!("sweeper-audit-{}.jsonl.gz", p.partition));
    let partial = path.with_extension("gz.partial");
    let expected = ledger::audit::partition_rows(&state.pool, p).await?;
    let mut out = Some(export_file::create(
        &partial,
        flate2::Compression::default(),
    )?);
    let mut rows = 0i64;
    let mut after = 0i64;
    loop {
        let page = ledger::audit::first_shape_page(&state.pool, p, after, PAGE_ROWS).await?;
        let Some(last) = page.last() else { break };
        after = last.row.audit_id;
        rows += write_rows(&mut out, &page).await?;
    }
    let mut after = 0i64;
    loop {
        let executions =
            ledger::audit::lean_executions(&state.pool, p, after, PAGE_EXECUTIONS).await?;
        let Some(&last) = executions.last() else {
            break;
        };
        after = last;
        let page = ledger::audit::lean_rows(&state.pool, p, &executions).await?;
        rows += write_rows(&mut out, &page).await?;
    }
    let manifests = ledger::audit::manifest_lines(&state.pool, p).await?;
    rows += write_lines(&mut out, manifests.join("\n").into_bytes(), manifests.len()).await?;
    if rows != expected {
        bail!(
            "audit partition {} changed while it was exported ({rows} rows read, {expected} counted)",
            p.partition
        );
    }
    let sha256 = export_file::finish(out, &partial, &path, dir).await?;
    verify(&path, rows, &sha256).await?;
    let location = path.display().to_string();
    ledger::audit::record_export(&state.pool, p, rows, &sha256, &location).await?;
    Ok(Export {
        partition: p.partition.clone(),
        state: "exported".into(),
        rows,
        sha256,
        location,
    })
}

/// Writes `page` to the export, one JSON line per row; returns how many.
async fn write_rows(
    out: &mut Option<Encoder>,
    page: &[ledger::audit::ExportRow],
) -> anyhow::Result<i64> {
    let mut lines = Vec::with_capacity(page.len() * 320);
    for (n, row) in page.iter().enumerate() {
        if n > 0 {
            lines.push(b'\n');
        }
        serde_json::to_writer(&mut lines, row)?;
    }
    write_lines(out, lines, page.len()).await
}
