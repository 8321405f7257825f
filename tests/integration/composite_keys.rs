//! Keys of several columns (issue 31): a multi-tenant table keyed `(tenant_id, id)` on every
//! transport, a table keyed `(id, created_at)` whose ids repeat, the one item key text written
//! alike in SQL and in Rust, the item endpoint's spellings, and what `check-config` refuses.

use crate::common::*;
use crate::kit::process::{sweeper, write_config};
use crate::scenarios::Transport;

/// `demo.tickets` keyed `(tenant_id, id)` — its primary key in the other order, `(id,
/// tenant_id)`, as a unique index may list them — with `demo.attachments` referencing a ticket
/// through both columns (NO ACTION: a referenced ticket's delete fails alone).
pub const TENANT_TICKETS: &str = "
create schema demo;
create table demo.tickets (
    tenant_id text not null,
    id bigint not null,
    status text,
    legal_hold boolean,
    closed_at timestamptz,
    primary key (id, tenant_id)
);
create index on demo.tickets (closed_at);
create table demo.attachments (
    id bigint primary key,
    tenant_id text,
    ticket_id bigint,
    foreign key (ticket_id, tenant_id) references demo.tickets (id, tenant_id)
);
";

/// Tenants whose names JSON must escape: a quote, a backslash, a tab, a non-ASCII letter.
const TENANTS: [&str; 4] = ["acme", "b\"q\\x", "t\tab", "ümlaut, ok"];

