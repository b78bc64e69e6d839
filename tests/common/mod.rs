//! Shared helpers for integration tests: locating the oracle env and running its Python.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Repository root (tests run with the package root as the working directory).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The oracle interpreter; a missing env is a loud failure, never a skip.
pub fn python() -> PathBuf {
    let py = root().join(".venv/bin/python");
    assert!(
        py.is_file(),
        "oracle env missing at {}: run scripts/setup.sh",
        py.display()
    );
    py
}

/// Runs `python script args...` in the oracle env and panics with its stderr on failure.
pub fn run_python(script: &Path, args: &[&str]) -> String {
    let out = Command::new(python())
        .arg(script)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .expect("failed to start the oracle python");
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Path to the compiled `mlxb` binary under test.
pub fn mlxb() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_mlxb"))
}
