//! Throwaway PostgreSQL clusters on loopback ports, for the tests that need a second server: a
//! streaming standby (replay lag, promotion) and a restore into another cluster. Made with the
//! machine's own binaries (`/usr/lib/postgresql/<version>/bin`), run as the `postgres` OS user
//! when the tests run as root (`initdb` refuses root). Stopped and removed on drop.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The directory of the PostgreSQL server binaries (the newest version installed).
pub fn bin_dir() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("/usr/lib/postgresql (the Debian PostgreSQL packages)")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL server installed")
}

fn as_postgres(program: &Path, args: &[&str]) -> Command {
    let root = is_root();
    let mut c = if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    };
    c.args(args);
    c
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn run(mut c: Command, what: &str) {
    let out = c.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A running cluster.
pub struct Cluster {
    pub dir: PathBuf,
    pub port: u16,
}

impl Cluster {
    fn data_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "sweeper-cluster-{name}-{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ));
        std::fs::create_dir_all(&dir).unwrap();
        if is_root() {
            run(
                {
                    let mut c = Command::new("chown");
                    c.args(["postgres:postgres"]).arg(&dir);
                    c
                },
                "chown",
            );
        }
        dir
    }

    /// A new primary (trust authentication on loopback, replication allowed).
    pub fn primary(name: &str) -> Cluster {
        let dir = Self::data_dir(name);
        let pgdata = dir.join("data");
        run(
            as_postgres(
                &bin_dir().join("initdb"),
                &[
                    "-D",
                    pgdata.to_str().unwrap(),
                    "--auth=trust",
                    "-U",
                    "postgres",
                    "--no-sync",
                ],
            ),
            "initdb",
        );
        let c = Cluster {
            dir,
            port: super::process::free_port(),
        };
        c.start();
        c
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), started.
    pub fn standby_of(primary: &Cluster, name: &str) -> Cluster {
        let dir = Self::data_dir(name);
        let pgdata = dir.join("data");
        let port = primary.port.to_string();
        run(
            as_postgres(
                &bin_dir().join("pg_basebackup"),
                &[
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &port,
                    "-U",
                    "postgres",
                    "-D",
                    pgdata.to_str().unwrap(),
                    "-R",
                    "-c",
                    "fast",
                    "-X",
                    "stream",
                    "--no-sync",
                    "-d",
                    &format!("application_name={name}"),
                ],
            ),
            "pg_basebackup",
        );
        let c = Cluster {
            dir,
            port: super::process::free_port(),
        };
        c.start();
        c
    }

    fn start(&self) {
        let pgdata = self.dir.join("data");
        let log = self.dir.join("log");
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c fsync=off \
             -c wal_receiver_status_interval=1s",
            self.port
        );
        run(
            as_postgres(
                &bin_dir().join("pg_ctl"),
                &[
                    "-D",
                    pgdata.to_str().unwrap(),
                    "-l",
                    log.to_str().unwrap(),
                    "-o",
                    &opts,
                    "-w",
                    "start",
                ],
            ),
            "pg_ctl start",
        );
    }

    /// `postgres://postgres@127.0.0.1:{port}/{db}`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The URL of `db` as `user`.
    pub fn url_as(&self, user: &str, db: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let pgdata = self.dir.join("data");
        let _ = as_postgres(
            &bin_dir().join("pg_ctl"),
            &["-D", pgdata.to_str().unwrap(), "-m", "immediate", "stop"],
        )
        .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
