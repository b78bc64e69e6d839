//! Pieces the decoders here share: the pre-norm residual layer, the LM head (untied or tied to
//! the embedding) and the plain llama attention shape.

use super::attention::{inv_sqrt_scale, AttentionShape};
use crate::engine::error::Result;
use crate::engine::kernels;
use crate::engine::nn::{Embedding, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::Array;

/// A llama-style layer's two pre-norm residual halves:
/// `h = x + mixer(input_layernorm(x))`, then `h + ffn(post_attention_layernorm(h))`.
pub struct PreNormLayer {
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    /// `--host-elementwise`: residual adds of f32 data already on the host stay there.
    host: bool,
}

impl PreNormLayer {
    /// Loads `{prefix}.input_layernorm` and `{prefix}.post_attention_layernorm`.
    pub fn load(w: &mut WeightStore, prefix: &str, dim: i32, eps: f64) -> Result<Self> {
        Ok(Self {
            input_layernorm: RmsNorm::load(w, &format!("{prefix}.input_layernorm"), dim, eps)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                &format!("{prefix}.post_attention_layernorm"),
                dim,
                eps,
            )?,
            host: w.host_elementwise(),
        })
    }

    /// The two norms on the host, for the host decode step (`None` unless both are f32).
    pub fn host_norms(&self) -> Result<Option<HostNorms>> {
        let (a, b) = (
            self.input_layernorm.host_weight()?,
            self.post_attention_layernorm.host_weight()?,
        );
        Ok(match (a, b) {
            (Some((input, eps)), Some((post, _))) => Some(HostNorms { input, post, eps }),
            _ => None,
        })
    }

    /// Runs the layer with its token mixer and feed-forward branches.
    pub fn forward(
        &self,
        x: &Array,
        mixer: impl FnOnce(&Array) -> Result<Array>,
        ffn: impl FnOnce(&Array) -> Result<Array>,
    ) -> Result<Array> {
        let h = self.residual(x, &mixer(&self.input_layernorm.forward(x)?)?)?;
        self.residual(&h, &ffn(&self.post_attention_layernorm.forward(&h)?)?)
    }

    /// `x + y`; on the host when both are same-shape f32 data already there (the host decode
    /// step's case), so the next norm and products need not wait for MLX.
    fn residual(&self, x: &Array, y: &Array) -> Result<Array> {
        if self.host && kernels::host_allowed() && x.shape() == y.shape() {
            if let (Some(a), Some(b)) = (kernels::ready_f32(x), kernels::ready_f32(y)) {
                let mut out = vec![0.0; a.len()];
                kernels::elementwise::add(a, b, &mut out);
                return Ok(Array::from_slice(&out, x.shape()));
            }
        }
        Ok(x.add(y)?)
    }
}

/// A [`PreNormLayer`]'s norm weights as host vectors.
pub struct HostNorms {
    /// `input_layernorm` weight.
    pub input: Vec<f32>,
    /// `post_attention_layernorm` weight.
    pub post: Vec<f32>,
    /// Their epsilon.
    pub eps: f32,
}

/// The output projection: `lm_head`, or the embedding's `as_linear` when tied.
pub struct LmHead(Option<Linear>);

impl LmHead {
    /// Loads `{path}` (`[vocab, dim]`) unless the head is tied.
    pub fn load(w: &mut WeightStore, tied: bool, path: &str, dim: i32, vocab: i32) -> Result<Self> {
        Ok(Self(if tied {
            None
        } else {
            Some(Linear::load(w, path, dim, vocab, false)?)
        }))
    }

    /// Logits for the final hidden states.
    pub fn forward(&self, embed: &Embedding, x: &Array) -> Result<Array> {
        match &self.0 {
            Some(head) => head.forward(x),
            None => embed.as_linear(x),
        }
    }
}

/// A llama block's attention shape: no biases, no q/k norms, scale `head_dim**-0.5`.
pub fn plain_attention(
    hidden: i32,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
) -> AttentionShape {
    AttentionShape {
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        qkv_bias: false,
        o_bias: false,
        qk_norm_eps: None,
        scale: inv_sqrt_scale(head_dim),
    }
}
