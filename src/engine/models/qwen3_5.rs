//! `qwen3_5`: mlx-lm's `models/qwen3_5.py` (text part). A hybrid decoder: every
//! `full_attention_interval`-th layer is qwen3_next's gated full attention (per-head q/k RMSNorm,
//! partial RoPE, `o_proj(out * sigmoid(gate))`) over a `KVCache`; the others are gated delta-net
//! linear attention over a recurrent [`ArraysCache`]. The feed-forward is a SwiGLU MLP, or a
//! sparse MoE with a gated shared expert when `num_experts > 0` (also `qwen3_5_moe`).
//! The config may nest the text fields under `text_config`; tensors live under `language_model.`.

use super::activations::{swiglu, CompiledOp};
use super::attention::{AttentionShape, AttentionVariant, GqaAttention};
use super::decoder::{plain_attention, Decoder, LayerIo, LayerKind, LmHead, PreNormLayer};
use super::gated_delta::{DeltaOps, DeltaShape, GatedDeltaNet};
use super::mlp::GatedMlp;
use super::rope::Rope;
use super::switch::{check_experts, FeedForward, MoeShape, SparseMoe};
use super::{LanguageModel, ModelSpec};
use crate::engine::cache::{AttentionMask, KvCache};
use crate::engine::error::{EngineError, Result};
use crate::engine::nn::{weak_scalar, Embedding, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::{json, Value};

/// mlx-lm's `TextModelArgs` with its defaults (every field is optional there).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Args {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub max_position_embeddings: i32,
    pub linear_num_value_heads: i32,
    pub linear_num_key_heads: i32,
    pub linear_key_head_dim: i32,
    pub linear_value_head_dim: i32,
    pub linear_conv_kernel_dim: i32,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub head_dim: Option<i32>,
    pub full_attention_interval: i32,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub shared_expert_intermediate_size: i32,
    pub moe_intermediate_size: i32,
    pub norm_topk_prob: bool,
    /// Absent → mlx-lm's default dict; `null` → use the top-level rope fields.
    pub rope_parameters: Value,
    pub partial_rotary_factor: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Value>,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            rms_norm_eps: 1e-6,
            vocab_size: 151936,
            num_key_value_heads: 8,
            max_position_embeddings: 131072,
            linear_num_value_heads: 64,
            linear_num_key_heads: 16,
            linear_key_head_dim: 192,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
            tie_word_embeddings: false,
            attention_bias: false,
            head_dim: None,
            full_attention_interval: 4,
            num_experts: 0,
            num_experts_per_tok: 0,
            shared_expert_intermediate_size: 0,
            moe_intermediate_size: 0,
            norm_topk_prob: true,
            rope_parameters: json!({"type": "default", "mrope_section": [11, 11, 10],
                "rope_theta": 100000, "partial_rotary_factor": 0.25}),
            partial_rotary_factor: 0.25,
            rope_theta: 100000.0,
            rope_scaling: None,
        }
    }
}

impl Args {
    /// `TextModelArgs.__post_init__`: a non-empty `rope_parameters` overrides the rope fields.
    /// Returns (partial_rotary_factor, rope_theta, rope_scaling).
    fn rope(&self, spec: &ModelSpec) -> Result<(f64, f64, Option<Value>)> {
        match self.rope_parameters.as_object() {
            Some(p) if !p.is_empty() => {
                let get = |k: &str, default: f64| match p.get(k) {
                    None => Ok(default),
                    Some(v) => v.as_f64().ok_or_else(|| {
                        spec.field_error(&format!("rope_parameters.{k}"), "must be a number")
                    }),
                };
                Ok((
                    get("partial_rotary_factor", 0.25)?,
                    get("rope_theta", 100000.0)?,
                    Some(self.rope_parameters.clone()),
                ))
            }
            _ => Ok((
                self.partial_rotary_factor,
                self.rope_theta,
                self.rope_scaling.clone(),
            )),
        }
    }
}

/// The token mixer of one layer.
enum Mixer {
    Linear(GatedDeltaNet),
    Attention(GqaAttention),
}

struct Block {
    mixer: Mixer,
    ffn: FeedForward,
    norms: PreNormLayer,
}

/// The qwen3_5 text decoder with its LM head.
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: LmHead,
    swiglu: CompiledOp,
    delta: DeltaOps,
    vocab_size: i32,
}

const PREFIX: &str = "language_model";

/// `Model.sanitize`: drops vision tensors and moves the rest under `language_model.`.
fn rename_to_language_model(w: &mut WeightStore) {
    for name in w.names() {
        if name.starts_with("vision_tower") || name.starts_with("model.visual") {
            w.discard(&name);
            continue;
        }
        let new = if name.starts_with("model.language_model") {
            name.replace("model.language_model", "language_model.model")
        } else if name.starts_with("language_model.") {
            continue;
        } else {
            format!("{PREFIX}.{name}")
        };
        if let Ok(t) = w.take_any(&name) {
            w.insert(&new, t);
        }
    }
}

