//! The `sweeper` binary: parses the command line and hands over to the library.
#![forbid(unsafe_code)]

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = sweeper::cli::Cli::parse();
    sweeper::cli::run(cli)
}
