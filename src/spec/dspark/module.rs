//! The DSpark drafter network (DeepSpec's `Qwen3DSparkModel` / `Gemma4DSparkModel`):
//!
//! - **context features** `H = hidden_norm(fc(concat(taps)))` for each committed target row;
//! - **KV injection**: every backbone layer projects `H` to keys/values with its own `k_proj`/
//!   `v_proj` (k_norm and RoPE at the rows' absolute positions) and caches them; queries come
//!   from the block only;
//! - **the block** `[anchor, MASK x (γ-1)]` at absolute positions `p..p+γ-1` attends to all
//!   cached context and to itself with no mask (non-causal); its keys/values are dropped after
//!   the pass, so the cache only ever holds committed context;
//! - **base logits** `U = lm_head(norm(h))` for the whole block in one call (the target's head,
//!   or the checkpoint's own copy), over the reduced draft vocabulary when the checkpoint has
//!   one ([`super::vocab`]);
//! - **sequential heads** (Markov / RNN / gated) add a prefix-dependent bias step by step, and
//!   the **confidence head** `w [h_k; W1[x_{k-1}]] + b` scores each step (a logit).
//!
//! Each backbone layer reuses the engine's [`GqaAttention`] with a plain [`FullCache`]: context
//! rows are pushed through it once (only their keys/values are ever evaluated, MLX being lazy),
//! then the block runs over the same cache, which is trimmed back by γ.

use super::checkpoint::{DsparkConfig, LayerStyle, SeqHead};
use super::host_block::HostBlock;
use super::host_sampler::{host_f32, HeadWeights, HostDraft, HostSampler};
use super::vocab::DraftVocab;
use crate::engine::cache::{AttentionMask, CacheSnapshot, FullCache, KvCache};
use crate::engine::error::Result;
use crate::engine::kernels::{HostDecoder, HostForm, HostLayer, Numerics};
use crate::engine::models::activations::{geglu, softcap_graph, swiglu, CompiledOp};
use crate::engine::models::attention::{inv_sqrt_scale, AttentionShape, GqaAttention};
use crate::engine::models::mlp::GatedMlp;
use crate::engine::models::rope::Rope;
use crate::engine::models::{Caches, LanguageModel};
use crate::engine::nn::{weak_scalar, Embedding, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::{fast, ops, random, Array, Dtype};

/// Gemma4's value path: values get a scale-free RMSNorm (and no RoPE) before they are cached.
struct NormedValues {
    inner: FullCache,
    eps: f32,
}

impl KvCache for NormedValues {
    fn offset(&self) -> i32 {
        self.inner.offset()
    }
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let values = fast::rms_norm(values, None, self.eps)?;
        self.inner.update_and_fetch(keys, &values)
    }
    fn make_mask(&self, n: i32, window: Option<i32>, return_array: bool) -> Result<AttentionMask> {
        self.inner.make_mask(n, window, return_array)
    }
    fn trim(&mut self, n: i32) -> i32 {
        self.inner.trim(n)
    }
    fn is_trimmable(&self) -> bool {
        true
    }
    fn state(&self) -> Vec<Array> {
        self.inner.state()
    }
    fn snapshot(&self) -> CacheSnapshot {
        self.inner.snapshot()
    }
    fn restore(&mut self, snapshot: CacheSnapshot) -> Result<()> {
        self.inner.restore(snapshot)
    }
}

/// Gemma4's extra per-layer parts: norms around the MLP and the layer scalar.
struct Sandwich {
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    layer_scalar: Array,
}

struct Layer {
    attn: GqaAttention,
    mlp: GatedMlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    sandwich: Option<Sandwich>,
}

/// The sequential head's parameters (`markov_head.*`).
struct SequentialHead {
    kind: SeqHead,
    w1: Embedding,
    w2: Linear,
    /// RNN: `joint_proj` (2r+d → 3r); gated: `gate_proj` (d+r → r).
    proj: Option<Linear>,
}

/// What the backbone produced for one block.
pub struct BlockOut {
    /// Post-final-norm hidden states `[γ, d]` (what every head reads).
    pub hidden: Array,
    /// Base logits `U` `[γ, V]` (one LM-head call).
    pub base_logits: Array,
}

