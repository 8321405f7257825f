//! The uploads quick start (`sweeper quickstart --scenario uploads`): expired uploads are deleted
//! from the bucket, then their rows.
//!
//! In its own database, [`UPLOADS_DATABASE`], it seeds `app.uploads` (the table of
//! `deploy/examples/schema.sql` plus a `status`): uploads over five months, some still
//! `uploading`, some on legal hold, some live (no `expired_at`); each upload's file is written to
//! its own directory, [`bucket_dir`], which a `local` dependency serves as the bucket (the same
//! object-store code path as S3, GCS and Azure). A few eligible rows get no file: their object is
//! already gone. `upload-retention` (as in `deploy/examples/upload-retention.toml`, with the
//! `uploading` exclusion) is triggered for the latest daily tick; the server is aborted once a
//! third of the eligible objects are deleted, as a crash would, and a new one finishes the run.
//! The report compares the database and the directory before and after.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::PgConnection;

use super::{Demo, Options};

/// The database the uploads quick start owns: dropped and recreated on every run.
pub const UPLOADS_DATABASE: &str = "sweeper_quickstart_uploads";

/// Uploads seeded.
const UPLOADS: i64 = 4_000;

/// The policy's daily schedule.
const CRON: &str = "15 4 * * *";

/// The policy's `retain_for`, in days.
const RETAIN_DAYS: i64 = 30;

/// Short leases, so the commands the aborted server held are reclaimed within seconds
/// (`claim_batch × command_deadline` must stay below the lease), the bucket, and the policy as
/// an operator would write it; `{root}` is the bucket's directory.
const CONFIG: &str = r#"
[queue]
workers = 2
lease = "10s"
claim_batch = 1
[consume]
command_deadline = "5s"
statement_timeout = "5s"
[planning]
lease = "10s"

[[dependency]]
name = "uploads"
kind = "local"
root = '{root}'

[[policy]]
name = "upload-retention"
schedule = { cron = "15 4 * * *", timezone = "UTC" }
target = { table = "app.uploads", key = "id", timestamp = "expired_at" }
retain_for = "30d"
exclude = [ { column = "legal_hold", equals = true },
            { column = "status", equals = "uploading" } ]
batch_size = 100
action = { kind = "object_store", dependency = "uploads", column = "object_key", then = "delete_row" }
"#;

/// The directory the quick start uses as its bucket: `sweeper_quickstart_uploads` under the
/// system's temporary directory, removed and recreated on every run (like the database).
pub fn bucket_dir() -> PathBuf {
    std::env::temp_dir().join(UPLOADS_DATABASE)
}

/// One seeded upload.
struct Upload {
    id: i64,
    object_key: String,
    size_bytes: i64,
    legal_hold: bool,
    uploading: bool,
    /// Whether the policy deletes it at the cutoff.
    eligible: bool,
    /// Whether its file was written (false: an eligible row whose object is already gone).
    has_file: bool,
}

impl Upload {
    fn path(&self, root: &Path) -> PathBuf {
        root.join(&self.object_key)
    }

    /// The file's bytes: a line naming the upload, repeated to `size_bytes`.
    fn bytes(&self) -> Vec<u8> {
        let line = format!("upload {}: {}\n", self.id, self.object_key);
        line.bytes()
            .cycle()
            .take(self.size_bytes.max(0) as usize)
            .collect()
    }

    /// Whether its file is there with the bytes it was seeded with.
    fn intact(&self, root: &Path) -> bool {
        std::fs::read(self.path(root)).is_ok_and(|b| b == self.bytes())
    }
}

