//! Sweeper against PostgreSQL's own limit and against a naive job, in one reproducible run.
//!
//! `cargo bench --bench sweeper` (release build) on the local PostgreSQL (`DATABASE_URL` names the
//! server). Every contender works on its own copy of one seeded database (`CREATE DATABASE ...
//! TEMPLATE`), and repetitions are interleaved, so each figure is a ratio measured side by side.
//! See BENCHMARKS.md for what each contender is and the last full run.
//!
//! Options: `--rows N` (default 1000000), `--backlog N` (default 10000000), `--reps N` (3),
//! `--batch N` (250), `--naive-sample N` (20000), `--triggers N` (25), `--wrk-seconds N` (5),
//! `--json PATH` (target/bench/sweeper.json), `--growth N,N,...` (the sparse scenario's table
//! sizes, 1000000,3000000,10000000), `--sparse-eligible N` (50000), `--smoke` (small sizes, for
//! CI).
//!
//! The dense scenario also runs on the composite-key rows moved into a table range partitioned on
//! `closed_at` (issue 33), once in 6 and once in 120 leaves over the same span of time.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::Mutex;

#[allow(dead_code)]
#[path = "../tests/kit/mod.rs"]
mod kit;

#[path = "contenders/floor.rs"]
mod floor;

use kit::db::{copy_database, database_url, drop_database};
use kit::process::{Launch, Server};

const SECRET: &str = "bench-secret-bench-secret-bench-secret-0123";

#[derive(Debug, Clone)]
struct Opts {
    rows: i64,
    backlog: i64,
    reps: usize,
    batch: usize,
    naive_sample: i64,
    triggers: usize,
    wrk_seconds: u64,
    json: String,
    /// Table sizes of the sparse scenario (its growth table).
    growth: Vec<i64>,
    /// Eligible rows in each of them.
    sparse_eligible: i64,
    /// A smoke run (CI): the partitioned contenders with 1 worker only, their WAL not read.
    smoke: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        rows: 1_000_000,
        backlog: 10_000_000,
        reps: 3,
        batch: 250,
        naive_sample: 20_000,
        triggers: 25,
        wrk_seconds: 5,
        json: "target/bench/sweeper.json".into(),
        growth: vec![1_000_000, 3_000_000, 10_000_000],
        sparse_eligible: 50_000,
        smoke: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let next = || args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--smoke" => {
                o.rows = 20_000;
                o.backlog = 200_000;
                o.reps = 1;
                o.naive_sample = 2_000;
                o.triggers = 20;
                o.wrk_seconds = 2;
                o.growth = vec![50_000, 200_000];
                o.sparse_eligible = 1_000;
                o.smoke = true;
                i += 1;
                continue;
            }
            "--rows" => o.rows = next().parse().expect("--rows N"),
            "--backlog" => o.backlog = next().parse().expect("--backlog N"),
            "--reps" => o.reps = next().parse().expect("--reps N"),
            "--batch" => o.batch = next().parse().expect("--batch N"),
            "--naive-sample" => o.naive_sample = next().parse().expect("--naive-sample N"),
            "--triggers" => o.triggers = next().parse().expect("--triggers N"),
            "--wrk-seconds" => o.wrk_seconds = next().parse().expect("--wrk-seconds N"),
            "--json" => o.json = next(),
            "--growth" => {
                o.growth = next()
                    .split(',')
                    .map(|n| n.parse().expect("--growth N,N,..."))
                    .collect()
            }
            "--sparse-eligible" => o.sparse_eligible = next().parse().expect("--sparse-eligible N"),
            // cargo bench passes --bench; ignore what is not ours.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    o
}

/// The ticket table's key as the policy writes it: the dense scenario runs on both.
const SINGLE_KEY: &str = r#""id""#;
/// `(id, closed_at)`, the primary key of the composite-key copy of the table (issue 31).
const COMPOSITE_KEY: &str = r#"["id", "closed_at"]"#;

fn policy_toml(batch: usize, key: &str) -> String {
    format!(
        r#"
[[policy]]
name = "ticket-retention"
schedule = {{ cron = "0 2 * * *", timezone = "UTC" }}
target = {{ table = "demo.tickets", key = {key}, timestamp = "closed_at" }}
retain_for = "90d"
exclude = [ {{ column = "legal_hold", equals = true }} ]
batch_size = {batch}
max_concurrent_commands = 16
"#
    )
}

fn config_toml(db: &str, workers: usize, batch: usize) -> String {
    config_toml_keyed(db, workers, batch, SINGLE_KEY)
}

fn config_toml_keyed(db: &str, workers: usize, batch: usize, key: &str) -> String {
    format!(
        r#"
database_url = "{url}"
listen = "127.0.0.1:0"
[database]
max_connections = 12
[queue]
workers = {workers}
[[auth.issuer]]
iss = "bench"
audience = "sweeper"
keys = [ {{ kid = "bench", secret = "{SECRET}" }} ]
{policy}
"#,
        url = database_url(db),
        policy = policy_toml(batch, key)
    )
}

fn token() -> String {
    kit::client::mint(
        "bench",
        "bench",
        SECRET,
        "bench",
        &kit::client::ALL_SCOPES,
        7_200,
    )
}

fn window() -> chrono::DateTime<chrono::Utc> {
    sweeper::window::Schedule::new("0 2 * * *", "UTC")
        .unwrap()
        .latest_tick_at_or_before(chrono::Utc::now())
        .unwrap()
}

/// Seeds a database: the ledger migrated, `demo.tickets` with `rows` rows of ~200 bytes, ~70 %
/// older than the cutoff, ~2 % on legal hold (deterministic: the generator is seeded).
async fn seed(name: &str, rows: i64) {
    seed_keyed(name, rows, SINGLE_KEY).await
}

