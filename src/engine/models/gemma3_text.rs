//! `gemma3_text`: mlx-lm's `models/gemma3_text.py`. Sliding-window layers (local RoPE base,
//! `RotatingKVCache`) alternate with global layers every `sliding_window_pattern`; all norms are
//! `rms_norm(x, 1 + w)`; the MLP is `gelu_approx(gate) * up`; residuals go through the compiled
//! `clip_residual` (a plain add except in float16).

use super::activations::GeluApprox;
use super::attention::{AttentionShape, GqaAttention, QkNormStyle};
use super::decoder::{Decoder, LayerIo, LayerKind};
use super::gemma2::SandwichBlock;
use super::rope::Rope;
use super::{LanguageModel, ModelSpec};
use crate::engine::error::Result;
use crate::engine::nn::{Embedding, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{ops, Array, Dtype};
use serde::Deserialize;

/// config.json fields gemma3_text reads, with mlx-lm's `ModelArgs` defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub rope_theta: f64,
    pub rope_local_base_freq: f64,
    pub query_pre_attn_scalar: f64,
    pub sliding_window: i32,
    pub sliding_window_pattern: i32,
    pub max_position_embeddings: i32,
    pub rope_scaling: Option<serde_json::Value>,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            hidden_size: 1152,
            num_hidden_layers: 26,
            intermediate_size: 6912,
            num_attention_heads: 4,
            head_dim: 256,
            rms_norm_eps: 1.0e-6,
            vocab_size: 262144,
            num_key_value_heads: 1,
            rope_theta: 1_000_000.0,
            rope_local_base_freq: 10_000.0,
            query_pre_attn_scalar: 256.0,
            sliding_window: 512,
            sliding_window_pattern: 6,
            max_position_embeddings: 32768,
            rope_scaling: None,
        }
    }
}

type Binary =
    Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> std::result::Result<Array, Exception>>;

/// `clip_residual(x, y)`: `x + y`, except in float16 where the sum is taken in float32 and
/// clipped to the float16 range.
fn clip_residual_graph((x, y): (&Array, &Array)) -> std::result::Result<Array, Exception> {
    if x.dtype() != Dtype::Float16 {
        return x.add(y);
    }
    let bound = Dtype::Float16.finfo_max().unwrap_or(65504.0) as f32;
    let sum = x
        .as_dtype(Dtype::Float32)?
        .add(y.as_dtype(Dtype::Float32)?)?;
    ops::clip(&sum, (Array::from_f32(-bound), Array::from_f32(bound)))?.as_dtype(Dtype::Float16)
}

/// The compiled (shapeless, as in mlx-lm) `clip_residual`.
struct ClipResidual {
    compiled: Binary,
    eager: bool,
}

impl ClipResidual {
    fn new(compiled: bool) -> Self {
        Self {
            compiled: Box::new(compile(clip_residual_graph, true)),
            eager: !compiled,
        }
    }

    fn apply(&mut self, x: &Array, y: &Array) -> Result<Array> {
        if self.eager {
            return Ok(clip_residual_graph((x, y))?);
        }
        Ok((self.compiled)((x, y))?)
    }
}

/// The gemma3 text decoder with its LM head (tied when the checkpoint has no `lm_head`).
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<SandwichBlock>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    gelu: GeluApprox,
    clip_residual: ClipResidual,
    hidden_size: i32,
    sliding_window: i32,
    sliding_window_pattern: i32,
    vocab_size: i32,
}

