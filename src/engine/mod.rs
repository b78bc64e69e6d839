//! The shared engine: MLX runtime facts, models, caches, sampling and the generation loop.

pub mod attend;
pub mod bits;
pub mod cache;
pub mod chat_template;
pub mod contain;
pub mod detokenizer;
pub mod divergence;
pub mod error;
pub mod flags;
pub mod fsutil;
pub mod generate;
pub mod gguf;
pub mod kernels;
pub mod loader;
pub mod models;
pub mod nn;
pub mod oracle;
pub mod plan;
pub mod prompts;
pub mod registry_models;
pub mod runtime;
pub mod sample;
pub mod session;
pub mod text;
pub mod tokenizer;
pub mod weights;
