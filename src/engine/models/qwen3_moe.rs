//! `qwen3_moe`: mlx-lm's `models/qwen3_moe.py` — qwen3's attention (per-head q/k RMSNorm, plain
//! RoPE at `rope_theta`) with sparse MoE feed-forwards (softmax top-k router, `SwitchGLU` experts)
//! on every `decoder_sparse_step`-th layer not listed in `mlp_only_layers`.

use super::activations::{swiglu, CompiledOp};
use super::attention::{AttentionShape, GqaAttention};
use super::decoder::{plain_attention, Decoder, LayerIo, LmHead, PreNormLayer};
use super::mlp::GatedMlp;
use super::rope::Rope;
use super::switch::{check_experts, stack_experts, FeedForward, MoeShape, SparseMoe};
use super::{LanguageModel, ModelSpec};
use crate::engine::error::Result;
use crate::engine::nn::{Embedding, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::Array;
use serde::Deserialize;

/// config.json fields qwen3_moe reads (mlx-lm's `ModelArgs`: all required but `rope_scaling`,
/// which mlx-lm's qwen3_moe ignores).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub decoder_sparse_step: i32,
    pub mlp_only_layers: Vec<i32>,
    pub moe_intermediate_size: i32,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: i32,
    pub norm_topk_prob: bool,
}

struct Block {
    attn: GqaAttention,
    ffn: FeedForward,
    norms: PreNormLayer,
}

/// The qwen3_moe decoder with its LM head.
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: LmHead,
    swiglu: CompiledOp,
    vocab_size: i32,
}

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    let a: Args = spec.args()?;
    spec.check_heads(a.num_attention_heads, a.num_key_value_heads)?;
    if a.num_hidden_layers < 1 {
        return Err(spec.field_error("num_hidden_layers", "must be at least 1"));
    }
    let moe_layer = |i: i32| {
        a.num_experts > 0
            && !a.mlp_only_layers.contains(&i)
            && (i + 1) % a.decoder_sparse_step.max(1) == 0
    };
    if a.num_experts > 0 {
        check_experts(
            spec,
            a.num_experts,
            a.num_experts_per_tok,
            "num_experts_per_tok",
        )?;
        if a.decoder_sparse_step < 1 {
            return Err(spec.field_error("decoder_sparse_step", "must be at least 1"));
        }
    }
    if a.tie_word_embeddings {
        w.discard("lm_head.weight");
    }
    let (d, eps) = (a.hidden_size, a.rms_norm_eps);
    let shape = AttentionShape {
        qk_norm_eps: Some(eps),
        ..plain_attention(d, a.num_attention_heads, a.num_key_value_heads, a.head_dim)
    };
    let rope = Rope::Plain {
        dims: a.head_dim,
        traditional: false,
        base: a.rope_theta as f32,
        scale: 1.0,
    };
    let moe = MoeShape {
        hidden: d,
        experts: a.num_experts,
        top_k: a.num_experts_per_tok,
        expert_inter: a.moe_intermediate_size,
        norm_topk_prob: a.norm_topk_prob,
        shared_inter: None,
    };
    let mut layers = Vec::new();
    for i in 0..a.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mlp = format!("{p}.mlp");
        let ffn = if moe_layer(i) {
            stack_experts(w, &mlp, a.num_experts)?;
            FeedForward::Moe(Box::new(SparseMoe::load(w, &mlp, moe)?))
        } else {
            FeedForward::Dense(Box::new(GatedMlp::load(
                w,
                &mlp,
                d,
                a.intermediate_size,
                false,
            )?))
        };
        layers.push(Block {
            attn: GqaAttention::load(w, &format!("{p}.self_attn"), shape.clone(), rope.clone())?,
            ffn,
            norms: PreNormLayer::load(w, &p, d, eps)?,
        });
    }
    Ok(Box::new(Model {
        embed_tokens: Embedding::load(w, "model.embed_tokens", a.vocab_size, d)?,
        layers,
        norm: RmsNorm::load(w, "model.norm", d, eps)?,
        lm_head: LmHead::load(w, a.tie_word_embeddings, "lm_head", d, a.vocab_size)?,
        swiglu: swiglu(spec.forks.compiled_activations),
        vocab_size: a.vocab_size,
    }))
}

impl Decoder for Model {
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    fn input(&self, inputs: &Array) -> Result<Array> {
        self.embed_tokens.forward(inputs)
    }

    fn block(&mut self, i: usize, h: &Array, io: LayerIo<'_>) -> Result<Array> {
        let (layer, (mask, cache)) = (&self.layers[i], io.attention()?);
        layer.norms.forward(
            h,
            |x| layer.attn.forward(x, mask, cache),
            |x| layer.ffn.forward(x, &mut self.swiglu),
        )
    }

    fn output(&mut self, h: &Array) -> Result<Array> {
        self.lm_head
            .forward(&self.embed_tokens, &self.norm.forward(h)?)
    }
}

impl LanguageModel for Model {
    super::decoder_model!();
}
