//! Running mlx-optiq 0.7.7 (the L2 oracle) in its own env, `.venv-optiq` beside `.venv` (it
//! pins other transformers versions than mlx-lm's env), on the same MLX release and BLAS: the
//! `optiq eval` path with a per-layer KV allocation. The driver script ships inside the binary.

use super::compare::compare;
use super::divergence::greedy_steps;
use super::mlx_lm::{self, run_trace, OracleTrace};
use crate::engine::error::{EngineError, Result};
use crate::engine::models::LoadedModel;
use crate::engine::plan::KvLayerQuant;
use std::path::{Path, PathBuf};

/// The optiq trace script (assets/oracle/optiq_trace.py), embedded.
const TRACE_SCRIPT: &str = include_str!("../../assets/oracle/optiq_trace.py");

/// The L2 oracle's name as reports print it.
pub const ORACLE: &str = "mlx-optiq 0.7.7 (optiq eval path)";

/// The optiq env's Python: `$MLXB_OPTIQ_PYTHON`, else `.venv-optiq` beside the mlx-lm env.
pub fn python() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("MLXB_OPTIQ_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    let beside = mlx_lm::python().ok().and_then(|p| {
        Some(
            p.parent()?
                .parent()?
                .parent()?
                .join(".venv-optiq/bin/python"),
        )
    });
    match beside {
        Some(p) if p.is_file() => Ok(p),
        _ => Err(EngineError::Runtime(
            "cannot find the L2 oracle env (.venv-optiq with mlx-optiq); run scripts/setup.sh --dev or set MLXB_OPTIQ_PYTHON".into(),
        )),
    }
}

/// optiq's `kv_config.json` for a per-layer allocation (absent layers: full precision).
pub fn kv_config_json(layers: &[Option<KvLayerQuant>]) -> serde_json::Value {
    layers
        .iter()
        .enumerate()
        .filter_map(|(i, q)| {
            q.map(
                |q| serde_json::json!({"layer_idx": i, "bits": q.bits, "group_size": q.group_size}),
            )
        })
        .collect()
}

/// Runs the optiq eval path greedily on `prompt_ids` of the model in `model` with the per-layer
/// KV allocation `layers`.
pub fn trace(
    model: &Path,
    layers: &[Option<KvLayerQuant>],
    prompt_ids: &[u32],
    max_tokens: usize,
    prefill_step_size: usize,
) -> Result<OracleTrace> {
    let dir = tempfile::tempdir()
        .map_err(|e| EngineError::Runtime(format!("cannot create a temporary directory ({e})")))?;
    let config = dir.path().join("kv_config.json");
    std::fs::write(&config, kv_config_json(layers).to_string())
        .map_err(|e| EngineError::file(&config, format!("cannot write ({e})")))?;
    let request = serde_json::json!({
        "model": model,
        "kv_config": config,
        "prompt_ids": prompt_ids,
        "max_tokens": max_tokens,
        "prefill_step_size": prefill_step_size,
    });
    run_trace(
        &python()?,
        "mlx-optiq",
        "optiq_trace.py",
        TRACE_SCRIPT,
        &request,
    )
}

/// Whether `loaded` (loaded from `dir` with its per-layer KV allocation) decodes every prompt
/// greedily for `steps` steps with the oracle's ids and logprob bits.
pub fn identical_to_l2(
    loaded: &mut LoadedModel,
    dir: &Path,
    prompts: &[Vec<u32>],
    steps: usize,
    prefill_step_size: usize,
) -> Result<bool> {
    let layers = loaded.plan.kv_bits.clone();
    for prompt in prompts {
        let ours = greedy_steps(loaded, prompt, steps, prefill_step_size, None)?;
        let theirs = trace(dir, &layers, prompt, steps, prefill_step_size)?;
        if !compare(&ours, &theirs.ids, theirs.logprobs.as_ref())?.identical {
            return Ok(false);
        }
    }
    Ok(true)
}
