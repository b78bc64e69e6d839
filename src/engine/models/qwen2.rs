//! `qwen2`: mlx-lm's `models/qwen2.py` (llama's block with biased q/k/v projections, head_dim
//! always `hidden_size // num_attention_heads`). The decoder here is shared with `qwen3`.

use super::activations::SwiGlu;
use super::attention::{inv_sqrt_scale, AttentionShape, GqaAttention};
use super::decoder::PreNormLayer;
use super::mlp::GatedMlp;
use super::rope::Rope;
use super::{Caches, ForwardOpts, ForwardOut, LanguageModel, ModelSpec};
use crate::engine::cache::{FullCache, KvCache};
use crate::engine::error::Result;
use crate::engine::nn::{Embedding, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::Array;
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

/// What a qwen-style decoder is made of: every layer is full attention over a `KVCache`,
/// `x + attn(norm(x))` then `h + mlp(norm(h))` with a SwiGLU MLP.
pub(super) struct DecoderConfig {
    pub hidden: i32,
    pub layers: i32,
    pub intermediate: i32,
    pub vocab: i32,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub attention: AttentionShape,
    pub rope: Rope,
}

struct Block {
    attn: GqaAttention,
    mlp: GatedMlp,
    norms: PreNormLayer,
}

/// The qwen2/qwen3 decoder with its LM head.
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    swiglu: SwiGlu,
    vocab_size: i32,
}

/// Loads the decoder; the caller has already applied its architecture's `sanitize`.
pub(super) fn build_decoder(
    spec: &ModelSpec,
    w: &mut WeightStore,
    c: DecoderConfig,
) -> Result<Box<dyn LanguageModel>> {
    if c.tie_word_embeddings {
        w.discard("lm_head.weight");
    }
    let d = c.hidden;
    let mut layers = Vec::new();
    for i in 0..c.layers {
        let p = format!("model.layers.{i}");
        layers.push(Block {
            attn: GqaAttention::load(
                w,
                &format!("{p}.self_attn"),
                c.attention.clone(),
                c.rope.clone(),
            )?,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), d, c.intermediate, false)?,
            norms: PreNormLayer::load(w, &p, d, c.rms_norm_eps)?,
        });
    }
    Ok(Box::new(Model {
        embed_tokens: Embedding::load(w, "model.embed_tokens", c.vocab, d)?,
        layers,
        norm: RmsNorm::load(w, "model.norm", d, c.rms_norm_eps)?,
        lm_head: if c.tie_word_embeddings {
            None
        } else {
            Some(Linear::load(w, "lm_head", d, c.vocab, false)?)
        },
        swiglu: SwiGlu::new(&spec.forks),
        vocab_size: c.vocab,
    }))
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
    let attention = AttentionShape {
        hidden: a.hidden_size,
        n_heads: a.num_attention_heads,
        n_kv_heads: a.num_key_value_heads,
        head_dim,
        qkv_bias: true,
        o_bias: false,
        qk_norm_eps: None,
        scale: inv_sqrt_scale(head_dim),
    };
    let rope = Rope::from_config(
        head_dim,
        a.rope_theta,
        a.rope_traditional,
        a.rope_scaling.as_ref(),
    )?;
    build_decoder(
        spec,
        w,
        DecoderConfig {
            hidden: a.hidden_size,
            layers: a.num_hidden_layers,
            intermediate: a.intermediate_size,
            vocab: a.vocab_size,
            rms_norm_eps: a.rms_norm_eps,
            tie_word_embeddings: a.tie_word_embeddings,
            attention,
            rope,
        },
    )
}

impl LanguageModel for Model {
    fn forward(&mut self, inputs: &Array, caches: &mut Caches) -> Result<Array> {
        Ok(self
            .forward_ext(inputs, caches, &ForwardOpts::default())?
            .logits)
    }

    fn forward_ext(
        &mut self,
        inputs: &Array,
        caches: &mut Caches,
        opts: &ForwardOpts,
    ) -> Result<ForwardOut> {
        let run = opts.layers_to_run(self.layers.len(), caches.len())?;
        let mut h = self.embed(inputs)?;
        let mask = caches[0].make_mask(h.shape()[1], None, false)?;
        let mut taps = Vec::new();
        for (i, (layer, cache)) in self.layers[..run].iter().zip(caches.iter_mut()).enumerate() {
            let swiglu = &mut self.swiglu;
            h = layer.norms.forward(
                &h,
                |x| layer.attn.forward(x, &mask, cache.as_mut()),
                |x| layer.mlp.forward_swiglu(x, swiglu),
            )?;
            opts.capture(i, &h, &mut taps);
        }
        let logits = self.lm_head(&self.final_norm(&h)?)?;
        Ok(ForwardOut {
            logits,
            taps: opts.finish_taps(taps),
        })
    }

    super::llama_layout_accessors!();

    fn make_caches(&self) -> Caches {
        self.layers
            .iter()
            .map(|_| -> Box<dyn KvCache> { Box::new(FullCache::new()) })
            .collect()
    }

    fn vocab_size(&self) -> i32 {
        self.vocab_size
    }
}
