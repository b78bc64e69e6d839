//! A loaded model and its tokenizer: what every subcommand opens first.

use super::error::{EngineError, Result};
use super::flags::Forks;
use super::models::{self, LoadedModel};
use super::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// A model directory opened for generation.
pub struct Session {
    /// The model with its weights.
    pub model: LoadedModel,
    /// Its tokenizer and chat template.
    pub tokenizer: Tokenizer,
    /// The model directory.
    pub dir: PathBuf,
}

/// Resolves a `--model` value to a model directory.
pub fn resolve_model(model_ref: Option<&str>) -> Result<PathBuf> {
    let Some(r) = model_ref else {
        return Err(EngineError::Input(
            "no --model given; pass an MLX-format model directory (config.json, model*.safetensors, tokenizer.json)".into(),
        ));
    };
    let p = Path::new(r);
    if p.is_dir() {
        return Ok(p.to_path_buf());
    }
    Err(EngineError::Input(format!(
        "--model {r}: no such directory; pass an MLX-format model directory (mlxb never downloads from a hub)"
    )))
}

impl Session {
    /// Loads the model and tokenizer from `dir` with the given forks.
    pub fn open(dir: &Path, forks: Forks) -> Result<Self> {
        let tokenizer = Tokenizer::load(dir)?;
        let model = models::load(dir, forks)?;
        Ok(Self {
            model,
            tokenizer,
            dir: dir.to_path_buf(),
        })
    }
}
