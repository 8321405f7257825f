//! Which walk plans a run (issue 13): the key-order walk visits every key of the table, the
//! timestamp-index walk only the rows older than the cutoff. The choice is made per run, from
//! the planner's estimate of the eligible fraction, and said with its reason wherever an
//! operator looks (`check-config`, `GET /policies`, `GET /runs/{id}`).

use serde::Serialize;
use sqlx::PgConnection;

use super::Target;
use crate::config::PathSetting;

/// The walk that plans a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanningPath {
    /// Every key of the table in key order (keys never change, so a key is met once). Costs
    /// what the table costs: the right walk when most rows are eligible.
    KeyOrder,
    /// `timestamp < cutoff` in (timestamp, key) order through an index that leads with the
    /// timestamp, with a keyset cursor. Costs what the eligible rows cost; a row whose
    /// timestamp moves forward past the cursor is met again, and the run's planned keys keep
    /// it out of a second command.
    TimestampIndex,
}

impl PlanningPath {
    /// The name in the ledger and in JSON: `key_order`, `timestamp_index`.
    pub fn as_str(self) -> &'static str {
        match self {
            PlanningPath::KeyOrder => "key_order",
            PlanningPath::TimestampIndex => "timestamp_index",
        }
    }

    /// The path named `s` (as stored by [`PlanningPath::as_str`]).
    pub fn parse(s: &str) -> Option<PlanningPath> {
        match s {
            "key_order" => Some(PlanningPath::KeyOrder),
            "timestamp_index" => Some(PlanningPath::TimestampIndex),
            _ => None,
        }
    }
}

/// The estimated eligible fraction (rows older than the cutoff ÷ rows) above which the
/// key-order walk is chosen even when an index leads with the timestamp. Above it, reading the
/// table in key order touches each heap page about once, while the index walk would fetch most
/// rows by timestamp, in heap order unrelated to the key, and record each planned key.
pub const INDEX_PATH_MAX_FRACTION: f64 = 0.25;

/// A path and why it was chosen.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PathChoice {
    /// The path.
    pub path: PlanningPath,
    /// Why, for operators (e.g. "no index leads with closed_at").
    pub reason: String,
    /// The index the timestamp-index walk would use, if there is one.
    pub index: Option<String>,
    /// The planner's estimate of the fraction of rows older than the cutoff (0..=1), when it
    /// was asked.
    pub estimated_fraction: Option<f64>,
}

/// An index that can drive the timestamp walk: valid, B-tree, not partial, leading with the
/// timestamp column. `(name, whether its second column is the key)`; one with the key second
/// is preferred (the walk's order is then the index's order, no sort within a timestamp).
pub async fn timestamp_index(
    conn: &mut PgConnection,
    target: &Target,
) -> sqlx::Result<Option<(String, bool)>> {
    let walk = walk_order(conn, target).await?;
    sqlx::query_as(
        "select i.indexrelid::regclass::text,
                coalesce(i.indnkeyatts > 1 and k.attname = $3, false) as key_second
           from pg_index i
           join pg_class ic on ic.oid = i.indexrelid
           join pg_am am on am.oid = ic.relam and am.amname = 'btree'
           join pg_attribute t on t.attrelid = i.indrelid and t.attnum = i.indkey[0]
           left join pg_attribute k on k.attrelid = i.indrelid and k.attnum = i.indkey[1]
          where i.indrelid = to_regclass($1) and t.attname = $2
            and i.indisvalid and i.indisready and i.indpred is null
          order by key_second desc, i.indnkeyatts, ic.relname
          limit 1",
    )
    .bind(target.table.quoted())
    .bind(target.timestamp.as_str())
    .bind(&walk[0])
    .fetch_optional(conn)
    .await
}

/// The planner's estimate of the fraction of `target`'s rows whose timestamp is before
/// `cutoff` (two `EXPLAIN`s, no rows read; 0 for an empty table).
pub async fn estimated_fraction(
    conn: &mut PgConnection,
    target: &Target,
    cutoff: chrono::DateTime<chrono::Utc>,
) -> sqlx::Result<f64> {
    let table = target.table.quoted();
    // The cutoff is a timestamp this process formatted: safe as a literal, and a literal (not a
    // parameter) lets the planner use the column's statistics for it.
    let older = format!(
        "explain (format json) select 1 from {table} where {} < '{}'::timestamptz",
        target.timestamp.quoted(),
        cutoff.to_rfc3339()
    );
    let all = format!("explain (format json) select 1 from {table}");
    let rows = |plan: serde_json::Value| plan[0]["Plan"]["Plan Rows"].as_f64().unwrap_or(0.0);
    let older: sqlx::types::Json<serde_json::Value> =
        sqlx::query_scalar(&older).fetch_one(&mut *conn).await?;
    let all: sqlx::types::Json<serde_json::Value> =
        sqlx::query_scalar(&all).fetch_one(&mut *conn).await?;
    let (older, all) = (rows(older.0), rows(all.0));
    Ok(if all <= 0.0 {
        0.0
    } else {
        (older / all).min(1.0)
    })
}

