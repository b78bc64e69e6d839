//! `qwen3_5_moe`: mlx-lm's `models/qwen3_5_moe.py` — the [`qwen3_5`](super::qwen3_5) hybrid
//! decoder with MoE feed-forwards; its `sanitize` also splits fused `experts.gate_up_proj`
//! tensors (HF layout) into the switch layers' gate and up projections.

use super::{LanguageModel, ModelSpec};
use crate::engine::error::Result;
use crate::engine::weights::WeightStore;

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    super::qwen3_5::build_text(spec, w, true)
}
