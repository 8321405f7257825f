//! The command line: `serve`, `migrate`, `check-config`, `token`, `schedules`, `quickstart`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::app::Application;
use crate::config::DurationSpec;
use crate::settings::Config;
use crate::state as app;

/// The version `sweeper --version` prints: the package version and the commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("SWEEPER_COMMIT"),
    ")"
);

/// sweeper: scheduled data-retention cleanup, correctly.
#[derive(Debug, Parser)]
#[command(name = "sweeper", version = VERSION, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP server, the built-in queue workers and the planner.
    Serve {
        /// Configuration file (TOML).
        #[arg(long, env = "SWEEPER_CONFIG", default_value = "sweeper.toml")]
        config: PathBuf,
    },
    /// Apply the ledger migrations to the configured database and exit.
    Migrate {
        /// Configuration file (TOML).
        #[arg(long, env = "SWEEPER_CONFIG", default_value = "sweeper.toml")]
        config: PathBuf,
    },
    /// Validate the configuration, then the policies against the database; exit 2 on an invalid
    /// configuration, 1 when the database checks fail.
    CheckConfig {
        /// Configuration file (TOML).
        #[arg(long, env = "SWEEPER_CONFIG", default_value = "sweeper.toml")]
        config: PathBuf,
    },
    /// Mint a bearer token signed with an issuer's newest key, printed on stdout.
    Token {
        /// Configuration file (TOML).
        #[arg(long, env = "SWEEPER_CONFIG", default_value = "sweeper.toml")]
        config: PathBuf,
        /// Scopes, space- or comma-separated or repeated: `trigger:*`, `trigger:{policy}`,
        /// `consume`, `ops:read`, `ops:write`.
        #[arg(long = "scope", required = true, num_args = 1..)]
        scopes: Vec<String>,
        /// Lifetime (s, m, h, d or w), e.g. `1h`.
        #[arg(long, default_value = "1h")]
        ttl: String,
        /// The token's `sub` (recorded as the actor of what it does).
        #[arg(long, default_value = "operator")]
        sub: String,
        /// The issuer's `iss` (default: the first configured issuer).
        #[arg(long)]
        issuer: Option<String>,
    },
    /// Print the external scheduler's definitions (Cloud Scheduler, Kubernetes, QStash, cron,
    /// systemd) for every policy, from the policies' own schedules; needs no database or secret.
    /// Exit 2 on an invalid configuration or URL, 1 when a policy's cron cannot be expressed for
    /// the format (then nothing is printed on stdout and each refusal is said on stderr).
    Schedules {
        /// Configuration file (TOML).
        #[arg(long, env = "SWEEPER_CONFIG", default_value = "sweeper.toml")]
        config: PathBuf,
        /// Which scheduler's definitions.
        #[arg(long, value_enum)]
        format: crate::schedules::Format,
        /// The base URL the triggers call (`<url>/trigger/<policy>`); default: `[qstash]
        /// public_url`, else required.
        #[arg(long)]
        url: Option<String>,
    },
    /// Create a demo database (200,000 support tickets, or with `--scenario` customers and
    /// digest data, uploads and their files, or payments), start the server, trigger runs over
    /// HTTP as a cron would, wait for them and print a report.
    Quickstart {
        /// Which job: `retention` (200,000 support tickets, `ticket-retention`), `digest`
        /// (the weekly support digest to active customers, then its cleanup stage, with a
        /// worker restart mid-digest), `uploads` (expired uploads: their files deleted from a
        /// local directory as the bucket, then their rows, with a worker restart mid-run) or
        /// `reconciliation` (closed payments checked against a local payment provider that
        /// throttles, stamped on a match, mismatches left as dead letters, with a worker restart
        /// mid-run).
        #[arg(long, value_enum, default_value_t = crate::quickstart::Scenario::Retention)]
        scenario: crate::quickstart::Scenario,
        /// Stop after the report; the last stdout line is a JSON summary.
        #[arg(long)]
        exit: bool,
        /// Port to serve on (0 picks a free one).
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Tickets to seed (retention scenario).
        #[arg(long, default_value_t = 200_000)]
        rows: i64,
    },
}