/// [`seed`], the table's primary key `(id, closed_at)` when `key` is [`COMPOSITE_KEY`] (the same
/// rows: the generator is seeded).
async fn seed_keyed(name: &str, rows: i64, key: &str) {
    let pool = kit::db::create_migrated(name).await;
    let mut c = pool.acquire().await.unwrap();
    floor::create_tickets(&mut c, 0.17).await;
    let w = window();
    // Closed uniformly over the 300 days before the window: 210/300 = 70 % before the cutoff.
    let mut start = 1i64;
    while start <= rows {
        let end = (start + 1_000_000 - 1).min(rows);
        sqlx::query(
            "insert into demo.tickets
             select g, 1 + g % 50000, 'closed', random() < 0.02,
                    $3::timestamptz - random() * interval '300 days',
                    'Ticket ' || g || ': refund request for order', repeat('x', 120)
               from generate_series($1::bigint, $2::bigint) g",
        )
        .bind(start)
        .bind(end)
        .bind(w)
        .execute(&mut *c)
        .await
        .unwrap();
        start = end + 1;
    }
    if key == COMPOSITE_KEY {
        sqlx::raw_sql(
            "alter table demo.tickets drop constraint tickets_pkey;
             alter table demo.tickets alter column closed_at set not null;
             alter table demo.tickets add primary key (id, closed_at);",
        )
        .execute(&mut *c)
        .await
        .unwrap();
    }
    sqlx::query("create index tickets_closed_at on demo.tickets (closed_at)")
        .execute(&mut *c)
        .await
        .unwrap();
    sqlx::query("vacuum analyze demo.tickets")
        .execute(&mut *c)
        .await
        .unwrap();
    drop(c);
    pool.close().await;
}

/// The leaf counts of the partitioned copies (issue 33): the same rows in 6 leaves and in 120.
const LEAVES: [usize; 2] = [6, 120];

/// Seeds database `name` with the rows of `composite` (a [`seed_keyed`] database with
/// [`COMPOSITE_KEY`]: copied, not generated again, so they are the same rows byte for byte) moved
/// into a `demo.tickets` range partitioned on `closed_at` in `leaves` leaves, keyed
/// `(id, closed_at)`, with the same index on `closed_at`.
///
/// The rows were closed uniformly over the 300 days before the window, and that span is what both
/// layouts divide into leaves of equal length: 6 of 50 days (6 monthly leaves could not hold
/// those rows) and 120 of 2.5 days. So every leaf of both holds rows (about `rows / leaves`), the eligible
/// rows are the same 70 %, and the only difference is how many leaves they are spread over: more
/// leaves to walk, more short commands (a leaf's remainder), more statements each pruned to its
/// leaf. 120 monthly leaves of which all but a few were empty would measure little more than
/// walking empty leaves. The first leaf is unbounded below and the last above, so that every row
/// has a leaf whatever the session's time zone does to the seed's day arithmetic; the cutoff
/// (90 days before the window) falls inside a 50-day leaf, which is walked, and on a bound of the
/// 2.5-day leaves, so the 36 leaves from it on are skipped.
async fn seed_partitioned(name: &str, composite: &str, leaves: usize) {
    copy_database(composite, name).await;
    let mut c = PgConnection::connect(&database_url(name)).await.unwrap();
    sqlx::raw_sql(
        "create table demo.tickets_p (id bigint not null, customer_id bigint not null,
             status text not null, legal_hold boolean not null, closed_at timestamptz not null,
             subject text not null, body text not null) partition by range (closed_at)",
    )
    .execute(&mut c)
    .await
    .unwrap();
    let start = window() - chrono::TimeDelta::days(300);
    let width = chrono::TimeDelta::days(300) / leaves as i32;
    let bound = |k: usize| format!("'{}'", (start + width * k as i32).to_rfc3339());
    for k in 0..leaves {
        let from = if k == 0 { "minvalue".into() } else { bound(k) };
        let to = if k + 1 == leaves {
            "maxvalue".into()
        } else {
            bound(k + 1)
        };
        sqlx::raw_sql(&format!(
            "create table demo.tickets_{k:03} partition of demo.tickets_p
                 for values from ({from}) to ({to})"
        ))
        .execute(&mut c)
        .await
        .unwrap();
    }
    sqlx::raw_sql(
        "insert into demo.tickets_p select * from demo.tickets order by id;
         drop table demo.tickets;
         alter table demo.tickets_p rename to tickets;
         alter table demo.tickets add constraint tickets_pkey primary key (id, closed_at);
         create index tickets_closed_at on demo.tickets (closed_at);",
    )
    .execute(&mut c)
    .await
    .unwrap();
    // Apart: VACUUM runs outside a transaction block.
    sqlx::raw_sql("vacuum analyze demo.tickets")
        .execute(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
}

async fn eligible_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from demo.tickets where closed_at < $1 and not legal_hold")
        .bind(window() - chrono::TimeDelta::days(90))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Sweeper's statements in process: its own delete_rows statements per command (the consume
/// pipeline, called in process: no HTTP, no queue, no service), `conns` commands at a time.
async fn in_process(db: &str, batch: usize, conns: usize) -> f64 {
    let config = sweeper::settings::Config::from_toml(&config_toml(db, 0, batch)).unwrap();
    let policy = config.policies[0].clone();
    let app = sweeper::app::Application::build(config).await.unwrap();
    let state = app.state();
    let principal = sweeper::auth::Principal {
        credential: sweeper::auth::Credential::Bearer,
        subject: "bench".into(),
        scopes: ["ops:write".to_string()].into_iter().collect(),
    };
    let hints = sweeper::trigger::WindowHints {
        schedule_time_header: None,
        window_param: Some(sweeper::window::format(window())),
    };
    let run = match sweeper::trigger::trigger(&state, &policy, hints, false, &principal)
        .await
        .unwrap()
    {
        sweeper::trigger::TriggerOutcome::Created(r) => r,
        other => panic!("{other:?}"),
    };
    while sweeper::plan::plan_next_job(&state).await.unwrap() != sweeper::plan::PlanStep::Idle {}
    let ids: Vec<String> = sqlx::query_scalar(
        "select command_id from sweeper.commands where run_id = $1 order by batch_no desc",
    )
    .bind(&run.run_id)
    .fetch_all(&state.pool)
    .await
    .unwrap();
    let queue = std::sync::Arc::new(Mutex::new(ids));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (q, s) = (queue.clone(), state.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let Some(id) = q.lock().await.pop() else {
                    return;
                };
                sweeper::execute::execute(
                    &s,
                    &id,
                    sweeper::execute::Executor::Delivery { push: false },
                    "bench",
                )
                .await
                .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seconds = started.elapsed().as_secs_f64();
    let deleted: i64 =
        sqlx::query_scalar("select deleted from sweeper.run_totals where run_id = $1")
            .bind(&run.run_id)
            .fetch_one(&state.pool)
            .await
            .unwrap();
    state.pool.close().await;
    deleted as f64 / seconds
}

/// The naive job: one DELETE and one audit INSERT per row, autocommit, over `sample` rows.
async fn naive(db: &str, sample: i64) -> f64 {
    let mut c = PgConnection::connect(&database_url(db)).await.unwrap();
    let ids: Vec<i64> = sqlx::query_scalar(
        "select id from demo.tickets where closed_at < $1 and not legal_hold order by id limit $2",
    )
    .bind(window() - chrono::TimeDelta::days(90))
    .bind(sample)
    .fetch_all(&mut c)
    .await
    .unwrap();
    let started = Instant::now();
    for id in &ids {
        sqlx::query("delete from demo.tickets where id = $1")
            .bind(id)
            .execute(&mut c)
            .await
            .unwrap();
        sqlx::query(
            "insert into sweeper.audit (policy, policy_version, run_id, window_at, cutoff,
                                        command_id, item_key, outcome, actor, dry_run)
             values ('naive', 'v', 'naive', now(), now(), 'naive', $1, 'deleted', 'naive', false)",
        )
        .bind(id.to_string())
        .execute(&mut c)
        .await
        .unwrap();
    }
    ids.len() as f64 / started.elapsed().as_secs_f64()
}

