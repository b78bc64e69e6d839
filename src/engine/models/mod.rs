//! Model architectures, one file per mlx-lm `model_type`, and the registry that picks one from
//! config.json. Adding an architecture is one file plus one line in [`REGISTRY`].

pub mod activations;
pub mod attention;
pub mod decoder;
pub mod gated_delta;
pub mod gemma2;
pub mod gemma3_text;
pub mod gemma4_text;
mod gemma4_text_attention;
mod gemma4_text_moe;
pub mod host_step;
pub mod llama;
pub mod minicpm;
pub mod mlp;
pub mod pipeline;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_5_moe;
pub mod qwen3_moe;
pub mod rope;
pub mod switch;

use super::cache::KvCache;
use super::error::{EngineError, Result};
use super::forks::Forks;
use super::shard::{RankShare, ShardPlan, Share};
use super::weights::{QuantConfig, WeightStore};
use mlx_rs::Array;
use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};

/// One cache per layer, in layer order.
pub type Caches = Vec<Box<dyn KvCache>>;

/// What every architecture provides to the engine.
pub trait LanguageModel {
    /// Runs token ids `[B, L]` through the model, updating `caches`; returns logits `[B, L, V]`.
    fn forward(&mut self, inputs: &Array, caches: &mut Caches) -> Result<Array> {
        Ok(self
            .forward_ext(inputs, caches, &ForwardOpts::default())?
            .logits)
    }
    /// A forward that can also stop early (the `self` drafter: first K layers, then the final
    /// norm and LM head) and hand out chosen layers' outputs (taps for drafters that condition
    /// on target hidden states). Numerics of the layers run are those of `forward`.
    fn forward_ext(
        &mut self,
        inputs: &Array,
        caches: &mut Caches,
        opts: &ForwardOpts,
    ) -> Result<ForwardOut>;
    /// The input embedding of ids `[B, L]` → `[B, L, D]`: exactly what the first layer receives
    /// (gemma's `sqrt(hidden)` scale included). Drafters that share the target's embedding
    /// (DSpark) call it; architectures that do not expose it refuse.
    fn embed(&self, _inputs: &Array) -> Result<Array> {
        Err(not_exposed("embedding"))
    }
    /// The final norm `forward` applies after the last layer (hidden `[.., D]` → `[.., D]`).
    fn final_norm(&self, _hidden: &Array) -> Result<Array> {
        Err(not_exposed("final norm"))
    }
    /// The output head on already-normalized hidden states `[.., D]` → logits `[.., V]` (tied or
    /// untied; a final logit soft-cap included), as `forward` applies it after [`Self::final_norm`].
    fn lm_head(&self, _hidden: &Array) -> Result<Array> {
        Err(not_exposed("LM head"))
    }
    /// The output head's rows `[n, D]` for target ids `[n]` (dequantized when quantized), when
    /// the head is a plain linear map; `None` otherwise (a soft-cap, a bias, or a head the
    /// architecture does not expose this way), and callers fall back to [`Self::lm_head`].
    /// Why: a drafter restricted to a few thousand ids needs only those rows, and reading them
    /// directly avoids a full-vocabulary product (slow for quantized heads on CPU).
    fn lm_head_rows(&self, _ids: &Array) -> Result<Option<Array>> {
        Ok(None)
    }
    /// Does now the one-time work of the L1 host decode step the model will take (building it,
    /// checking its parts against MLX, packing its weights), so that it falls in loading, as
    /// llama.cpp repacks weights at load, not in the first generated tokens; nothing for a
    /// model without one.
    fn prepare_host_step(&mut self) -> Result<()> {
        Ok(())
    }
    /// Makes now what the host step would make for speculative verify blocks of up to
    /// `max_block` tokens as they recur (packed copies; see
    /// [`host_step::HostStep::prepare_blocks`]); nothing for a model without one.
    fn prepare_verify_blocks(&mut self, _max_block: usize) -> Result<()> {
        Ok(())
    }
    /// Fresh caches of the kinds this architecture uses per layer.
    fn make_caches(&self) -> Caches;
    /// Output vocabulary size.
    fn vocab_size(&self) -> i32;
}

