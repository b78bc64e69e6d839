//! `mlxb` command line: parse, dispatch to `cmd::*`, map errors to exit codes.

// A panic is never the answer to user input (issue #13): outside tests, every `unwrap`/`expect`
// must become an error that names the file or field.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use clap::Parser;

/// mimalloc: the tokenizer build at start-up is allocation-bound (see Cargo.toml).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = mlxb::cmd::Cli::parse();
    mlxb::cmd::run(cli)
}
