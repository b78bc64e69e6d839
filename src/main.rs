//! `mlxb` command line: parse, dispatch to `cmd::*`, map errors to exit codes.

use clap::Parser;

/// mimalloc: the tokenizer build at start-up is allocation-bound (see Cargo.toml).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = mlxb::cmd::Cli::parse();
    mlxb::cmd::run(cli)
}
