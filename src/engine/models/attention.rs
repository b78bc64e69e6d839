//! The grouped-query attention block shared by llama-family models (llama, qwen2, qwen3, ...):
//! q/k/v projections, optional per-head q/k RMSNorm (qwen3, gemma3), RoPE at the cache offset, cache
//! update, and SDPA exactly as mlx-lm's `base.scaled_dot_product_attention` calls it.

use super::rope::Rope;
use crate::engine::cache::{AttentionMask, KvCache};
use crate::engine::error::Result;
use crate::engine::nn::{Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::Array;

/// `mx.fast.scaled_dot_product_attention(q, k, v, scale, mask)`.
pub fn sdpa(q: &Array, k: &Array, v: &Array, scale: f32, mask: &AttentionMask) -> Result<Array> {
    let mask = match mask {
        AttentionMask::None => None,
        AttentionMask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        AttentionMask::Array(a) => Some(ScaledDotProductAttentionMask::Array(a)),
    };
    Ok(fast::scaled_dot_product_attention(
        q, k, v, scale, mask, None,
    )?)
}

/// `head_dim ** -0.5` folded in f64 like Python, then rounded to f32.
pub fn inv_sqrt_scale(head_dim: i32) -> f32 {
    (head_dim as f64).powf(-0.5) as f32
}

/// Shapes and options of one attention block.
#[derive(Debug, Clone)]
pub struct AttentionShape {
    /// Model width.
    pub hidden: i32,
    /// Query heads.
    pub n_heads: i32,
    /// Key/value heads.
    pub n_kv_heads: i32,
    /// Per-head width.
    pub head_dim: i32,
    /// Bias on q/k/v.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k with this eps (qwen3).
    pub qk_norm_eps: Option<f64>,
    /// Softmax scale.
    pub scale: f32,
}

/// Where the per-head q/k RMSNorm sits and which weight form it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNormStyle {
    /// qwen3: `nn.RMSNorm` on `[B, L, H, D]`, before the head transpose.
    Plain,
    /// gemma3: `rms_norm(x, 1.0 + w)` on `[B, H, L, D]`, after the head transpose.
    GemmaAfterTranspose,
}

/// A loaded grouped-query attention block.
pub struct GqaAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    norm_style: QkNormStyle,
    shape: AttentionShape,
    rope: Rope,
}

impl GqaAttention {
    /// Loads `{prefix}.{q,k,v,o}_proj` (+ `q_norm`/`k_norm`, applied the qwen3 way).
    pub fn load(
        w: &mut WeightStore,
        prefix: &str,
        shape: AttentionShape,
        rope: Rope,
    ) -> Result<Self> {
        Self::load_styled(w, prefix, shape, rope, QkNormStyle::Plain)
    }

    /// Like [`GqaAttention::load`], with the q/k norms applied in `norm_style`.
    pub fn load_styled(
        w: &mut WeightStore,
        prefix: &str,
        shape: AttentionShape,
        rope: Rope,
        norm_style: QkNormStyle,
    ) -> Result<Self> {
        let s = &shape;
        let (qd, kvd) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
        let norm = |w: &mut WeightStore, name: &str| -> Result<Option<RmsNorm>> {
            s.qk_norm_eps
                .map(|eps| RmsNorm::load(w, &format!("{prefix}.{name}"), s.head_dim, eps))
                .transpose()
        };
        Ok(Self {
            q_proj: Linear::load(w, &format!("{prefix}.q_proj"), s.hidden, qd, s.qkv_bias)?,
            k_proj: Linear::load(w, &format!("{prefix}.k_proj"), s.hidden, kvd, s.qkv_bias)?,
            v_proj: Linear::load(w, &format!("{prefix}.v_proj"), s.hidden, kvd, s.qkv_bias)?,
            o_proj: Linear::load(w, &format!("{prefix}.o_proj"), qd, s.hidden, s.o_bias)?,
            q_norm: norm(w, "q_norm")?,
            k_norm: norm(w, "k_norm")?,
            norm_style,
            shape,
            rope,
        })
    }

    fn heads(&self, x: &Array, n: i32, norm: &Option<RmsNorm>) -> Result<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let x = x.reshape(&[b, l, n, -1])?;
        Ok(match (norm, self.norm_style) {
            (Some(norm), QkNormStyle::Plain) => norm.forward(&x)?.transpose_axes(&[0, 2, 1, 3])?,
            (Some(norm), QkNormStyle::GemmaAfterTranspose) => {
                norm.forward_one_plus(&x.transpose_axes(&[0, 2, 1, 3])?)?
            }
            (None, _) => x.transpose_axes(&[0, 2, 1, 3])?,
        })
    }

    /// Attention over `x` ([B, L, D]) with the layer's cache and mask.
    pub fn forward(
        &self,
        x: &Array,
        mask: &AttentionMask,
        cache: &mut dyn KvCache,
    ) -> Result<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let q = self.heads(&self.q_proj.forward(x)?, self.shape.n_heads, &self.q_norm)?;
        let k = self.heads(
            &self.k_proj.forward(x)?,
            self.shape.n_kv_heads,
            &self.k_norm,
        )?;
        let v = self.heads(&self.v_proj.forward(x)?, self.shape.n_kv_heads, &None)?;
        let offset = cache.offset();
        let q = self.rope.apply(&q, offset)?;
        let k = self.rope.apply(&k, offset)?;
        let (k, v) = cache.update_and_fetch(&k, &v)?;
        let out = sdpa(&q, &k, &v, self.shape.scale, mask)?;
        self.o_proj
            .forward(&out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?)
    }
}
