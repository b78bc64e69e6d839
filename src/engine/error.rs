//! Typed engine errors. Each names the file or field at fault and how to fix it; `cmd/`
//! turns the user-facing ones into one sentence and exit code 2.

use std::path::PathBuf;

/// Errors a user can cause (bad files, bad flags) or the environment can cause (runtime).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Something in the user's input is wrong; the message says what and how to fix it.
    #[error("{0}")]
    Input(String),
    /// The model's chat template is missing, broken or unsupported. The sentence names no
    /// flag: each front end adds the way around it that it offers (`--ignore-chat-template`).
    #[error("{}{reason}", path.as_ref().map(|p| format!("{}: ", p.display())).unwrap_or_default())]
    ChatTemplate {
        /// The file the template came from, when it is at fault.
        path: Option<PathBuf>,
        /// What is wrong.
        reason: String,
    },
    /// A file could not be read or parsed.
    #[error("{path}: {reason}")]
    File { path: PathBuf, reason: String },
    /// The MLX runtime is missing, mismatched or broken.
    #[error("MLX runtime problem: {0}")]
    Runtime(String),
    /// mlxb's output differs from its oracle (exit code 1: a bug, not bad input).
    #[error("parity check failed: {0}")]
    Parity(String),
    /// An MLX operation failed.
    #[error("MLX error: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    /// Reading an MLX array's data failed (dtype or shape mismatch).
    #[error("MLX array conversion error: {0}")]
    Conversion(#[from] mlx_rs::error::ConversionError),
}

impl EngineError {
    /// Builds a [`EngineError::File`] for `path`.
    pub fn file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        EngineError::File {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// Whether the user can fix this by changing their input (exit code 2).
    pub fn is_user_error(&self) -> bool {
        matches!(
            self,
            EngineError::Input(_)
                | EngineError::ChatTemplate { .. }
                | EngineError::File { .. }
                | EngineError::Runtime(_)
        )
    }
}

/// Result alias for engine code.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