/// Runs the uploads quick start.
// Over 80 lines: a script read top to bottom (database, seed, bucket, serve, trigger, restart,
// wait, check, report), each step a few lines that share its locals.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    println!("== sweeper quickstart: expired uploads and their objects ==");
    let (window, window_s) = super::latest_window(CRON)?;
    let cutoff = window - chrono::Duration::days(RETAIN_DAYS);
    let root = bucket_dir();
    println!(
        "creating database {UPLOADS_DATABASE}: {UPLOADS} uploads over five months; their files in \
         {} ...",
        root.display()
    );
    let t_seed = Instant::now();
    let (mut conn, demo_url) = super::recreate_database(UPLOADS_DATABASE).await?;
    let uploads = seed(&mut conn, window, cutoff).await?;
    let root_for_write = root.clone();
    let uploads = tokio::task::spawn_blocking(move || {
        write_bucket(&root_for_write, &uploads).map(|()| uploads)
    })
    .await??;
    let rows_before = uploads.len() as i64;
    let objects_before = count_files(&root)?;
    let eligible_with_file = uploads.iter().filter(|u| u.eligible && u.has_file).count() as i64;
    let seeded_missing = uploads.iter().filter(|u| !u.has_file).count() as i64;
    println!(
        "seeded in {:.1}s: {rows_before} uploads, {objects_before} objects; {} eligible at \
         {window_s} ({seeded_missing} of them without their object)",
        t_seed.elapsed().as_secs_f64(),
        eligible_with_file + seeded_missing
    );

    let root_text = root
        .to_str()
        .context("the temporary directory is not UTF-8")?;
    if root_text.contains(['\'', '\n', '\r']) {
        bail!("the temporary directory {root_text} cannot be written as a TOML literal string");
    }
    let mut demo = Demo::start(&demo_url, opts.port, &CONFIG.replace("{root}", root_text)).await?;
    let started = Instant::now();
    let run = demo.trigger("upload-retention", &window_s).await?;
    let run_id = run["run_id"].as_str().context("no run_id")?.to_string();

    // A crash in the middle of the run: the server is aborted with object deletes in flight.
    let deleted_so_far = async || {
        let root = root.clone();
        let now = tokio::task::spawn_blocking(move || count_files(&root)).await;
        objects_before - now.ok().and_then(Result::ok).unwrap_or(objects_before)
    };
    super::wait_until(Duration::from_secs(120), async || {
        deleted_so_far().await >= eligible_with_file / 3
    })
    .await;
    let at_abort = deleted_so_far().await;
    demo.restart().await?;
    println!(
        "aborted the server after {at_abort} objects were deleted and started a new one on {}; \
         the commands the old one held are reclaimed when their 10 s leases expire",
        demo.base
    );
    let run = demo.wait_terminal(&run_id).await?;
    let seconds = started.elapsed().as_secs_f64();

    // The database and the directory after the run, upload by upload.
    let kept: HashSet<i64> = sqlx::query_scalar("select id from app.uploads")
        .fetch_all(&mut conn)
        .await?
        .into_iter()
        .collect();
    let root_for_check = root.clone();
    let check =
        tokio::task::spawn_blocking(move || Check::of(&root_for_check, &uploads, &kept)).await??;
    let objects_after = count_files(&root)?;
    let rows_after = check.kept_rows;
    let remaining_sql = eligible_rows(&mut conn, cutoff).await?;
    let already_absent = super::audited(&mut conn, &run_id, "already_absent").await?;
    let audit_deleted = super::audited(&mut conn, &run_id, "deleted").await?;
    let n = |k: &str| run[k].as_i64().unwrap_or(0);

    println!();
    println!("run {run_id}: {}", run["status"].as_str().unwrap_or("?"));
    println!(
        "  cutoff              {}",
        run["cutoff"].as_str().unwrap_or("?")
    );
    println!("  uploads (rows)      {rows_before} before, {rows_after} after");
    println!("  objects (files)     {objects_before} before, {objects_after} after");
    println!("  eligible (planned)  {}", n("eligible_planned"));
    println!("  deleted             {} (object, then row)", n("deleted"));
    println!(
        "  already absent      {already_absent} (object missing, row deleted; {seeded_missing} \
         seeded so)"
    );
    println!("  rows deleted        {}", rows_before - rows_after);
    println!("  held at planning    {}", super::held_total(&run));
    if let Some(reasons) = run["held_at_planning"].as_object() {
        for (reason, count) in reasons {
            println!("    {reason:<18}{count}");
        }
    }
    println!("  failed              {}", n("failed"));
    println!("  remaining eligible  {}", n("remaining_eligible"));
    println!(
        "check: {} of {} rows on legal hold kept with their files intact; {} of {} uploading",
        check.held_intact, check.held, check.uploading_intact, check.uploading
    );
    println!(
        "       kept rows whose file is gone {}, whose file changed {}; deleted rows whose file \
         remains {}; files with no row {}",
        check.kept_missing, check.kept_changed, check.deleted_with_object, check.orphans
    );
    println!("objects deleted at abort {at_abort}");
    println!("seconds               {seconds:.1}");

    let summary = json!({
        "scenario": "uploads",
        "run_id": run_id,
        "status": run["status"],
        "window": window_s,
        "cutoff": run["cutoff"],
        "rows_before": rows_before,
        "rows_after": rows_after,
        "rows_deleted": rows_before - rows_after,
        "objects_before": objects_before,
        "objects_after": objects_after,
        "objects_deleted": objects_before - objects_after,
        "eligible": n("eligible_planned"),
        "deleted": n("deleted"),
        "audit_deleted_rows": audit_deleted,
        "already_absent": already_absent,
        "seeded_missing": seeded_missing,
        "held_rows": check.held,
        "held_rows_intact": check.held_intact,
        "uploading_rows": check.uploading,
        "uploading_rows_intact": check.uploading_intact,
        "held_at_planning": run["held_at_planning"],
        "kept_rows_missing_object": check.kept_missing,
        "kept_objects_changed": check.kept_changed,
        "deleted_rows_with_object": check.deleted_with_object,
        "objects_without_row": check.orphans,
        "failed": n("failed"),
        "remaining_eligible": run["remaining_eligible"],
        "remaining_eligible_rows": remaining_sql,
        "objects_at_abort": at_abort,
        "seconds": (seconds * 10.0).round() / 10.0,
        "bucket": root_text,
        "database_url": super::without_password(&demo_url),
    });
    let q = "-H \"Authorization: Bearer $SWEEPER_TOKEN\"";
    let hints = [
        format!(
            "curl -s {q} \"$SWEEPER_URL/runs/$RUN\" | jq '{{status, deleted, already_absent}}'"
        ),
        format!("curl -s {q} \"$SWEEPER_URL/runs/$RUN/items?limit=5\" | jq ."),
        format!("find {root_text} -type f | wc -l"),
    ];
    demo.finish(opts.exit, &run_id, &hints).await?;
    println!("{summary}");
    Ok(())
}