fn init_tracing(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_current_span(true)
        .try_init();
}

/// Runs a parsed command line; the exit code is 0 on success, 1 on failure, 2 on bad config.
pub fn run(cli: Cli) -> ExitCode {
    // One crypto provider for rustls and jsonwebtoken: aws-lc-rs.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let quiet = matches!(
        cli.command,
        Command::Quickstart { .. } | Command::Token { .. } | Command::Schedules { .. }
    );
    init_tracing(if quiet { "warn" } else { "info" });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// When `path` does not exist: which file was looked for (absolute: the working directory is
/// often not the one the operator thinks), and how to point at another.
fn missing(path: &std::path::Path) -> Option<String> {
    (!path.exists()).then(|| {
        let full = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        format!(
            "no configuration file at {}: pass --config <file> or set SWEEPER_CONFIG \
             (deploy/sweeper.example.toml is a complete example)",
            full.display()
        )
    })
}

fn load(path: &std::path::Path) -> Result<Config, ExitCode> {
    if let Some(why) = missing(path) {
        eprintln!("{why}");
        return Err(ExitCode::from(2));
    }
    let config = Config::load(path).map_err(|e| {
        eprintln!("{}: {e}", path.display());
        ExitCode::from(2)
    })?;
    warn_overridden_url(&config, path);
    Ok(config)
}

/// Says when the environment's database URL replaces the one the file sets (the environment
/// wins: a file naming one database and a shell exporting another is an easy mistake).
fn warn_overridden_url(config: &Config, path: &std::path::Path) {
    if let Some(var) = config.database_url_overridden_by {
        warn!(
            variable = var,
            "database_url: {var} in the environment overrides the one in {}",
            path.display()
        );
    }
}

/// `sweeper schedules`: reads only the policies and `[qstash] public_url` (no database, no
/// secret), so it runs where deploy scripts run, before any secret exists.
fn schedules(
    path: &std::path::Path,
    format: crate::schedules::Format,
    url: Option<&str>,
) -> ExitCode {
    if let Some(why) = missing(path) {
        eprintln!("{why}");
        return ExitCode::from(2);
    }
    let source = match crate::schedules::read(path) {
        Ok(s) => s,
        Err(errors) => {
            for e in errors {
                eprintln!("{}: {e}", path.display());
            }
            return ExitCode::from(2);
        }
    };
    let Some(raw) = url.or(source.public_url.as_deref()) else {
        eprintln!(
            "--url is required: {} has no [qstash] public_url to default to, and the definitions \
             need the base URL the scheduler calls (<url>/trigger/<policy>)",
            path.display()
        );
        return ExitCode::from(2);
    };
    let base = match crate::schedules::base_url(raw) {
        Ok(b) => b,
        Err(why) => {
            eprintln!("{why}");
            return ExitCode::from(2);
        }
    };
    match crate::schedules::render(format, &source, &base, path) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(refusals) => {
            for r in &refusals {
                eprintln!("{r}");
            }
            eprintln!(
                "{}: {} policy schedule(s) refused; nothing printed",
                path.display(),
                refusals.len()
            );
            ExitCode::FAILURE
        }
    }
}

