//! `minicpm`: mlx-lm's `models/minicpm.py` — llama's block (head_dim `hidden / heads`, SwiGLU)
//! with MiniCPM's scalings: the embedding times `scale_emb`, each residual branch times
//! `scale_depth / sqrt(num_hidden_layers)`, and the untied head's input divided by
//! `hidden_size / dim_model_base`. A checkpoint without `lm_head.weight` reuses the embedding
//! table as the (untied) head, as mlx-lm's `sanitize` does.

use super::activations::SwiGlu;
use super::decoder::{plain_attention, Decoder, LayerIo};
use super::llama::Block;
use super::rope::Rope;
use super::{LanguageModel, ModelSpec};
use crate::engine::error::Result;
use crate::engine::nn::{weak_scalar, Embedding, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::{ops, Array};
use serde::Deserialize;

/// config.json fields minicpm reads (mlx-lm's `ModelArgs`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    pub hidden_size: i32,
    pub dim_model_base: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub scale_depth: f64,
    pub scale_emb: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn default_theta() -> f64 {
    1_000_000.0
}

/// The output projection: mlx-lm's untied `lm_head(out / (hidden / dim_model_base))`, or the
/// tied `out @ embed_tokens.weight.T` (no division).
enum Head {
    Untied { lm_head: Linear, divisor: f64 },
    Tied(Array),
}

/// The MiniCPM decoder with its LM head.
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    head: Head,
    swiglu: SwiGlu,
    scale_emb: f64,
    residual_scale: f64,
    vocab_size: i32,
}

/// The embedding table used as an LM head (only possible unquantized, as in mlx-lm).
fn dense_table(w: &WeightStore, embed: &Embedding) -> Result<Array> {
    embed.dense_weight().cloned().ok_or_else(|| {
        w.err(
            "minicpm uses the embedding table as the LM head here, which works only for an \
             unquantized table; keep `model.embed_tokens` unquantized or ship `lm_head`"
                .into(),
        )
    })
}

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    let a: Args = spec.args()?;
    spec.check_heads(a.num_attention_heads, a.num_key_value_heads)?;
    if a.num_hidden_layers < 1 {
        return Err(spec.field_error("num_hidden_layers", "must be at least 1"));
    }
    if a.dim_model_base <= 0 {
        return Err(spec.field_error("dim_model_base", "must be positive"));
    }
    let (d, eps) = (a.hidden_size, a.rms_norm_eps);
    let head_dim = d / a.num_attention_heads;
    let shape = plain_attention(d, a.num_attention_heads, a.num_key_value_heads, head_dim);
    let rope = Rope::from_config(
        head_dim,
        a.rope_theta,
        a.rope_traditional,
        a.rope_scaling.as_ref(),
    )?;
    let mut layers = Vec::new();
    for i in 0..a.num_hidden_layers {
        layers.push(Block::load(
            w,
            &format!("model.layers.{i}"),
            shape.clone(),
            rope.clone(),
            a.intermediate_size,
            false,
            eps,
        )?);
    }
    let embed_tokens = Embedding::load(w, "model.embed_tokens", a.vocab_size, d)?;
    let head = if a.tie_word_embeddings {
        Head::Tied(dense_table(w, &embed_tokens)?)
    } else {
        let divisor = a.hidden_size as f64 / a.dim_model_base as f64;
        let lm_head = if w.contains("lm_head.weight") {
            Linear::load(w, "lm_head", d, a.vocab_size, false)?
        } else {
            Linear::dense(dense_table(w, &embed_tokens)?)
        };
        Head::Untied { lm_head, divisor }
    };
    Ok(Box::new(Model {
        embed_tokens,
        layers,
        norm: RmsNorm::load(w, "model.norm", d, eps)?,
        head,
        swiglu: SwiGlu::new(&spec.forks),
        scale_emb: a.scale_emb,
        residual_scale: a.scale_depth / (a.num_hidden_layers as f64).powf(0.5),
        vocab_size: a.vocab_size,
    }))
}

impl Decoder for Model {
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// `embed_tokens(ids) * scale_emb`.
    fn input(&self, inputs: &Array) -> Result<Array> {
        let h = self.embed_tokens.forward(inputs)?;
        Ok(h.multiply(weak_scalar(self.scale_emb, &h)?)?)
    }

    /// Each residual branch times `scale_depth / sqrt(num_hidden_layers)`.
    fn block(&mut self, i: usize, h: &Array, io: LayerIo<'_>) -> Result<Array> {
        let scale = self.residual_scale;
        let scaled = |r: Array| -> Result<Array> { Ok(r.multiply(weak_scalar(scale, &r)?)?) };
        self.layers[i].forward(h, io.attention()?, &mut self.swiglu, scaled)
    }

    fn output(&mut self, h: &Array) -> Result<Array> {
        let out = self.norm.forward(h)?;
        match &self.head {
            Head::Untied { lm_head, divisor } => {
                lm_head.forward(&out.divide(weak_scalar(*divisor, &out)?)?)
            }
            Head::Tied(table) => Ok(ops::matmul(&out, table.t())?),
        }
    }
}

impl LanguageModel for Model {
    super::decoder_model!();
}
