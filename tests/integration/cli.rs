//! The `sweeper` binary: `check-config`, `token`, and `serve` as a real process under different
//! time zones.

use crate::common::*;
use crate::kit::process::{Launch, Server, sweeper, write_config};
use serde_json::Value;

#[tokio::test]
async fn check_config_names_each_mismatch_with_the_database() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    for stmt in [
        "create schema demo",
        "create table demo.tickets (id bigint, status text, legal_hold boolean, closed_at timestamp)",
        "create table demo.events (id uuid primary key, at timestamptz, flag boolean)",
        "create table demo.event_refs (id bigint primary key, event_id uuid references demo.events (id))",
    ] {
        sqlx::query(stmt).execute(&pool).await.unwrap();
    }
    let policies = r#"
[[policy]]
name = "tickets"
schedule = { cron = "0 2 * * *" }
target = { table = "demo.tickets", key = "id", timestamp = "closed_at" }
retain_for = "90d"
exclude = [ { column = "legal_hold", equals = "maybe" }, { column = "missing", is_null = true } ]

[[policy]]
name = "events"
schedule = { cron = "0 * * * *" }
target = { table = "demo.events", key = "id", timestamp = "at" }
retain_for = "1d"
"#;
    let path = write_config(&config_toml(&db.url, 0, "", policies));
    // The path from SWEEPER_CONFIG; variables Kubernetes injects for a Service named sweeper
    // are not settings.
    let out = sweeper(&["check-config"])
        .env("SWEEPER_CONFIG", &path)
        .env("SWEEPER_SERVICE_HOST", "10.0.0.1")
        .env("SWEEPER_PORT", "tcp://10.0.0.1:80")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for expected in [
        "error: policy[tickets]: target.key: column id has no unique index",
        "error: policy[tickets]: target.timestamp: column closed_at is timestamp without time zone",
        "error: policy[tickets]: exclude[0]: value `maybe` is not a valid boolean",
        "error: policy[tickets]: exclude[1]: column missing does not exist",
        "warning: policy[events]: target.timestamp: no index leads with at",
        "warning: policy[events]: foreign key event_refs_event_id_fkey on demo.event_refs references demo.events with ON DELETE NO ACTION",
    ] {
        assert!(
            stdout.contains(expected),
            "missing `{expected}` in:\n{stdout}"
        );
    }
    assert!(!stdout.contains("policy[events]: target.key"), "{stdout}");

    // DATABASE_URL overrides the file's database_url for the binary.
    let elsewhere = write_config(&config_toml(
        "postgres://127.0.0.1:1/nowhere",
        0,
        "",
        policies,
    ));
    let out = sweeper(&["check-config", "--config", elsewhere.to_str().unwrap()])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("has no unique index"), "{stdout}");
    // ... and says so: the file's URL is not the one checked.
    assert!(
        stdout.contains(&format!(
            "info: database_url: DATABASE_URL in the environment overrides the one in {}",
            elsewhere.display()
        )),
        "{stdout}"
    );
    assert!(
        !String::from_utf8_lossy(
            &sweeper(&["check-config", "--config", path.to_str().unwrap()])
                .output()
                .unwrap()
                .stdout
        )
        .contains("overrides"),
        "no such line without the variable"
    );

    // `serve` refuses the same configuration.
    let out = sweeper(&["serve", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no unique index"));
}

#[tokio::test]
async fn invalid_configuration_exits_2_and_names_every_problem() {
    let base = r#"
database_url = "postgres://127.0.0.1/none"
[queue]
lease = "10m"
[[auth.issuer]]
iss = "a"
audience = "b"
keys = [ { kid = "k", secret_env = "SWEEPER_TEST_UNSET_SECRET" } ]
[[policy]]
name = "p"
schedule = { cron = "0 2 * *", timezone = "Mars/Base" }
target = { table = "t", key = "id", timestamp = "ts" }
retain_for = "90d"
"#;
    let check = |text: &str, env: Option<(&str, &str)>| {
        let path = write_config(text);
        let mut cmd = sweeper(&["check-config", "--config", path.to_str().unwrap()]);
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(!stderr.contains("secret ="), "secrets never printed");
        assert!(
            stderr
                .lines()
                .last()
                .is_some_and(|l| l.ends_with("the server would refuse to start")),
            "the verdict is the last line: {stderr}"
        );
        stderr
    };
    // Type errors stop at the first one, with its key.
    let e = check(&base.replace("\"10m\"", "\"10x\""), None);
    assert!(e.contains("bad duration `10x`"), "{e}");
    let e = check(&base.replace("\"90d\"", "\"3mo\""), None);
    assert!(
        e.contains("bad duration `3mo`") && e.contains("retain_for"),
        "{e}"
    );
    // An environment override is validated like the file.
    let e = check(base, Some(("SWEEPER_QUEUE__POLL_INTERVAL", "2ms")));
    assert!(e.contains("bad duration `2ms`"), "{e}");
    // Validation reports every problem at once, each with its path.
    let e = check(base, None);
    for expected in [
        "auth.issuer[0].keys[k]: environment variable SWEEPER_TEST_UNSET_SECRET is not set",
        "policy[p].schedule.cron: `0 2 * *` has 4 fields",
    ] {
        assert!(e.contains(expected), "missing `{expected}` in:\n{e}");
    }
    let e = check(&base.replace("0 2 * *\"", "0 2 * * *\""), None);
    assert!(
        e.contains("policy[p].schedule.timezone: `Mars/Base` is not an IANA time zone name"),
        "{e}"
    );
    let e = check(
        &base
            .replace("0 2 * *\"", "0 0 * * * *\"")
            .replace("lease = \"10m\"", "unknown_knob = 1"),
        None,
    );
    assert!(e.contains("unknown_knob"), "{e}");
}

#[tokio::test]
async fn the_token_command_mints_tokens_the_server_accepts() {
    let app = TestApp::spawn(Spawn::default()).await;
    let path = write_config(&config_toml(&app.db.url, 0, "", &ticket_policy(10)));
    let out = sweeper(&[
        "token",
        "--config",
        path.to_str().unwrap(),
        "--scope",
        "ops:read",
        "--ttl",
        "10m",
        "--sub",
        "oncall",
    ])
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let claims = jsonwebtoken::dangerous::insecure_decode::<Value>(&token)
        .unwrap()
        .claims;
    assert_eq!(claims["sub"], "oncall");
    assert_eq!(claims["iss"], "sweeper-test");
    assert_eq!(claims["aud"], "sweeper");
    let ttl = claims["exp"].as_i64().unwrap() - chrono::Utc::now().timestamp();
    assert!((590..=600).contains(&ttl), "{ttl}");
    let ok = app
        .client
        .get(format!("{}/policies", app.base))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    for (scope, sub) in [("ops:admin", "x"), ("trigger:nope", "x"), ("ops:read", " ")] {
        let out = sweeper(&[
            "token",
            "--config",
            path.to_str().unwrap(),
            "--scope",
            scope,
            "--sub",
            sub,
        ])
        .output()
        .unwrap();
        assert_eq!(out.status.code(), Some(1), "{scope} / {sub:?}");
        assert!(out.stdout.is_empty());
    }
    let listed = app
        .client
        .get(format!("{}/runs", app.base))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 200);
    let denied = app.post("/trigger/ticket-retention", Some(&token)).await;
    assert_eq!(denied.status(), 403);
}

