//! `gemma4_text`: mlx-lm's `models/gemma4_text.py`. Per-layer types (`layer_types`, or every
//! `sliding_window_pattern`-th layer global) with their own head widths and RoPE (default on
//! sliding layers, partial "proportional" RoPE via a frequency array on global ones, rotated at
//! an `mx.array` offset); q/k RMSNorm and a scale-free v norm, attention scale 1; optionally
//! K == V on global layers; the last `num_kv_shared_layers` layers reuse the keys/values of the
//! last earlier layer of their type and keep no cache; sandwich norms, a dense GeGLU MLP
//! (double-wide on KV-shared layers) plus, in the MoE variant, a routed expert branch; per-layer
//! input embeddings (2B/4B models); a learned per-layer output scalar; and a soft-capped head.
//! The attention (`gemma4_text_attention`) and the routed expert branch (`gemma4_text_moe`)
//! are the files beside this one.

use super::activations::{geglu, gelu_approx, logit_softcap, CompiledOp};
use super::decoder::{self, Decoder, LayerIo, LayerKind, LmHead};
use super::gemma4_text_attention::{Attention, SharedKv};
use super::gemma4_text_moe::MoeBranch;
use super::mlp::GatedMlp;
use super::{Caches, ForwardOpts, ForwardOut, LanguageModel, ModelSpec};
use crate::engine::cache::{AttentionMask, KvCache};
use crate::engine::error::{EngineError, Result};
use crate::engine::nn::{weak_scalar, Embedding, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array};
use serde::Deserialize;
use serde_json::{json, Value};

pub use super::gemma4_text_attention::load_rope;

/// The `layer_types` name of global (full-attention) layers.
pub const FULL: &str = "full_attention";
/// The `layer_types` name of sliding-window layers.
pub const SLIDING: &str = "sliding_attention";

/// mlx-lm's `ModelArgs` for gemma4_text, with its defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub global_head_dim: Option<i32>,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub vocab_size_per_layer_input: i32,
    pub num_key_value_heads: i32,
    pub num_global_key_value_heads: Option<i32>,
    pub num_kv_shared_layers: i32,
    pub hidden_size_per_layer_input: Option<i32>,
    pub rope_traditional: bool,
    pub rope_parameters: Option<Value>,
    pub sliding_window: i32,
    pub sliding_window_pattern: i32,
    pub attention_k_eq_v: bool,
    pub final_logit_softcapping: Option<f64>,
    pub use_double_wide_mlp: bool,
    pub enable_moe_block: bool,
    pub num_experts: Option<i32>,
    pub top_k_experts: Option<i32>,
    pub moe_intermediate_size: Option<i32>,
    pub layer_types: Option<Vec<String>>,
    pub tie_word_embeddings: bool,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            hidden_size: 1536,
            num_hidden_layers: 35,
            intermediate_size: 6144,
            num_attention_heads: 8,
            head_dim: 256,
            global_head_dim: Some(512),
            rms_norm_eps: 1e-6,
            vocab_size: 262144,
            vocab_size_per_layer_input: 262144,
            num_key_value_heads: 1,
            num_global_key_value_heads: None,
            num_kv_shared_layers: 20,
            hidden_size_per_layer_input: Some(256),
            rope_traditional: false,
            rope_parameters: None,
            sliding_window: 512,
            sliding_window_pattern: 5,
            attention_k_eq_v: false,
            final_logit_softcapping: Some(30.0),
            use_double_wide_mlp: true,
            enable_moe_block: false,
            num_experts: None,
            top_k_experts: None,
            moe_intermediate_size: None,
            layer_types: None,
            tie_word_embeddings: true,
        }
    }
}

impl Args {
    /// `__post_init__`'s `layer_types`: the sliding pattern repeated when not given.
    pub fn layer_types(&self) -> Vec<String> {
        if let Some(t) = &self.layer_types {
            return t.clone();
        }
        let p = self.sliding_window_pattern.max(1) as usize;
        (0..self.num_hidden_layers.max(0) as usize)
            .map(|i| if i % p == p - 1 { FULL } else { SLIDING }.to_owned())
            .collect()
    }

