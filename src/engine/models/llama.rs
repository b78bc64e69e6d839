//! `llama` (and `mistral`, which mlx-lm maps onto it): mlx-lm's `models/llama.py`.

use super::activations::SwiGlu;
use super::attention::{AttentionShape, GqaAttention};
use super::decoder::{plain_attention, Decoder, LayerIo, LayerKind, PreNormLayer};
use super::host_step::{HostHead, HostStep};
use super::mlp::GatedMlp;
use super::pipeline::Stage;
use super::rope::Rope;
use super::{Caches, ForwardOpts, ForwardOut, LanguageModel, ModelSpec};
use crate::engine::cache::{AttentionMask, KvCache};
use crate::engine::cache_attention::exact_attention_matches_mlx;
use crate::engine::error::Result;
use crate::engine::kernels::{
    Bf16Numerics, HostDecoder, HostForm, HostLayer, Numerics, ProjWeight, MAX_M,
};
use crate::engine::nn::{Embedding, Linear, RmsNorm};
use crate::engine::shard::{ShardPlan, Sharding};
use crate::engine::weights::WeightStore;
use mlx_rs::{Array, Dtype};
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

/// llama's decoder layer, which qwen2, qwen3 and minicpm share: `h = x + attn(norm(x))`, then
/// `h + mlp(norm(h))` with a SwiGLU MLP.
pub(super) struct Block {
    attn: GqaAttention,
    mlp: GatedMlp,
    norms: PreNormLayer,
}

impl Block {
    /// Loads `{prefix}.self_attn`, `{prefix}.mlp` and the layer's two norms.
    pub(super) fn load(
        w: &mut WeightStore,
        prefix: &str,
        shape: AttentionShape,
        rope: Rope,
        intermediate: i32,
        mlp_bias: bool,
        eps: f64,
    ) -> Result<Self> {
        let d = shape.hidden;
        Ok(Self {
            attn: GqaAttention::load(w, &format!("{prefix}.self_attn"), shape, rope)?,
            mlp: GatedMlp::load(w, &format!("{prefix}.mlp"), d, intermediate, mlp_bias)?,
            norms: PreNormLayer::load(w, prefix, d, eps)?,
        })
    }

    /// Runs the layer; `branch` maps each residual branch's output before it is added
    /// (`Ok` for plain llama, minicpm's depth scaling).
    pub(super) fn forward(
        &self,
        h: &Array,
        (mask, cache): (&AttentionMask, &mut dyn KvCache),
        swiglu: &mut SwiGlu,
        branch: impl Fn(Array) -> Result<Array>,
    ) -> Result<Array> {
        self.norms.forward(
            h,
            |x| branch(self.attn.forward(x, mask, cache)?),
            |x| branch(self.mlp.forward_swiglu(x, swiglu)?),
        )
    }
}

/// The llama decoder with its LM head (also qwen2's and qwen3's).
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    /// Per layer: whether it is a sliding-window layer (empty when none is).
    sliding: Vec<bool>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    swiglu: SwiGlu,
    sliding_window: Option<i32>,
    vocab_size: i32,
    /// The host decode step (`--perf-kernel on` or `--host-step on`); `None` where the
    /// architecture never has one.
    host_step: Option<HostStep>,
    /// Whether that step is the L1 one, in MLX's order (`--host-step on` without
    /// `--perf-kernel`).
    exact_step: bool,
    /// This rank's place in a pipeline-parallel job (its `layers` are its own run of them).
    pipeline: Option<Stage>,
}

/// The config.json sizes of a llama-style decoder, under the names llama, qwen2 and qwen3
/// share (each architecture's `Args` has already checked they are there).
#[derive(Debug, Clone, Deserialize)]
pub(super) struct Sizes {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub vocab_size: i32,
    pub rms_norm_eps: f64,
}

/// What a llama-style decoder is made of: every layer is [`Block`] with the same attention
/// shape and RoPE, attending over a `KVCache` (qwen2 and qwen3 build theirs from this).
pub(super) struct DecoderConfig {
    pub sizes: Sizes,
    pub tie_word_embeddings: bool,
    pub attention: AttentionShape,
    pub rope: Rope,
}

