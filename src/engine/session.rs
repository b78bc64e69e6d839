//! A loaded model and its tokenizer: what every subcommand opens first.

use super::error::Result;
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

/// Resolves a `--model` value to a model directory: an MLX-format directory, a built-in model's
/// short name, or (none) the default model; built-in models are fetched and imported on first use.
pub fn resolve_model(model_ref: Option<&str>) -> Result<PathBuf> {
    super::registry_models::resolve(model_ref)
}

impl Session {
    /// Loads the model and tokenizer from `dir` with the given forks. The tokenizer (pure
    /// Rust, ~0.1 s for a 50k vocabulary) is parsed on a second thread while this one builds
    /// the model, so it costs nothing on the way to the first token; MLX stays on this thread.
    pub fn open(dir: &Path, forks: Forks) -> Result<Self> {
        let (tokenizer, model) = std::thread::scope(|scope| {
            let tokenizer = scope.spawn(|| Tokenizer::load(dir));
            let model = models::load(dir, forks);
            let tokenizer = tokenizer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (tokenizer, model)
        });
        let (tokenizer, model) = (tokenizer?, model?);
        Ok(Self {
            model,
            tokenizer,
            dir: dir.to_path_buf(),
        })
    }
}