    /// `__post_init__`'s default `rope_parameters`.
    pub fn rope_parameters(&self) -> Value {
        self.rope_parameters.clone().unwrap_or_else(|| {
            json!({
                FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
            })
        })
    }
}

/// Per-layer input gating (2B/4B models).
struct PerLayerGate {
    per_layer_input_gate: Linear,
    per_layer_projection: Linear,
    post_per_layer_input_norm: RmsNorm,
}

struct Block {
    attn: Attention,
    mlp: GatedMlp,
    moe: Option<MoeBranch>,
    per_layer: Option<PerLayerGate>,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    layer_scalar: Array,
    sliding: bool,
}

/// The model-level per-layer input embeddings.
struct PerLayerInputs {
    embed_tokens_per_layer: Embedding,
    per_layer_model_projection: Linear,
    per_layer_projection_norm: RmsNorm,
    width: i32,
}

/// Compiled functions shared by every layer.
struct Fns {
    geglu: CompiledOp,
    gelu_approx: CompiledOp,
    softcap: Option<CompiledOp>,
}

/// The gemma4 text decoder with its LM head.
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: LmHead,
    per_layer_inputs: Option<PerLayerInputs>,
    /// For each layer, the layer whose keys/values it uses (itself unless KV-shared).
    previous_kvs: Vec<usize>,
    fns: Fns,
    hidden_size: i32,
    sliding_window: i32,
    cached_layers: usize,
    vocab_size: i32,
}

fn validate(spec: &ModelSpec, a: &Args, types: &[String]) -> Result<usize> {
    if a.num_hidden_layers < 1 {
        return Err(spec.field_error("num_hidden_layers", "must be at least 1"));
    }
    if a.layer_types.is_none() && a.sliding_window_pattern < 1 {
        return Err(spec.field_error("sliding_window_pattern", "must be at least 1"));
    }
    spec.check_layer_types(types, a.num_hidden_layers, &[FULL, SLIDING])?;
    if a.sliding_window < 1 {
        return Err(spec.field_error("sliding_window", "must be at least 1"));
    }
    let n = a.num_hidden_layers;
    if a.num_kv_shared_layers < 0 || a.num_kv_shared_layers >= n {
        return Err(spec.field_error(
            "num_kv_shared_layers",
            &format!(
                "is {}; it must be between 0 and num_hidden_layers - 1 ({})",
                a.num_kv_shared_layers,
                n - 1
            ),
        ));
    }
    let m = (n - a.num_kv_shared_layers) as usize;
    if let Some(t) = types[m..].iter().find(|t| !types[..m].contains(t)) {
        return Err(spec.field_error(
            "num_kv_shared_layers",
            &format!("leaves no earlier \"{t}\" layer for the KV-shared \"{t}\" layers to reuse"),
        ));
    }
    spec.check_heads(a.num_attention_heads, a.num_key_value_heads)?;
    if let Some(g) = a.num_global_key_value_heads.filter(|_| a.attention_k_eq_v) {
        spec.check_heads(a.num_attention_heads, g).map_err(|_| {
            spec.field_error(
                "num_global_key_value_heads",
                &format!(
                    "is {g}; it must divide num_attention_heads ({})",
                    a.num_attention_heads
                ),
            )
        })?;
    }
    if a.enable_moe_block {
        let experts = a.num_experts.ok_or_else(|| {
            spec.field_error("num_experts", "is required when enable_moe_block is true")
        })?;
        let k = a.top_k_experts.ok_or_else(|| {
            spec.field_error("top_k_experts", "is required when enable_moe_block is true")
        })?;
        super::switch::check_experts(spec, experts, k, "top_k_experts")?;
        if a.moe_intermediate_size.is_none() {
            return Err(spec.field_error(
                "moe_intermediate_size",
                "is required when enable_moe_block is true",
            ));
        }
    }
    if let Some(cap) = a.final_logit_softcapping {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(spec.field_error(
                "final_logit_softcapping",
                "must be a positive number or null",
            ));
        }
    }
    Ok(m)
}