/// What the directory holds against the rows, after the run.
struct Check {
    kept_rows: i64,
    held: i64,
    held_intact: i64,
    uploading: i64,
    uploading_intact: i64,
    /// Kept rows whose file is gone.
    kept_missing: i64,
    /// Kept rows whose file is there with other bytes than seeded.
    kept_changed: i64,
    /// Deleted rows whose file remains.
    deleted_with_object: i64,
    /// Files no seeded upload names.
    orphans: i64,
}

impl Check {
    fn of(root: &Path, uploads: &[Upload], kept: &HashSet<i64>) -> anyhow::Result<Check> {
        let mut c = Check {
            kept_rows: kept.len() as i64,
            held: 0,
            held_intact: 0,
            uploading: 0,
            uploading_intact: 0,
            kept_missing: 0,
            kept_changed: 0,
            deleted_with_object: 0,
            orphans: 0,
        };
        for u in uploads {
            let exists = u.path(root).is_file();
            if !kept.contains(&u.id) {
                c.deleted_with_object += exists as i64;
                continue;
            }
            let intact = u.intact(root);
            c.kept_missing += !exists as i64;
            c.kept_changed += (exists && !intact) as i64;
            if u.legal_hold {
                c.held += 1;
                c.held_intact += intact as i64;
            }
            if u.uploading {
                c.uploading += 1;
                c.uploading_intact += intact as i64;
            }
        }
        let named: HashSet<PathBuf> = uploads.iter().map(|u| u.path(root)).collect();
        let mut files = Vec::new();
        walk(root, &mut files)?;
        c.orphans = files.iter().filter(|f| !named.contains(*f)).count() as i64;
        Ok(c)
    }
}

