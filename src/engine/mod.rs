//! The shared engine: MLX runtime facts, models, caches, sampling and the generation loop.

pub mod cache;
pub mod error;
pub mod flags;
pub mod generate;
pub mod models;
pub mod nn;
pub mod oracle;
pub mod runtime;
pub mod sample;
pub mod session;
pub mod tokenizer;
pub mod weights;