/// `Model.sanitize`: drops rotary buffers, clipping statistics and the K/V projections of
/// KV-shared layers; splits fused `experts.gate_up_proj` into the switch layers.
fn sanitize(w: &mut WeightStore, first_kv_shared: usize) -> Result<()> {
    const DROP: [&str; 5] = [
        "self_attn.rotary_emb",
        "input_max",
        "input_min",
        "output_max",
        "output_min",
    ];
    const SHARED_DROP: [&str; 3] = [
        ".self_attn.k_proj",
        ".self_attn.v_proj",
        ".self_attn.k_norm",
    ];
    for name in w.names() {
        let layer: Option<usize> = name
            .split("layers.")
            .nth(1)
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse().ok());
        let shared_kv = SHARED_DROP.iter().any(|s| name.contains(s))
            && layer.is_some_and(|l| l >= first_kv_shared);
        if DROP.iter().any(|s| name.contains(s)) || shared_kv {
            w.discard(&name);
        } else if let Some(base) = name.strip_suffix(".experts.gate_up_proj") {
            let v = w.take_any(&name)?;
            let mut parts = v.split_equal(2, -2)?;
            let (Some(up), Some(gate)) = (parts.pop(), parts.pop()) else {
                return Err(w.err(format!("`{name}` could not be split into gate and up")));
            };
            w.insert(
                &format!("{base}.experts.switch_glu.gate_proj.weight"),
                gate.contiguous()?,
            );
            w.insert(
                &format!("{base}.experts.switch_glu.up_proj.weight"),
                up.contiguous()?,
            );
        } else if let Some(base) = name.strip_suffix(".experts.down_proj") {
            let v = w.take_any(&name)?;
            w.insert(&format!("{base}.experts.switch_glu.down_proj.weight"), v);
        }
    }
    Ok(())
}

/// Builds the model from config.json and the checkpoint's tensors.
pub fn build(spec: &ModelSpec, w: &mut WeightStore) -> Result<Box<dyn LanguageModel>> {
    let a: Args = spec.args()?;
    let types = a.layer_types();
    let first_kv_shared = validate(spec, &a, &types)?;
    sanitize(w, first_kv_shared)?;
    let rope_params = a.rope_parameters();
    let (d, eps) = (a.hidden_size, a.rms_norm_eps);
    let n = a.num_hidden_layers as usize;
    let per_layer_width = a.hidden_size_per_layer_input.filter(|&v| v != 0);
    let mut layers = Vec::with_capacity(n);
    for (i, t) in types.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let has_kv = i < first_kv_shared;
        let attn = Attention::load(
            spec,
            w,
            &format!("{p}.self_attn"),
            &a,
            &rope_params,
            t,
            has_kv,
        )?;
        let double = a.use_double_wide_mlp && !has_kv && first_kv_shared > 0;
        let inter = a.intermediate_size * if double { 2 } else { 1 };
        let norm =
            |w: &mut WeightStore, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), d, eps);
        let moe = MoeBranch::load(w, &p, &a)?;
        let per_layer = per_layer_width
            .map(|pw| PerLayerGate::load(w, &p, d, pw, eps))
            .transpose()?;
        layers.push(Block {
            attn,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), d, inter, false)?,
            moe,
            per_layer,
            input_layernorm: norm(w, "input_layernorm")?,
            post_attention_layernorm: norm(w, "post_attention_layernorm")?,
            pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
            layer_scalar: w.take(&format!("{p}.layer_scalar"), &[1])?,
            sliding: t == SLIDING,
        });
    }
    let per_layer_inputs = per_layer_width
        .map(|pw| PerLayerInputs::load(w, &a, pw))
        .transpose()?;
    // For shared layers, the last earlier non-shared layer of the same type.
    let previous_kvs = (0..n)
        .map(|j| {
            if j < first_kv_shared {
                j
            } else {
                (0..first_kv_shared)
                    .rev()
                    .find(|&i| types[i] == types[j])
                    .unwrap_or(j)
            }
        })
        .collect();
    let compiled = spec.forks.compiled_activations;
    Ok(Box::new(Model {
        embed_tokens: Embedding::load(w, "model.embed_tokens", a.vocab_size, d)?,
        layers,
        norm: RmsNorm::load(w, "model.norm", d, eps)?,
        lm_head: LmHead::load(w, a.tie_word_embeddings, "lm_head", d, a.vocab_size)?,
        per_layer_inputs,
        previous_kvs,
        fns: Fns {
            geglu: geglu(compiled),
            gelu_approx: gelu_approx(compiled),
            softcap: a
                .final_logit_softcapping
                .map(|c| logit_softcap(c, compiled)),
        },
        hidden_size: d,
        sliding_window: a.sliding_window,
        cached_layers: first_kv_shared,
        vocab_size: a.vocab_size,
    }))
}