/// The ticket policy keyed `["tenant_id", "id"]`.
fn tenant_key(policy: String) -> String {
    policy.replace(r#"key = "id""#, r#"key = ["tenant_id", "id"]"#)
}

/// The item key text of ticket `(tenant, id)`: compact JSON, the policy's column order.
fn item(tenant: &str, id: i64) -> String {
    serde_json::to_string(&[tenant.to_string(), id.to_string()]).unwrap()
}

/// Ids 1..=30 under each tenant (ids repeat across tenants): closed long ago unless `id` is a
/// multiple of 3, id 7 on legal hold. Returns the eligible tickets' item keys, sorted.
async fn seed_tenants(pool: &sqlx::PgPool) -> Vec<String> {
    let mut eligible = vec![];
    let (mut tenants, mut ids, mut closed, mut holds) = (vec![], vec![], vec![], vec![]);
    for t in TENANTS {
        for id in 1..=30i64 {
            let old = id % 3 != 0;
            tenants.push(t.to_string());
            ids.push(id);
            closed.push(if old {
                at("2026-01-01T00:00:00Z")
            } else {
                at("2026-08-31T00:00:00Z")
            });
            holds.push(id == 7);
            if old && id != 7 {
                eligible.push(item(t, id));
            }
        }
    }
    sqlx::query(
        "insert into demo.tickets (tenant_id, id, status, legal_hold, closed_at)
         select t, i, 'closed', h, c from unnest($1::text[], $2::bigint[], $3::bool[], $4::timestamptz[]) u(t, i, h, c)",
    )
    .bind(&tenants)
    .bind(&ids)
    .bind(&holds)
    .bind(&closed)
    .execute(pool)
    .await
    .unwrap();
    eligible.sort();
    eligible
}

/// The item keys of the tickets left, sorted.
async fn tickets_left(pool: &sqlx::PgPool) -> Vec<String> {
    let rows: Vec<(String, i64)> = sqlx::query_as("select tenant_id, id from demo.tickets")
        .fetch_all(pool)
        .await
        .unwrap();
    let mut keys: Vec<String> = rows.iter().map(|(t, i)| item(t, *i)).collect();
    keys.sort();
    keys
}

/// A multi-tenant run over `t`: deletes of id 5 (under every tenant) fail transiently until a
/// delivery failed on one; the run completes with every eligible `(tenant, id)` deleted once and
/// audited once under its JSON item key, and nothing else touched.
async fn a_tenant_keyed_table_is_cleaned(t: &Transport) -> TestApp {
    let app = t.app_with(TENANT_TICKETS, tenant_key).await;
    let eligible = seed_tenants(&app.pool).await;
    let before = tickets_left(&app.pool).await;
    fail_ticket_deletes(&app.pool, 5).await;
    let run_id = app.api.trigger_new("ticket-retention", "").await;
    crate::kit::ledger::wait_transient_failure(&app.pool).await;
    heal_ticket_deletes(&app.pool, 5).await;
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted"].as_i64().unwrap(), eligible.len() as i64);
    let kept: Vec<String> = before
        .into_iter()
        .filter(|k| !eligible.contains(k))
        .collect();
    assert_eq!(
        tickets_left(&app.pool).await,
        kept,
        "exactly the eligible rows deleted"
    );
    let mut deleted: Vec<String> = app
        .audit(&run_id)
        .await
        .into_iter()
        .filter(|(_, o, _)| o == "deleted")
        .map(|(k, _, _)| k)
        .collect();
    deleted.sort();
    assert_eq!(
        deleted, eligible,
        "one deleted row per eligible key, by its text"
    );
    assert_eq!(
        crate::kit::ledger::items_with_several_outcomes(&app.pool).await,
        0,
        "one outcome per item"
    );
    // The held ticket's reason, under each tenant.
    let held: i64 = sqlx::query_scalar(
        "select count(*) from sweeper.audit_trail where run_id = $1 and outcome = 'excluded'",
    )
    .bind(&run_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(held <= TENANTS.len() as i64, "{held}");
    app
}

#[tokio::test]
async fn builtin_a_tenant_keyed_table_is_cleaned() {
    a_tenant_keyed_table_is_cleaned(&Transport::Builtin).await;
}

#[tokio::test]
async fn pubsub_a_tenant_keyed_table_is_cleaned() {
    a_tenant_keyed_table_is_cleaned(&Transport::pubsub().await).await;
}

#[tokio::test]
async fn qstash_a_tenant_keyed_table_is_cleaned() {
    a_tenant_keyed_table_is_cleaned(&Transport::qstash().await).await;
}

/// An item that fails alone under a composite key (a row of `demo.attachments` references it)
/// becomes an item dead letter named by its JSON key; once the reference is gone, a redrive by
/// curl deletes it, and its history is found by the key's text percent-encoded.
#[tokio::test]
async fn a_composite_key_dead_letter_is_redriven_and_its_history_found() {
    let app = Transport::Builtin
        .app_with(TENANT_TICKETS, tenant_key)
        .await;
    seed_tenants(&app.pool).await;
    let tenant = TENANTS[1];
    sqlx::query("insert into demo.attachments values (1, $1, 4)")
        .bind(tenant)
        .execute(&app.pool)
        .await
        .unwrap();
    let run_id = app.api.trigger_new("ticket-retention", "").await;
    let run = app.wait_terminal(&run_id).await;
    assert_eq!(run["status"], "completed_with_dead_letters", "{run}");
    let run = app.get_json(&format!("/runs/{run_id}")).await;
    let dl = &run["open_dead_letters"][0];
    assert_eq!(dl["item_key"], item(tenant, 4).as_str(), "{dl}");
    assert_eq!(dl["replay_safe"]["will_fail_again"], true, "{dl}");
    let id = dl["dead_letter_id"].as_i64().unwrap();

    sqlx::query("delete from demo.attachments")
        .execute(&app.pool)
        .await
        .unwrap();
    let dl = app.get_json(&format!("/dead-letters/{id}")).await;
    assert_eq!(dl["replay_safe"]["will_fail_again"], false, "{dl}");
    app.api.redrive(id, "attachment removed").await;
    app.wait_until(&run_id, "the redrive done", |r| {
        r["dead_letters"]["resolved"] == 1
    })
    .await;
    let left: i64 =
        sqlx::query_scalar("select count(*) from demo.tickets where tenant_id = $1 and id = 4")
            .bind(tenant)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(left, 0, "the redrive deleted the ticket");

    // The history, by the key percent-encoded, written with spaces and a leading zero.
    let spelled = format!("[ {} , \"004\" ]", serde_json::to_string(tenant).unwrap());
    let path = format!(
        "/policies/ticket-retention/items/{}",
        percent_encoding::utf8_percent_encode(&spelled, percent_encoding::NON_ALPHANUMERIC)
    );
    let h = app.get_json(&path).await;
    assert_eq!(h["item_key"], item(tenant, 4).as_str(), "{h}");
    assert_eq!(
        h["key"],
        serde_json::json!({"tenant_id": tenant, "id": "4"})
    );
    assert_eq!(
        h["key_columns"],
        serde_json::json!([{"name": "tenant_id", "type": "text"}, {"name": "id", "type": "bigint"}])
    );
    let outcomes: Vec<&str> = h["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["failed", "deleted"], "{h}");
    assert!(h["earlier_key"].is_null(), "{h}");
    // A key of the wrong shape is a 400 in our words.
    for bad in ["4", "[\"acme\"]", "[\"acme\",\"four\"]"] {
        let a = app
            .api
            .send(
                reqwest::Method::GET,
                &format!(
                    "/policies/ticket-retention/items/{}",
                    percent_encoding::utf8_percent_encode(bad, percent_encoding::NON_ALPHANUMERIC)
                ),
                None,
            )
            .await;
        assert_eq!(a.status, 400, "{bad}: {}", a.body);
        assert_eq!(a.body["type"], "urn:sweeper:problem:bad-key", "{}", a.body);
        let detail = a.body["detail"].as_str().unwrap();
        assert!(detail.contains("(tenant_id, id)"), "{detail}");
    }
}

/// `demo.events` keyed `(id, created_at)`, as a time-partitioned table's primary key must be;
/// its ids repeat.
const EVENTS: &str = "
create schema demo;
create table demo.events (
    id bigint not null,
    created_at timestamptz not null,
    payload text,
    primary key (id, created_at)
);
create index on demo.events (created_at, id);
";

const EVENTS_POLICY: &str = r#"
[[policy]]
name = "events"
schedule = { cron = "0 2 * * *", timezone = "UTC" }
target = { table = "demo.events", key = ["id", "created_at"], timestamp = "created_at" }
retain_for = "30d"
batch_size = 7
"#;

/// Every eligible `(id, created_at)` is deleted once and audited once — whichever walk plans it
/// — and its history is found by the canonical text and by an equivalent spelling (another
/// offset, `.000000`), answered with the canonical one.
#[tokio::test]
async fn a_table_keyed_id_and_created_at_with_repeating_ids_is_cleaned_once_per_key() {
    for path in ["key_order", "timestamp_index"] {
        let app = TestApp::spawn(Spawn {
            now: Some(at("2026-09-01T02:01:00Z")),
            policies: EVENTS_POLICY.into(),
            extra_toml: format!("[planning]\npath = \"{path}\"\npage_rows = 5\n"),
            setup_sql: EVENTS,
            workers: 1,
        })
        .await;
        // Ids 1..=12, each at three times: two old (one with microseconds), one recent.
        sqlx::query(
            "insert into demo.events
             select i, t, 'x' from generate_series(1, 12) i,
                    unnest(array['2026-05-01T00:00:00Z', '2026-05-02T10:20:30.120000Z',
                                 '2026-08-30T00:00:00Z']::timestamptz[]) t",
        )
        .execute(&app.pool)
        .await
        .unwrap();
        let run_id = app.api.trigger_new("events", "").await;
        let done = app.wait_terminal(&run_id).await;
        assert_eq!(done["status"], "completed", "{path}: {done}");
        assert_eq!(done["deleted"], 24, "{path}: {done}");
        let mut deleted: Vec<String> = app
            .audit(&run_id)
            .await
            .into_iter()
            .map(|(k, o, _)| {
                assert_eq!(o, "deleted");
                k
            })
            .collect();
        deleted.sort();
        let mut want: Vec<String> = (1..=12)
            .flat_map(|i| {
                [
                    format!(r#"["{i}","2026-05-01T00:00:00Z"]"#),
                    format!(r#"["{i}","2026-05-02T10:20:30.12Z"]"#),
                ]
            })
            .collect();
        want.sort();
        assert_eq!(deleted, want, "{path}: every eligible key once");
        let left: i64 = sqlx::query_scalar("select count(*) from demo.events")
            .fetch_one(&app.pool)
            .await
            .unwrap();
        assert_eq!(left, 12, "{path}: the recent rows kept");

        for spelled in [
            r#"["7","2026-05-02T10:20:30.12Z"]"#,
            r#"["7","2026-05-02T12:20:30.120000+02:00"]"#,
            r#"[7, "2026-05-02 10:20:30.120+00"]"#,
        ] {
            let h = app
                .get_json(&format!(
                    "/policies/events/items/{}",
                    percent_encoding::utf8_percent_encode(
                        spelled,
                        percent_encoding::NON_ALPHANUMERIC
                    )
                ))
                .await;
            assert_eq!(h["item_key"], r#"["7","2026-05-02T10:20:30.12Z"]"#, "{h}");
            assert_eq!(h["audit"][0]["outcome"], "deleted", "{spelled}: {h}");
            assert_eq!(h["audit"][0]["run_id"], run_id.as_str());
        }
        app.stop().await;
    }
}

/// A policy keyed `id` whose table is then keyed `(id, created_at)` (a table being
/// partitioned): the new key's history also returns the old key's, marked `earlier_key`.
#[tokio::test]
async fn a_key_that_grew_a_column_keeps_the_earlier_keys_history() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: EVENTS_POLICY.replace(r#"key = ["id", "created_at"]"#, r#"key = "id""#),
        setup_sql: "create schema demo;
             create table demo.events (id bigint not null, created_at timestamptz not null,
                                       payload text, primary key (id, created_at));
             create unique index events_id on demo.events (id);",
        workers: 1,
        extra_toml: String::new(),
    })
    .await;
    sqlx::query("insert into demo.events values (7, '2026-05-01T00:00:00Z', 'x')")
        .execute(&app.pool)
        .await
        .unwrap();
    let first = app.api.trigger_new("events", "").await;
    app.wait_terminal(&first).await;
    let (db, pool) = app.stop().await;
    sqlx::query("drop index demo.events_id")
        .execute(&pool)
        .await
        .unwrap();
    set_clock(&pool, at("2026-09-02T02:01:00Z")).await;
    let app = TestApp::start(db, pool, 1, "", EVENTS_POLICY).await;
    sqlx::query("insert into demo.events values (7, '2026-06-01T00:00:00Z', 'y')")
        .execute(&app.pool)
        .await
        .unwrap();
    let second = app.api.trigger_new("events", "").await;
    app.wait_terminal(&second).await;
    let h = app
        .get_json(&format!(
            "/policies/events/items/{}",
            percent_encoding::utf8_percent_encode(
                r#"["7","2026-06-01T00:00:00Z"]"#,
                percent_encoding::NON_ALPHANUMERIC
            )
        ))
        .await;
    assert_eq!(h["audit"][0]["run_id"], second.as_str(), "{h}");
    let earlier = &h["earlier_key"];
    assert_eq!(earlier["item_key"], "7", "{h}");
    assert_eq!(earlier["audit"][0]["run_id"], first.as_str(), "{h}");
    assert_eq!(earlier["audit"][0]["outcome"], "deleted");
}

/// `check-config` on the key's rules, in our words.
#[tokio::test]
async fn check_config_says_what_a_composite_key_needs() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(
        "create schema demo;
         create table demo.ok (tenant_id text not null, id bigint not null, closed_at timestamptz,
                               primary key (id, tenant_id));
         create index on demo.ok (closed_at);
         create table demo.nullable (tenant_id text, id bigint not null, closed_at timestamptz);
         create unique index on demo.nullable (tenant_id, id);
         create table demo.partial (tenant_id text not null, id bigint not null, closed_at timestamptz);
         create unique index on demo.partial (tenant_id, id) where id > 0;
         create table demo.wider (tenant_id text not null, id bigint not null, v int not null,
                                  closed_at timestamptz, primary key (tenant_id, id, v));
         create table demo.numeric (tenant_id text not null, n numeric not null, closed_at timestamptz,
                                    primary key (tenant_id, n));
         create collation demo.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
         create table demo.collated (name text collate demo.ci not null, id int not null,
                                     closed_at timestamptz);
         create unique index on demo.collated (name collate \"C\", id);
         create table demo.insensitive (name text collate demo.ci not null, id int not null,
                                        closed_at timestamptz, primary key (name, id));
         create type demo.int8 as enum ('a', 'b');
         create table demo.shadow (t text not null, id demo.int8 not null, closed_at timestamptz,
                                   primary key (t, id));
         create table demo.partial_one (id bigint not null, closed_at timestamptz);
         create unique index on demo.partial_one (id) where id > 100;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let policy = |name: &str, table: &str, key: &str| {
        format!(
            "[[policy]]\nname = \"{name}\"\nschedule = {{ cron = \"0 2 * * *\" }}\n\
             target = {{ table = \"demo.{table}\", key = {key}, timestamp = \"closed_at\" }}\n\
             retain_for = \"90d\"\n"
        )
    };
    let policies = [
        policy("ok", "ok", r#"["tenant_id", "id"]"#),
        policy("nullable", "nullable", r#"["tenant_id", "id"]"#),
        policy("partial", "partial", r#"["tenant_id", "id"]"#),
        policy("wider", "wider", r#"["tenant_id", "id"]"#),
        policy("numeric", "numeric", r#"["tenant_id", "n"]"#),
        policy("collated", "collated", r#"["name", "id"]"#),
        policy("insensitive", "insensitive", r#"["name", "id"]"#),
        policy("shadow", "shadow", r#"["t", "id"]"#),
        policy("partial_one", "partial_one", r#""id""#),
    ]
    .join("\n");
    let path = write_config(&config_toml(&db.url, 0, "", &policies));
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    for expected in [
        "error: policy[nullable]: target.key: column(s) tenant_id admit NULL",
        "error: policy[partial]: target.key: no primary key or unique index of demo.partial is exactly (tenant_id, id)",
        "error: policy[wider]: target.key: no primary key or unique index of demo.wider is exactly (tenant_id, id)",
        "error: policy[numeric]: target.key: column n is numeric; a key column is bigint, integer, smallint, uuid, text, varchar, timestamptz, timestamp or date",
        // An index comparing under another collation, or a nondeterministic one ('a' = 'A'),
        // does not make a key: the walk, the match and the text would disagree.
        "error: policy[collated]: target.key: no primary key or unique index of demo.collated is exactly (name, id)",
        "error: policy[insensitive]: target.key: no primary key or unique index of demo.insensitive is exactly (name, id)",
        // A type named like a built-in one is not taken for it.
        "error: policy[shadow]: target.key: column id is demo.int8; a key column is",
        // A one-column key meets the same test: a partial unique index is no key.
        "error: policy[partial_one]: target.key: column id has no unique index",
    ] {
        assert!(
            stdout.contains(expected),
            "missing `{expected}` in:\n{stdout}"
        );
    }
    assert!(!stdout.contains("policy[ok]: target.key"), "{stdout}");

    // Shapes refused before any database: one name in an array, five names, a name twice, a
    // number.
    for (key, expected) in [
        (
            r#"["id"]"#,
            "target.key: a key of several columns names 2 to 4 of them, not 1",
        ),
        (
            r#"["a", "b", "c", "d", "e"]"#,
            "names 2 to 4 of them, not 5",
        ),
        (r#"["id", "id"]"#, "target.key: column `id` is named twice"),
        (
            "5",
            "a column name (key = \"id\") or an array of 2 to 4 column names",
        ),
        (
            r#"[["a", "b"], "c"]"#,
            "a column name (each entry of key = [...] names one column)",
        ),
    ] {
        let path = write_config(&config_toml(&db.url, 0, "", &policy("bad", "ok", key)));
        let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
            .output()
            .unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_ne!(out.status.code(), Some(0), "{key}: {all}");
        assert!(
            all.contains(expected),
            "{key}: missing `{expected}` in:\n{all}"
        );
    }
}

/// The item key text SQL writes (planning, the delete's RETURNING) and the text Rust writes (the
/// item endpoint) agree byte for byte on arbitrary values of every key type, whatever the
/// session's `TimeZone` and `DateStyle`: effects and dead letters are keyed by it.
#[tokio::test]
async fn sql_and_rust_write_the_same_item_key_text_for_arbitrary_values() {
    use proptest::strategy::{Strategy, ValueTree};
    use sweeper::policy::{Key, KeyColumns, KeyConfig, KeyType};
    let db = TestDb::create().await;
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    sqlx::raw_sql("set timezone = 'Asia/Kathmandu'; set datestyle = 'SQL, DMY'")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::raw_sql(
        "create table k (n int primary key, a bigint, b integer, c smallint, d uuid, e text,
                         f varchar, g timestamptz, h timestamp, i date)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let types = [
        ("a", KeyType::Bigint),
        ("b", KeyType::Integer),
        ("c", KeyType::Smallint),
        ("d", KeyType::Uuid),
        ("e", KeyType::Text),
        ("f", KeyType::Varchar),
        ("g", KeyType::Timestamptz),
        ("h", KeyType::Timestamp),
        ("i", KeyType::Date),
    ];
    // Microseconds within years 0001–9999, and text of any characters PostgreSQL stores
    // (everything but NUL).
    let micros = -62_135_596_800_000_000i64..253_402_214_400_000_000i64;
    let strategy = (
        proptest::num::i64::ANY,
        proptest::num::i32::ANY,
        proptest::num::i16::ANY,
        proptest::num::u128::ANY,
        "[^\u{0}]{0,12}",
        "[\u{1}-\u{7f}]{0,12}",
        micros.clone(),
        micros,
        0i32..3_652_059,
    );
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut rows = vec![];
    for n in 0..400 {
        let v = strategy.new_tree(&mut runner).unwrap().current();
        let ts = chrono::DateTime::<chrono::Utc>::from_timestamp_micros(v.6).unwrap();
        let naive = chrono::DateTime::<chrono::Utc>::from_timestamp_micros(v.7)
            .unwrap()
            .naive_utc();
        let date =
            chrono::NaiveDate::from_ymd_opt(1, 1, 1).unwrap() + chrono::TimeDelta::days(v.8 as i64);
        // Written in a spelling that is not the canonical one where the type has another.
        let written = vec![
            format!("{:+}", v.0),
            format!("{:+}", v.1),
            format!("{:+}", v.2),
            uuid::Uuid::from_u128(v.3)
                .simple()
                .to_string()
                .to_uppercase(),
            v.4.clone(),
            v.5.clone(),
            ts.with_timezone(&chrono::FixedOffset::east_opt(5 * 3600 + 1800).unwrap())
                .format("%Y-%m-%dT%H:%M:%S%.6f%:z")
                .to_string(),
            naive.format("%Y-%m-%d %H:%M:%S%.6f").to_string(),
            date.format("%Y-%m-%d").to_string(),
        ];
        rows.push((n, written));
    }
    let mut insert = sqlx::QueryBuilder::<sqlx::Postgres>::new("insert into k ");
    insert.push_values(&rows, |mut b, (n, w)| {
        b.push_bind(*n);
        for ((_, t), v) in types.iter().zip(w) {
            b.push("cast(")
                .push_bind_unseparated(v.clone())
                .push_unseparated(format!(" as {})", t.as_str()));
        }
    });
    insert.build().execute(&mut conn).await.unwrap();
    // Every type alone, and the types in pairs and in fours.
    let mut shapes: Vec<Vec<usize>> = (0..types.len()).map(|i| vec![i]).collect();
    shapes.extend((0..types.len()).map(|i| vec![i, (i + 4) % types.len()]));
    shapes.extend((0..types.len()).map(|i| vec![(i + 8) % 9, i, (i + 3) % 9, (i + 6) % 9]));
    for shape in shapes {
        let names: Vec<String> = shape.iter().map(|&i| types[i].0.to_string()).collect();
        let written = if names.len() == 1 {
            KeyConfig::One(names[0].clone())
        } else {
            KeyConfig::Many(names.clone())
        };
        let key = Key::new(
            &KeyColumns::parse(&written).unwrap(),
            shape.iter().map(|&i| types[i].1).collect(),
            None,
        );
        let sql: Vec<(i32, String)> =
            sqlx::query_as(&format!("select n, {} from k order by n", key.text_sql("")))
                .fetch_all(&mut conn)
                .await
                .unwrap();
        for (n, text) in sql {
            let w = &rows[n as usize].1;
            let canonical: Vec<String> = shape
                .iter()
                .map(|&i| types[i].1.canonical(&w[i]).unwrap())
                .collect();
            assert_eq!(key.text_of(&canonical), text, "{names:?} {w:?}");
            assert_eq!(
                key.canonical(&text).unwrap(),
                text,
                "canonical is a fixed point"
            );
        }
        // And the text finds its row again, through the key's own match.
        let texts: Vec<String> = sqlx::query_scalar(&format!("select {} from k", key.text_sql("")))
            .fetch_all(&mut conn)
            .await
            .unwrap();
        let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new("select count(*) from k where ");
        key.push_in(&mut q, "", texts);
        let found: i64 = q.build_query_scalar().fetch_one(&mut conn).await.unwrap();
        assert_eq!(found, 400, "{names:?}");
    }
}

/// An `http` action over a table keyed `(tenant_id, id)`, two runs planned before either
/// executes: each item is called once, with the idempotency key `{policy}:{item}:1` naming its
/// JSON item key — or `sha256:` and the hex digest of it when the whole key would pass 255 bytes
/// (a tenant name of 240 characters) — and the other run excludes it (`effect_open` matches the
/// item key text).
#[tokio::test]
async fn an_http_action_on_a_composite_key_calls_each_item_once_under_its_item_key() {
    use crate::ext_common::*;
    use crate::standin::{StandIn, ok};
    use sha2::Digest;
    let provider = StandIn::start(std::time::Duration::from_millis(2), |_, _| ok()).await;
    let policy = payments_policy("reconcile", "payments", 10, "", "")
        .replace(r#"key = "id""#, r#"key = ["tenant_id", "id"]"#)
        .replace("/pay/{id}", "/pay/{tenant_id}/{id}");
    let app = TestApp::spawn(Spawn {
        setup_sql: "create schema ext;
            create table ext.payments (tenant_id text not null, id bigint not null,
                status text not null default 'closed', closed_at timestamptz,
                reconciled_at timestamptz, primary key (tenant_id, id))",
        policies: dependency("payments", &provider.url(), "") + &policy,
        workers: 0,
        now: Some(at(NOW)),
        extra_toml: String::new(),
    })
    .await;
    let long = "t".repeat(240);
    sqlx::query(
        "insert into ext.payments (tenant_id, id, closed_at)
         select t, i, timestamptz '2026-08-01' from unnest($1::text[]) t, generate_series(1, 6) i",
    )
    .bind(vec!["acme".to_string(), long.clone()])
    .execute(&app.pool)
    .await
    .unwrap();
    let mut runs = vec![];
    for window in ["2026-09-01", "2026-09-02"] {
        let (status, run) = app.trigger("reconcile", &format!("?window={window}")).await;
        assert!(status == 202 || status == 200, "{run}");
        let run_id = run["run_id"].as_str().unwrap().to_string();
        app.wait_planned(&run_id).await;
        runs.push(run_id);
    }
    app.drain().await;
    for r in &runs {
        assert_eq!(app.wait_terminal(r).await["status"], "completed");
    }
    let mut keys: Vec<String> = provider
        .calls()
        .iter()
        .map(|c| c.idempotency_key.clone().unwrap())
        .collect();
    keys.sort();
    let mut want: Vec<String> = (1..=6)
        .flat_map(|i| {
            let long_item = item(&long, i);
            [
                format!("reconcile:{}:1", item("acme", i)),
                format!(
                    "reconcile:sha256:{}:1",
                    hex::encode(sha2::Sha256::digest(long_item.as_bytes()))
                ),
            ]
        })
        .collect();
    want.sort();
    assert_eq!(keys, want, "each item called once, under its item key");
    let unreconciled: i64 =
        sqlx::query_scalar("select count(*) from ext.payments where reconciled_at is null")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(unreconciled, 0);
    let (reconciled, items, open): (i64, i64, i64) = sqlx::query_as(
        "select count(*) filter (where outcome = 'reconciled'), count(distinct item_key),
                (select count(*) from sweeper.effects where state <> 'closed')
           from sweeper.audit_trail where policy = 'reconcile'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((reconciled, items, open), (12, 12, 0));
}

/// A dry run over a `(tenant_id, id)` key records `would_delete` under each eligible item key and
/// deletes nothing; the present state of a kept record is read through the key.
#[tokio::test]
async fn a_dry_run_on_a_composite_key_records_each_eligible_item_key() {
    let app = Transport::Builtin
        .app_with(TENANT_TICKETS, tenant_key)
        .await;
    let eligible = seed_tenants(&app.pool).await;
    let before = tickets_left(&app.pool).await;
    let run_id = app
        .api
        .trigger_new("ticket-retention", "?dry_run=true")
        .await;
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        tickets_left(&app.pool).await,
        before,
        "a dry run deletes nothing"
    );
    let mut would: Vec<String> = app
        .audit(&run_id)
        .await
        .into_iter()
        .filter(|(_, o, _)| o == "would_delete")
        .map(|(k, _, _)| k)
        .collect();
    would.sort();
    assert_eq!(would, eligible);
    // A held ticket, now: present, old enough, held by its exclusion.
    let h = app
        .get_json(&format!(
            "/policies/ticket-retention/items/{}",
            percent_encoding::utf8_percent_encode(
                &item(TENANTS[3], 7),
                percent_encoding::NON_ALPHANUMERIC
            )
        ))
        .await;
    let now = &h["present_state"];
    assert_eq!(
        (&now["present"], &now["old_enough"], &now["eligible"]),
        (
            &serde_json::json!(true),
            &serde_json::json!(true),
            &serde_json::json!(false)
        ),
        "{h}"
    );
    assert_eq!(now["held_by"], "legal_hold", "{h}");
}

/// A key whose unique index is gone once the server runs (`check-config` and start-up refuse
/// such a key; a migration can drop the index later) holds the run at planning, kind `schema`,
/// saying why: nothing is deleted without the index that makes each key name one row.
#[tokio::test]
async fn a_key_whose_unique_index_is_gone_holds_the_run_and_deletes_nothing() {
    let app = Transport::Builtin
        .app_with(TENANT_TICKETS, tenant_key)
        .await;
    seed_tenants(&app.pool).await;
    sqlx::raw_sql(
        "drop table demo.attachments;
         alter table demo.tickets drop constraint tickets_pkey;
         create index on demo.tickets (id, tenant_id);",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let run_id = app.api.trigger_new("ticket-retention", "").await;
    let mut held: Option<(String, String)> = None;
    for _ in 0..200 {
        held = sqlx::query_as(
            "select held_kind, held_reason from sweeper.planning_jobs
              where run_id = $1 and held_kind is not null",
        )
        .bind(&run_id)
        .fetch_optional(&app.pool)
        .await
        .unwrap();
        if held.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (kind, reason) = held.expect("planning is held");
    assert_eq!(kind, "schema");
    assert!(
        reason
            .contains("no primary key or unique index of demo.tickets is exactly (tenant_id, id)"),
        "{reason}"
    );
    let (left, audit, commands): (i64, i64, i64) = sqlx::query_as(
        "select (select count(*) from demo.tickets), (select count(*) from sweeper.audit_trail),
                (select count(*) from sweeper.commands)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((left, audit, commands), (120, 0, 0));
}

/// A row of a `(tenant_id, id)` key that another transaction holds locked delays only itself:
/// the lock wait names the session that holds it, its neighbours are deleted and audited, the
/// next try deletes with `FOR UPDATE SKIP LOCKED` over the composite key, and once the lock is
/// released the run completes with every eligible key deleted once.
#[tokio::test]
async fn a_locked_row_of_a_composite_key_delays_only_itself() {
    use sqlx::Connection;
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        policies: tenant_key(ticket_policy(10)),
        extra_toml: "[consume]\nlock_timeout = \"1s\"\n".into(),
        setup_sql: TENANT_TICKETS,
        workers: 0,
    })
    .await;
    let eligible = seed_tenants(&app.pool).await;
    let locked = item(TENANTS[1], 1);
    let mut blocker = sqlx::PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("begin").execute(&mut blocker).await.unwrap();
    let pid: i32 = sqlx::query_scalar(
        "select pg_backend_pid() from demo.tickets where tenant_id = $1 and id = 1 for update",
    )
    .bind(TENANTS[1])
    .fetch_one(&mut blocker)
    .await
    .unwrap();
    let run_id = app.api.trigger_new("ticket-retention", "").await;
    app.wait_planned(&run_id).await;
    app.drain().await;
    let (command, error, class): (String, String, String) = sqlx::query_as(
        "select command_id, last_error, last_error_class from sweeper.commands
          where run_id = $1 and $2 = any(item_keys)",
    )
    .bind(&run_id)
    .bind(&locked)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(class, "locked", "{error}");
    assert!(error.contains(&format!("pid {pid}")), "{error}");
    let left_of_command: Vec<String> = sqlx::query_scalar(
        "select k from sweeper.commands c, unnest(c.item_keys) k
          where c.command_id = $1
            and not exists (select 1 from sweeper.audit_trail a where a.command_id = c.command_id
                                                           and a.item_key = k)",
    )
    .bind(&command)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(left_of_command, vec![locked], "its neighbours are done");
    // A second try while it is still locked takes the SKIP LOCKED path.
    crate::kit::ledger::advance_clock(&app.pool, 6).await;
    app.drain().await;
    sqlx::query("commit").execute(&mut blocker).await.unwrap();
    crate::kit::ledger::advance_clock(&app.pool, 6).await;
    app.drain().await;
    let done = app.wait_terminal(&run_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    let mut deleted: Vec<String> = app
        .audit(&run_id)
        .await
        .into_iter()
        .filter(|(_, o, _)| o == "deleted")
        .map(|(k, _, _)| k)
        .collect();
    deleted.sort();
    assert_eq!(deleted, eligible);
    assert_eq!(
        crate::kit::ledger::items_with_several_outcomes(&app.pool).await,
        0
    );
}

/// A one-column key keeps sending its whole text in the idempotency key, however long: the
/// `sha256:` form is for keys of several columns only, so an effect opened by a release before
/// it existed is retried with the key it was first called with.
#[tokio::test]
async fn a_long_one_column_key_is_sent_whole_in_the_idempotency_key() {
    use crate::ext_common::*;
    use crate::standin::{StandIn, ok};
    let provider = StandIn::start(std::time::Duration::from_millis(1), |_, _| ok()).await;
    let policy =
        payments_policy("reconcile", "payments", 10, "", "").replace("/pay/{id}", "/pay/x");
    let app = TestApp::spawn(Spawn {
        setup_sql: "create schema ext;
            create table ext.payments (id text primary key, status text not null default 'closed',
                closed_at timestamptz, reconciled_at timestamptz)",
        policies: dependency("payments", &provider.url(), "") + &policy,
        workers: 0,
        now: Some(at(NOW)),
        extra_toml: String::new(),
    })
    .await;
    let long = "p".repeat(300);
    sqlx::query("insert into ext.payments (id, closed_at) values ($1, '2026-08-01')")
        .bind(&long)
        .execute(&app.pool)
        .await
        .unwrap();
    let (status, run) = app.trigger("reconcile", "?window=2026-09-01").await;
    assert!(status == 202 || status == 200, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    app.wait_planned(&run_id).await;
    app.drain().await;
    assert_eq!(app.wait_terminal(&run_id).await["status"], "completed");
    let keys: Vec<String> = provider
        .calls()
        .iter()
        .map(|c| c.idempotency_key.clone().unwrap())
        .collect();
    assert_eq!(keys, [format!("reconcile:{long}:1")]);
}
