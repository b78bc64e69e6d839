//! mlxb: fast, exact local LLM inference on MLX. The binary (`main.rs`) is clap dispatch
//! only; the shared engine and the speculative-decoding seam live here so tests use them too.

pub mod bench;
pub mod cmd;
pub mod engine;
pub mod server;
pub mod spec;