/// qwen3_5_moe's `sanitize`: splits fused `experts.gate_up_proj` into the switch layers.
fn split_gate_up(w: &mut WeightStore, layers: i32) -> Result<()> {
    for l in 0..layers {
        let prefix = format!("{PREFIX}.model.layers.{l}.mlp");
        let key = format!("{prefix}.experts.gate_up_proj");
        if !w.contains(&key) {
            continue;
        }
        let gate_up = w.take_any(&key)?;
        let mid = gate_up.shape()[gate_up.ndim() - 2] / 2;
        w.insert(
            &format!("{prefix}.switch_mlp.gate_proj.weight"),
            gate_up.index((Ellipsis, ..mid, ..)),
        );
        w.insert(
            &format!("{prefix}.switch_mlp.up_proj.weight"),
            gate_up.index((Ellipsis, mid.., ..)),
        );
        let down = w.take_any(&format!("{prefix}.experts.down_proj"))?;
        w.insert(&format!("{prefix}.switch_mlp.down_proj.weight"), down);
    }
    Ok(())
}

/// `TextModel.sanitize`: drops MTP tensors (and a tied head), moves HF-layout conv weights to
/// MLX layout and, for such unconverted checkpoints, stores the `1 + w` norm weights.
fn sanitize_text(w: &mut WeightStore, tie: bool) -> Result<()> {
    let names = w.names();
    let mut conv = Vec::new();
    for name in names.iter().filter(|n| n.contains("conv1d.weight")) {
        let t = w.take_any(name)?;
        if t.shape()[t.ndim() - 1] != 1 {
            conv.push(name.clone());
        }
        w.insert(name, t);
    }
    let unsanitized = !conv.is_empty();
    for name in names.iter().filter(|n| n.contains("mtp.")) {
        w.discard(name);
    }
    if tie {
        w.discard(&format!("{PREFIX}.lm_head.weight"));
    }
    for name in &conv {
        let t = w.take_any(name)?;
        w.insert(name, t.move_axis(2, 1)?);
    }
    if unsanitized {
        const NORMS: [&str; 5] = [
            ".input_layernorm.weight",
            ".post_attention_layernorm.weight",
            "model.norm.weight",
            ".q_norm.weight",
            ".k_norm.weight",
        ];
        for name in w.names() {
            if NORMS.iter().any(|s| name.ends_with(s)) {
                let t = w.take_any(&name)?;
                let t = if t.ndim() == 1 {
                    t.add(weak_scalar(1.0, &t)?)?
                } else {
                    t
                };
                w.insert(&name, t);
            }
        }
    }
    Ok(())
}

/// The text config: `text_config` when present, else the whole config (mlx-lm's `from_dict`).
fn text_args(spec: &ModelSpec) -> Result<Args> {
    match spec.config.get("text_config") {
        Some(tc) => serde_json::from_value(tc.clone()).map_err(|e| {
            EngineError::file(
                &spec.config_path,
                format!("`text_config`: {e}; fix config.json for this model_type"),
            )
        }),
        None => spec.args(),
    }
}

fn validate(spec: &ModelSpec, a: &Args) -> Result<()> {
    spec.check_heads(a.num_attention_heads, a.num_key_value_heads)?;
    let positive = [
        ("num_hidden_layers", a.num_hidden_layers),
        ("full_attention_interval", a.full_attention_interval),
        ("linear_num_key_heads", a.linear_num_key_heads),
        ("linear_num_value_heads", a.linear_num_value_heads),
    ];
    if let Some((f, v)) = positive.iter().find(|(_, v)| *v < 1) {
        return Err(spec.field_error(f, &format!("is {v}; it must be at least 1")));
    }
    if a.num_hidden_layers < a.full_attention_interval {
        return Err(spec.field_error(
            "num_hidden_layers",
            &format!(
                "is {} but must be at least full_attention_interval ({}): mlx-lm takes the attention mask from layer {}",
                a.num_hidden_layers,
                a.full_attention_interval,
                a.full_attention_interval - 1
            ),
        ));
    }
    if a.linear_num_value_heads % a.linear_num_key_heads != 0 {
        return Err(spec.field_error(
            "linear_num_value_heads",
            &format!(
                "is {}; it must be a multiple of linear_num_key_heads ({})",
                a.linear_num_value_heads, a.linear_num_key_heads
            ),
        ));
    }
    if a.linear_conv_kernel_dim < 2 {
        return Err(spec.field_error("linear_conv_kernel_dim", "must be at least 2"));
    }
    if a.num_experts > 0 {
        check_experts(
            spec,
            a.num_experts,
            a.num_experts_per_tok,
            "num_experts_per_tok",
        )?;
    }
    Ok(())
}