/// The llama family's output head: the untied `lm_head` when the checkpoint has one, else the
/// embedding table used as a linear map (tied).
pub(crate) fn output_head(
    lm_head: Option<&super::nn::Linear>,
    embed: &super::nn::Embedding,
    hidden: &Array,
) -> Result<Array> {
    match lm_head {
        Some(head) => head.forward(hidden),
        None => embed.as_linear(hidden),
    }
}

/// [`LanguageModel::forward_ext`] as the shared decoder loop ([`decoder::run`]), the caches its
/// layer kinds ask for ([`decoder::make_caches`]) and the `vocab_size` field, for a model that
/// implements [`decoder::Decoder`].
macro_rules! decoder_model {
    () => {
        fn forward_ext(
            &mut self,
            inputs: &mlx_rs::Array,
            caches: &mut $crate::engine::models::Caches,
            opts: &$crate::engine::models::ForwardOpts,
        ) -> $crate::engine::error::Result<$crate::engine::models::ForwardOut> {
            super::decoder::run(self, inputs, caches, opts)
        }

        fn make_caches(&self) -> $crate::engine::models::Caches {
            super::decoder::make_caches(self)
        }

        fn vocab_size(&self) -> i32 {
            self.vocab_size
        }
    };
}
pub(crate) use decoder_model;

/// [`LanguageModel::embed`], [`LanguageModel::final_norm`] and [`LanguageModel::lm_head`] for a
/// model laid out like llama (`embed_tokens`, `norm`, an optional untied `lm_head`).
macro_rules! llama_layout_accessors {
    () => {
        fn embed(&self, inputs: &Array) -> Result<Array> {
            self.embed_tokens.forward(inputs)
        }

        fn final_norm(&self, hidden: &Array) -> Result<Array> {
            self.norm.forward(hidden)
        }

        fn lm_head(&self, hidden: &Array) -> Result<Array> {
            super::output_head(self.lm_head.as_ref(), &self.embed_tokens, hidden)
        }

        fn lm_head_rows(&self, ids: &Array) -> Result<Option<Array>> {
            match self.lm_head.as_ref() {
                Some(head) => head.weight_rows(ids),
                None => self.embed_tokens.forward(ids).map(Some),
            }
        }
    };
}
pub(crate) use llama_layout_accessors;

/// The refusal of [`LanguageModel`]'s optional accessors for a part an architecture keeps private.
fn not_exposed(part: &str) -> EngineError {
    EngineError::Input(format!(
        "this model_type does not expose its {part} yet, which the DSpark drafter shares; use a llama, qwen2, qwen3 or gemma3_text target"
    ))
}

/// Options of [`LanguageModel::forward_ext`].
#[derive(Debug, Clone, Default)]
pub struct ForwardOpts {
    /// Run only the first this-many layers, then the final norm and LM head.
    pub exit_after: Option<usize>,
    /// Layer indices whose outputs (residual stream after the layer) to return, in order.
    pub taps: Vec<usize>,
}

/// What [`LanguageModel::forward_ext`] returns.
pub struct ForwardOut {
    /// Logits `[B, L, V]`.
    pub logits: Array,
    /// One array `[B, L, D]` per requested tap, in the order requested.
    pub taps: Vec<Array>,
}

impl ForwardOpts {
    /// How many layers to run out of `total`, checking the request against the model, whose
    /// first `cached` layers each need one of the `caches` given (later ones keep none).
    pub fn layers_to_run(&self, total: usize, cached: usize, caches: usize) -> Result<usize> {
        let n = self.exit_after.unwrap_or(total);
        if n == 0 || n > total || caches < n.min(cached) {
            return Err(EngineError::Input(format!(
                "early exit after {n} layers is out of range: the model has {total} layers ({caches} caches given)"
            )));
        }
        if let Some(t) = self.taps.iter().find(|&&t| t >= n) {
            return Err(EngineError::Input(format!(
                "layer tap {t} is out of range: only {n} layers run"
            )));
        }
        Ok(n)
    }

    /// Collects `h` into `taps` if layer `i` is tapped.
    pub fn capture(&self, i: usize, h: &Array, taps: &mut Vec<(usize, Array)>) {
        if self.taps.contains(&i) {
            taps.push((i, h.clone()));
        }
    }