/// The result of sequential sampling over a block, all lazy (one evaluation reads it).
pub struct Sampled {
    /// Drafted tokens `[γ]` (uint32).
    pub tokens: Array,
    /// Corrected logits `z_k` `[γ, V]` (`[γ, Vd]` over a reduced draft vocabulary).
    pub logits: Array,
    /// Confidence logits `[γ]` (before the sigmoid), when the checkpoint has a confidence head.
    pub confidence: Option<Array>,
    /// The sampling distributions `softmax(z_k / T)` `[γ, V]` when sampling at T > 0.
    pub probs: Option<Array>,
}

/// The DSpark drafter network with its weights.
pub struct DsparkModule {
    config: DsparkConfig,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<Layer>,
    norm: RmsNorm,
    embed_tokens: Option<Embedding>,
    lm_head: Option<Linear>,
    seq: Option<SequentialHead>,
    confidence: Option<Linear>,
    act: CompiledOp,
    /// The reduced draft vocabulary, when the checkpoint has one.
    vocab: Option<DraftVocab>,
    /// The output head restricted to the draft ids `[d] → [Vd]` (built at the first block from
    /// the head in use, the target's or the checkpoint's own).
    draft_head: Option<Linear>,
    /// The sequential head's output map restricted to the draft ids `[r] → [Vd]`.
    draft_w2: Option<Linear>,
    /// Whether dense products take the host path (`--host-matvec`), for the restricted maps.
    host_matvec: bool,
    /// The heads' weights for greedy sampling on the host (made at the first greedy block;
    /// `None` inside when they are not dense f32).
    host_sampler: std::cell::OnceCell<Option<HostSampler>>,
}

/// Gemma4 checkpoints with K==V have no `v_proj`: values are the raw `k_proj` output, so the
/// key projection is loaded a second time as the value projection.
fn alias_value_projection(w: &mut WeightStore, prefix: &str) -> Result<()> {
    for part in ["weight", "scales", "biases"] {
        let k = format!("{prefix}.k_proj.{part}");
        if w.contains(&k) {
            let a = w.take_any(&k)?;
            w.insert(&format!("{prefix}.v_proj.{part}"), a.clone());
            w.insert(&k, a);
        }
    }
    Ok(())
}