/// Starts `sweeper serve` on database `db` with `workers` built-in workers.
async fn serve(db: &str, workers: usize, batch: usize) -> Server {
    serve_keyed(db, workers, batch, SINGLE_KEY).await
}

/// [`serve`] with the policy keyed `key`.
async fn serve_keyed(db: &str, workers: usize, batch: usize, key: &str) -> Server {
    let how = Launch {
        ready_within: Some(Duration::from_secs(60)),
        ..Default::default()
    };
    Server::launch(&config_toml_keyed(db, workers, batch, key), how).await
}

/// What one end-to-end run of sweeper measured.
struct Builtin {
    /// Items deleted.
    deleted: i64,
    /// Seconds from the trigger to the run's completion.
    seconds: f64,
    /// Seconds from the trigger until planning was seen done (polled every 10 ms).
    planned_in: f64,
    /// The server's peak RSS in MB.
    rss_mb: f64,
    /// The run's commands, and their average size in items (`sweeper.commands.item_keys`).
    commands: i64,
    avg_command: f64,
}

/// Sweeper end to end: a real server process, a real HTTP trigger, the built-in queue draining
/// the run with `workers` workers.
async fn sweeper_builtin(db: &str, batch: usize, workers: usize, key: &str) -> Builtin {
    let server = serve_keyed(db, workers, batch, key).await;
    let started = Instant::now();
    let r = reqwest::Client::new()
        .post(format!(
            "{}/trigger/ticket-retention?window={}",
            server.base,
            sweeper::window::format(window())
        ))
        .bearer_auth(token())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let run: Value = r.json().await.unwrap();
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let pool = PgPool::connect(&database_url(db)).await.unwrap();
    let mut planned_in = None;
    let deleted: i64 = loop {
        let (status, deleted, planned): (String, i64, bool) = sqlx::query_as(
            "select t.status, t.deleted, j.done from sweeper.run_totals t
               join sweeper.planning_jobs j using (run_id) where run_id = $1",
        )
        .bind(&run_id)
        .fetch_one(&pool)
        .await
        .unwrap();
        if planned && planned_in.is_none() {
            planned_in = Some(started.elapsed().as_secs_f64());
        }
        if status.starts_with("completed") {
            break deleted;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let seconds = started.elapsed().as_secs_f64();
    let rss = server.peak_rss_mb();
    let path: Option<String> =
        sqlx::query_scalar("select path from sweeper.planning_jobs where run_id = $1")
            .bind(&run_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    let (commands, avg_command): (i64, f64) = sqlx::query_as(
        "select count(*), coalesce(avg(cardinality(item_keys)), 0)::float8
           from sweeper.commands where run_id = $1",
    )
    .bind(&run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    let planned_in = planned_in.unwrap_or(seconds);
    eprintln!(
        "  planned along {} in {planned_in:.2} s of {seconds:.2} s; {commands} commands of \
         {avg_command:.1} items on average",
        path.as_deref().unwrap_or("?"),
    );
    pool.close().await;
    Builtin {
        deleted,
        seconds,
        planned_in,
        rss_mb: rss,
        commands,
        avg_command,
    }
}

/// Trigger latency with a backlog: `n` dry-run triggers (each a new run) against a table of
/// `backlog` rows, sequentially; returns (p50, p99) in milliseconds.
async fn trigger_latency(db: &str, batch: usize, n: usize) -> (f64, f64) {
    let server = serve(db, 0, batch).await;
    let client = reqwest::Client::new();
    let url = format!(
        "{}/trigger/ticket-retention?dry_run=true&window={}",
        server.base,
        sweeper::window::format(window())
    );
    let token = token();
    let mut ms = Vec::new();
    for _ in 0..n {
        let started = Instant::now();
        let r = client.post(&url).bearer_auth(&token).send().await.unwrap();
        assert_eq!(r.status(), 202);
        let _ = r.bytes().await;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| ms[((ms.len() as f64 - 1.0) * p).round() as usize];
    (pct(0.5), pct(0.99))
}

/// Requests/s of a wrk run.
fn wrk(url: &str, lua: &str, seconds: u64) -> f64 {
    let dir = std::env::temp_dir().join("sweeper-bench-wrk");
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join(format!("{}.lua", lua.len()));
    std::fs::write(&script, lua).unwrap();
    let out = Command::new("wrk")
        .args([
            "-t2",
            "-c16",
            &format!("-d{seconds}s"),
            "-s",
            script.to_str().unwrap(),
            url,
        ])
        .output()
        .expect("wrk runs (apt-get install wrk)");
    let text = String::from_utf8_lossy(&out.stdout);
    let non2xx = text.contains("Non-2xx");
    assert!(!non2xx, "wrk saw errors:\n{text}");
    text.lines()
        .find(|l| l.starts_with("Requests/sec:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no Requests/sec in wrk output:\n{text}"))
}

/// The duplicate-delivery fast path next to an authenticated endpoint of the same server that
/// does one indexed lookup (`GET /dead-letters/{id}` of an envelope dead letter), interleaved;
/// returns (consume rps, lookup rps).
async fn fast_path(db: &str, batch: usize, seconds: u64) -> Option<(f64, f64)> {
    if Command::new("wrk").arg("--version").output().is_err() {
        eprintln!("wrk is not installed (apt-get install wrk): skipping the fast-path ratio");
        return None;
    }
    let server = serve(db, 0, batch).await;
    let pool = PgPool::connect(&database_url(db)).await.unwrap();
    let command: String = sqlx::query_scalar(
        "select command_id from sweeper.commands where state = 'succeeded' limit 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let dl: i64 = sqlx::query_scalar(
        "insert into sweeper.dead_letters (kind, reason, class, raw_sha256, first_failure_at, last_failure_at)
         values ('envelope', 'bench', 'permanent', 'bench', now(), now()) returning dead_letter_id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.close().await;
    let token = token();
    let consume_lua = format!(
        "wrk.method = \"POST\"\nwrk.body = '{{\"command_id\": \"{command}\"}}'\n\
         wrk.headers[\"Content-Type\"] = \"application/json\"\n\
         wrk.headers[\"Authorization\"] = \"Bearer {token}\"\n"
    );
    let lookup_lua = format!("wrk.headers[\"Authorization\"] = \"Bearer {token}\"\n");
    let (mut c, mut l) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        l.push(wrk(
            &format!("{}/dead-letters/{dl}", server.base),
            &lookup_lua,
            seconds,
        ));
        c.push(wrk(
            &format!("{}/consume", server.base),
            &consume_lua,
            seconds,
        ));
    }
    Some((median(&mut c), median(&mut l)))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The sparse scenario on a table of `rows` rows with about `eligible` eligible: sweeper (trigger
/// → completed, 1 worker) and the floor finding its rows through the timestamp index (1
/// connection), interleaved `reps` times; (median sweeper seconds, median floor seconds, items).
async fn sparse(rows: i64, eligible: i64, batch: usize, reps: usize) -> (f64, f64, i64) {
    let seed_db = format!("sweeper_bench_sparse_{rows}");
    let work = format!("sweeper_bench_sparse_work_{rows}");
    eprintln!("seeding {rows} rows, about {eligible} eligible ...");
    floor::seed_sparse(&seed_db, rows, eligible, window()).await;
    let (mut sw, mut fl, mut items) = (Vec::new(), Vec::new(), 0);
    for rep in 0..reps {
        copy_database(&seed_db, &work).await;
        let Builtin {
            deleted, seconds, ..
        } = sweeper_builtin(&work, batch, 1, SINGLE_KEY).await;
        eprintln!("rep {rep} sparse {rows}: sweeper {deleted} items in {seconds:.2} s");
        sw.push(seconds);
        items = deleted;
        copy_database(&seed_db, &work).await;
        let cutoff = window() - chrono::TimeDelta::days(90);
        let (n, seconds) = floor::floor(
            &work,
            cutoff,
            (floor::Find::TimestampIndex, floor::Audit::Sweepers),
            batch,
            1,
        )
        .await;
        eprintln!("rep {rep} sparse {rows}: floor {n} items in {seconds:.2} s");
        assert_eq!(n, deleted, "the floor and sweeper delete the same rows");
        fl.push(seconds);
    }
    drop_database(&work).await;
    drop_database(&seed_db).await;
    (median(&mut sw), median(&mut fl), items)
}

#[tokio::main]
// Over 80 lines: one benchmark run in order (seed, interleaved contenders, sparse and growth,
// trigger latency, fast path, report).
async fn main() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let o = opts();
    let t0 = Instant::now();
    let seed_db = format!("sweeper_bench_seed_{}", o.rows);
    let work_name = format!("sweeper_bench_work_{}", o.rows);
    let work = work_name.as_str();
    eprintln!("seeding {} rows ...", o.rows);
    seed(&seed_db, o.rows).await;
    let composite_db = format!("sweeper_bench_seed_{}_composite", o.rows);
    seed_keyed(&composite_db, o.rows, COMPOSITE_KEY).await;
    let partitioned_dbs =
        LEAVES.map(|n| (n, format!("sweeper_bench_seed_{}_partitioned{n}", o.rows)));
    for (n, db) in &partitioned_dbs {
        eprintln!("moving the composite-key rows into {n} leaves ...");
        seed_partitioned(db, &composite_db, *n).await;
    }
    let eligible = {
        let p = PgPool::connect(&database_url(&seed_db)).await.unwrap();
        let n = eligible_count(&p).await;
        p.close().await;
        n
    };
    eprintln!(
        "{eligible} eligible rows; {} repetitions, batch {}",
        o.reps, o.batch
    );

    let contenders: Vec<&str> = [
        "thin_floor_1conn",
        "thin_floor_2conn",
        "lean_floor_1conn",
        "lean_floor_2conn",
        "floor_1conn",
        "floor_2conn",
        "in_process_1conn",
        "in_process_2conn",
        "naive",
        "sweeper_builtin_composite_1worker",
        "sweeper_builtin_composite_2workers",
        // The composite-key rows in 6 and in 120 leaves (issue 33); a smoke run, 1 worker only.
        "sweeper_builtin_partitioned6_1worker",
        "sweeper_builtin_partitioned120_1worker",
        "sweeper_builtin_partitioned6_2workers",
        "sweeper_builtin_partitioned120_2workers",
        // Last: the fast path below needs the last copy's completed run on the one-column table.
        "sweeper_builtin_1worker",
        "sweeper_builtin_2workers",
    ]
    .into_iter()
    .filter(|n| !(o.smoke && leaves_of(n).is_some() && n.ends_with("2workers")))
    .collect();
    let cutoff = window() - chrono::TimeDelta::days(90);
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); contenders.len()];
    // Per contender and repetition: what it wrote (WAL, commits, audit bytes).
    let mut costs: Vec<Vec<Cost>> = vec![Vec::new(); contenders.len()];
    let batches = (eligible as u64).div_ceil(o.batch as u64) as f64;
    let mut rss: Vec<f64> = Vec::new();
    // Per built-in contender and repetition: (seconds planning, commands, items per command).
    let mut runs: Vec<Vec<(f64, i64, f64)>> = vec![Vec::new(); contenders.len()];
    for rep in 0..o.reps {
        for (i, name) in contenders.iter().enumerate() {
            let composite = name.contains("composite");
            let leaves = leaves_of(name);
            let template = match leaves {
                Some(n) => &partitioned_dbs.iter().find(|(l, _)| *l == n).unwrap().1,
                None if composite => &composite_db,
                None => &seed_db,
            };
            copy_database(template, work).await;
            // A smoke run reads no WAL around the partitioned contenders (1.5 s a reading).
            let read_wal = !(o.smoke && leaves.is_some());
            // Every contender starts right after a checkpoint, so each pays the same full-page
            // images; a checkpoint inside its run is counted (raise `max_wal_size` and
            // `checkpoint_timeout` on the benchmark's server to avoid one).
            let before = if read_wal {
                Some(WalMark::take(work, true).await)
            } else {
                None
            };
            let v = match *name {
                "thin_floor_1conn" | "thin_floor_2conn" | "lean_floor_1conn"
                | "lean_floor_2conn" | "floor_1conn" | "floor_2conn" => {
                    let conns = if name.ends_with("1conn") { 1 } else { 2 };
                    let audit = if name.starts_with("thin") {
                        floor::Audit::Thin
                    } else if name.starts_with("lean") {
                        floor::Audit::Lean
                    } else {
                        floor::Audit::Sweepers
                    };
                    let find = (floor::Find::KeyOrder, audit);
                    let (n, secs) = floor::floor(work, cutoff, find, o.batch, conns).await;
                    assert_eq!(n, eligible);
                    n as f64 / secs
                }
                "in_process_1conn" => in_process(work, o.batch, 1).await,
                "in_process_2conn" => in_process(work, o.batch, 2).await,
                "naive" => naive(work, o.naive_sample).await,
                _ => {
                    let workers = if name.ends_with("1worker") { 1 } else { 2 };
                    let key = if composite || leaves.is_some() {
                        COMPOSITE_KEY
                    } else {
                        SINGLE_KEY
                    };
                    let b = sweeper_builtin(work, o.batch, workers, key).await;
                    assert_eq!(b.deleted, eligible, "{name}");
                    rss.push(b.rss_mb);
                    runs[i].push((b.planned_in, b.commands, b.avg_command));
                    b.deleted as f64 / b.seconds
                }
            };
            let Some(before) = before else {
                eprintln!("rep {rep} {name}: {v:.0} items/s");
                results[i].push(v);
                continue;
            };
            let after = WalMark::take(work, false).await;
            let cost = Cost::between(&before, &after, eligible as f64, batches, work).await;
            eprintln!(
                "rep {rep} {name}: {v:.0} items/s; {:.0} WAL bytes/item ({} without full-page \
                 images), {:.2} WAL syncs and {:.2} commits per batch, audit {} bytes/item, \
                 {} checkpoint(s) inside",
                cost.wal,
                cost.wal_no_fpi.map_or("?".into(), |v| format!("{v:.0}")),
                cost.syncs,
                cost.commits,
                cost.audit.map_or("-".into(), |v| format!("{v:.0}")),
                cost.checkpoints
            );
            results[i].push(v);
            if *name != "naive" {
                costs[i].push(cost);
            }
        }
    }
    // The fast path needs a completed run: the last copy has one.
    let fast = fast_path(work, o.batch, o.wrk_seconds).await;
    drop_database(work).await;
    drop_database(&seed_db).await;
    drop_database(&composite_db).await;
    for (_, db) in &partitioned_dbs {
        drop_database(db).await;
    }

    // Sparse, and its growth: the same eligible count on ever larger tables.
    let mut growth = Vec::new();
    for &rows in &o.growth {
        let (sw, fl, items) = sparse(rows, o.sparse_eligible, o.batch, o.reps).await;
        growth.push(json!({"rows": rows, "items": items, "sweeper_seconds": sw,
                           "floor_seconds": fl, "ratio": fl / sw}));
    }

    let backlog_db = format!("sweeper_bench_backlog_{}", o.backlog);
    eprintln!("seeding the {}-row backlog ...", o.backlog);
    seed(&backlog_db, o.backlog).await;
    let (p50, p99) = trigger_latency(&backlog_db, o.batch, o.triggers).await;
    drop_database(&backlog_db).await;

    let med: Vec<f64> = results.iter_mut().map(|v| median(v)).collect();
    // A contender's median items/s (NaN when it did not run: a smoke run's 2-worker leaves).
    let m = |name: &str| {
        contenders
            .iter()
            .position(|c| *c == name)
            .map_or(f64::NAN, |i| med[i])
    };
    let [
        th1,
        th2,
        lf1,
        lf2,
        fl1,
        fl2,
        ip1,
        ip2,
        naive_ips,
        cp1,
        cp2,
        sw1,
        sw2,
    ] = [
        "thin_floor_1conn",
        "thin_floor_2conn",
        "lean_floor_1conn",
        "lean_floor_2conn",
        "floor_1conn",
        "floor_2conn",
        "in_process_1conn",
        "in_process_2conn",
        "naive",
        "sweeper_builtin_composite_1worker",
        "sweeper_builtin_composite_2workers",
        "sweeper_builtin_1worker",
        "sweeper_builtin_2workers",
    ]
    .map(m);
    let builtin_runs = builtin_runs(&contenders, &runs);
    let partitioned = partitioned_report(&builtin_runs, &m);
    let cost_medians = contenders
        .iter()
        .zip(costs.iter_mut())
        .filter(|(_, c)| !c.is_empty())
        .map(|(n, c)| {
            let col = |f: fn(&Cost) -> Option<f64>| {
                let mut v: Vec<f64> = c.iter().filter_map(f).collect();
                (!v.is_empty()).then(|| median(&mut v))
            };
            (
                n.to_string(),
                json!({"wal_bytes_per_item": col(|c| Some(c.wal)),
                       "wal_bytes_per_item_without_fpi": col(|c| c.wal_no_fpi),
                       "wal_syncs_per_batch": col(|c| Some(c.syncs)),
                       "commits_per_batch": col(|c| Some(c.commits)),
                       "audit_bytes_per_item": col(|c| c.audit),
                       "checkpoints_inside": c.iter().map(|c| c.checkpoints).sum::<i64>()}),
            )
        })
        .collect::<serde_json::Map<_, _>>();
    let peak_rss = rss.iter().cloned().fold(0.0, f64::max);
    let table = json!({
        "rows": o.rows,
        "eligible": eligible,
        "batch": o.batch,
        "repetitions": o.reps,
        "items_per_second": contenders.iter().zip(&med).map(|(n, v)| (n.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "samples": contenders.iter().zip(&results).map(|(n, v)| (n.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "ratio_to_thin_floor": { "sweeper_builtin_1worker": sw1 / th1, "sweeper_builtin_2workers": sw2 / th2,
                                 "in_process_1conn": ip1 / th1, "in_process_2conn": ip2 / th2,
                                 "floor_1conn": fl1 / th1, "floor_2conn": fl2 / th2 },
        "ratio_to_lean_floor": { "sweeper_builtin_1worker": sw1 / lf1, "sweeper_builtin_2workers": sw2 / lf2,
                                 "lean_floor_1conn_to_thin": lf1 / th1, "lean_floor_2conn_to_thin": lf2 / th2 },
        "ratio_to_floor": { "sweeper_builtin_1worker": sw1 / fl1, "sweeper_builtin_2workers": sw2 / fl2,
                            "in_process_1conn": ip1 / fl1, "in_process_2conn": ip2 / fl2 },
        "wal_and_commits": cost_medians,
        "composite_key_time_ratio": { "1worker": sw1 / cp1, "2workers": sw2 / cp2 },
        "partitioned": partitioned,
        "builtin_runs": builtin_runs,
        "ratio_to_naive": { "floor_1conn": fl1 / naive_ips, "sweeper_builtin_1worker": sw1 / naive_ips,
                            "sweeper_builtin_2workers": sw2 / naive_ips },
        "sparse_growth": growth,
        "trigger_latency_ms": { "backlog_rows": o.backlog, "triggers": o.triggers, "p50": p50, "p99": p99 },
        "fast_path": fast.map(|(c, l)| json!({"consume_duplicate_rps": c, "one_lookup_rps": l, "ratio": c / l})),
        "server_peak_rss_mb": peak_rss,
        "seconds": t0.elapsed().as_secs_f64(),
    });

    println!();
    println!(
        "sweeper benchmark: {} rows ({} eligible), batch {}, {} repetition(s), medians",
        o.rows, eligible, o.batch, o.reps
    );
    println!(
        "{:<36}{:>12}{:>12}{:>12}{:>12}",
        "contender", "items/s", "vs thin", "vs floor", "vs naive"
    );
    // Each against the floors on as many connections as it uses.
    let row = |name: &str, v: f64, floors: Option<(f64, f64)>| {
        let (vt, vf) = floors
            .map(|(t, f)| (format!("{:.2}x", v / t), format!("{:.2}x", v / f)))
            .unwrap_or_else(|| ("-".into(), "-".into()));
        println!(
            "{name:<36}{v:>12.0}{vt:>12}{vf:>12}{:>11.1}x",
            v / naive_ips
        );
    };
    row("PostgreSQL thin floor, 1 conn", th1, None);
    row("PostgreSQL thin floor, 2 conns", th2, None);
    row("PostgreSQL lean floor, 1 conn", lf1, Some((th1, lf1)));
    row("PostgreSQL lean floor, 2 conns", lf2, Some((th2, lf2)));
    row(
        "PostgreSQL floor (sweeper's audit), 1",
        fl1,
        Some((th1, fl1)),
    );
    row(
        "PostgreSQL floor (sweeper's audit), 2",
        fl2,
        Some((th2, fl2)),
    );
    row("sweeper's statements in process, 1", ip1, Some((th1, fl1)));
    row("sweeper's statements in process, 2", ip2, Some((th2, fl2)));
    row("naive (row by row)", naive_ips, None);
    row("sweeper built-in, 1 worker", sw1, Some((th1, fl1)));
    row("sweeper built-in, 2 workers", sw2, Some((th2, fl2)));
    println!(
        "sweeper built-in against the lean floor: {:.2}x with 1 worker, {:.2}x with 2 (target: 0.8x)",
        sw1 / lf1,
        sw2 / lf2
    );
    row(
        "sweeper built-in, (id, closed_at), 1",
        cp1,
        Some((th1, fl1)),
    );
    row(
        "sweeper built-in, (id, closed_at), 2",
        cp2,
        Some((th2, fl2)),
    );
    println!(
        "key (id, closed_at) against key id, time: {:.2}x with 1 worker, {:.2}x with 2 (target: within 1.3x)",
        sw1 / cp1,
        sw2 / cp2
    );
    print_partitioned(&partitioned, &builtin_runs, &row, (th1, fl1), (th2, fl2));
    println!(
        "{:<42}{:>11}{:>11}{:>13}{:>15}{:>14}{:>6}",
        "per batch / item (medians)",
        "WAL B/item",
        "no FPI",
        "syncs/batch",
        "commits/batch",
        "audit B/item",
        "ckpt"
    );
    let f = |v: &Value, d: usize| v.as_f64().map_or("-".into(), |v| format!("{v:.d$}"));
    for (name, c) in &cost_medians {
        println!(
            "{name:<42}{:>11}{:>11}{:>13}{:>15}{:>14}{:>6}",
            f(&c["wal_bytes_per_item"], 0),
            f(&c["wal_bytes_per_item_without_fpi"], 0),
            f(&c["wal_syncs_per_batch"], 2),
            f(&c["commits_per_batch"], 2),
            f(&c["audit_bytes_per_item"], 0),
            c["checkpoints_inside"].as_i64().unwrap_or(0)
        );
    }
    println!(
        "sparse (about {} eligible, timestamp index), 1 worker / 1 conn:",
        o.sparse_eligible
    );
    println!(
        "{:>12}{:>8}{:>14}{:>12}{:>10}",
        "rows", "items", "sweeper s", "floor s", "ratio"
    );
    for g in &growth {
        println!(
            "{:>12}{:>8}{:>14.2}{:>12.2}{:>9.2}x",
            g["rows"].as_i64().unwrap(),
            g["items"].as_i64().unwrap(),
            g["sweeper_seconds"].as_f64().unwrap(),
            g["floor_seconds"].as_f64().unwrap(),
            g["ratio"].as_f64().unwrap()
        );
    }
    println!(
        "trigger latency with a {}-row backlog: p50 {p50:.1} ms, p99 {p99:.1} ms ({} dry-run triggers)",
        o.backlog, o.triggers
    );
    match fast {
        Some((c, l)) => println!(
            "duplicate /consume fast path: {c:.0} req/s vs one-lookup endpoint {l:.0} req/s: {:.2}x",
            c / l
        ),
        None => println!("duplicate /consume fast path: skipped (no wrk)"),
    }
    println!("server peak RSS: {peak_rss:.1} MB");
    println!("total {:.0} s", t0.elapsed().as_secs_f64());
    if let Some(dir) = std::path::Path::new(&o.json).parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(&o.json, serde_json::to_string_pretty(&table).unwrap()).unwrap();
    println!("{}", serde_json::to_string(&table).unwrap());
}

/// The leaf count of a partitioned contender (`sweeper_builtin_partitioned120_1worker`: 120).
fn leaves_of(name: &str) -> Option<usize> {
    let rest = name.split_once("partitioned")?.1;
    rest.split('_').next()?.parse().ok()
}

/// Per built-in contender that ran, the medians of its runs' planning seconds, commands and
/// items per command, and the samples.
fn builtin_runs(
    contenders: &[&str],
    runs: &[Vec<(f64, i64, f64)>],
) -> serde_json::Map<String, Value> {
    contenders
        .iter()
        .zip(runs)
        .filter(|(_, r)| !r.is_empty())
        .map(|(n, r)| {
            let mut planning: Vec<f64> = r.iter().map(|x| x.0).collect();
            let mut commands: Vec<f64> = r.iter().map(|x| x.1 as f64).collect();
            let mut sizes: Vec<f64> = r.iter().map(|x| x.2).collect();
            let samples: Vec<Value> = r
                .iter()
                .map(|(p, c, a)| json!({"planning_seconds": p, "commands": c, "items_per_command": a}))
                .collect();
            (
                n.to_string(),
                json!({"planning_seconds": median(&mut planning),
                       "commands": median(&mut commands),
                       "items_per_command": median(&mut sizes),
                       "samples": samples}),
            )
        })
        .collect()
}

/// The partitioned targets' figures (issue 33): medians, the time of 120 leaves against 6, the
/// time of 6 leaves against the plain tables (key `id` and key `(id, closed_at)`), and the
/// average command size. A time ratio is the inverse of the items/s ratio; NaN (JSON null) when a
/// contender did not run.
fn partitioned_report(runs: &serde_json::Map<String, Value>, m: &dyn Fn(&str) -> f64) -> Value {
    let [few, many] = LEAVES;
    let name =
        |leaves: usize, workers: &str| format!("sweeper_builtin_partitioned{leaves}_{workers}");
    let per_workers =
        |f: &dyn Fn(&str) -> f64| json!({"1worker": f("1worker"), "2workers": f("2workers")});
    let plain = |key: &str, workers: &str| m(&format!("sweeper_builtin_{key}{workers}"));
    json!({
        "leaves": LEAVES,
        "items_per_second": LEAVES.iter().flat_map(|l| ["1worker", "2workers"].map(|w| {
            let n = name(*l, w);
            (n.clone(), json!(m(&n)))
        })).collect::<serde_json::Map<_, _>>(),
        "time_ratio_many_vs_few": per_workers(&|w| m(&name(few, w)) / m(&name(many, w))),
        "time_ratio_few_vs_plain_key_id": per_workers(&|w| plain("", w) / m(&name(few, w))),
        "time_ratio_few_vs_plain_key_id_closed_at": per_workers(&|w| plain("composite_", w) / m(&name(few, w))),
        "time_ratio_many_vs_plain_key_id": per_workers(&|w| plain("", w) / m(&name(many, w))),
        "time_ratio_many_vs_plain_key_id_closed_at": per_workers(&|w| plain("composite_", w) / m(&name(many, w))),
        "items_per_command": LEAVES.iter().flat_map(|l| ["1worker", "2workers"].map(|w| name(*l, w)))
            .filter_map(|n| runs.get(&n).map(|r| (n, r["items_per_command"].clone())))
            .collect::<serde_json::Map<_, _>>(),
        "targets": {"many_vs_few": 1.2, "few_vs_plain": 1.3},
    })
}

/// Prints a contender's row of the table: its name, items/s, and the floors (thin, sweeper's
/// audit) on as many connections as it uses.
type PrintRow<'a> = dyn Fn(&str, f64, Option<(f64, f64)>) + 'a;

/// Prints the partitioned contenders' rows (`row`, against the floors on 1 and on 2
/// connections), their ratios against the targets, and every built-in run's planning time and
/// command size.
fn print_partitioned(
    p: &Value,
    runs: &serde_json::Map<String, Value>,
    row: &PrintRow<'_>,
    floors1: (f64, f64),
    floors2: (f64, f64),
) {
    let [few, many] = LEAVES;
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    for leaves in LEAVES {
        for (w, floors) in [("1worker", floors1), ("2workers", floors2)] {
            let v = f(&p["items_per_second"][format!("sweeper_builtin_partitioned{leaves}_{w}")]);
            if !v.is_nan() {
                let n = if w == "1worker" { 1 } else { 2 };
                row(
                    &format!("sweeper built-in, {leaves} leaves, {n}"),
                    v,
                    Some(floors),
                );
            }
        }
    }
    let pair = |key: &str| {
        format!(
            "{:.2}x with 1 worker, {:.2}x with 2",
            f(&p[key]["1worker"]),
            f(&p[key]["2workers"])
        )
    };
    println!(
        "partitioned, {many} leaves against {few}, time: {} (target: within 1.2x)",
        pair("time_ratio_many_vs_few")
    );
    println!(
        "partitioned, {few} leaves against the plain table keyed id, time: {}; keyed (id, closed_at): {} (target: within 1.3x)",
        pair("time_ratio_few_vs_plain_key_id"),
        pair("time_ratio_few_vs_plain_key_id_closed_at")
    );
    println!(
        "partitioned, {many} leaves against the plain table keyed id, time: {}; keyed (id, closed_at): {}",
        pair("time_ratio_many_vs_plain_key_id"),
        pair("time_ratio_many_vs_plain_key_id_closed_at")
    );
    println!(
        "{:<42}{:>12}{:>12}{:>14}",
        "built-in runs (medians)", "planning s", "commands", "items/command"
    );
    for (name, r) in runs {
        println!(
            "{name:<42}{:>12.2}{:>12.0}{:>14.1}",
            f(&r["planning_seconds"]),
            f(&r["commands"]),
            f(&r["items_per_command"])
        );
    }
}

/// Where the WAL stood, and the cluster's counters, at one moment of the benchmark.
struct WalMark {
    lsn: String,
    checkpoints: i64,
    counters: (f64, f64, f64, f64),
}

impl WalMark {
    /// Reads the mark, after a `CHECKPOINT` when `checkpoint`.
    async fn take(db: &str, checkpoint: bool) -> WalMark {
        let counters = wal_counters(db).await;
        let mut c = sqlx::PgConnection::connect(&database_url("postgres"))
            .await
            .unwrap();
        if checkpoint {
            sqlx::query("checkpoint").execute(&mut c).await.unwrap();
        }
        let (lsn, checkpoints): (String, i64) = sqlx::query_as(
            "select pg_current_wal_insert_lsn()::text,
                    (select checkpoints_timed + checkpoints_req from pg_stat_bgwriter)",
        )
        .fetch_one(&mut c)
        .await
        .unwrap();
        c.close().await.unwrap();
        WalMark {
            lsn,
            checkpoints,
            counters,
        }
    }
}

/// What one contender's run wrote.
#[derive(Debug, Clone)]
struct Cost {
    /// WAL bytes per deleted item (`pg_stat_wal`).
    wal: f64,
    /// The same without full-page images (`pg_waldump --stats`; None when it cannot be run).
    wal_no_fpi: Option<f64>,
    syncs: f64,
    commits: f64,
    /// Bytes of every audit table, heap and indexes, per deleted item (None: no audit written).
    audit: Option<f64>,
    /// Checkpoints that fell inside the run (0 for a fair comparison).
    checkpoints: i64,
}

impl Cost {
    async fn between(
        before: &WalMark,
        after: &WalMark,
        items: f64,
        batches: f64,
        db: &str,
    ) -> Cost {
        let (b, a) = (before.counters, after.counters);
        Cost {
            wal: (a.1 - b.1) / items,
            wal_no_fpi: waldump_record_bytes(&before.lsn, &after.lsn).map(|v| v / items),
            syncs: (a.2 - b.2) / batches,
            commits: (a.3 - b.3) / batches,
            audit: audit_bytes(db).await.map(|v| v / items),
            checkpoints: after.checkpoints - before.checkpoints,
        }
    }
}

/// WAL bytes between two LSNs without full-page images, from `pg_waldump --stats` (its
/// `Total` line: records, record bytes, FPI bytes, all), read from the local server's `pg_wal`.
/// None when the server's data directory or `pg_waldump` cannot be found.
fn waldump_record_bytes(from: &str, to: &str) -> Option<f64> {
    let (major, data) = (|| {
        let out = Command::new("psql")
            .args([
                &database_url("postgres"),
                "-Atc",
                "select current_setting('server_version_num')::int / 10000, \
                 current_setting('data_directory')",
            ])
            .output()
            .ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        let (m, d) = text.trim().split_once('|')?;
        Some((m.to_string(), d.to_string()))
    })()?;
    let out = Command::new(format!("/usr/lib/postgresql/{major}/bin/pg_waldump"))
        .args([
            "--stats",
            "-p",
            &format!("{data}/pg_wal"),
            "-s",
            from,
            "-e",
            to,
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let total = text.lines().find(|l| l.starts_with("Total"))?;
    total.split_whitespace().nth(2)?.parse().ok()
}

/// Bytes of every table of sweeper's audit (both shapes, every month: heap, indexes, TOAST) on
/// database `db`, or None when it holds no audit row.
async fn audit_bytes(db: &str) -> Option<f64> {
    let mut c = sqlx::PgConnection::connect(&database_url(db))
        .await
        .unwrap();
    let (bytes, rows): (f64, i64) = sqlx::query_as(
        "select (select coalesce(sum(pg_total_relation_size(c.oid)), 0)::float8
                   from pg_class c join pg_inherits i on i.inhrelid = c.oid
                  where i.inhparent in ('sweeper.audit'::regclass, 'sweeper.audit_executions'::regclass,
                                        'sweeper.audit_items'::regclass,
                                        'sweeper.audit_manifests'::regclass)),
                (select count(*) from sweeper.audit_trail)",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    (rows > 0).then_some(bytes)
}

/// The cluster's WAL records, WAL bytes and WAL syncs (`pg_stat_wal`) and database `db`'s
/// commits (`pg_stat_database`), read after the statistics of finished sessions are flushed
/// (PostgreSQL flushes a backend's counters at most once a second).
async fn wal_counters(db: &str) -> (f64, f64, f64, f64) {
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    let mut c = sqlx::PgConnection::connect(&database_url("postgres"))
        .await
        .unwrap();
    let row: (f64, f64, f64, f64) = sqlx::query_as(
        "select w.wal_records::float8, w.wal_bytes::float8, w.wal_sync::float8,
                d.xact_commit::float8
           from pg_stat_wal w, pg_stat_database d where d.datname = $1",
    )
    .bind(db)
    .fetch_one(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    row
}