impl PerLayerGate {
    /// Loads layer `prefix`'s gate for per-layer inputs `width` wide.
    fn load(w: &mut WeightStore, prefix: &str, hidden: i32, width: i32, eps: f64) -> Result<Self> {
        Ok(Self {
            per_layer_input_gate: Linear::load(
                w,
                &format!("{prefix}.per_layer_input_gate"),
                hidden,
                width,
                false,
            )?,
            per_layer_projection: Linear::load(
                w,
                &format!("{prefix}.per_layer_projection"),
                width,
                hidden,
                false,
            )?,
            post_per_layer_input_norm: RmsNorm::load(
                w,
                &format!("{prefix}.post_per_layer_input_norm"),
                hidden,
                eps,
            )?,
        })
    }
}

impl PerLayerInputs {
    /// Loads the model-level tables for per-layer inputs `width` wide.
    fn load(w: &mut WeightStore, a: &Args, width: i32) -> Result<Self> {
        let all = a.num_hidden_layers * width;
        Ok(Self {
            embed_tokens_per_layer: Embedding::load(
                w,
                "model.embed_tokens_per_layer",
                a.vocab_size_per_layer_input,
                all,
            )?,
            per_layer_model_projection: Linear::load(
                w,
                "model.per_layer_model_projection",
                a.hidden_size,
                all,
                false,
            )?,
            per_layer_projection_norm: RmsNorm::load(
                w,
                "model.per_layer_projection_norm",
                width,
                a.rms_norm_eps,
            )?,
            width,
        })
    }

    /// `_get_per_layer_inputs` + `_project_per_layer_inputs`: `[B, L, layers, width]`.
    fn compute(&self, inputs: &Array, h: &Array, layers: i32) -> Result<Array> {
        let shape = [layers, self.width];
        let e = self.embed_tokens_per_layer.forward(inputs)?;
        let e = e.multiply(weak_scalar((self.width as f64).powf(0.5), &e)?)?;
        let e = ops::unflatten(&e, -1, &shape)?;
        let proj = self.per_layer_model_projection.forward(h)?;
        let hidden = h.shape()[h.ndim() - 1];
        let proj = proj.multiply(weak_scalar((hidden as f64).powf(-0.5), &proj)?)?;
        let proj = self
            .per_layer_projection_norm
            .forward(&ops::unflatten(&proj, -1, &shape)?)?;
        let sum = proj.add(&e)?;
        Ok(sum.multiply(weak_scalar(2.0f64.powf(-0.5), &sum)?)?)
    }
}

