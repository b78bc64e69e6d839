//! `gemma2`: mlx-lm's `models/gemma2.py`. Every layer attends over a full `KVCache` with an
//! explicit boolean mask (mlx-lm ignores gemma2's sliding window); attention is computed by hand
//! with the scores soft-capped; all norms are `rms_norm(x, 1 + w)` with sandwich norms around
//! attention and MLP; the embedding is scaled by `sqrt(hidden)`; the tied head's logits are
//! soft-capped at `final_logit_softcapping`.

use super::activations::{softcap_graph, GeluApprox};
use super::attention::{AttentionShape, AttentionVariant, GqaAttention};
use super::decoder::{Decoder, LayerIo};
use super::mlp::GatedMlp;
use super::rope::Rope;
use super::{LanguageModel, ModelSpec};
use crate::engine::cache::{AttentionMask, KvCache};
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

/// One decoder layer, which gemma3_text shares: attention and a GeGLU MLP, each wrapped in a
/// pre- and a post-norm (`rms_norm(x, 1 + w)`).
pub(super) struct SandwichBlock {
    attn: GqaAttention,
    mlp: GatedMlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
}

impl SandwichBlock {
    /// Loads layer `{prefix}`: its attention (by `attn`, from `{prefix}.self_attn`), its MLP
    /// and its four norms, for `(hidden, intermediate, eps)`.
    pub(super) fn load(
        w: &mut WeightStore,
        prefix: &str,
        (hidden, intermediate, eps): (i32, i32, f64),
        attn: impl FnOnce(&mut WeightStore, &str) -> Result<GqaAttention>,
    ) -> Result<Self> {
        let norm = |w: &mut WeightStore, name: &str| {
            RmsNorm::load(w, &format!("{prefix}.{name}"), hidden, eps)
        };
        Ok(Self {
            attn: attn(w, &format!("{prefix}.self_attn"))?,
            mlp: GatedMlp::load(w, &format!("{prefix}.mlp"), hidden, intermediate, false)?,
            input_layernorm: norm(w, "input_layernorm")?,
            post_attention_layernorm: norm(w, "post_attention_layernorm")?,
            pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
        })
    }

    /// Runs the layer; `residual(x, y)` adds a branch's normed output `y` to the stream `x`
    /// (a plain add in gemma2, `clip_residual` in gemma3).
    pub(super) fn forward(
        &self,
        h: &Array,
        (mask, cache): (&AttentionMask, &mut dyn KvCache),
        gelu: &mut GeluApprox,
        mut residual: impl FnMut(&Array, &Array) -> Result<Array>,
    ) -> Result<Array> {
        let r = self
            .attn
            .forward(&self.input_layernorm.forward_one_plus(h)?, mask, cache)?;
        let h = residual(h, &self.post_attention_layernorm.forward_one_plus(&r)?)?;
        let r = self.mlp.forward_with(
            &self.pre_feedforward_layernorm.forward_one_plus(&h)?,
            |g, u| Ok(gelu.apply(g)?.multiply(u)?),
        )?;
        residual(&h, &self.post_feedforward_layernorm.forward_one_plus(&r)?)
    }
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
    let dims = (d, a.intermediate_size, eps);
    let mut layers = Vec::new();
    for i in 0..a.num_hidden_layers {
        let attn = |w: &mut WeightStore, path: &str| {
            GqaAttention::load_variant(w, path, shape.clone(), rope.clone(), variant)
        };
        let p = format!("model.layers.{i}");
        layers.push(SandwichBlock::load(w, &p, dims, attn)?);
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

impl Decoder for Model {
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// mlx-lm's gemma2 asks `create_attention_mask(h, cache, return_array=True)`.
    fn full_mask_array(&self) -> bool {
        true
    }

    /// `embed_tokens(ids) * sqrt(hidden_size)`.
    fn input(&self, inputs: &Array) -> Result<Array> {
        let h = self.embed_tokens.forward(inputs)?;
        Ok(h.multiply(weak_scalar((self.hidden_size as f64).powf(0.5), &h)?)?)
    }

    fn block(&mut self, i: usize, h: &Array, io: LayerIo<'_>) -> Result<Array> {
        let add = |x: &Array, y: &Array| Ok(x.add(y)?);
        self.layers[i].forward(h, io.attention()?, &mut self.gelu, add)
    }

    /// The tied head on `rms_norm(h, 1 + w)`, soft-capped.
    fn output(&mut self, h: &Array) -> Result<Array> {
        let out = self
            .embed_tokens
            .as_linear(&self.norm.forward_one_plus(h)?)?;
        Ok(softcap_graph(&out, self.final_logit_softcapping)?)
    }
}

impl LanguageModel for Model {
    super::decoder_model!();
}
