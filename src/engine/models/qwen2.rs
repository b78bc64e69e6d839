//! `qwen2`: mlx-lm's `models/qwen2.py` — llama's decoder ([`super::llama::build_decoder`]) with
//! biased q/k/v projections, head_dim always `hidden_size // num_attention_heads`.

use super::attention::AttentionShape;
use super::decoder::plain_attention;
use super::llama::{build_decoder, DecoderConfig};
use super::rope::Rope;
use super::{LanguageModel, ModelSpec};
use crate::engine::error::Result;
use crate::engine::weights::WeightStore;
use serde::Deserialize;

/// config.json fields qwen2 reads (mlx-lm's `ModelArgs`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: i32,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

fn default_max_positions() -> i32 {
    32768
}
fn default_theta() -> f64 {
    1_000_000.0
}
fn yes() -> bool {
    true
}

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    let a: Args = spec.args()?;
    spec.check_heads(a.num_attention_heads, a.num_key_value_heads)?;
    if a.num_hidden_layers < 1 {
        return Err(spec.field_error("num_hidden_layers", "must be at least 1"));
    }
    let head_dim = a.hidden_size / a.num_attention_heads;
    w.discard_matching("self_attn.rotary_emb.inv_freq");
    let (n_heads, n_kv) = (a.num_attention_heads, a.num_key_value_heads);
    let config = DecoderConfig {
        sizes: spec.args()?,
        tie_word_embeddings: a.tie_word_embeddings,
        attention: AttentionShape {
            qkv_bias: true,
            ..plain_attention(a.hidden_size, n_heads, n_kv, head_dim)
        },
        rope: Rope::from_config(
            head_dim,
            a.rope_theta,
            a.rope_traditional,
            a.rope_scaling.as_ref(),
        )?,
    };
    build_decoder(spec, w, config)
}
