//! The one way tests and benchmarks start the `sweeper` binary: a configuration file written to a
//! fresh directory, `sweeper serve --config` on a loopback port, readiness awaited on `/readyz`,
//! the process killed when its [`Server`] drops.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The binary cargo built for this test or benchmark.
pub const BIN: &str = env!("CARGO_BIN_EXE_sweeper");

/// A free loopback port, for a server whose address must be known before it starts (a public
/// URL in its configuration, or a restart on the same port).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Writes `text` as `sweeper.toml` in a fresh temporary directory; returns its path.
pub fn write_config(text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sweeper-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sweeper.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A `sweeper` command with the test environment cleared of what would override a
/// configuration file (`DATABASE_URL`, `SWEEPER_CONFIG`), its output captured.
pub fn sweeper(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("SWEEPER_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// How to start a server; `Launch::default()` is a free port, no extra environment, no crash
/// point, readiness awaited for 30 s.
pub struct Launch<'a> {
    /// The port (a restart on the same port keeps a push endpoint valid); `None`: a free one.
    pub port: Option<u16>,
    /// Extra environment variables.
    pub env: &'a [(&'a str, &'a str)],
    /// `SWEEPER_CRASH_AT`: the named crash point to abort at (the `failpoints` feature).
    pub crash_at: Option<&'a str>,
    /// How long to wait for `/readyz` to answer 200; `None`: do not wait (an HTTPS server, whose
    /// caller waits with a client that trusts its certificate).
    pub ready_within: Option<Duration>,
}

impl Default for Launch<'_> {
    fn default() -> Self {
        Launch {
            port: None,
            env: &[],
            crash_at: None,
            ready_within: Some(Duration::from_secs(30)),
        }
    }
}

/// A running `sweeper serve` process, killed on drop.
pub struct Server {
    pub child: Child,
    /// `http://127.0.0.1:{port}`.
    pub base: String,
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `sweeper serve` with the configuration `text` (its `127.0.0.1:0` listen address
    /// replaced by the chosen port) and waits until it is ready.
    pub async fn start(text: &str) -> Server {
        Self::launch(text, Launch::default()).await
    }

    /// [`Server::start`] with [`Launch`] options.
    pub async fn launch(text: &str, how: Launch<'_>) -> Server {
        let port = how.port.unwrap_or_else(free_port);
        let path = write_config(&text.replace("127.0.0.1:0", &format!("127.0.0.1:{port}")));
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--config", path.to_str().unwrap()])
            .env_remove("DATABASE_URL")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        for (k, v) in how.env {
            cmd.env(k, v);
        }
        if let Some(point) = how.crash_at {
            cmd.env("SWEEPER_CRASH_AT", point);
        }
        let server = Server {
            child: cmd.spawn().unwrap(),
            base: format!("http://127.0.0.1:{port}"),
            port,
        };
        if let Some(within) = how.ready_within {
            server.wait_ready(within).await;
        }
        server
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&self, within: Duration) {
        let started = Instant::now();
        while reqwest::get(format!("{}/readyz", self.base))
            .await
            .map(|r| r.status() != 200)
            .unwrap_or(true)
        {
            assert!(started.elapsed() < within, "server did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits (up to `within`) until the process exits; returns its status.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(started.elapsed() < within, "still running after {within:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the process aborted at its crash point.
    pub async fn wait_crashed(&mut self) {
        let status = self.wait_exit(Duration::from_secs(30)).await;
        assert!(
            !status.success(),
            "the server exited cleanly instead of crashing"
        );
    }

    /// Sends SIGTERM (a graceful shutdown).
    pub fn terminate(&self) {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
    }

    /// Peak resident set size so far, in MB (`VmHWM` of `/proc/{pid}/status`).
    pub fn peak_rss_mb(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map(|kb| kb / 1024.0)
            .unwrap_or(f64::NAN)
    }
}