impl DsparkModule {
    /// Builds the module from a validated config, taking its tensors from `w` (the caller runs
    /// `w.finish()` for strictness). `compiled` compiles the MLP activation as mlx-lm does.
    pub fn build(config: &DsparkConfig, w: &mut WeightStore, compiled: bool) -> Result<Self> {
        let c = config;
        let (d, v, r) = (c.hidden_size, c.vocab_size, c.markov_rank);
        w.discard_matching("rotary_emb.inv_freq");
        let gemma = c.layer_style == LayerStyle::Gemma4;
        let shape = AttentionShape {
            hidden: d,
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            qkv_bias: false,
            o_bias: false,
            qk_norm_eps: Some(c.rms_norm_eps),
            scale: c.attention_scale.unwrap_or(inv_sqrt_scale(c.head_dim)),
        };
        let rope = Rope::from_config(c.head_dim, c.rope_theta, false, c.rope_scaling.as_ref())?;
        let eps = c.rms_norm_eps;
        let mut layers = Vec::new();
        for i in 0..c.num_hidden_layers {
            let p = format!("layers.{i}");
            let norm =
                |w: &mut WeightStore, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), d, eps);
            if c.attention_k_eq_v {
                alias_value_projection(w, &format!("{p}.self_attn"))?;
            }
            let sandwich = if gemma {
                let name = format!("{p}.layer_scalar");
                let scalar = w.take_any(&name)?;
                if scalar.size() != 1 {
                    return Err(w.err(format!(
                        "tensor `{name}` has shape {:?}; a layer scalar holds one value",
                        scalar.shape()
                    )));
                }
                Some(Sandwich {
                    pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm")?,
                    post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
                    layer_scalar: scalar,
                })
            } else {
                None
            };
            layers.push(Layer {
                attn: GqaAttention::load(
                    w,
                    &format!("{p}.self_attn"),
                    shape.clone(),
                    rope.clone(),
                )?,
                mlp: GatedMlp::load(w, &format!("{p}.mlp"), d, c.intermediate_size, false)?,
                input_layernorm: norm(w, "input_layernorm")?,
                post_attention_layernorm: norm(w, "post_attention_layernorm")?,
                sandwich,
            });
        }
        let seq = match c.seq_head {
            SeqHead::None => None,
            kind => Some(SequentialHead {
                kind,
                w1: Embedding::load(w, "markov_head.markov_w1", v, r)?,
                w2: Linear::load(w, "markov_head.markov_w2", r, v, false)?,
                proj: match kind {
                    SeqHead::Rnn => Some(Linear::load(
                        w,
                        "markov_head.joint_proj",
                        2 * r + d,
                        3 * r,
                        true,
                    )?),
                    SeqHead::Gated => {
                        Some(Linear::load(w, "markov_head.gate_proj", d + r, r, true)?)
                    }
                    _ => None,
                },
            }),
        };
        let confidence = if c.confidence_head {
            Some(Linear::load(
                w,
                "confidence_head.proj",
                c.confidence_input(),
                1,
                true,
            )?)
        } else {
            None
        };
        let embed_tokens = if w.contains("embed_tokens.weight") {
            Some(Embedding::load(w, "embed_tokens", v, d)?)
        } else {
            None
        };
        let lm_head = if w.contains("lm_head.weight") {
            Some(Linear::load(w, "lm_head", d, v, false)?)
        } else {
            None
        };
        let vocab = DraftVocab::read(w, v)?;
        if vocab.is_some() && c.final_logit_softcapping.is_some() {
            return Err(w.err(
                "has a reduced draft vocabulary (`d2t`) for a target whose logits are soft-capped; mlxb restricts only heads without soft-capping".into(),
            ));
        }
        let draft_w2 = match (&vocab, &seq) {
            (Some(vocab), Some(s)) => {
                let dtype = s.w1.forward(&Array::from_slice(&[0u32], &[1]))?.dtype();
                Some(vocab.restrict(|x| s.w2.forward(x), r, dtype, w.host_matvec())?)
            }
            _ => None,
        };
        Ok(Self {
            config: config.clone(),
            fc: Linear::load(w, "fc", c.num_taps() * d, d, false)?,
            hidden_norm: RmsNorm::load(w, "hidden_norm", d, eps)?,
            layers,
            norm: RmsNorm::load(w, "norm", d, eps)?,
            embed_tokens,
            lm_head,
            seq,
            confidence,
            act: if gemma {
                geglu(compiled)
            } else {
                swiglu(compiled)
            },
            vocab,
            draft_head: None,
            draft_w2,
            host_matvec: w.host_matvec(),
            host_sampler: Default::default(),
        })
    }

    /// The config the module was built from.
    pub fn config(&self) -> &DsparkConfig {
        &self.config
    }

    /// Empty context caches, one per backbone layer.
    pub fn new_caches(&self) -> Caches {
        let eps = self.config.rms_norm_eps as f32;
        let gemma = self.config.layer_style == LayerStyle::Gemma4;
        self.layers
            .iter()
            .map(|_| -> Box<dyn KvCache> {
                if gemma {
                    Box::new(NormedValues {
                        inner: FullCache::new(),
                        eps,
                    })
                } else {
                    Box::new(FullCache::new())
                }
            })
            .collect()
    }

    /// Context features `hidden_norm(fc(taps))` of rows `[1, L, m*d]` → `[1, L, d]`.
    pub fn context_features(&self, taps: &Array) -> Result<Array> {
        self.hidden_norm.forward(&self.fc.forward(taps)?)
    }

    /// Appends context rows (features `[1, L, d]`, positions continuing the caches' offset) to
    /// every layer's cache as keys/values.
    pub fn extend_context(&self, features: &Array, caches: &mut Caches) -> Result<()> {
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            // Only the keys/values stored in the cache are used; the attention output over the
            // context rows is dropped unevaluated.
            layer
                .attn
                .forward(features, &AttentionMask::None, cache.as_mut())?;
        }
        Ok(())
    }

    /// Embeds block ids `[1, γ]` with the checkpoint's own table or the target's.
    fn embed(&self, target: &dyn LanguageModel, ids: &Array) -> Result<Array> {
        match &self.embed_tokens {
            None => target.embed(ids),
            Some(e) => {
                let h = e.forward(ids)?;
                if !self.config.scale_embeddings {
                    return Ok(h);
                }
                let scale = weak_scalar((self.config.hidden_size as f64).sqrt(), &h)?;
                Ok(h.multiply(&scale)?)
            }
        }
    }

    /// Base logits from post-norm hidden states, with the checkpoint's own head or the target's.
    fn head(&self, target: &dyn LanguageModel, h: &Array) -> Result<Array> {
        match &self.lm_head {
            None => target.lm_head(h),
            Some(head) => {
                let z = head.forward(h)?;
                match self.config.final_logit_softcapping {
                    Some(cap) => Ok(softcap_graph(&z, cap)?),
                    None => Ok(z),
                }
            }
        }
    }

    /// One backbone pass over the block `[anchor, MASK x (γ-1)]` at the caches' offset (the
    /// anchor's absolute position); the block's keys/values are trimmed off afterwards.
    pub fn block(
        &mut self,
        target: &dyn LanguageModel,
        anchor: u32,
        caches: &mut Caches,
    ) -> Result<BlockOut> {
        let g = self.config.block_size;
        let mut ids = vec![self.config.mask_token_id as i32; g];
        ids[0] = anchor as i32;
        let mut h = self.embed(target, &Array::from_slice(&ids, &[1, g as i32]))?;
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let x = layer.input_layernorm.forward(&h)?;
            let a = layer
                .attn
                .forward(&x, &AttentionMask::None, cache.as_mut())?;
            cache.trim(g as i32);
            h = match &layer.sandwich {
                None => {
                    let h = h.add(&a)?;
                    let m = layer
                        .mlp
                        .forward_op(&layer.post_attention_layernorm.forward(&h)?, &mut self.act)?;
                    h.add(&m)?
                }
                Some(s) => {
                    let h = h.add(&layer.post_attention_layernorm.forward(&a)?)?;
                    let m = layer
                        .mlp
                        .forward_op(&s.pre_feedforward_layernorm.forward(&h)?, &mut self.act)?;
                    h.add(&s.post_feedforward_layernorm.forward(&m)?)?
                        .multiply(&s.layer_scalar)?
                }
            };
        }
        let hidden = self.norm.forward(&h)?.squeeze_axes(&[0])?;
        let base_logits = match self.draft_head(target, hidden.dtype())? {
            Some(restricted) => restricted.forward(&hidden)?,
            None => self.head(target, &hidden)?,
        };
        Ok(BlockOut {
            hidden,
            base_logits,
        })
    }

    /// The output head restricted to the draft ids (made at the first call from the head in
    /// use, in `dtype`); `None` without a reduced draft vocabulary.
    fn draft_head(&mut self, target: &dyn LanguageModel, dtype: Dtype) -> Result<Option<&Linear>> {
        let Some(vocab) = &self.vocab else {
            return Ok(None);
        };
        if self.draft_head.is_none() {
            let d = self.config.hidden_size;
            let head = |x: &Array| self.head(target, x);
            let restricted = match &self.lm_head {
                // The drafter's own head: through the identity.
                Some(_) => vocab.restrict(head, d, dtype, self.host_matvec)?,
                None => Linear::dense_host(
                    vocab.target_head_rows(target, head, d, dtype)?,
                    self.host_matvec,
                ),
            };
            self.draft_head = Some(restricted);
        }
        Ok(self.draft_head.as_ref())
    }

    /// The embeddings of `ids` as f32 host rows; `None` when they are not f32.
    pub fn embedded_rows(
        &self,
        target: &dyn LanguageModel,
        ids: &[u32],
    ) -> Result<Option<Vec<f32>>> {
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let rows = self.embed(target, &Array::from_slice(&ids, &[1, ids.len() as i32]))?;
        host_f32(&rows)
    }

    /// The drafter on the host kernels ([`HostBlock`]) for greedy rounds: `None` unless it is a
    /// Qwen3-style drafter with f32 weights and a head of its own or over a reduced draft
    /// vocabulary (the target's whole head stays on MLX).
    pub fn host_block(&mut self, target: &dyn LanguageModel) -> Result<Option<HostBlock>> {
        let form = HostForm::Fast;
        if self.config.layer_style != LayerStyle::Qwen3
            || self.config.final_logit_softcapping.is_some()
        {
            return Ok(None);
        }
        // The checkpoint's weights are read as they are (bfloat16 where they are bfloat16
        // values); rows taken from the target's head, which the checkpoint does not fix, are
        // read as bfloat16, half the bytes of the round's largest product.
        let from_target = self.lm_head.is_none();
        let head = match self.draft_head(target, Dtype::Float32)? {
            Some(restricted) => restricted.host_proj(form)?,
            None => match &self.lm_head {
                Some(own) => own.host_proj(form)?,
                None => None,
            },
        };
        let (Some(head), Some(fc), Some((hidden_norm, eps)), Some((final_norm, _))) = (
            head,
            self.fc.host_proj(form)?,
            self.hidden_norm.host_weight(form)?,
            self.norm.host_weight(form)?,
        ) else {
            return Ok(None);
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        let mut shape = None;
        for l in &self.layers {
            let (Some(attn), Some(mlp), Some((input_norm, _)), Some((post_norm, _))) = (
                l.attn.host_parts(form)?,
                l.mlp.host_parts(form)?,
                l.input_layernorm.host_weight(form)?,
                l.post_attention_layernorm.host_weight(form)?,
            ) else {
                return Ok(None);
            };
            shape = Some((attn.heads, attn.rope));
            layers.push(HostLayer {
                input_norm,
                post_norm,
                attn: attn.proj.map(|p| p.in_any_order(false)),
                mlp: mlp.map(|p| p.in_any_order(false)),
                qk_norm: attn.qk_norm,
            });
        }
        let Some((heads, rope)) = shape else {
            return Ok(None);
        };
        let Some(mask_row) = self.embedded_rows(target, &[self.config.mask_token_id as u32])?
        else {
            return Ok(None);
        };
        let decoder = HostDecoder {
            layers,
            // Never read: the block enters as rows.
            embed: head.clone(),
            head: Some(head.in_any_order(from_target)),
            final_norm,
            eps,
            heads,
            numerics: Numerics::Fast(rope.host()?),
        };
        Ok(HostBlock::new(
            decoder,
            fc.in_any_order(false),
            hidden_norm,
            mask_row,
        ))
    }

    /// Samples the block left to right: `z_k = U_k + bias_k(prefix)`, `x_k = argmax z_k` (or a
    /// draw from `softmax(z_k / temp)` when `temp > 0`), then the confidence logit of step k
    /// from `[h_k; W1[x_{k-1}]]`. Everything stays on the device.
    pub fn sample(&self, out: &BlockOut, anchor: u32, temp: f64) -> Result<Sampled> {
        let g = self.config.block_size as i32;
        let mut prev = Array::from_slice(&[anchor], &[1]);
        let mut state: Option<Array> = None;
        let (mut tokens, mut logits, mut confs, mut probs) = (vec![], vec![], vec![], vec![]);
        for k in 0..g {
            let h = out.hidden.index(k..k + 1);
            let u = out.base_logits.index(k..k + 1);
            let e = self.seq.as_ref().map(|s| s.w1.forward(&prev)).transpose()?;
            let z = match (&self.seq, &e) {
                (Some(s), Some(e)) => u.add(&s.bias(
                    &h,
                    e,
                    &mut state,
                    self.config.markov_rank,
                    self.draft_w2.as_ref(),
                )?)?,
                _ => u,
            };
            if let Some(c) = &self.confidence {
                let input = match (&e, self.config.confidence_head_with_markov) {
                    (Some(e), true) => ops::concatenate(&[h.clone(), e.as_dtype(h.dtype())?], -1)?,
                    _ => h.clone(),
                };
                confs.push(c.forward(&input)?.reshape(&[1])?);
            }
            let x = if temp > 0.0 {
                let scaled = z
                    .as_dtype(Dtype::Float32)?
                    .multiply(Array::from_f32((1.0 / temp) as f32))?;
                let p = ops::softmax_axis(&scaled, -1, true)?;
                probs.push(match &self.vocab {
                    Some(vocab) => vocab.to_target_probs(&p, self.config.vocab_size)?,
                    None => p,
                });
                random::categorical(&scaled, -1, None, None)?
            } else {
                argmax_axis(&z, -1, false)?
            };
            let x = match &self.vocab {
                Some(vocab) => vocab.to_target(&x)?,
                None => x,
            };
            tokens.push(x.clone());
            logits.push(z);
            prev = x;
        }
        Ok(Sampled {
            tokens: ops::concatenate(&tokens, 0)?,
            logits: ops::concatenate(&logits, 0)?,
            confidence: (!confs.is_empty())
                .then(|| ops::concatenate(&confs, 0))
                .transpose()?,
            probs: (!probs.is_empty())
                .then(|| ops::concatenate(&probs, 0))
                .transpose()?,
        })
    }

    /// [`Self::sample`] at temperature 0 on the host ([`HostSampler`]): the drafted target ids
    /// and confidence logits from one read of the block. `None` where the heads are not dense
    /// f32 (the caller samples on MLX).
    pub fn sample_greedy_on_host(&self, out: &BlockOut, anchor: u32) -> Result<Option<HostDraft>> {
        match self.host_sampler()? {
            Some(s) => Ok(Some(s.sample(&out.hidden, &out.base_logits, anchor)?)),
            None => Ok(None),
        }
    }

    /// The greedy host sampler (made at the first call); `None` where the heads are not dense
    /// f32.
    pub fn host_sampler(&self) -> Result<Option<&HostSampler>> {
        if let Some(s) = self.host_sampler.get() {
            return Ok(s.as_ref());
        }
        let s = match self.head_weights() {
            Some(w) => HostSampler::new(w)?,
            None => None,
        };
        Ok(self.host_sampler.get_or_init(|| s).as_ref())
    }

    /// The weights the sequential and confidence heads read, over the draft ids; `None` when
    /// one of them is not a dense layer (quantized or split over ranks).
    fn head_weights(&self) -> Option<HeadWeights<'_>> {
        // A layer that is there must be dense: `Some(None)` marks one that is not.
        fn dense(l: Option<&Linear>) -> Option<Option<(&Array, Option<&Array>)>> {
            l.map(Linear::dense_parts)
        }
        let seq = self.seq.as_ref();
        let w2 = dense(self.draft_w2.as_ref().or(seq.map(|s| &s.w2)));
        let w1 = seq.map(|s| s.w1.dense_weight());
        let proj = dense(seq.and_then(|s| s.proj.as_ref()));
        let confidence = dense(self.confidence.as_ref());
        if [
            w2.map(|p| p.is_some()),
            w1.map(|p| p.is_some()),
            proj.map(|p| p.is_some()),
            confidence.map(|p| p.is_some()),
        ]
        .contains(&Some(false))
        {
            return None;
        }
        Some(HeadWeights {
            kind: seq.map_or(SeqHead::None, |s| s.kind),
            w1: w1.flatten(),
            w2: w2.flatten().map(|(w, _)| w),
            proj: proj.flatten(),
            confidence: confidence.flatten(),
            confidence_with_markov: self.config.confidence_head_with_markov,
            target_ids: self.vocab.as_ref().map(|v| v.target_ids()),
        })
    }
}

