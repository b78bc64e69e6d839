//! Resumable training state: f32 parameters, Adam moments, step and options in one
//! safetensors file written atomically, so `--resume` continues a run exactly.

use crate::engine::error::{EngineError, Result};
use mlx_rs::Array;
use std::collections::HashMap;
use std::path::Path;

use super::forward::Params;
use super::optim::{AdamW, TrainOptions};

/// The training-state file inside a checkpoint directory (parameters, Adam moments, step).
pub const STATE_FILE: &str = "train-state.safetensors";

/// Writes the training state (f32 parameters, moments, step, options) atomically.
pub fn save_state(dir: &Path, params: &Params, opt: &AdamW, opts: &TrainOptions) -> Result<()> {
    let mut arrays: Vec<(String, &Array)> = Vec::new();
    for (i, name) in params.names.iter().enumerate() {
        arrays.push((format!("p.{name}"), &params.values[i]));
        arrays.push((format!("m.{name}"), &opt.m[i]));
        arrays.push((format!("v.{name}"), &opt.v[i]));
    }
    let mut meta = HashMap::new();
    meta.insert("step".to_owned(), opt.step.to_string());
    meta.insert(
        "options".to_owned(),
        serde_json::to_string(opts).map_err(|e| EngineError::Runtime(e.to_string()))?,
    );
    let tmp = dir.join(format!("tmp-{STATE_FILE}"));
    Array::save_safetensors(arrays, &meta, &tmp)
        .map_err(|e| EngineError::file(&tmp, format!("cannot write the training state ({e})")))?;
    std::fs::rename(&tmp, dir.join(STATE_FILE))
        .map_err(|e| EngineError::file(dir, format!("cannot write {STATE_FILE} ({e})")))
}

/// Reads a training state written by [`save_state`] into `params` (names must match) and
/// returns the optimizer and the saved options.
pub fn load_state(dir: &Path, params: &mut Params) -> Result<(AdamW, TrainOptions)> {
    let path = dir.join(STATE_FILE);
    let bad = |r: String| EngineError::file(&path, r);
    let (arrays, meta) = Array::load_safetensors_with_metadata(&path).map_err(|e| {
        bad(format!(
            "cannot read the training state ({e}); start without --resume"
        ))
    })?;
    let step = meta
        .get("step")
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or_else(|| bad("the training state has no step".into()))?;
    let opts: TrainOptions = meta
        .get("options")
        .and_then(|s| serde_json::from_str(s).ok())
        .ok_or_else(|| bad("the training state has no options".into()))?;
    let mut opt = AdamW::new(params)?;
    opt.step = step;
    for (i, name) in params.names.iter().enumerate() {
        let get = |prefix: &str| {
            arrays
                .get(&format!("{prefix}.{name}"))
                .cloned()
                .ok_or_else(|| {
                    bad(format!(
                        "tensor `{name}` is missing; the state belongs to another drafter"
                    ))
                })
        };
        let p = get("p")?;
        if p.shape() != params.values[i].shape() {
            return Err(bad(format!(
                "tensor `{name}` has another shape; the state belongs to another drafter"
            )));
        }
        params.values[i] = p;
        opt.m[i] = get("m")?;
        opt.v[i] = get("v")?;
    }
    if arrays.len() != 3 * params.names.len() {
        return Err(bad(
            "the state has extra tensors; it belongs to another drafter".into(),
        ));
    }
    Ok((opt, opts))
}
