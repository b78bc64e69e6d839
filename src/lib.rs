//! mlxb: fast, exact local LLM inference on MLX. The binary (`main.rs`) is clap dispatch
//! only; the shared engine and the speculative-decoding seam live here so tests use them too.

// A panic is never the answer to user input (issue #13): outside tests, every `unwrap`/`expect`
// must become an error that names the file or field.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod bench;
pub mod cmd;
pub mod convert;
pub mod engine;
pub mod oracle;
pub mod progress;
pub mod server;
pub mod spec;
pub mod train;