/// What llama itself adds to a [`DecoderConfig`].
#[derive(Default)]
struct LlamaParts {
    mlp_bias: bool,
    /// Per layer: whether it is a sliding-window layer (empty when none is).
    sliding: Vec<bool>,
    sliding_window: Option<i32>,
    host_step: bool,
}

/// Loads a qwen-style decoder; the caller has already applied its architecture's `sanitize`.
pub(super) fn build_decoder(
    spec: &ModelSpec,
    w: &mut WeightStore,
    c: DecoderConfig,
) -> Result<Box<dyn LanguageModel>> {
    let parts = LlamaParts {
        host_step: true,
        ..LlamaParts::default()
    };
    load(spec, w, c, parts)
}

/// Loads the decoder `c` describes, with llama's own `parts`.
fn load(
    spec: &ModelSpec,
    w: &mut WeightStore,
    c: DecoderConfig,
    parts: LlamaParts,
) -> Result<Box<dyn LanguageModel>> {
    if c.tie_word_embeddings {
        w.discard("lm_head.weight");
    }
    let s = &c.sizes;
    let (d, vocab, eps) = (s.hidden_size, s.vocab_size, s.rms_norm_eps);
    let (attention, intermediate) = split_over_ranks(spec, w, &c)?;
    // Under pipeline parallelism this rank builds its own run of layers only.
    let pipeline = w.pipeline();
    let own = match &pipeline {
        Some((layers, _)) => layers.start as i32..layers.end as i32,
        None => 0..s.num_hidden_layers,
    };
    let sliding = parts
        .sliding
        .get(own.start as usize..own.end as usize)
        .unwrap_or_default()
        .to_vec();
    let mut layers = Vec::new();
    for i in own {
        layers.push(Block::load(
            w,
            &format!("model.layers.{i}"),
            attention.clone(),
            c.rope.clone(),
            intermediate,
            parts.mlp_bias,
            eps,
        )?);
    }
    Ok(Box::new(Model {
        embed_tokens: Embedding::load(w, "model.embed_tokens", vocab, d)?,
        layers,
        sliding,
        norm: RmsNorm::load(w, "model.norm", d, eps)?,
        lm_head: if c.tie_word_embeddings {
            None
        } else {
            Some(Linear::load(w, "lm_head", d, vocab, false)?)
        },
        swiglu: SwiGlu::new(&spec.forks),
        sliding_window: parts.sliding_window,
        vocab_size: vocab,
        // Under `--perf-kernel on` (tier L3), or in MLX's order under `--host-step on` (L1). A
        // pipeline stage has no whole model for it to run.
        host_step: (parts.host_step && (w.host_kernel() || w.host_step()) && pipeline.is_none())
            .then(HostStep::default),
        exact_step: !w.host_kernel() && w.host_step(),
        pipeline: pipeline.map(|(_, group)| Stage::new(group)),
    }))
}

/// mlx-lm's `Model.shard` for llama, qwen2 and qwen3: q/k/v and gate/up split by outputs,
/// o and down by inputs (summed over the ranks); embeddings, norms and the head whole.
pub(super) const TENSOR_PARALLEL: &ShardPlan = &[
    (".self_attn.q_proj", Sharding::Outputs),
    (".self_attn.k_proj", Sharding::Outputs),
    (".self_attn.v_proj", Sharding::Outputs),
    (".self_attn.o_proj", Sharding::Inputs),
    (".mlp.gate_proj", Sharding::Outputs),
    (".mlp.up_proj", Sharding::Outputs),
    (".mlp.down_proj", Sharding::Inputs),
];

