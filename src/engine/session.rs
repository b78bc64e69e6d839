//! A loaded model and its tokenizer: what every subcommand opens first.

use super::error::Result;
use super::forks::Forks;
use super::models::{self, LoadedModel};
use super::startup::StartupTrace;
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
    /// Where opening it and each generation on it mark their start-up steps.
    pub startup: StartupTrace,
}

impl Session {
    /// Loads the model and tokenizer from `dir` with the given forks. The tokenizer (pure
    /// Rust, ~0.19 s for SmolLM2's 49k vocabulary) is parsed on a second thread while this one
    /// builds the model; MLX stays on this thread. With page-mapped weights (~0.04 s) the
    /// tokenizer is the longer of the two (`MLXB_TRACE_STARTUP=1` shows both).
    pub fn open(dir: &Path, forks: Forks) -> Result<Self> {
        Self::open_traced(dir, forks, StartupTrace::default())
    }

    /// [`Session::open`], marking its steps on `startup` and keeping it for the generations.
    pub fn open_traced(dir: &Path, forks: Forks, startup: StartupTrace) -> Result<Self> {
        startup.mark("session open");
        let (tokenizer, model) = std::thread::scope(|scope| {
            let tokenizer = scope.spawn(|| {
                let t = Tokenizer::load(dir);
                startup.mark("tokenizer parsed");
                t
            });
            let model = models::load_on_ranks(dir, forks, super::distributed::world());
            startup.mark("model built");
            let model = model.and_then(|mut m| {
                m.model.prepare_host_step()?;
                startup.mark("host step prepared");
                Ok(m)
            });
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
            startup,
        })
    }
}
