//! `mlxb` command line: parse, dispatch to `cmd::*`, map errors to exit codes.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = mlxb::cmd::Cli::parse();
    mlxb::cmd::run(cli)
}