/// Starts `sweeper serve` as a child process with `tz` as its time zone.
async fn serve_process(db_url: &str, tz: &str) -> Server {
    serve_process_with(db_url, tz, &ticket_policy(10)).await
}

/// [`serve_process`] with other policies (and dependencies).
async fn serve_process_with(db_url: &str, tz: &str, policies: &str) -> Server {
    let text = config_toml(db_url, 2, "", policies);
    let env = [("TZ", tz), ("PGTZ", tz)];
    let how = Launch {
        env: &env,
        ..Default::default()
    };
    Server::launch(&text, how).await
}

#[tokio::test]
async fn the_selected_set_is_the_same_under_utc_and_tokyo() {
    let app = TestApp::spawn(Spawn {
        now: Some(at("2026-09-01T02:01:00Z")),
        ..Default::default()
    })
    .await;
    // Rows straddling the cutoff (2026-06-03T02:00:00Z) by a second, and by the Tokyo offset.
    let cutoff = at("2026-06-03T02:00:00Z");
    let mut rows = Vec::new();
    for (i, delta) in [-32_401i64, -32_400, -3_601, -1, 0, 1, 3_600, 32_400]
        .iter()
        .enumerate()
    {
        rows.push((
            i as i64 + 1,
            Some("closed"),
            Some(false),
            Some(cutoff + chrono::TimeDelta::seconds(*delta)),
        ));
    }
    insert_tickets(&app.pool, &rows).await;
    let token = app.ops_token();
    let mut sets = Vec::new();
    for tz in ["UTC", "Asia/Tokyo"] {
        let server = serve_process(&app.db.url, tz).await;
        let run_id = Client::new(&server.base, token.clone())
            .trigger_new("ticket-retention", "?dry_run=true")
            .await;
        let done = app.wait_terminal(&run_id).await;
        drop(server);
        assert_eq!(done["cutoff"], "2026-06-03T02:00:00Z");
        let mut keys: Vec<String> = app
            .audit(&run_id)
            .await
            .into_iter()
            .filter(|(_, o, _)| o == "would_delete")
            .map(|(k, _, _)| k)
            .collect();
        keys.sort();
        sets.push(keys);
    }
    assert_eq!(sets[0], vec!["1", "2", "3", "4"]);
    assert_eq!(sets[0], sets[1]);
}