/// Each layer's attention shape and MLP width on this rank: the whole model's, or under tensor
/// parallelism its share of the heads and of the MLP (mlx-lm's `n_heads //= N`), refused with
/// the config field at fault where they do not divide.
fn split_over_ranks(
    spec: &ModelSpec,
    w: &WeightStore,
    c: &DecoderConfig,
) -> Result<(AttentionShape, i32)> {
    let ranks = w.tensor_ranks() as i32;
    if ranks == 1 {
        return Ok((c.attention.clone(), c.sizes.intermediate_size));
    }
    let a = &c.attention;
    let fields = [
        ("num_attention_heads", a.n_heads),
        ("num_key_value_heads", a.n_kv_heads),
        ("intermediate_size", c.sizes.intermediate_size),
    ];
    if let Some((field, n)) = fields.iter().find(|(_, n)| n % ranks != 0) {
        return Err(spec.field_error(
            field,
            &format!("is {n}, which does not split over {ranks} ranks; run this model on a number of ranks that divides it"),
        ));
    }
    let attention = AttentionShape {
        n_heads: a.n_heads / ranks,
        n_kv_heads: a.n_kv_heads / ranks,
        ..a.clone()
    };
    Ok((attention, c.sizes.intermediate_size / ranks))
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
    let (d, hd) = (a.hidden_size, head_dim);
    let config = DecoderConfig {
        sizes: spec.args()?,
        tie_word_embeddings: a.tie_word_embeddings,
        attention: AttentionShape {
            qkv_bias: a.attention_bias,
            o_bias: a.attention_bias,
            ..plain_attention(d, a.num_attention_heads, n_kv, hd)
        },
        rope: Rope::from_config(
            hd,
            a.rope_theta,
            a.rope_traditional,
            a.rope_scaling.as_ref(),
        )?,
    };
    let parts = LlamaParts {
        mlp_bias: a.mlp_bias,
        sliding: layer_types
            .iter()
            .map(|t| t == "sliding_attention")
            .collect(),
        sliding_window: a.sliding_window,
        host_step: true,
    };
    load(spec, w, config, parts)
}

impl Model {
    /// The L1 host step, where this model has one and the host may run now (not inside
    /// [`crate::engine::kernels::mlx_only`]).
    fn exact_host_step(&self) -> Option<&HostStep> {
        self.host_step
            .as_ref()
            .filter(|_| self.exact_step && crate::engine::kernels::host_allowed())
    }

