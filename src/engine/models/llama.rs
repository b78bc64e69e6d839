//! `llama` (and `mistral`, which mlx-lm maps onto it): mlx-lm's `models/llama.py`.

use super::activations::SwiGlu;
use super::attention::{inv_sqrt_scale, AttentionShape, GqaAttention};
use super::decoder::PreNormLayer;
use super::host_step::{HostHead, HostStep};
use super::mlp::GatedMlp;
use super::rope::Rope;
use super::{Caches, ForwardOpts, ForwardOut, LanguageModel, ModelSpec};
use crate::engine::cache::{AttentionMask, FullCache, KvCache, RotatingCache};
use crate::engine::error::Result;
use crate::engine::kernels::{HostDecoder, HostLayer};
use crate::engine::nn::{Embedding, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::Array;
use serde::Deserialize;

/// config.json fields llama reads (mlx-lm's `ModelArgs`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub head_dim: Option<i32>,
    pub num_key_value_heads: Option<i32>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    pub layer_types: Option<Vec<String>>,
    pub sliding_window: Option<i32>,
}

fn default_theta() -> f64 {
    10000.0
}
fn yes() -> bool {
    true
}

struct Block {
    attn: GqaAttention,
    mlp: GatedMlp,
    norms: PreNormLayer,
    sliding: bool,
}

/// The llama decoder with its LM head.
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    swiglu: SwiGlu,
    sliding_window: Option<i32>,
    vocab_size: i32,
    host_step: HostStep,
}

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    let a: Args = spec.args()?;
    let n_kv = a.num_key_value_heads.unwrap_or(a.num_attention_heads);
    spec.check_heads(a.num_attention_heads, n_kv)?;
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    let layer_types = a
        .layer_types
        .clone()
        .unwrap_or_else(|| vec!["full_attention".into(); a.num_hidden_layers as usize]);
    spec.check_layer_types(
        &layer_types,
        a.num_hidden_layers,
        &["full_attention", "sliding_attention"],
    )?;
    if layer_types.iter().any(|t| t == "sliding_attention") && a.sliding_window.is_none() {
        return Err(spec.field_error(
            "sliding_window",
            "is required when layer_types has sliding_attention",
        ));
    }
    w.discard_matching("self_attn.rotary_emb.inv_freq");
    if a.tie_word_embeddings {
        w.discard("lm_head.weight");
    }
    let (d, hd) = (a.hidden_size, head_dim);
    let mut layers = Vec::new();
    for (i, t) in layer_types.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let shape = AttentionShape {
            hidden: d,
            n_heads: a.num_attention_heads,
            n_kv_heads: n_kv,
            head_dim: hd,
            qkv_bias: a.attention_bias,
            o_bias: a.attention_bias,
            qk_norm_eps: None,
            scale: inv_sqrt_scale(hd),
        };
        let rope = Rope::from_config(
            hd,
            a.rope_theta,
            a.rope_traditional,
            a.rope_scaling.as_ref(),
        )?;
        layers.push(Block {
            attn: GqaAttention::load(w, &format!("{p}.self_attn"), shape, rope)?,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), d, a.intermediate_size, a.mlp_bias)?,
            norms: PreNormLayer::load(w, &p, d, a.rms_norm_eps)?,
            sliding: t == "sliding_attention",
        });
    }
    Ok(Box::new(Model {
        embed_tokens: Embedding::load(w, "model.embed_tokens", a.vocab_size, d)?,
        layers,
        norm: RmsNorm::load(w, "model.norm", d, a.rms_norm_eps)?,
        lm_head: if a.tie_word_embeddings {
            None
        } else {
            Some(Linear::load(w, "lm_head", d, a.vocab_size, false)?)
        },
        swiglu: SwiGlu::new(&spec.forks),
        sliding_window: a.sliding_window,
        vocab_size: a.vocab_size,
        host_step: HostStep::default(),
    }))
}

impl Model {
    /// The whole model as a host decode step (`--perf-kernel on`), when every layer is the
    /// plain full-attention llama block with host-kernel weights and f32 norms.
    fn host_decoder(&self) -> Result<Option<HostDecoder>> {
        if self.layers.iter().any(|l| l.sliding) {
            return Ok(None);
        }
        let Some(embed) = self.embed_tokens.host_quant()? else {
            return Ok(None);
        };
        let head = match &self.lm_head {
            None => None,
            Some(h) => match h.host_quant()? {
                Some(h) => Some(h),
                None => return Ok(None),
            },
        };
        let Some((final_norm, eps)) = self.norm.host_weight()? else {
            return Ok(None);
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        let mut shape = None;
        for l in &self.layers {
            let (Some(attn), Some(mlp), Some(norms)) = (
                l.attn.host_parts()?,
                l.mlp.host_parts()?,
                l.norms.host_norms()?,
            ) else {
                return Ok(None);
            };
            shape = Some((attn.heads, attn.rope));
            layers.push(HostLayer {
                input_norm: norms.input,
                post_norm: norms.post,
                attn: attn.proj,
                mlp,
            });
        }
        let Some((heads, rope)) = shape else {
            return Ok(None);
        };
        Ok(Some(HostDecoder {
            layers,
            embed,
            head,
            final_norm,
            eps,
            heads,
            rope,
        }))
    }
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
        if let Some(out) = self
            .host_step
            .run(|| self.host_decoder(), inputs, caches, opts)?
        {
            let logits = match out.head {
                HostHead::Logits(logits) => logits,
                HostHead::Hidden(h) => self.lm_head(&self.final_norm(&h)?)?,
            };
            return Ok(ForwardOut {
                logits,
                taps: out.taps,
            });
        }
        let layers = &self.layers[..run];
        let mut h = self.embed(inputs)?;
        let n = h.shape()[1];
        // Every cache of one kind has the same offset, so any of them gives mlx-lm's mask.
        let fa_mask = match layers.iter().position(|l| !l.sliding) {
            Some(i) => caches[i].make_mask(n, None, false)?,
            None => AttentionMask::None,
        };
        let swa_mask = match layers.iter().position(|l| l.sliding) {
            Some(i) => Some(caches[i].make_mask(n, self.sliding_window, false)?),
            None => None,
        };
        let mut taps = Vec::new();
        for (i, (layer, cache)) in layers.iter().zip(caches.iter_mut()).enumerate() {
            let mask = match (&swa_mask, layer.sliding) {
                (Some(m), true) => m,
                _ => &fa_mask,
            };
            let swiglu = &mut self.swiglu;
            h = layer.norms.forward(
                &h,
                |x| layer.attn.forward(x, mask, cache.as_mut()),
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
            .map(|l| -> Box<dyn KvCache> {
                match (l.sliding, self.sliding_window) {
                    (true, Some(w)) => Box::new(RotatingCache::new(w, 0)),
                    _ => Box::new(FullCache::new()),
                }
            })
            .collect()
    }

    fn vocab_size(&self) -> i32 {
        self.vocab_size
    }
}