#[tokio::test]
async fn the_example_policies_pass_check_config_against_their_schema() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/examples");
    let schema = std::fs::read_to_string(dir.join("schema.sql")).unwrap();
    sqlx::raw_sql(&schema).execute(&pool).await.unwrap();
    for example in ["upload-retention.toml", "payment-reconciliation.toml"] {
        let out = sweeper(&[
            "check-config",
            "--config",
            dir.join(example).to_str().unwrap(),
        ])
        .env("DATABASE_URL", &db.url)
        .env_remove("SWEEPER_DATABASE_URL")
        .env("HS256_KEY_2026_06", SECRET)
        .env("PAYMENTS_API_TOKEN", "example-token")
        .output()
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{example}:\n{stdout}\n{stderr}");
        assert!(
            stdout.contains("database checks passed"),
            "{example}:\n{stdout}"
        );
    }
}

#[tokio::test]
async fn check_config_checks_the_columns_an_action_reads_and_stamps() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(
        "create schema ext;
         create table ext.payments (id bigint primary key, closed_at timestamptz, reconciled_at text)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let policies = r#"
[[dependency]]
name = "payments"
base_url = "https://api.payments.example"

[[policy]]
name = "reconcile"
schedule = { cron = "0 2 * * *" }
target = { table = "ext.payments", key = "id", timestamp = "closed_at" }
retain_for = "1d"
action = { kind = "http", dependency = "payments", method = "POST", path = "/p/{id}/{tenant}", then = { set = "reconciled_at" } }
"#;
    let path = write_config(&config_toml(&db.url, 0, "", policies));
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("column tenant (named by the action) does not exist"),
        "{stdout}"
    );
    assert!(
        stdout.contains("action.then.set: column reconciled_at is text"),
        "{stdout}"
    );
}

#[tokio::test]
async fn check_config_warns_about_query_tokens() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(TICKETS).execute(&pool).await.unwrap();
    let text = config_toml(&db.url, 0, "", &ticket_policy(10)).replace(
        "\n[[auth.issuer]]",
        "\n[[auth.query_token]]\nsubject = \"emulator\"\ntoken_env = \"CARGO_PKG_DESCRIPTION\"\n\n[[auth.issuer]]",
    );
    let path = write_config(&text);
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("warning: auth.query_token[emulator]"),
        "{stdout}"
    );
}

/// The deployment configurations in `deploy/` (the built-in queue, Cloud Run with Pub/Sub,
/// QStash) pass `check-config` against the table their policy cleans.
#[tokio::test]
async fn the_deploy_configurations_pass_check_config() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(
        "create schema support;
         create table support.tickets (id bigint primary key, closed_at timestamptz not null,
                                       legal_hold boolean not null default false, status text);
         create index on support.tickets (closed_at, id)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    for config in [
        "sweeper.example.toml",
        "cloudrun/sweeper.toml",
        "qstash/sweeper.toml",
    ] {
        let out = sweeper(&[
            "check-config",
            "--config",
            dir.join(config).to_str().unwrap(),
        ])
        .env("SWEEPER_DATABASE_URL", &db.url)
        .env("HS256_KEY_2026_06", SECRET)
        .env("QSTASH_TOKEN", "qstash-api-token")
        .env("QSTASH_CURRENT_SIGNING_KEY", "sig_current")
        .env("QSTASH_NEXT_SIGNING_KEY", "sig_next")
        .output()
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{config}:\n{stdout}\n{stderr}");
        assert!(
            stdout.contains("database checks passed"),
            "{config}:\n{stdout}"
        );
    }
}

