//! The shared engine: MLX runtime facts, models, caches, sampling and the generation loop.

pub mod error;
pub mod runtime;