    /// Orders captured taps as requested.
    pub fn finish_taps(&self, mut taps: Vec<(usize, Array)>) -> Vec<Array> {
        self.taps
            .iter()
            .filter_map(|t| {
                taps.iter()
                    .position(|(i, _)| i == t)
                    .map(|p| taps.swap_remove(p).1)
            })
            .collect()
    }
}

type Builder = fn(&ModelSpec, &mut WeightStore) -> Result<Box<dyn LanguageModel>>;

/// `model_type` → constructor. mlx-lm's `MODEL_REMAPPING` aliases are listed as extra rows.
pub const REGISTRY: &[(&str, Builder)] = &[
    ("llama", llama::build),
    ("mistral", llama::build),
    ("minicpm", minicpm::build),
    ("qwen2", qwen2::build),
    ("qwen3", qwen3::build),
    ("qwen3_5", qwen3_5::build),
    ("qwen3_5_moe", qwen3_5_moe::build),
    ("qwen3_moe", qwen3_moe::build),
    ("gemma2", gemma2::build),
    ("gemma3_text", gemma3_text::build),
    ("gemma4_text", gemma4_text::build),
];

/// The supported `model_type`s, for `mlxb models` and error messages.
pub fn supported_types() -> Vec<&'static str> {
    REGISTRY.iter().map(|(t, _)| *t).collect()
}

/// config.json fields that size a tensor or a loop and must be at least 1 when given.
const POSITIVE_SIZES: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
    "global_head_dim",
    "moe_intermediate_size",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
];

/// config.json counts where 0 means "none" (dense models, no sharing) but a negative is corrupt.
const NON_NEGATIVE_COUNTS: &[&str] = &[
    "num_experts",
    "num_experts_per_tok",
    "shared_expert_intermediate_size",
    "num_kv_shared_layers",
    "hidden_size_per_layer_input",
    "sliding_window",
    "max_position_embeddings",
];

/// config.json counts that drive a loop or an allocation before any tensor is looked at, with
/// the largest value accepted: far past any real model (the deepest have ~130 layers, the widest
/// MoE a few hundred experts), and small enough that a corrupt value fails fast instead of
/// looping or allocating for minutes.
const MAX_COUNTS: &[(&str, f64)] = &[
    ("num_hidden_layers", 10_000.0),
    ("num_experts", 100_000.0),
    ("num_experts_per_tok", 100_000.0),
    ("num_kv_shared_layers", 10_000.0),
];

/// config.json plus what a builder needs to interpret it.
pub struct ModelSpec {
    /// Path of config.json (for error messages).
    pub config_path: PathBuf,
    /// The parsed config.
    pub config: serde_json::Value,
    /// Fork switches for this run.
    pub forks: Forks,
}