// Over 80 lines: one short arm per subcommand.
async fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Serve { config } => {
            let config = match load(&config) {
                Ok(c) => c,
                Err(code) => return Ok(code),
            };
            let app = Application::build(config).await?;
            info!(port = app.port(), "sweeper serving");
            let shutdown = CancellationToken::new();
            tokio::spawn(crate::app::shutdown_on_signal(shutdown.clone()));
            app.run_until(shutdown).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate { config } => {
            let config = match load(&config) {
                Ok(c) => c,
                Err(code) => return Ok(code),
            };
            app::migrate(&config).await?;
            println!("migrations applied");
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig { config } => {
            let path = config;
            if let Some(why) = missing(&path) {
                // The verdict is the last line, here too.
                eprintln!("{why}; the server would refuse to start");
                return Ok(ExitCode::from(2));
            }
            let config = match Config::load(&path) {
                Ok(c) => c,
                Err(e) => {
                    // The verdict is the last line, here too.
                    eprintln!("{}: {e}", path.display());
                    eprintln!(
                        "{}: {} problem(s): the configuration is invalid; the server would refuse \
                         to start",
                        path.display(),
                        e.0.len()
                    );
                    return Ok(ExitCode::from(2));
                }
            };
            if let Some(var) = config.database_url_overridden_by {
                println!(
                    "info: database_url: {var} in the environment overrides the one in {}; \
                     checked against {var}'s database",
                    path.display()
                );
            }
            for q in &config.credentials.query_tokens {
                println!(
                    "warning: auth.query_token[{}]: a token in /consume's query string is weaker \
                     than OIDC (URLs are often logged by proxies and platforms); use it only \
                     where the sender cannot send an Authorization header",
                    q.subject
                );
            }
            // The verdict comes last, after every finding, so the last line tells.
            let checked = async {
                let pool = app::connect(&config).await?;
                let findings = crate::policy::check::check_policies(
                    &pool,
                    &config.policies,
                    config.planning.path,
                )
                .await;
                let readable = crate::governor::readability(&pool).await;
                pool.close().await;
                anyhow::Ok((findings?, readable?))
            };
            let (findings, readable) = match checked.await {
                Ok(f) => f,
                Err(e) => {
                    println!("error: {e:#}");
                    println!(
                        "{}: the configuration parses, but it could not be checked against the \
                         database; the server would refuse to start",
                        path.display()
                    );
                    return Ok(ExitCode::FAILURE);
                }
            };
            let count = |level| findings.iter().filter(|f| f.level == level).count();
            let errors = count(crate::policy::check::Level::Error);
            let warnings = count(crate::policy::check::Level::Warning)
                + readable.iter().filter(|(w, _)| *w).count();
            for f in &findings {
                println!("{f}");
            }
            for (warning, line) in &readable {
                println!("{}: {line}", if *warning { "warning" } else { "info" });
            }
            for p in &config.policies {
                println!("info: {}", crate::policy::safety::summary(p));
            }
            if errors > 0 {
                println!(
                    "{}: {errors} error(s): the server would refuse to start",
                    path.display()
                );
                Ok(ExitCode::FAILURE)
            } else {
                println!(
                    "{}: configuration is valid ({} policies, {warnings} warning(s)); database \
                     checks passed",
                    path.display(),
                    config.policies.len()
                );
                Ok(ExitCode::SUCCESS)
            }
        }
        Command::Token {
            config,
            scopes,
            ttl,
            sub,
            issuer,
        } => {
            let config = match load(&config) {
                Ok(c) => c,
                Err(code) => return Ok(code),
            };
            let ttl: DurationSpec = ttl.parse().map_err(anyhow::Error::msg)?;
            let issuer = match &issuer {
                Some(iss) => config.credentials.issuers.iter().find(|i| &i.iss == iss),
                None => config.credentials.issuers.first(),
            }
            .context("no such issuer in the configuration ([[auth.issuer]])")?;
            let scopes: Vec<String> = scopes
                .iter()
                .flat_map(|s| s.split([' ', ',']))
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            if sub.trim().is_empty() {
                anyhow::bail!("--sub must not be empty: it names who acts with this token");
            }
            for scope in &scopes {
                let known = matches!(
                    scope.as_str(),
                    "consume" | "ops:read" | "ops:write" | "trigger:*"
                ) || scope
                    .strip_prefix("trigger:")
                    .is_some_and(|p| config.policy(p).is_some());
                if !known {
                    anyhow::bail!(
                        "unknown scope `{scope}`: use consume, ops:read, ops:write, trigger:* or \
                         trigger:<policy> for a configured policy"
                    );
                }
            }
            println!(
                "{}",
                crate::auth::mint(issuer, &sub, &scopes, ttl.seconds())?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Schedules {
            config,
            format,
            url,
        } => Ok(schedules(&config, format, url.as_deref())),
        Command::Quickstart {
            scenario,
            exit,
            port,
            rows,
        } => {
            crate::quickstart::run(crate::quickstart::Options {
                scenario,
                exit,
                port,
                rows,
            })
            .await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
