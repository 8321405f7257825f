//! Records the commit the binary is built from, for `sweeper --version`: `git rev-parse` in the
//! source tree (a clone, or cargo's checkout for `cargo install --git`), else `unknown` (a
//! source archive without git).

fn main() {
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=SWEEPER_COMMIT={commit}");
    // A new commit moves the branch's ref (or packed-refs); a checkout moves HEAD.
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        println!("cargo:rerun-if-changed={path}");
    }
}
