//! The shared engine, inference only: MLX runtime facts, models, caches, attention, sampling,
//! tokenizer and detokenizer, weights, host kernels, the fork table and the generation loop.
//! It imports nothing from the tools above it (`convert`, `oracle`, `train`, `cmd`, ...).

pub mod batch;
pub mod batch_verify;
pub mod bits;
pub mod cache;
pub mod cache_attention;
pub mod chat_template;
pub mod contain;
pub mod detokenizer;
pub mod distributed;
pub mod error;
pub mod forks;
pub mod fsutil;
pub mod generate;
pub mod kernels;
pub mod loader;
pub mod logprobs;
pub mod models;
pub mod nn;
pub mod plan;
pub mod rollback;
pub mod runtime;
pub mod sample;
pub mod session;
pub mod shard;
pub mod startup;
pub mod text;
pub mod tokenizer;
pub mod tool_calls;
pub mod weights;
