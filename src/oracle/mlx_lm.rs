//! Running mlx-lm (the L1 oracle) in the runtime env, on the same libmlx as mlxb, for
//! `mlxb parity` and `bench --baseline`. The driver script ships inside the binary.

use crate::engine::error::{EngineError, Result};
use mlx_rs::Array;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

/// The L1 oracle's name as reports print it.
pub const ORACLE: &str = "mlx-lm 0.32.2";

/// The mlx-lm trace script (assets/oracle/mlx_lm_trace.py), embedded.
const TRACE_SCRIPT: &str = include_str!("../../assets/oracle/mlx_lm_trace.py");

/// The oracle's Python: `$MLXB_ORACLE_PYTHON`, else the env whose libmlx mlxb was linked to.
pub fn python() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("MLXB_ORACLE_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    // <venv>/lib/pythonX.Y/site-packages/mlx/lib → <venv>/bin/python
    let lib = PathBuf::from(option_env!("MLXB_RUNTIME_LIB_DIR").unwrap_or(""));
    let venv = lib.ancestors().nth(5).map(|p| p.join("bin/python"));
    match venv {
        Some(p) if p.is_file() => Ok(p),
        _ => Err(EngineError::Runtime(
            "cannot find the oracle env's python (mlx-lm); run scripts/setup.sh or set MLXB_ORACLE_PYTHON".into(),
        )),
    }
}

/// What mlx-lm produced for one request.
pub struct OracleTrace {
    /// Generated token ids.
    pub ids: Vec<i32>,
    /// `[steps, V]` logprobs, one row per generated token.
    pub logprobs: Option<Array>,
    /// `[L, V]` logits of a one-shot prompt forward, when requested.
    pub prompt_logits: Option<Array>,
    /// The oracle's own timings (load, prompt, generation, peak memory).
    pub timings: serde_json::Value,
}

/// Runs mlx-lm's `generate_step` as described by `request` (see the script's docstring).
pub fn trace(request: &serde_json::Value) -> Result<OracleTrace> {
    run_trace(
        &python()?,
        "mlx-lm",
        "mlx_lm_trace.py",
        TRACE_SCRIPT,
        request,
    )
}

/// Runs an oracle trace script (`script`, saved as `name`) with `python` on `request`; the
/// script writes `ids`, `logprobs` and optionally `prompt_logits` and prints its timings.
pub fn run_trace(
    python: &std::path::Path,
    oracle: &str,
    name: &str,
    script: &str,
    request: &serde_json::Value,
) -> Result<OracleTrace> {
    let dir = std::env::temp_dir().join(format!("mlxb-oracle-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| EngineError::file(&dir, format!("cannot create ({e})")))?;
    let script_path = dir.join(name);
    let req = dir.join("request.json");
    let out = dir.join("out.safetensors");
    let write = |p: &PathBuf, s: &str| {
        std::fs::write(p, s).map_err(|e| EngineError::file(p, format!("cannot write ({e})")))
    };
    write(&script_path, script)?;
    write(&req, &request.to_string())?;
    let output = Command::new(python)
        .arg(&script_path)
        .arg(&req)
        .arg(&out)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .map_err(|e| EngineError::Runtime(format!("cannot start the oracle python ({e})")))?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        let _ = std::fs::remove_dir_all(&dir);
        return Err(EngineError::Runtime(format!("{oracle} failed: {last}")));
    }
    let mut arrays: HashMap<String, Array> = Array::load_safetensors(&out)
        .map_err(|e| EngineError::Runtime(format!("cannot read the oracle's output ({e})")))?;
    let _ = std::fs::remove_dir_all(&dir);
    let ids = arrays
        .remove("ids")
        .map(|a| a.as_slice::<i32>().to_vec())
        .unwrap_or_default();
    let timings = String::from_utf8_lossy(&output.stdout)
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(serde_json::Value::Null);
    Ok(OracleTrace {
        ids,
        logprobs: arrays.remove("logprobs"),
        prompt_logits: arrays.remove("prompt_logits"),
        timings,
    })
}
