//! `gemma2`: mlx-lm's `models/gemma2.py`. Every layer attends over a full `KVCache` with an
//! explicit boolean mask (mlx-lm ignores gemma2's sliding window); attention is computed by hand
//! with the scores soft-capped; all norms are `rms_norm(x, 1 + w)` with sandwich norms around
//! attention and MLP; the embedding is scaled by `sqrt(hidden)`; the tied head's logits are
//! soft-capped at `final_logit_softcapping`.

use super::activations::{softcap_graph, GeluApprox};
use super::attention::{AttentionShape, AttentionVariant, GqaAttention};
use super::mlp::GatedMlp;
use super::rope::Rope;
use super::{full_caches, Caches, LanguageModel, ModelSpec};
use crate::engine::error::Result;
use crate::engine::nn::{weak_scalar, Embedding, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::Array;
use serde::Deserialize;

/// config.json fields gemma2 reads (mlx-lm's `ModelArgs`, same required fields and defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    #[serde(default = "default_attn_cap")]
    pub attn_logit_softcapping: f64,
    #[serde(default = "default_final_cap")]
    pub final_logit_softcapping: f64,
    #[serde(default = "default_qpas")]
    pub query_pre_attn_scalar: f64,
}

fn default_theta() -> f64 {
    10000.0
}
fn default_attn_cap() -> f64 {
    50.0
}
fn default_final_cap() -> f64 {
    30.0
}
fn default_qpas() -> f64 {
    144.0
}

/// One decoder layer: attention and MLP, each wrapped in a pre- and a post-norm.
struct SandwichBlock {
    attn: GqaAttention,
    mlp: GatedMlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
}

/// The gemma2 decoder with its tied, soft-capped LM head.
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<SandwichBlock>,
    norm: RmsNorm,
    gelu: GeluApprox,
    hidden_size: i32,
    final_logit_softcapping: f64,
    vocab_size: i32,
}

fn check_positive(spec: &ModelSpec, field: &str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(spec.field_error(field, &format!("is {v}; it must be a positive number")))
    }
}

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    let a: Args = spec.args()?;
    spec.check_heads(a.num_attention_heads, a.num_key_value_heads)?;
    if a.num_hidden_layers < 1 {
        return Err(spec.field_error("num_hidden_layers", "must be at least 1"));
    }
    check_positive(spec, "attn_logit_softcapping", a.attn_logit_softcapping)?;
    check_positive(spec, "final_logit_softcapping", a.final_logit_softcapping)?;
    check_positive(spec, "query_pre_attn_scalar", a.query_pre_attn_scalar)?;
    let (d, eps) = (a.hidden_size, a.rms_norm_eps);
    let shape = AttentionShape {
        hidden: d,
        n_heads: a.num_attention_heads,
        n_kv_heads: a.num_key_value_heads,
        head_dim: a.head_dim,
        qkv_bias: false,
        o_bias: false,
        qk_norm_eps: None,
        // `1.0 / (query_pre_attn_scalar**0.5)`, folded in f64.
        scale: (1.0 / a.query_pre_attn_scalar.powf(0.5)) as f32,
    };
    let variant = AttentionVariant {
        softcap: Some(a.attn_logit_softcapping),
        ..Default::default()
    };
    let rope = Rope::Plain {
        dims: a.head_dim,
        traditional: a.rope_traditional,
        base: a.rope_theta as f32,
        scale: 1.0,
    };
    let mut layers = Vec::new();
    for i in 0..a.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let norm =
            |w: &mut WeightStore, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), d, eps);
        layers.push(SandwichBlock {
            attn: GqaAttention::load_variant(
                w,
                &format!("{p}.self_attn"),
                shape.clone(),
                rope.clone(),
                variant,
            )?,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), d, a.intermediate_size, false)?,
            input_layernorm: norm(w, "input_layernorm")?,
            post_attention_layernorm: norm(w, "post_attention_layernorm")?,
            pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
        });
    }
    Ok(Box::new(Model {
        embed_tokens: Embedding::load(w, "model.embed_tokens", a.vocab_size, d)?,
        layers,
        norm: RmsNorm::load(w, "model.norm", d, eps)?,
        gelu: GeluApprox::new(spec.forks.compiled_activations),
        hidden_size: d,
        final_logit_softcapping: a.final_logit_softcapping,
        vocab_size: a.vocab_size,
    }))
}

impl LanguageModel for Model {
    fn forward(&mut self, inputs: &Array, caches: &mut Caches) -> Result<Array> {
        let h = self.embed_tokens.forward(inputs)?;
        let mut h = h.multiply(weak_scalar((self.hidden_size as f64).powf(0.5), &h)?)?;
        let mask = caches[0].make_mask(h.shape()[1], None, true)?;
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = layer.attn.forward(
                &layer.input_layernorm.forward_one_plus(&h)?,
                &mask,
                cache.as_mut(),
            )?;
            let hh = h.add(layer.post_attention_layernorm.forward_one_plus(&r)?)?;
            let gelu = &mut self.gelu;
            let r = layer.mlp.forward_with(
                &layer.pre_feedforward_layernorm.forward_one_plus(&hh)?,
                |g, u| Ok(gelu.apply(g)?.multiply(u)?),
            )?;
            h = hh.add(layer.post_feedforward_layernorm.forward_one_plus(&r)?)?;
        }
        let out = self
            .embed_tokens
            .as_linear(&self.norm.forward_one_plus(&h)?)?;
        Ok(softcap_graph(&out, self.final_logit_softcapping)?)
    }

    fn make_caches(&self) -> Caches {
        full_caches(self.layers.len())
    }

    fn vocab_size(&self) -> i32 {
        self.vocab_size
    }
}