impl Block {
    fn forward(
        &self,
        x: &Array,
        mask: &AttentionMask,
        cache: Option<&mut dyn KvCache>,
        shared: Option<&SharedKv>,
        per_layer_input: Option<Array>,
        fns: &mut Fns,
    ) -> Result<(Array, SharedKv)> {
        let (h, kv) = self
            .attn
            .forward(&self.input_layernorm.forward(x)?, mask, cache, shared)?;
        let h = x.add(self.post_attention_layernorm.forward(&h)?)?;
        let dense = self
            .mlp
            .forward_op(&self.pre_feedforward_layernorm.forward(&h)?, &mut fns.geglu)?;
        let ff = match &self.moe {
            None => dense,
            Some(moe) => moe.forward(&dense, &h, &mut fns.geglu)?,
        };
        let mut h = h.add(self.post_feedforward_layernorm.forward(&ff)?)?;
        if let (Some(g), Some(pli)) = (&self.per_layer, per_layer_input) {
            let gate = fns
                .gelu_approx
                .call1(&[g.per_layer_input_gate.forward(&h)?])?;
            let gate = g.per_layer_projection.forward(&gate.multiply(&pli)?)?;
            h = h.add(g.post_per_layer_input_norm.forward(&gate)?)?;
        }
        Ok((h.multiply(&self.layer_scalar)?, kv))
    }
}

/// What one call hands every layer: the per-layer input embeddings and each layer's
/// keys/values, which the KV-shared layers reuse.
#[derive(Default)]
pub struct Pass {
    per_layer: Option<Array>,
    kvs: Vec<Option<SharedKv>>,
}

impl Decoder<Pass> for Model {
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    fn layer_kind(&self, i: usize) -> LayerKind {
        match self.layers.get(i) {
            Some(l) if l.sliding => LayerKind::Sliding,
            _ => LayerKind::Full,
        }
    }

    fn sliding_window(&self) -> Option<i32> {
        Some(self.sliding_window)
    }

    /// The last `num_kv_shared_layers` layers keep no cache.
    fn cached_layers(&self) -> usize {
        self.cached_layers
    }

    fn begin(&self, inputs: &Array, h: &Array) -> Result<Pass> {
        let per_layer = match &self.per_layer_inputs {
            Some(p) => Some(p.compute(inputs, h, self.layers.len() as i32)?),
            None => None,
        };
        Ok(Pass {
            per_layer,
            kvs: vec![None; self.layers.len()],
        })
    }

    /// A KV-shared layer attends the keys/values of the last earlier layer of its type.
    fn block(&mut self, i: usize, h: &Array, io: LayerIo<'_, Pass>) -> Result<Array> {
        let src = self.previous_kvs[i];
        let shared = if src == i {
            None
        } else {
            io.pass.kvs[src].as_ref()
        };
        let pli = io
            .pass
            .per_layer
            .as_ref()
            .map(|p| p.index((.., .., i as i32, ..)));
        let (out, kv) = self.layers[i].forward(h, io.mask, io.cache, shared, pli, &mut self.fns)?;
        io.pass.kvs[i] = Some(kv);
        Ok(out)
    }

    /// The head on the final norm, soft-capped when `final_logit_softcapping` is set.
    fn output(&mut self, h: &Array) -> Result<Array> {
        let logits = self
            .lm_head
            .forward(&self.embed_tokens, &self.norm.forward(h)?)?;
        Ok(match &mut self.fns.softcap {
            Some(cap) => cap.call1(&[logits])?,
            None => logits,
        })
    }
}

impl LanguageModel for Model {
    fn forward_ext(
        &mut self,
        inputs: &Array,
        caches: &mut Caches,
        opts: &ForwardOpts,
    ) -> Result<ForwardOut> {
        if opts.exit_after.is_some() {
            return Err(EngineError::Input(
                "gemma4_text does not support early exit yet (the `self` drafter); use another drafter kind".into(),
            ));
        }
        decoder::run(self, inputs, caches, opts)
    }

    /// `embed_tokens(ids) * sqrt(hidden_size)`, as the first layer receives it.
    fn embed(&self, inputs: &Array) -> Result<Array> {
        let h = self.embed_tokens.forward(inputs)?;
        Ok(h.multiply(weak_scalar((self.hidden_size as f64).powf(0.5), &h)?)?)
    }

    fn final_norm(&self, hidden: &Array) -> Result<Array> {
        self.norm.forward(hidden)
    }

    fn make_caches(&self) -> Caches {
        decoder::make_caches(self)
    }

    fn vocab_size(&self) -> i32 {
        self.vocab_size
    }
}