impl ModelSpec {
    /// Deserializes the architecture's args struct; a missing or mistyped field is one sentence.
    pub fn args<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_value(self.config.clone()).map_err(|e| {
            EngineError::file(
                &self.config_path,
                format!("{e}; fix config.json for this model_type"),
            )
        })
    }

    /// An error naming a config field.
    pub fn field_error(&self, field: &str, problem: &str) -> EngineError {
        EngineError::file(&self.config_path, format!("`{field}` {problem}"))
    }

    /// Checks that heads are positive and query heads are a multiple of key/value heads.
    pub fn check_heads(&self, n_heads: i32, n_kv: i32) -> Result<()> {
        if n_heads <= 0 || n_kv <= 0 || n_heads % n_kv != 0 {
            return Err(self.field_error(
                "num_key_value_heads",
                &format!("is {n_kv} with num_attention_heads {n_heads}; it must divide the attention heads"),
            ));
        }
        Ok(())
    }

    /// Refuses a non-positive size (or a negative count), or a count past `MAX_COUNTS`, in
    /// config.json or its `text_config`, for every family before any shape is computed from it.
    pub fn check_sizes(&self) -> Result<()> {
        let nested = self.config.get("text_config").filter(|t| t.is_object());
        for (prefix, config) in [("", Some(&self.config)), ("text_config.", nested)] {
            let Some(config) = config else { continue };
            for (fields, min, what) in [
                (POSITIVE_SIZES, 1.0, "a positive size"),
                (NON_NEGATIVE_COUNTS, 0.0, "zero or more"),
            ] {
                for field in fields {
                    let value = config.get(*field).and_then(serde_json::Value::as_f64);
                    if let Some(v) = value.filter(|&v| v < min) {
                        return Err(self.field_error(
                            &format!("{prefix}{field}"),
                            &format!("is {v}; it must be {what}"),
                        ));
                    }
                }
            }
            for (field, max) in MAX_COUNTS {
                let value = config.get(*field).and_then(serde_json::Value::as_f64);
                if let Some(v) = value.filter(|v| v > max) {
                    return Err(self.field_error(
                        &format!("{prefix}{field}"),
                        &format!("is {v}; mlxb accepts at most {max} (is the file corrupt?)"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks `layer_types` has one known entry per layer.
    pub fn check_layer_types(
        &self,
        types: &[String],
        n_layers: i32,
        allowed: &[&str],
    ) -> Result<()> {
        if types.len() != n_layers as usize {
            return Err(self.field_error(
                "layer_types",
                &format!(
                    "has {} entries but num_hidden_layers is {n_layers}",
                    types.len()
                ),
            ));
        }
        if let Some(bad) = types.iter().find(|t| !allowed.contains(&t.as_str())) {
            return Err(self.field_error(
                "layer_types",
                &format!("contains unknown type \"{bad}\" (allowed: {allowed:?})"),
            ));
        }
        Ok(())
    }
}

/// A loaded model plus facts the engine needs about it.
pub struct LoadedModel {
    /// The architecture instance with its weights.
    pub model: Box<dyn LanguageModel>,
    /// `model_type` from config.json.
    pub model_type: String,
    /// The parsed config.json.
    pub config: serde_json::Value,
    /// The forks it was loaded with, resolved for this model (give it to the generator).
    pub plan: super::plan::ForkPlan,
}

impl LoadedModel {
    /// Takes the per-layer KV quantization from optiq's `kv_config.json` at `path`
    /// (`--kv-config`) instead of the one beside the model.
    pub fn use_kv_config(&mut self, path: &Path) -> Result<()> {
        let layers = self.model.make_caches().len();
        self.plan = self
            .plan
            .clone()
            .with_optiq_kv_config(path, layers, &self.config)?;
        Ok(())
    }

    /// Forwards one block of every size from one to `max_block` tokens over a short context on
    /// scratch caches, so that work a block size does once, at its first use (the L1 host
    /// step's checks of its products and attention against MLX, tens of milliseconds each),
    /// is done before a measurement starts, and so are the packed copies the step makes for
    /// verify blocks once they recur ([`LanguageModel::prepare_verify_blocks`]). The context
    /// goes in as a generation's first step does (on MLX); nothing else about the model
    /// changes.
    pub fn warm_up_blocks(&mut self, max_block: usize) -> Result<()> {
        let mut caches = self.model.make_caches();
        self.plan.prepare(&mut caches);
        let ids = |n: usize| Array::from_slice(&vec![0i32; n], &[1, n as i32]);
        let eval = |logits: Array, caches: &Caches| -> Result<()> {
            let mut outputs: Vec<Array> = caches.iter().flat_map(|c| c.state()).collect();
            outputs.push(logits);
            Ok(mlx_rs::transforms::eval(&outputs)?)
        };
        let context = super::kernels::mlx_only(|| self.model.forward(&ids(4), &mut caches))?;
        eval(context, &caches)?;
        for n in 1..=max_block {
            let saved: Vec<_> = caches.iter().map(|c| c.snapshot()).collect();
            let logits = self.model.forward(&ids(n), &mut caches)?;
            eval(logits, &caches)?;
            for (cache, snapshot) in caches.iter_mut().zip(saved) {
                cache.restore(snapshot)?;
            }
        }
        self.model.prepare_verify_blocks(max_block)
    }
}

/// The model types whose layers split over the ranks of a job, with their tensor-parallel split
/// (mlx-lm's `Model.shard` of each); each also runs pipeline-parallel (whole layers per rank).
const SPLIT_OVER_RANKS: &[(&str, &ShardPlan)] = &[
    ("llama", llama::TENSOR_PARALLEL),
    ("mistral", llama::TENSOR_PARALLEL),
    ("qwen2", llama::TENSOR_PARALLEL),
    ("qwen3", llama::TENSOR_PARALLEL),
];

/// Reads config.json in `dir`, picks the architecture and loads the weights into it.
pub fn load(dir: &Path, forks: Forks) -> Result<LoadedModel> {
    load_on_ranks(dir, forks, None)
}

/// What this rank of `group` holds of a `model_type` model, split as the job asks
/// ([`crate::engine::distributed::split`]).
fn rank_share(
    spec: &ModelSpec,
    model_type: &str,
    group: std::sync::Arc<crate::engine::distributed::Group>,
) -> Result<RankShare> {
    use crate::engine::distributed::{pipeline_layers, split, Split};
    let plan = SPLIT_OVER_RANKS
        .iter()
        .find(|(t, _)| *t == model_type)
        .map(|(_, plan)| *plan)
        .ok_or_else(|| {
            let types: Vec<&str> = SPLIT_OVER_RANKS.iter().map(|(t, _)| *t).collect();
            EngineError::file(
                &spec.config_path,
                format!(
                    "model_type \"{model_type}\" has no form split over ranks, so it cannot run on \
                     {} ranks (mlxb splits {}); run it as one process",
                    group.size(),
                    types.join(", ")
                ),
            )
        })?;
    let share = match split() {
        Split::Tensor => Share::Tensor(plan),
        Split::Pipeline => {
            let layers = spec
                .config
                .get("num_hidden_layers")
                .and_then(|n| n.as_u64())
                .unwrap_or(0) as usize;
            if layers < group.size() {
                return Err(spec.field_error(
                    "num_hidden_layers",
                    &format!(
                        "is {layers}, fewer than the {} ranks of the pipeline; run it on fewer ranks",
                        group.size()
                    ),
                ));
            }
            Share::Pipeline(pipeline_layers(layers, group.rank(), group.size()))
        }
    };
    Ok(RankShare::new(group, share))
}

/// [`load`] as this rank's share of a model split over `group` (whole when `None`).
pub fn load_on_ranks(
    dir: &Path,
    forks: Forks,
    group: Option<std::sync::Arc<crate::engine::distributed::Group>>,
) -> Result<LoadedModel> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| {
        EngineError::file(
            &config_path,
            format!("cannot read config.json ({e}); is this a model directory?"),
        )
    })?;
    let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        EngineError::file(&config_path, format!("config.json is not valid JSON ({e})"))
    })?;
    let model_type = config
        .get("model_type")
        .and_then(|v| v.as_str())
        .ok_or_else(|| {
            EngineError::file(
                &config_path,
                "`model_type` is missing; mlxb dispatches on it like mlx-lm",
            )
        })?
        .to_owned();
    let builder = REGISTRY
        .iter()
        .find(|(t, _)| *t == model_type)
        .map(|(_, b)| *b)
        .ok_or_else(|| {
            EngineError::file(
                &config_path,
                format!(
                    "model_type \"{model_type}\" is not supported (supported: {})",
                    supported_types().join(", ")
                ),
            )
        })?;
    let spec = ModelSpec {
        config_path,
        config: config.clone(),
        forks,
    };
    spec.check_sizes()?;
    let quant = QuantConfig::from_config(&spec.config_path, &config)?;
    let share = group
        .map(|g| rank_share(&spec, &model_type, g))
        .transpose()?;
    let mut weights = WeightStore::load_on_ranks(dir, quant, share)?;
    weights.set_host_kernel(forks.host_q4());
    weights.set_host_matvec(forks.host_dense());
    weights.set_host_elementwise(forks.host_elem());
    weights.set_host_step(forks.host_exact_step());
    let model = builder(&spec, &mut weights)?;
    weights.finish()?;
    let plan =
        super::plan::ForkPlan::new(forks, &spec.config_path, &config, model.make_caches().len())?;
    Ok(LoadedModel {
        model,
        model_type,
        config,
        plan,
    })
}