    /// The whole model as a host decode step of `form`, when every layer is the plain
    /// full-attention llama block with weights the step takes: for `--perf-kernel on` some of
    /// them quantized (a dense model keeps its L1 path) with f32 norms, for `--host-step on` all
    /// of them dense, f32 or all bfloat16, with every part matching MLX (its rope table covering
    /// `positions`).
    fn host_decoder(&self, form: HostForm, positions: usize) -> Result<Option<HostDecoder>> {
        if self.sliding.iter().any(|&s| s) {
            return Ok(None);
        }
        let Some(embed) = self.embed_tokens.host_proj(form)? else {
            return Ok(None);
        };
        let head = match &self.lm_head {
            None => None,
            Some(h) => match h.host_proj(form)? {
                Some(h) => Some(h),
                None => return Ok(None),
            },
        };
        let Some((final_norm, eps)) = self.norm.host_weight(form)? else {
            return Ok(None);
        };
        // The L1 step computes in the embedding's dtype; every weight must share it.
        let dtype = self.embed_tokens.dtype();
        let mut uniform = self.norm.dtype() == dtype;
        let mut layers = Vec::with_capacity(self.layers.len());
        let mut shape = None;
        for l in &self.layers {
            let (Some(attn), Some(mlp), Some(norms)) = (
                l.attn.host_parts(form)?,
                l.mlp.host_parts(form)?,
                l.norms.host_norms(form)?,
            ) else {
                return Ok(None);
            };
            if attn.qk_norm.is_some() {
                // Llama's blocks have none; the step's single epsilon may not be theirs.
                return Ok(None);
            }
            shape = Some((attn.heads, attn.rope));
            uniform &= norms.dtype == dtype;
            layers.push(HostLayer {
                input_norm: norms.input,
                post_norm: norms.post,
                attn: attn.proj,
                mlp,
                qk_norm: None,
            });
        }
        let Some((heads, rope)) = shape else {
            return Ok(None);
        };
        let quantized = layers
            .iter()
            .flat_map(|l| l.attn.iter().chain(&l.mlp))
            .chain([&embed])
            .chain(&head)
            .any(|p| p.weight().quantized());
        uniform &= layers
            .iter()
            .flat_map(|l| l.attn.iter().chain(&l.mlp))
            .chain([&embed])
            .chain(&head)
            .all(|p| match p.weight() {
                ProjWeight::Exact(w) => w.dtype() == dtype,
                _ => true,
            });
        let numerics = match form {
            HostForm::Fast if quantized => Numerics::Fast(rope.host()?),
            HostForm::Exact if uniform && exact_attention_matches_mlx(heads, 1, dtype)? => {
                let Some(table) = rope.host_table(heads.head_dim, positions, dtype)? else {
                    return Ok(None);
                };
                match dtype {
                    Dtype::Float32 if self.swiglu.host_exact()? => Numerics::Mlx(table),
                    Dtype::Bfloat16 => match self.swiglu.host_exact_bf16()? {
                        Some(silu) => Numerics::MlxBf16(Bf16Numerics { rope: table, silu }),
                        None => return Ok(None),
                    },
                    _ => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        Ok(Some(HostDecoder {
            layers,
            embed,
            head,
            final_norm,
            eps,
            heads,
            numerics,
        }))
    }
}

impl Decoder for Model {
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    fn layer_kind(&self, i: usize) -> LayerKind {
        match self.sliding.get(i) {
            Some(true) => LayerKind::Sliding,
            _ => LayerKind::Full,
        }
    }

    fn sliding_window(&self) -> Option<i32> {
        self.sliding_window
    }

    /// The host decode step (`--perf-kernel on`) when the model and the caches qualify.
    fn shortcut(
        &mut self,
        inputs: &Array,
        caches: &mut Caches,
        opts: &ForwardOpts,
    ) -> Result<Option<ForwardOut>> {
        let Some(host_step) = &self.host_step else {
            return Ok(None);
        };
        let form = if self.exact_step {
            // Only blocks it may take, where the L1 host kernels may run (the step is built,
            // and its parts checked against MLX, at the first such call, not in a long prefill).
            let block = inputs.shape().last().copied().unwrap_or(0) as usize;
            if block > MAX_M || !crate::engine::kernels::host_allowed() {
                return Ok(None);
            }
            HostForm::Exact
        } else {
            HostForm::Fast
        };
        let build = |positions| self.host_decoder(form, positions);
        let Some(out) = host_step.run(build, inputs, caches, opts)? else {
            return Ok(None);
        };
        let logits = match out.head {
            HostHead::Logits(logits) => logits,
            HostHead::Hidden(h) => self.lm_head(&self.final_norm(&h)?)?,
        };
        Ok(Some(ForwardOut {
            logits,
            taps: out.taps,
        }))
    }

    fn input(&self, inputs: &Array) -> Result<Array> {
        let h = self.embed(inputs)?;
        match &self.pipeline {
            Some(stage) => stage.receive(h),
            None => Ok(h),
        }
    }

    fn block(&mut self, i: usize, h: &Array, io: LayerIo<'_>) -> Result<Array> {
        self.layers[i].forward(h, io.attention()?, &mut self.swiglu, Ok)
    }

    fn output(&mut self, h: &Array) -> Result<Array> {
        match &self.pipeline {
            Some(stage) => self.lm_head(&self.final_norm(&stage.finish(h.clone())?)?),
            None => self.lm_head(&self.final_norm(h)?),
        }
    }
}

impl LanguageModel for Model {
    super::decoder_model!();

    fn prepare_host_step(&mut self) -> Result<()> {
        match self.exact_host_step() {
            Some(step) => step.prepare(|positions| self.host_decoder(HostForm::Exact, positions)),
            None => Ok(()),
        }
    }

    fn prepare_verify_blocks(&mut self, max_block: usize) -> Result<()> {
        self.prepare_host_step()?;
        match self.exact_host_step() {
            Some(step) => step.prepare_blocks(max_block),
            None => Ok(()),
        }
    }

    super::llama_layout_accessors!();
}
