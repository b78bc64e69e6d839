//! `qwen3`: mlx-lm's `models/qwen3.py` — llama's decoder (as qwen2) without q/k/v bias, with an
//! explicit `head_dim` and a per-head RMSNorm on queries and keys before RoPE.

use super::attention::AttentionShape;
use super::decoder::plain_attention;
use super::llama::{build_decoder, DecoderConfig};
use super::rope::Rope;
use super::{LanguageModel, ModelSpec};
use crate::engine::error::Result;
use crate::engine::weights::WeightStore;
use serde::Deserialize;
use serde_json::Value;

/// config.json fields qwen3 reads (mlx-lm's `ModelArgs`; the fields without a default there are
/// required here too).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub max_position_embeddings: i32,
    pub head_dim: i32,
    pub tie_word_embeddings: bool,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<Value>,
    pub rope_parameters: Option<Value>,
}

impl Args {
    /// `ModelArgs.__post_init__`: transformers >= 5 nests `rope_theta` and the scaling config
    /// under `rope_parameters`; explicit top-level fields win. Returns (theta, scaling).
    fn rope(&self, spec: &ModelSpec) -> Result<(f64, Option<Value>)> {
        let mut theta = self.rope_theta;
        let mut scaling = self.rope_scaling.clone().filter(|v| !v.is_null());
        // Python truthiness: a non-empty dict.
        let params = self
            .rope_parameters
            .as_ref()
            .filter(|p| p.as_object().is_some_and(|o| !o.is_empty()));
        if let Some(p) = params {
            if theta.is_none() {
                theta = match p.get("rope_theta") {
                    None | Some(Value::Null) => None,
                    Some(v) => Some(v.as_f64().ok_or_else(|| {
                        spec.field_error("rope_parameters.rope_theta", "must be a number")
                    })?),
                };
            }
            if scaling.is_none() {
                scaling = Some(p.clone());
            }
        }
        let theta = theta.ok_or_else(|| {
            spec.field_error(
                "rope_theta",
                "is missing (neither top-level nor in rope_parameters); qwen3 needs it",
            )
        })?;
        Ok((theta, scaling))
    }
}

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    let a: Args = spec.args()?;
    spec.check_heads(a.num_attention_heads, a.num_key_value_heads)?;
    if a.num_hidden_layers < 1 {
        return Err(spec.field_error("num_hidden_layers", "must be at least 1"));
    }
    let (theta, scaling) = a.rope(spec)?;
    let attention = AttentionShape {
        qk_norm_eps: Some(a.rms_norm_eps),
        ..plain_attention(
            a.hidden_size,
            a.num_attention_heads,
            a.num_key_value_heads,
            a.head_dim,
        )
    };
    let config = DecoderConfig {
        sizes: spec.args()?,
        tie_word_embeddings: a.tie_word_embeddings,
        attention,
        rope: Rope::from_config(a.head_dim, theta, false, scaling.as_ref())?,
    };
    build_decoder(spec, w, config)
}
