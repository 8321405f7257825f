//! Verified export files (docs/design.md §2.9): gzip JSON Lines written through a `.partial` file,
//! hashed as written (SHA-256 of the file), synced, renamed, the directory synced, then re-read to
//! verify line count and SHA-256 before anything they stand for is dropped. Audit retention
//! exports months to them; the partition sweep, a retired partition's keys.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use sha2::{Digest, Sha256};

/// Starts an export at `partial` (created or truncated), compressed at `level`.
pub(crate) fn create(partial: &Path, level: Compression) -> anyhow::Result<Encoder> {
    let file = std::fs::File::create(partial)
        .with_context(|| format!("creating {}", partial.display()))?;
    Ok(GzEncoder::new(
        Hashing::new(std::io::BufWriter::new(file)),
        level,
    ))
}

/// Finishes the export in `out`: compressed, flushed and synced, renamed from `partial` to
/// `path`, and the rename made durable (`dir` synced). Returns the file's SHA-256.
pub(crate) async fn finish(
    out: Option<Encoder>,
    partial: &Path,
    path: &Path,
    dir: &Path,
) -> anyhow::Result<String> {
    let w = out.expect("the encoder");
    let sha256 = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
        let mut hashing = w.finish()?;
        hashing.flush()?;
        hashing.inner.get_ref().sync_all()?;
        Ok(hex::encode(hashing.hasher.finalize()))
    })
    .await??;
    std::fs::rename(partial, path)
        .with_context(|| format!("renaming {} to {}", partial.display(), path.display()))?;
    // The rename itself must be durable before what the file stands for can be dropped.
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing {}", dir.display()))?;
    Ok(sha256)
}

/// A gzip export being written, hashed as it is written.
pub(crate) type Encoder = GzEncoder<Hashing<std::io::BufWriter<std::fs::File>>>;

/// Writes `n` lines (`lines` without its last newline) to the export, off the async runtime.
pub(crate) async fn write_lines(
    out: &mut Option<Encoder>,
    mut lines: Vec<u8>,
    n: usize,
) -> anyhow::Result<i64> {
    if n == 0 {
        return Ok(0);
    }
    lines.push(b'\n');
    let mut w = out.take().expect("the encoder is put back after each page");
    w = tokio::task::spawn_blocking(move || -> std::io::Result<_> {
        w.write_all(&lines)?;
        Ok(w)
    })
    .await??;
    *out = Some(w);
    Ok(n as i64)
}

/// Re-reads the export at `path`: its SHA-256 must be `sha256` and it must hold `rows` lines.
pub(crate) async fn verify(path: &Path, rows: i64, sha256: &str) -> anyhow::Result<()> {
    let path: PathBuf = path.to_path_buf();
    let (found_sha, found_rows) =
        tokio::task::spawn_blocking(move || -> anyhow::Result<(String, i64)> {
            let mut hasher = Sha256::new();
            let mut f = std::fs::File::open(&path)
                .with_context(|| format!("re-reading the export {}", path.display()))?;
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
            }
            let mut gz = GzDecoder::new(std::io::BufReader::new(std::fs::File::open(&path)?));
            let mut lines = 0i64;
            loop {
                let n = gz.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                lines += buf[..n].iter().filter(|b| **b == b'\n').count() as i64;
            }
            Ok((hex::encode(hasher.finalize()), lines))
        })
        .await??;
    if found_sha != sha256 || found_rows != rows {
        tracing::warn!(
            sha256,
            found_sha,
            rows,
            found_rows,
            "an audit export does not verify"
        );
        bail!(
            "the export does not match its record (SHA-256 {found_sha}, {found_rows} rows; \
             recorded {sha256}, {rows} rows): nothing is dropped"
        );
    }
    Ok(())
}

/// A writer that hashes what passes through it (the SHA-256 of the file as written).
pub(crate) struct Hashing<W> {
    inner: W,
    hasher: Sha256,
}

impl<W> Hashing<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
        }
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