/// check-config names each privilege the role lacks on the target, one line each: SELECT on a
/// column the policy reads, DELETE, and UPDATE on some column (a role that may read and delete
/// but not lock rows, since `FOR UPDATE` needs UPDATE, would pass every other check and hold
/// every command that meets a locked row). Column grants, as deploy/roles.sql advises, suffice.
#[tokio::test]
async fn check_config_names_the_table_privileges_the_database_role_lacks() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let role = format!(
        "sweeper_limited_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    sqlx::raw_sql(&format!(
        "create schema support;
         create table support.tickets (id bigint primary key, closed_at timestamptz not null,
                                       legal_hold boolean not null default false, status text);
         create index on support.tickets (closed_at, id);
         create role {role} login;
         grant select (id, status) on support.tickets to {role}"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let url = url::Url::parse(&db.url)
        .map(|mut u| {
            u.set_username(&role).unwrap();
            u.to_string()
        })
        .unwrap();
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/sweeper.example.toml");
    let check = || {
        let out = sweeper(&["check-config", "--config", config.to_str().unwrap()])
            .env("SWEEPER_DATABASE_URL", &url)
            .env("HS256_KEY_2026_06", SECRET)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // Without USAGE on the schema: that line, and none of the table's (whose name does not even
    // resolve).
    let (ok, stdout) = check();
    assert!(!ok, "{stdout}");
    let lacks: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains(&format!("privileges: role {role} lacks")))
        .collect();
    let p = "error: policy[ticket-retention]: privileges";
    assert_eq!(
        lacks,
        [format!(
            "{p}: role {role} lacks USAGE on schema support: grant usage on schema \"support\" \
             to {role}"
        )],
        "{stdout}"
    );
    sqlx::query(&format!("grant usage on schema support to {role}"))
        .execute(&pool)
        .await
        .unwrap();
    let (ok, stdout) = check();
    assert!(!ok, "{stdout}");
    let lacks: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains(&format!("privileges: role {role} lacks")))
        .collect();
    assert_eq!(
        lacks,
        [
            format!(
                "{p}: role {role} lacks SELECT on column closed_at of support.tickets, which the \
                 policy reads: grant select (\"closed_at\") on \"support\".\"tickets\" to {role}"
            ),
            format!(
                "{p}: role {role} lacks SELECT on column legal_hold of support.tickets, which the \
                 policy reads: grant select (\"legal_hold\") on \"support\".\"tickets\" to {role}"
            ),
            format!(
                "{p}: role {role} lacks DELETE on support.tickets, which the policy deletes from: \
                 grant delete on \"support\".\"tickets\" to {role}"
            ),
            format!(
                "{p}: role {role} lacks UPDATE on every column of support.tickets: a command that \
                 meets a row another transaction holds, or whose item fails alone, locks the rows \
                 it acts on (SELECT … FOR UPDATE SKIP LOCKED), which PostgreSQL allows only with \
                 UPDATE on at least one column: grant update (\"closed_at\") on \
                 \"support\".\"tickets\" to {role}"
            ),
        ],
        "{stdout}"
    );
    // The statements printed are SQL PostgreSQL runs, and grant what the role lacked.
    for line in &lacks {
        let (_, statement) = line.rsplit_once(": grant ").unwrap();
        sqlx::query(&format!("grant {statement}"))
            .execute(&pool)
            .await
            .unwrap();
    }
    let (ok, stdout) = check();
    assert!(ok, "{stdout}");
    // A related table in another schema: USAGE first, then SELECT on the columns it reads, named
    // with the role like the target's lines.
    let held = std::env::temp_dir().join(format!("sweeper-held-{role}.toml"));
    std::fs::write(
        &held,
        std::fs::read_to_string(&config).unwrap().replace(
            r#"{ column = "legal_hold", equals = true },"#,
            r#"{ name = "held", exists = { table = "legal.holds", on = [ { related = "ticket_id", target = "id" } ] } },"#,
        ),
    )
    .unwrap();
    sqlx::raw_sql(
        "create schema legal;
         create table legal.holds (ticket_id bigint not null);
         create index on legal.holds (ticket_id)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let check_held = || {
        let out = sweeper(&["check-config", "--config", held.to_str().unwrap()])
            .env("SWEEPER_DATABASE_URL", &url)
            .env("HS256_KEY_2026_06", SECRET)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let stdout = check_held();
    assert!(
        stdout.contains(&format!(
            ".table: privileges: role {role} lacks USAGE on schema legal: grant usage on schema \
             \"legal\" to {role}"
        )),
        "{stdout}"
    );
    sqlx::query(&format!("grant usage on schema legal to {role}"))
        .execute(&pool)
        .await
        .unwrap();
    let stdout = check_held();
    assert!(
        stdout.contains(&format!(
            ".table: privileges: role {role} lacks SELECT on column ticket_id of legal.holds: \
             grant select (\"ticket_id\") on \"legal\".\"holds\" to {role}"
        )),
        "{stdout}"
    );
    sqlx::query(&format!(
        "grant select (ticket_id) on legal.holds to {role}"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let stdout = check_held();
    assert!(!stdout.contains(&format!("role {role} lacks")), "{stdout}");
    std::fs::remove_file(&held).unwrap();
    // The governor's signals: this role cannot read standby replay lag, and is told how to fix it.
    assert!(
        stdout.contains(&format!(
            "warning: governor: role {role} is not a member of pg_monitor or pg_read_all_stats"
        )),
        "{stdout}"
    );
    sqlx::query(&format!("grant pg_monitor to {role}"))
        .execute(&pool)
        .await
        .unwrap();
    let (ok, stdout) = check();
    assert!(ok, "{stdout}");
    assert!(
        stdout.contains(&format!(
            "info: governor: role {role} reads standby replay lag"
        )),
        "{stdout}"
    );
    sqlx::query(&format!("revoke pg_monitor from {role}"))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::raw_sql(&format!("drop owned by {role}; drop role {role}"))
        .execute(&pool)
        .await
        .unwrap();
}

/// Nullable key and timestamp columns, and a retention shorter than the schedule's period, are
/// warned about by name; the verdict is the last line, after every finding (also when the
/// database cannot be reached).
#[tokio::test]
async fn check_config_warns_of_nullable_columns_and_short_retention_and_ends_with_its_verdict() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(
        "create schema app;
         create table app.nk (k text unique, at timestamptz not null);
         create index on app.nk (at);
         create table app.nt (id bigint primary key, at timestamptz);
         create index on app.nt (at);
         create table app.flags (id bigint primary key, at timestamptz not null, keep text,
                                 n text);
         create index on app.flags (at)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let policies = r#"
[[policy]]
name = "nullable-key"
schedule = { cron = "0 2 * * *" }
target = { table = "app.nk", key = "k", timestamp = "at" }
retain_for = "90d"

[[policy]]
name = "nullable-timestamp"
schedule = { cron = "0 2 * * *" }
target = { table = "app.nt", key = "id", timestamp = "at" }
retain_for = "1s"
"#;
    let path = write_config(&config_toml(&db.url, 0, "", policies));
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for expected in [
        "warning: policy[nullable-key]: target.key: column k admits NULL",
        "warning: policy[nullable-timestamp]: target.timestamp: column at admits NULL",
        "warning: policy[nullable-timestamp]: retain_for (1s) is shorter than the schedule's period (1d)",
    ] {
        assert!(
            stdout.contains(expected),
            "missing `{expected}` in:\n{stdout}"
        );
    }
    assert!(
        !stdout.contains("policy[nullable-key]: retain_for"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("policy[nullable-key]: target.timestamp"),
        "{stdout}"
    );
    let last = stdout.lines().last().unwrap();
    assert!(
        last.contains("configuration is valid (2 policies, 3 warning(s))"),
        "{stdout}"
    );

    // A boolean or a number for a text column would be compared as the text 'true' or '1'.
    let typed = r#"
[[policy]]
name = "flags"
schedule = { cron = "0 2 * * *" }
target = { table = "app.flags", key = "id", timestamp = "at" }
retain_for = "90d"
exclude = [ { column = "keep", equals = true }, { column = "n", in = ["a", 1] } ]
"#;
    let path = write_config(&config_toml(&db.url, 0, "", typed));
    let out = sweeper(&["check-config", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    for expected in [
        "error: policy[flags]: exclude[0]: a boolean value is given for column keep, which is text",
        "error: policy[flags]: exclude[1]: a number value is given for column n, which is text",
    ] {
        assert!(
            stdout.contains(expected),
            "missing `{expected}` in:\n{stdout}"
        );
    }

    // A database error comes before the verdict, never after a "valid".
    let nowhere = write_config(&config_toml(
        "postgres://127.0.0.1:1/nowhere",
        0,
        "",
        policies,
    ));
    let out = sweeper(&["check-config", "--config", nowhere.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(!stdout.contains("is valid"), "{stdout}");
    assert!(
        stdout.lines().next().unwrap().starts_with("error: "),
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .last()
            .unwrap()
            .contains("the server would refuse to start"),
        "{stdout}"
    );
}

/// Every documented family is in the first scrape of a fresh process, before anything happened
/// (an alert cannot be written against a series that appears only once it moves), with its HELP
/// and TYPE lines; and every metric the monitoring kit's alert rules and dashboard name
/// (deploy/monitoring/) is one of them.
#[tokio::test]
async fn every_documented_series_is_exported_from_start_up() {
    let db = TestDb::create().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(TICKETS).execute(&pool).await.unwrap();
    // One held row, so the latest run's held figures exist too.
    let policies = format!(
        "{}\n[[dependency]]\nname = \"payments\"\nbase_url = \"https://api.payments.example\"\n",
        ticket_policy(10)
    );
    let server = serve_process_with(&db.url, "UTC", &policies).await;
    let text = Client::new(&server.base, String::new()).metrics().await;
    drop(server);
    let page =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md")).unwrap();
    for (family, kind, _) in sweeper::metrics::FAMILIES {
        assert!(
            page.contains(family),
            "docs/metrics.md does not document {family}"
        );
        if *family == "sweeper_held_at_planning" {
            continue; // one series per reason a run held: none yet
        }
        assert!(
            // A histogram's samples are its `_bucket`, `_sum` and `_count` lines.
            text.lines().any(|l| l.starts_with(&format!("{family}{{"))
                || l.starts_with(&format!("{family} "))
                || l.starts_with(&format!("{family}_count"))),
            "{family} missing from the first scrape:\n{text}"
        );
        let type_name = match kind {
            sweeper::metrics::Kind::Gauge => "gauge",
            sweeper::metrics::Kind::Counter => "counter",
            sweeper::metrics::Kind::Histogram => "histogram",
        };
        for head in [
            format!("# HELP {family} "),
            format!("# TYPE {family} {type_name}"),
        ] {
            assert_eq!(
                text.lines().filter(|l| l.starts_with(&head)).count(),
                1,
                "`{head}` not exactly once in:\n{text}"
            );
        }
    }
    // Every family in the text is documented and described.
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let family = line.split(' ').nth(2).unwrap();
        assert!(
            sweeper::metrics::FAMILIES
                .iter()
                .any(|(f, _, _)| *f == family),
            "{family} is exported but not in FAMILIES"
        );
    }
    for expected in [
        "sweeper_consume_shed_total 0",
        "sweeper_attempts_total{outcome=\"quarantined\",class=\"permanent\"} 0",
        "sweeper_dependency_calls_total{dependency=\"payments\",result=\"throttled\"} 0",
        "sweeper_last_successful_run_timestamp_seconds{policy=\"ticket-retention\"} 0",
        "sweeper_dependency_paused{dependency=\"payments\"} 0",
        "sweeper_policy_period_seconds{policy=\"ticket-retention\"} 86400",
        "sweeper_open_run_age_seconds{policy=\"ticket-retention\"} 0",
        "sweeper_policy_suspended{policy=\"ticket-retention\"} 0",
        "sweeper_run_execution_seconds_count{policy=\"ticket-retention\",trigger=\"backfill\"} 0",
    ] {
        assert!(
            text.lines().any(|l| l == expected),
            "no `{expected}` in:\n{text}"
        );
    }
    // The monitoring kit names only metrics a server exports.
    let kit = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring");
    let mut named = std::collections::BTreeSet::new();
    for file in ["alerts.yml", "alerts.test.yml", "dashboard.json"] {
        let body = std::fs::read_to_string(kit.join(file)).unwrap();
        let mut rest = body.as_str();
        while let Some(at) = rest.find("sweeper_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            rest = &rest[at + name.len()..];
            named.insert((file, name));
        }
    }
    assert!(named.len() > 10, "{named:?}");
    for (file, name) in &named {
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .filter(|base| {
                sweeper::metrics::FAMILIES
                    .iter()
                    .any(|(f, k, _)| f == base && *k == sweeper::metrics::Kind::Histogram)
            })
            .unwrap_or(name);
        // Every family but sweeper_held_at_planning was required above with HELP and TYPE.
        assert!(
            sweeper::metrics::FAMILIES
                .iter()
                .any(|(f, _, _)| *f == family),
            "deploy/monitoring/{file} names {name}, which no server exports"
        );
    }
}

/// The digest quick start, as the README runs it: each active customer gets one digest for the
/// week across the server's abort and restart, the cleanup leaves nothing eligible, no window is
/// missed; a second run in a row reports the same.
#[tokio::test]
async fn the_digest_quick_start_sends_each_digest_once_and_a_second_run_reports_the_same() {
    let mut reports = Vec::new();
    for _ in 0..2 {
        let out = sweeper(&["quickstart", "--scenario", "digest", "--exit"])
            .env("DATABASE_URL", crate::kit::db::server_url())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let last = stdout.lines().last().unwrap_or("");
        let r: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"));
        assert_eq!(r["duplicate_digests"], 0, "{r}");
        assert_eq!(r["digests_sent"], r["active_customers"], "{r}");
        assert_eq!(r["called"], r["active_customers"], "{r}");
        assert_eq!(r["remaining_eligible"], 0, "{r}");
        assert_eq!(r["digest_remaining_eligible"], 0, "{r}");
        assert_eq!(r["missed_windows"], 0, "{r}");
        assert_eq!(r["digest_status"], "completed", "{r}");
        assert_eq!(r["cleanup_status"], "completed", "{r}");
        assert!(r["active_customers"].as_i64().unwrap() > 200, "{r}");
        assert!(r["cleanup_deleted"].as_i64().unwrap() > 0, "{r}");
        // The stand-in failed calls (503s and one 429) and the abort came mid-digest.
        assert!(r["failed_calls"].as_i64().unwrap() >= 2, "{r}");
        let at_abort = r["digests_at_abort"].as_i64().unwrap();
        assert!(
            at_abort > 0 && at_abort < r["active_customers"].as_i64().unwrap(),
            "{r}"
        );
        reports.push(r);
    }
    for k in [
        "window",
        "active_customers",
        "digests_sent",
        "cleanup_deleted",
        "cleanup_cutoff",
    ] {
        assert_eq!(reports[0][k], reports[1][k], "{k}: {reports:?}");
    }
}

/// The uploads quick start, as the README runs it: across the server's abort and restart every
/// eligible upload loses its object and then its row, held and in-progress uploads keep theirs
/// byte for byte, the objects already missing are audited `already_absent`; its JSON agrees
/// with the database and the directory, checked here on their own; a second run in a row
/// reports the same.
#[tokio::test]
async fn the_uploads_quick_start_deletes_objects_then_rows_and_agrees_with_the_bucket() {
    let mut reports = Vec::new();
    for _ in 0..2 {
        let out = sweeper(&["quickstart", "--scenario", "uploads", "--exit"])
            .env("DATABASE_URL", crate::kit::db::server_url())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let last = stdout.lines().last().unwrap_or("");
        let r: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"));
        let n = |k: &str| r[k].as_i64().unwrap_or_else(|| panic!("{k}: {r}"));
        assert_eq!(r["status"], "completed", "{r}");
        assert!(n("rows_before") >= 3_000, "{r}");
        for k in [
            "kept_rows_missing_object",
            "deleted_rows_with_object",
            "kept_objects_changed",
            "objects_without_row",
            "remaining_eligible",
            "remaining_eligible_rows",
            "failed",
        ] {
            assert_eq!(n(k), 0, "{k}: {r}");
        }
        assert_eq!(n("rows_deleted"), n("rows_before") - n("rows_after"), "{r}");
        assert_eq!(n("rows_deleted"), n("eligible"), "{r}");
        assert_eq!(n("rows_deleted"), n("deleted") + n("already_absent"), "{r}");
        assert_eq!(n("deleted"), n("audit_deleted_rows"), "{r}");
        // Files removed: every `deleted` item's, and any the aborted server removed before it
        // recorded the call (its item is audited `already_absent` by the replay).
        assert_eq!(
            n("objects_deleted"),
            n("deleted") + n("already_absent") - n("seeded_missing"),
            "{r}"
        );
        assert_eq!(
            n("objects_before"),
            n("rows_before") - n("seeded_missing"),
            "{r}"
        );
        assert_eq!(n("objects_after"), n("rows_after"), "{r}");
        // Every seeded missing object is audited already_absent; an object the aborted server
        // deleted before it recorded the call may be too.
        assert!(n("seeded_missing") > 0, "{r}");
        assert!(n("already_absent") >= n("seeded_missing"), "{r}");
        assert!(
            n("held_rows") > 0 && n("held_rows_intact") == n("held_rows"),
            "{r}"
        );
        assert!(n("uploading_rows") > 0 && n("uploading_rows_intact") == n("uploading_rows"));
        let at_abort = n("objects_at_abort");
        assert!(at_abort > 0 && at_abort < n("objects_deleted"), "{r}");

        // The database and the directory, read here: the kept rows are exactly the files left.
        let pool =
            sqlx::PgPool::connect(&crate::kit::db::database_url("sweeper_quickstart_uploads"))
                .await
                .unwrap();
        let (rows, held): (i64, i64) =
            sqlx::query_as("select count(*), count(*) filter (where legal_hold) from app.uploads")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!((rows, held), (n("rows_after"), n("held_rows")), "{r}");
        let mut keys: Vec<String> = sqlx::query_scalar("select object_key from app.uploads")
            .fetch_all(&pool)
            .await
            .unwrap();
        let absent: i64 = sqlx::query_scalar(
            "select count(*) from sweeper.audit_trail where run_id = $1 and outcome = 'already_absent'",
        )
        .bind(r["run_id"].as_str().unwrap())
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(absent, n("already_absent"), "{r}");
        pool.close().await;
        let root = std::path::PathBuf::from(r["bucket"].as_str().unwrap());
        let mut files = Vec::new();
        let mut dirs = vec![root.clone()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else {
                    files.push(p.strip_prefix(&root).unwrap().to_str().unwrap().to_string());
                }
            }
        }
        keys.sort();
        files.sort();
        assert_eq!(files.len() as i64, n("objects_after"), "{r}");
        assert!(keys == files, "the kept rows and the files differ: {r}");
        reports.push(r);
    }
    for k in [
        "window",
        "cutoff",
        "rows_before",
        "rows_after",
        "rows_deleted",
        "objects_before",
        "objects_after",
        "seeded_missing",
        "held_rows",
        "uploading_rows",
    ] {
        assert_eq!(reports[0][k], reports[1][k], "{k}: {reports:?}");
    }
}

/// The reconciliation quick start, as the README runs it: across the provider's 429s and 503s
/// and the server's abort and restart, every eligible payment is either reconciled (stamped, the
/// provider's amount equal to ours) or mismatched (not stamped, an open item dead letter), none
/// is matched under two idempotency keys, and a second trigger of the window is the same run and
/// calls nothing; its JSON agrees with the database, read here on its own; a second run in a row
/// reports the same payments.
#[tokio::test]
async fn the_reconciliation_quick_start_stamps_matches_once_and_agrees_with_the_database() {
    let mut reports = Vec::new();
    for _ in 0..2 {
        let out = sweeper(&["quickstart", "--scenario", "reconciliation", "--exit"])
            .env("DATABASE_URL", crate::kit::db::server_url())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let last = stdout.lines().last().unwrap_or("");
        let r: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"));
        let n = |k: &str| r[k].as_i64().unwrap_or_else(|| panic!("{k}: {r}"));
        assert_eq!(r["status"], "completed_with_dead_letters", "{r}");
        for k in [
            "reconciled_twice",
            "remaining_eligible",
            "remaining_eligible_rows",
            "failed",
            "stamped_other_amount",
            "mismatched_stamped",
            "calls_after_second_trigger",
        ] {
            assert_eq!(n(k), 0, "{k}: {r}");
        }
        assert_eq!(n("second_trigger_status"), 200, "{r}");
        assert_eq!(r["second_trigger_same_run"], true, "{r}");
        assert!(n("eligible") > 1_000, "{r}");
        assert_eq!(n("eligible_planned"), n("eligible"), "{r}");
        assert_eq!(n("reconciled") + n("mismatched"), n("eligible"), "{r}");
        for k in ["reconciled_stamped", "audit_reconciled", "provider_matched"] {
            assert_eq!(n(k), n("reconciled"), "{k}: {r}");
        }
        assert!(n("seeded_differing") > 0 && n("seeded_unknown") > 0, "{r}");
        for k in ["audit_mismatched", "dead_letters", "dead_letters_open"] {
            assert_eq!(n(k), n("mismatched"), "{k}: {r}");
        }
        assert_eq!(
            n("mismatched"),
            n("seeded_differing") + n("seeded_unknown"),
            "{r}"
        );
        assert_eq!(
            (n("answered_mismatch"), n("answered_unknown")),
            (n("seeded_differing"), n("seeded_unknown")),
            "{r}"
        );
        // The stand-in pushed back (429 bursts and a 503 stretch), every push-back was retried,
        // and the abort came mid-run.
        assert!(n("throttled_429") > 0 && n("unavailable_503") > 0, "{r}");
        assert_eq!(
            n("throttled"),
            n("throttled_429") + n("unavailable_503"),
            "{r}"
        );
        assert!(n("retried") >= n("throttled"), "{r}");
        assert!(n("calls") >= n("eligible") + n("throttled"), "{r}");
        let at_abort = n("matches_at_abort");
        assert!(at_abort > 0 && at_abort < n("reconciled"), "{r}");
        let e = &r["mismatch_example"];
        assert!(e["ours"].is_i64() && e["provider"].is_i64() && e["ours"] != e["provider"]);

        // The database, read here.
        let pool = sqlx::PgPool::connect(&crate::kit::db::database_url(
            "sweeper_quickstart_reconciliation",
        ))
        .await
        .unwrap();
        let stamped: i64 = sqlx::query_scalar(
            "select count(*) from billing.payments where reconciled_at is not null",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(stamped, n("reconciled"), "{r}");
        // Every stamped payment's audit row recorded a match at our amount, exactly once.
        let (matched, once): (i64, i64) = sqlx::query_as(
            "select count(*) filter (where a.recorded::jsonb ->> '/status' = 'match'
                                       and (a.recorded::jsonb ->> '/provider_amount')::bigint
                                           = p.amount_cents),
                    count(distinct p.id)
               from billing.payments p
               join sweeper.audit_trail a on a.item_key = p.id and a.outcome = 'reconciled'
              where p.reconciled_at is not null",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((matched, once), (stamped, stamped), "{r}");
        // Each mismatch: an unstamped row, an open item dead letter carrying what was recorded.
        let dead: Vec<(String, Option<String>, Option<String>, bool)> = sqlx::query_as(
            "select d.item_key, d.outcome, d.recorded::jsonb ->> '/status',
                    p.reconciled_at is null
               from sweeper.dead_letters d join billing.payments p on p.id = d.item_key
              where d.kind = 'item' and d.status = 'open' and d.policy = 'payment-reconciliation'",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(dead.len() as i64, n("mismatched"), "{r}");
        for (item, outcome, status, unstamped) in &dead {
            assert_eq!(outcome.as_deref(), Some("mismatched"), "{item}");
            assert!(
                matches!(status.as_deref(), Some("mismatch" | "unknown")) && *unstamped,
                "{item}: {status:?}"
            );
        }
        let ours: i64 =
            sqlx::query_scalar("select amount_cents from billing.payments where id = $1")
                .bind(e["payment"].as_str().unwrap())
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(Some(ours), e["ours"].as_i64(), "{r}");
        pool.close().await;
        reports.push(r);
    }
    for k in [
        "window",
        "cutoff",
        "eligible",
        "reconciled",
        "mismatched",
        "seeded_differing",
        "seeded_unknown",
        "held_at_planning",
        "mismatch_example",
    ] {
        assert_eq!(reports[0][k], reports[1][k], "{k}: {reports:?}");
    }
}

#[test]
fn a_missing_configuration_file_is_named_with_where_it_was_looked_for() {
    let dir = std::env::temp_dir().join(format!("sweeper-no-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for args in [
        vec!["token", "--scope", "ops:read"],
        vec!["check-config"],
        vec!["serve"],
    ] {
        let out = sweeper(&args)
            .current_dir(&dir)
            .env_remove("SWEEPER_CONFIG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        let looked = dir.join("sweeper.toml");
        assert!(
            stderr.contains(&format!("no configuration file at {}", looked.display()))
                && stderr.contains("--config"),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("invalid configuration"), "{stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_version_names_the_release_and_the_commit() {
    let out = sweeper(&["--version"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success());
    let line = stdout.trim();
    assert!(
        line.starts_with(&format!("sweeper {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{line}"
    );
    let commit = line
        .rsplit_once("(commit ")
        .and_then(|(_, c)| c.strip_suffix(')'))
        .unwrap();
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{line}"
    );
}