impl SequentialHead {
    /// The bias `[1, V]` for one step from the post-norm hidden `h` `[1, d]` and the previous
    /// token's Markov embedding `e = W1[x_{k-1}]` `[1, r]`; `state` is the RNN's `s_{k-1}`
    /// (`None` = `s_0 = 0`). With `draft_w2` (`W2` restricted to a reduced draft vocabulary)
    /// the bias covers the draft ids only.
    fn bias(
        &self,
        h: &Array,
        e: &Array,
        state: &mut Option<Array>,
        r: i32,
        draft_w2: Option<&Linear>,
    ) -> Result<Array> {
        let dtype = e.dtype();
        let h = h.as_dtype(dtype)?;
        let inner = match (self.kind, &self.proj) {
            (SeqHead::Rnn, Some(joint)) => {
                let s = match state.take() {
                    Some(s) => s,
                    None => ops::zeros_dtype(&[1, r], dtype)?,
                };
                let z = ops::concatenate(&[s.clone(), e.clone(), h], -1)?;
                let parts = joint.forward(&z)?.split_equal(3, -1)?;
                let (gate, cand, out) = (ops::sigmoid(&parts[0])?, &parts[1], &parts[2]);
                let one = weak_scalar(1.0, &gate)?;
                let next = gate
                    .multiply(&s)?
                    .add(one.subtract(&gate)?.multiply(ops::tanh(cand)?)?)?;
                *state = Some(next);
                ops::tanh(out)?
            }
            (SeqHead::Gated, Some(gate)) => {
                let g = gate.forward(&ops::concatenate(&[h, e.clone()], -1)?)?;
                ops::sigmoid(&g)?.multiply(e)?
            }
            _ => e.clone(),
        };
        draft_w2.unwrap_or(&self.w2).forward(&inner)
    }
}