/// The policy's predicate at `cutoff`: expired before it, not on legal hold, not `uploading`.
const ELIGIBLE: &str = "expired_at < $1 and not legal_hold and status <> 'uploading'";

/// Rows of `app.uploads` the policy would still delete at `cutoff`.
async fn eligible_rows(conn: &mut PgConnection, cutoff: DateTime<Utc>) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(&format!(
        "select count(*) from app.uploads where {ELIGIBLE}"
    ))
    .bind(cutoff)
    .fetch_one(conn)
    .await?)
}

/// Seeds `app.uploads` (deterministic: the generator is seeded; uploads over the 150 days
/// before `window`, ~20 % still live, ~5 % `uploading`, ~3 % on legal hold) and returns every
/// upload; one in 25 of the rows eligible at `cutoff` (by id) gets no file: its object is
/// already gone.
async fn seed(
    conn: &mut PgConnection,
    window: DateTime<Utc>,
    cutoff: DateTime<Utc>,
) -> anyhow::Result<Vec<Upload>> {
    sqlx::raw_sql(
        "create schema app;
         create table app.uploads (
             id             bigint primary key,
             owner_id       bigint not null,
             -- The object's path inside the bucket (no leading /).
             object_key     text not null unique,
             content_type   text,
             size_bytes     bigint not null default 0,
             -- 'uploading' while a client still writes the object, then 'ready'.
             status         text not null,
             uploaded_at    timestamptz not null,
             -- When the upload stopped being needed; NULL while it is live (never eligible).
             expired_at     timestamptz,
             legal_hold     boolean not null default false);
         select setseed(0.31);",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "with r as (
             select g, 1 + (g * 7919) % 300 as owner,
                    $2::timestamptz - random() * interval '150 days' as up,
                    random() as a, random() as b, random() as c, random() as d
               from generate_series(1, $1::bigint) g)
         insert into app.uploads (id, owner_id, object_key, content_type, size_bytes, status,
                                  uploaded_at, expired_at, legal_hold)
         select g, owner,
                'u/' || owner || '/' || to_char(up at time zone 'UTC', 'YYYY/MM') || '/' || g
                    || '-' || (array['report.pdf', 'photo.jpg', 'invoice.pdf', 'notes.txt'])[1 + g % 4],
                (array['application/pdf', 'image/jpeg', 'application/pdf', 'text/plain'])[1 + g % 4],
                200 + (g * 37) % 1800,
                case when a < 0.05 then 'uploading' else 'ready' end,
                up,
                case when b < 0.2 then null else up + c * ($2::timestamptz - up) end,
                d < 0.03
           from r",
    )
    .bind(UPLOADS)
    .bind(window)
    .execute(&mut *conn)
    .await?;
    sqlx::raw_sql(
        "create index uploads_expired_at on app.uploads (expired_at);
         analyze app.uploads;",
    )
    .execute(&mut *conn)
    .await?;
    let rows: Vec<(i64, String, i64, bool, bool, bool)> = sqlx::query_as(&format!(
        "select id, object_key, size_bytes, legal_hold, status = 'uploading',
                coalesce({ELIGIBLE}, false)
           from app.uploads order by id"
    ))
    .bind(cutoff)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(id, object_key, size_bytes, legal_hold, uploading, eligible)| Upload {
                id,
                object_key,
                size_bytes,
                legal_hold,
                uploading,
                eligible,
                has_file: !(eligible && id % 25 == 7),
            },
        )
        .collect())
}

/// Removes and recreates `root` and writes every upload's file but the missing ones.
fn write_bucket(root: &Path, uploads: &[Upload]) -> anyhow::Result<()> {
    if root.exists() {
        std::fs::remove_dir_all(root).with_context(|| format!("removing {}", root.display()))?;
    }
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    for u in uploads.iter().filter(|u| u.has_file) {
        let path = u.path(root);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&path, u.bytes()).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Files under `root`, every level.
fn count_files(root: &Path) -> anyhow::Result<i64> {
    let mut files = Vec::new();
    walk(root, &mut files)?;
    Ok(files.len() as i64)
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            walk(&entry.path(), files)?;
        } else {
            files.push(entry.path());
        }
    }
    Ok(())
}