/// mlx-lm's layer rule: layer `i` is global iff `i % pattern == pattern - 1`.
fn is_global(i: usize, pattern: i32) -> bool {
    let p = pattern as usize;
    i % p == p - 1
}

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    let a: Args = spec.args()?;
    spec.check_heads(a.num_attention_heads, a.num_key_value_heads)?;
    if a.sliding_window_pattern < 1 {
        return Err(spec.field_error("sliding_window_pattern", "must be at least 1"));
    }
    if a.num_hidden_layers < a.sliding_window_pattern {
        return Err(spec.field_error(
            "num_hidden_layers",
            &format!(
                "is {} but must be at least sliding_window_pattern ({}): mlx-lm takes the global mask from layer {}",
                a.num_hidden_layers,
                a.sliding_window_pattern,
                a.sliding_window_pattern - 1
            ),
        ));
    }
    if a.sliding_window < 1 {
        return Err(spec.field_error("sliding_window", "must be at least 1"));
    }
    let (d, hd, p) = (a.hidden_size, a.head_dim, a.sliding_window_pattern);
    let eps = a.rms_norm_eps;
    let shape = AttentionShape {
        hidden: d,
        n_heads: a.num_attention_heads,
        n_kv_heads: a.num_key_value_heads,
        head_dim: hd,
        qkv_bias: false,
        o_bias: false,
        qk_norm_eps: Some(eps),
        scale: a.query_pre_attn_scalar.powf(-0.5) as f32,
    };
    let local_rope = Rope::from_config(hd, a.rope_local_base_freq, false, None)?;
    let global_rope = Rope::from_config(hd, a.rope_theta, false, a.rope_scaling.as_ref())?;
    let dims = (d, a.intermediate_size, eps);
    let mut layers = Vec::new();
    for i in 0..a.num_hidden_layers {
        let pre = format!("model.layers.{i}");
        let sliding = (i + 1) % p != 0;
        let rope = if sliding {
            local_rope.clone()
        } else {
            global_rope.clone()
        };
        let attn = |w: &mut WeightStore, path: &str| {
            GqaAttention::load_styled(
                w,
                path,
                shape.clone(),
                rope,
                QkNormStyle::GemmaAfterTranspose,
            )
        };
        layers.push(SandwichBlock::load(w, &pre, dims, attn)?);
    }
    // sanitize(): no `lm_head.weight` in the checkpoint means the head is tied.
    let lm_head = if w.contains("lm_head.weight") {
        Some(Linear::load(w, "lm_head", d, a.vocab_size, false)?)
    } else {
        None
    };
    Ok(Box::new(Model {
        embed_tokens: Embedding::load(w, "model.embed_tokens", a.vocab_size, d)?,
        layers,
        norm: RmsNorm::load(w, "model.norm", d, eps)?,
        lm_head,
        gelu: GeluApprox::new(spec.forks.compiled_activations),
        clip_residual: ClipResidual::new(spec.forks.compiled_activations),
        hidden_size: d,
        sliding_window: a.sliding_window,
        sliding_window_pattern: p,
        vocab_size: a.vocab_size,
    }))
}

impl Decoder for Model {
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// mlx-lm asks cache `p - 1` (global) and cache 0 (sliding); any cache of one kind has the
    /// same offset, so the first of each kind gives the same masks.
    fn layer_kind(&self, i: usize) -> LayerKind {
        if is_global(i, self.sliding_window_pattern) {
            LayerKind::Full
        } else {
            LayerKind::Sliding
        }
    }

    fn sliding_window(&self) -> Option<i32> {
        Some(self.sliding_window)
    }

    fn block(&mut self, i: usize, h: &Array, io: LayerIo<'_>) -> Result<Array> {
        let clip = &mut self.clip_residual;
        let residual = |x: &Array, y: &Array| clip.apply(x, y);
        self.layers[i].forward(h, io.attention()?, &mut self.gelu, residual)
    }
}

impl LanguageModel for Model {
    super::decoder_model!();

    fn embed(&self, inputs: &Array) -> Result<Array> {
        let h = self.embed_tokens.forward(inputs)?;
        // `mx.array(hidden_size**0.5, mx.bfloat16).astype(h.dtype)`: f64 -> f32 -> bf16 -> h.dtype.
        let scale = Array::from_f32((self.hidden_size as f64).powf(0.5) as f32)
            .as_dtype(Dtype::Bfloat16)?
            .as_dtype(h.dtype())?;
        Ok(h.multiply(&scale)?)
    }

    fn final_norm(&self, hidden: &Array) -> Result<Array> {
        self.norm.forward_one_plus(hidden)
    }

    fn lm_head(&self, hidden: &Array) -> Result<Array> {
        super::output_head(self.lm_head.as_ref(), &self.embed_tokens, hidden)
    }
}
