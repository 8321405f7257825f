//! How far a run's planning has walked, estimated from its cursor without a scan: the target's
//! smallest and largest key (key order, numeric keys) or its oldest timestamp (the timestamp
//! walk, which ends at the cutoff), each one index-backed `min`/`max` read.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::policy::{KeyType, Target};

/// Where a planning job stands: its walk and cursor.
#[derive(Debug, Clone, Default)]
pub struct Cursor<'a> {
    /// `key_order` or `timestamp_index`; None before the first page.
    pub path: Option<&'a str>,
    /// The last key planned (as text).
    pub key: Option<&'a str>,
    /// The timestamp walk's last timestamp, as seconds since the epoch (a float, so an
    /// `-infinity` cursor is `-inf` rather than a value chrono cannot hold).
    pub timestamp: Option<f64>,
}

/// The walked fraction (0-1): 0 before the first page; for key order over a key whose leading
/// column (in walk order) is an integer, `(cursor − min) / (max − min)` of that column; for the timestamp walk of a `timestamptz`
/// column, `(cursor − oldest) / (cutoff − oldest)`. None when it cannot be told this way (a
/// text or uuid key, a `timestamp` column with a zone, a read over one second).
pub async fn planned_fraction(
    pool: &PgPool,
    target: &Target,
    cursor: &Cursor<'_>,
    cutoff: DateTime<Utc>,
) -> Option<f64> {
    let Some(path) = cursor.path else {
        return Some(0.0);
    };
    let mut tx = pool.begin().await.ok()?;
    sqlx::query("set local statement_timeout = '1s'")
        .execute(&mut *tx)
        .await
        .ok()?;
    let table = target.table.quoted();
    let fraction = match path {
        "timestamp_index" if target.timestamp_zone.is_none() => {
            let Some(at) = cursor.timestamp else {
                return Some(0.0);
            };
            let ts = target.timestamp.quoted();
            // Epoch seconds, finite rows only: `-infinity` is a valid timestamptz (planned like
            // any old row) that a chrono value cannot hold.
            let oldest: Option<f64> = sqlx::query_scalar(&format!(
                "select extract(epoch from min({ts}))::float8 from {table}
                  where {ts} > '-infinity'::timestamptz"
            ))
            .fetch_one(&mut *tx)
            .await
            .ok()?;
            let oldest = oldest?;
            let span = cutoff.timestamp() as f64 - oldest;
            (span > 0.0 && at.is_finite()).then(|| (at - oldest) / span)
        }
        "key_order" => {
            let info = crate::policy::TableInfo::load(pool, &target.table)
                .await
                .ok()??;
            let key = info.key(&target.key).ok()?;
            let (leading, leading_type) = key.leading();
            if !matches!(
                leading_type,
                KeyType::Bigint | KeyType::Integer | KeyType::Smallint
            ) {
                return None;
            }
            let Some(at) = cursor
                .key
                .and_then(|k| key.leading_value(k))
                .and_then(|k| k.parse::<f64>().ok())
            else {
                return Some(0.0);
            };
            let key = leading.quoted();
            let (lo, hi): (Option<f64>, Option<f64>) = sqlx::query_as(&format!(
                "select min({key})::float8, max({key})::float8 from {table}"
            ))
            .fetch_one(&mut *tx)
            .await
            .ok()?;
            let (lo, hi) = (lo?, hi?);
            Some(if hi > lo { (at - lo) / (hi - lo) } else { 1.0 })
        }
        _ => None,
    };
    let _ = tx.rollback().await;
    fraction.map(|f| f.clamp(0.0, 1.0))
}