/// Builds the model; `split_gate_up` applies qwen3_5_moe's expert-tensor `sanitize` step.
pub(super) fn build_text(
    spec: &ModelSpec,
    w: &mut WeightStore,
    split_experts: bool,
) -> Result<Box<dyn LanguageModel>> {
    let a = text_args(spec)?;
    validate(spec, &a)?;
    rename_to_language_model(w);
    if split_experts {
        split_gate_up(w, a.num_hidden_layers)?;
    }
    sanitize_text(w, a.tie_word_embeddings)?;

    let (d, eps) = (a.hidden_size, a.rms_norm_eps);
    let head_dim = a.head_dim.unwrap_or(d / a.num_attention_heads);
    let (prf, theta, scaling) = a.rope(spec)?;
    let rope = Rope::from_config(
        (head_dim as f64 * prf) as i32,
        theta,
        false,
        scaling.as_ref(),
    )?;
    let shape = AttentionShape {
        qkv_bias: a.attention_bias,
        o_bias: a.attention_bias,
        qk_norm_eps: Some(eps),
        ..plain_attention(d, a.num_attention_heads, a.num_key_value_heads, head_dim)
    };
    let variant = AttentionVariant {
        output_gate: true,
        ..Default::default()
    };
    let delta = DeltaShape {
        hidden: d,
        v_heads: a.linear_num_value_heads,
        k_heads: a.linear_num_key_heads,
        k_dim: a.linear_key_head_dim,
        v_dim: a.linear_value_head_dim,
        conv_kernel: a.linear_conv_kernel_dim,
        eps,
    };
    let moe = MoeShape {
        hidden: d,
        experts: a.num_experts,
        top_k: a.num_experts_per_tok,
        expert_inter: a.moe_intermediate_size,
        norm_topk_prob: a.norm_topk_prob,
        shared_inter: Some(a.shared_expert_intermediate_size),
    };
    let mut layers = Vec::new();
    for i in 0..a.num_hidden_layers {
        let p = format!("{PREFIX}.model.layers.{i}");
        let mixer = if (i + 1) % a.full_attention_interval != 0 {
            Mixer::Linear(GatedDeltaNet::load(w, &format!("{p}.linear_attn"), delta)?)
        } else {
            let attn = GqaAttention::load_variant(
                w,
                &format!("{p}.self_attn"),
                shape.clone(),
                rope.clone(),
                variant,
            )?;
            Mixer::Attention(attn)
        };
        let mlp = format!("{p}.mlp");
        let ffn = if a.num_experts > 0 {
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
            mixer,
            ffn,
            norms: PreNormLayer::load(w, &p, d, eps)?,
        });
    }
    let compiled = spec.forks.compiled_activations;
    Ok(Box::new(Model {
        embed_tokens: Embedding::load(w, &format!("{PREFIX}.model.embed_tokens"), a.vocab_size, d)?,
        layers,
        norm: RmsNorm::load(w, &format!("{PREFIX}.model.norm"), d, eps)?,
        lm_head: LmHead::load(
            w,
            a.tie_word_embeddings,
            &format!("{PREFIX}.lm_head"),
            d,
            a.vocab_size,
        )?,
        swiglu: swiglu(compiled),
        delta: DeltaOps::new(compiled),
        vocab_size: a.vocab_size,
    }))
}

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    build_text(spec, w, false)
}

impl Block {
    fn forward(
        &self,
        h: &Array,
        mask: &AttentionMask,
        cache: &mut dyn KvCache,
        swiglu: &mut CompiledOp,
        delta: &mut DeltaOps,
    ) -> Result<Array> {
        let mixer = |x: &Array| match &self.mixer {
            Mixer::Attention(attn) => attn.forward(x, mask, cache),
            Mixer::Linear(net) => {
                let state = cache.as_arrays_mut().ok_or_else(|| {
                    EngineError::Runtime(
                        "a linear-attention layer was given a key/value cache".into(),
                    )
                })?;
                let padding = match mask {
                    AttentionMask::Array(m) => Some(m),
                    _ => None,
                };
                net.forward(x, state, padding, delta)
            }
        };
        self.norms
            .forward(h, mixer, |x| self.ffn.forward(x, swiglu))
    }
}

impl Decoder for Model {
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// Gated attention layers share the full-attention mask (mlx-lm takes it from the first
    /// one, layer `full_attention_interval - 1`); linear-attention layers take the padding
    /// mask of a batch (none for one sequence).
    fn layer_kind(&self, i: usize) -> LayerKind {
        match self.layers.get(i).map(|l| &l.mixer) {
            Some(Mixer::Linear(_)) => LayerKind::Recurrent,
            _ => LayerKind::Full,
        }
    }

    fn input(&self, inputs: &Array) -> Result<Array> {
        self.embed_tokens.forward(inputs)
    }

    fn block(&mut self, i: usize, h: &Array, io: LayerIo<'_>) -> Result<Array> {
        let (mask, cache) = io.attention()?;
        self.layers[i].forward(h, mask, cache, &mut self.swiglu, &mut self.delta)
    }

    fn output(&mut self, h: &Array) -> Result<Array> {
        self.lm_head
            .forward(&self.embed_tokens, &self.norm.forward(h)?)
    }
}

impl LanguageModel for Model {
    super::decoder_model!();
}