/// Chooses the path for a run of `target` at `cutoff` under `setting`: the timestamp-index walk
/// when an index leads with the timestamp, the column carries its zone (`timestamptz`: the walk
/// compares the column itself with the cutoff), and — under `auto` — the planner estimates at
/// most [`INDEX_PATH_MAX_FRACTION`] of the rows older than the cutoff; the key-order walk
/// otherwise.
pub async fn choose(
    conn: &mut PgConnection,
    target: &Target,
    cutoff: chrono::DateTime<chrono::Utc>,
    setting: PathSetting,
) -> sqlx::Result<PathChoice> {
    let ts = target.timestamp.as_str();
    let key_order = |reason: String, index: Option<String>, fraction: Option<f64>| PathChoice {
        path: PlanningPath::KeyOrder,
        reason,
        index,
        estimated_fraction: fraction,
    };
    if setting == PathSetting::KeyOrder {
        return Ok(key_order(
            "planning.path = \"key_order\"".into(),
            None,
            None,
        ));
    }
    // A forced timestamp walk that cannot be had says so.
    let forced = |reason: String| match setting {
        PathSetting::TimestampIndex => {
            format!("planning.path = \"timestamp_index\", but {reason}: the key-order walk is used")
        }
        _ => reason,
    };
    if let Some(zone) = &target.timestamp_zone {
        return Ok(key_order(
            forced(format!(
                "{ts} is a timestamp without time zone read in {zone}: the timestamp-index walk \
                 needs a timestamptz column"
            )),
            None,
            None,
        ));
    }
    let Some((index, key_second)) = timestamp_index(conn, target).await? else {
        return Ok(key_order(
            forced(format!(
                "no index leads with {ts} (create index on {} ({}))",
                target.table,
                key_list(conn, target).await?
            )),
            None,
            None,
        ));
    };
    let fraction = estimated_fraction(conn, target, cutoff).await?;
    let percent = format_percent(fraction);
    if setting == PathSetting::Auto && fraction > INDEX_PATH_MAX_FRACTION {
        return Ok(key_order(
            format!(
                "about {percent} of rows are older than the cutoff (planner estimate), over {}: \
                 the key-order walk reads fewer pages",
                format_percent(INDEX_PATH_MAX_FRACTION)
            ),
            Some(index),
            Some(fraction),
        ));
    }
    let why = match setting {
        PathSetting::TimestampIndex => "planning.path = \"timestamp_index\"".to_string(),
        _ => format!("about {percent} of rows are older than the cutoff (planner estimate)"),
    };
    let order = if key_second {
        String::new()
    } else {
        format!(
            "; ({}) would spare a sort within each timestamp",
            key_list(conn, target).await?
        )
    };
    Ok(PathChoice {
        path: PlanningPath::TimestampIndex,
        reason: format!("{why}: walked through index {index}{order}"),
        index: Some(index),
        estimated_fraction: Some(fraction),
    })
}

/// The key's columns in the order planning walks them (the order of the unique index that makes
/// the key; the policy's when the table cannot say).
async fn walk_order(conn: &mut PgConnection, target: &Target) -> sqlx::Result<Vec<String>> {
    let info = super::TableInfo::load_on(conn, &target.table).await?;
    Ok(match info.and_then(|t| t.key(&target.key).ok()) {
        Some(k) => k.walk_names().into_iter().map(String::from).collect(),
        None => target
            .key
            .columns()
            .iter()
            .map(|c| c.as_str().to_string())
            .collect(),
    })
}

/// The columns of an index that leads with the timestamp and then walks the key, in walk order:
/// `closed_at, id`, `closed_at, tenant_id, id`, `created_at, id` for a key `(id, created_at)`.
pub async fn key_list(conn: &mut PgConnection, target: &Target) -> sqlx::Result<String> {
    // A key that includes the timestamp (a time-partitioned table's) lists it once, first.
    let ts = target.timestamp.as_str();
    Ok(std::iter::once(ts.to_string())
        .chain(
            walk_order(conn, target)
                .await?
                .into_iter()
                .filter(|c| c != ts),
        )
        .collect::<Vec<_>>()
        .join(", "))
}

/// `0.0048` → `"0.48 %"`, `0.6863` → `"69 %"`.
fn format_percent(fraction: f64) -> String {
    let p = fraction * 100.0;
    if p < 10.0 {
        format!("{p:.2} %")
    } else {
        format!("{p:.0} %")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_round_trip_and_percentages_read_well() {
        for p in [PlanningPath::KeyOrder, PlanningPath::TimestampIndex] {
            assert_eq!(PlanningPath::parse(p.as_str()), Some(p));
        }
        assert_eq!(PlanningPath::parse("index"), None);
        assert_eq!(format_percent(0.0048), "0.48 %");
        assert_eq!(format_percent(0.6863), "69 %");
        assert_eq!(format_percent(0.25), "25 %");
    }
}
