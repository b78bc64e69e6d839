//! DSpark checkpoints. Two formats, one in-memory description ([`DsparkConfig`]) and one loader:
//!
//! - mlxb's own: `dspark.json` (this struct, serialized) + `model.safetensors`, `variant`
//!   `"dspark"` (legacy `"dflash"`: the same backbone with no sequential or confidence head);
//!   the target's embedding and LM head are shared, not stored.
//! - DeepSpec's Hugging Face format: `config.json` (a copy of the target's text config plus the
//!   DSpark fields, `architectures: [Qwen3DSparkModel | Gemma4DSparkModel]`) + safetensors with
//!   frozen copies of `embed_tokens` / `lm_head`.
//!
//! Both use DeepSpec's unprefixed tensor names (`fc.weight`, `layers.0.self_attn.q_proj.weight`,
//! `markov_head.markov_w1.weight`, `confidence_head.proj.weight`, ...). The loader refuses a
//! checkpoint that does not fit the target (hidden size, vocabulary, tapped layers) with one
//! sentence saying what to do. DeepSpec's config.json is translated in `deepspec`.

mod deepspec;

use crate::engine::error::{EngineError, Result};
use crate::engine::models::LanguageModel;
use crate::engine::weights::{QuantConfig, WeightStore};
use mlx_rs::Array;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// mlxb's config file name inside a checkpoint directory.
pub const DSPARK_CONFIG_FILE: &str = "dspark.json";
/// The weights file mlxb writes (any `model*.safetensors` is read).
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// What to do when a checkpoint does not fit, appended to every mismatch error.
const REMEDY: &str =
    "use a drafter made for this target (`mlxb dspark-init --model TARGET --out DIR` creates one)";

/// The sequential head that adds a prefix-dependent bias to the backbone's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SeqHead {
    /// No head: plain DFlash (the base logits alone).
    #[default]
    None,
    /// `z_k = U_k + W2 W1[x_{k-1}]` (the paper's Eq. 5; DeepSpec's "vanilla").
    Markov,
    /// The paper's gated recurrent cell over `[s; W1[x]; h]` (Eq. 6).
    Rnn,
    /// DeepSpec's code-only variant: `W2(sigmoid(gate([h; W1[x]])) * W1[x])`.
    Gated,
}

/// How the backbone layers are shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerStyle {
    /// Qwen3: pre-norm, GQA with per-head q/k RMSNorm, SwiGLU.
    #[default]
    Qwen3,
    /// Gemma4: sandwich norms, attention scale 1, optional K==V with a scale-free value norm,
    /// GeGLU, a per-layer scalar.
    Gemma4,
}

/// Which checkpoint format a directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `dspark.json` + safetensors.
    Mlxb,
    /// DeepSpec's `config.json` (`Qwen3DSparkModel` / `Gemma4DSparkModel`) + safetensors.
    DeepSpec,
}

/// Everything the drafter module needs, for both formats (mlxb's `dspark.json` is this struct).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DsparkConfig {
    /// `"dspark"`, or legacy `"dflash"` (no sequential or confidence head).
    pub variant: String,
    /// Backbone layer shape.
    #[serde(default)]
    pub layer_style: LayerStyle,
    /// Model width `d` (the target's hidden size).
    pub hidden_size: i32,
    /// Vocabulary `V` (the target's).
    pub vocab_size: i32,
    /// Backbone (draft) layers.
    pub num_hidden_layers: i32,
    /// Query heads per draft layer.
    pub num_attention_heads: i32,
    /// Key/value heads per draft layer.
    pub num_key_value_heads: i32,
    /// Per-head width.
    pub head_dim: i32,
    /// MLP width.
    pub intermediate_size: i32,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling config as the target's config.json writes it (`None` = plain RoPE).
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// Trained block size γ: drafts per round.
    pub block_size: usize,
    /// Target layers whose raw outputs are concatenated into the context features.
    pub target_layer_ids: Vec<i64>,
    /// Layers of the target the drafter was made for.
    #[serde(default)]
    pub num_target_layers: Option<usize>,
    /// Token id of the mask slots in the block.
    pub mask_token_id: i64,
    /// Sequential head.
    #[serde(default)]
    pub seq_head: SeqHead,
    /// Rank `r` of the Markov embedding `W1` / projection `W2`.
    #[serde(default)]
    pub markov_rank: i32,
    /// Whether a confidence head exists.
    #[serde(default)]
    pub confidence_head: bool,
    /// Whether the confidence head also sees `W1[x_{k-1}]` (input `d + r` instead of `d`).
    #[serde(default = "yes")]
    pub confidence_head_with_markov: bool,
    /// Attention softmax scale (`None` = `head_dim^-0.5`; Gemma4 uses 1).
    #[serde(default)]
    pub attention_scale: Option<f32>,
    /// Gemma4's K==V: no `v_proj`; values are the raw `k_proj` output.
    #[serde(default)]
    pub attention_k_eq_v: bool,
    /// Soft-cap `tanh(z/c)*c` on the base logits of the checkpoint's own LM head.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Multiply the checkpoint's own embedding by `sqrt(hidden_size)` (Gemma).
    #[serde(default)]
    pub scale_embeddings: bool,
    /// Calibrated per-position confidence thresholds (position 0 is never pruned).
    #[serde(default)]
    pub thresholds: Option<Vec<f64>>,
    /// Sequential temperature scaling: `c_k = sigmoid(logit_k / T_k)`.
    #[serde(default)]
    pub sts_temperatures: Option<Vec<f64>>,
    /// `model_type` of the target it was made for (informational).
    #[serde(default)]
    pub target_model_type: Option<String>,
    /// The shortest n-gram a lookup in front of this drafter matches where `--lookup-first` is
    /// not given ([`crate::spec::lookup_first`]; chosen by measuring the drafter on calibration
    /// prompts); absent = no lookup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookup_first: Option<usize>,
    /// The most tokens that lookup proposes where `--lookup-tokens` is not given; absent = the
    /// block size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookup_tokens: Option<usize>,
}

fn yes() -> bool {
    true
}

/// The facts about a target a drafter must fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetFacts {
    /// Hidden size (width of its embedding and layer outputs).
    pub hidden_size: i32,
    /// Output vocabulary.
    pub vocab_size: i32,
    /// Decoder layers.
    pub num_layers: usize,
}

impl TargetFacts {
    /// Reads the facts off a loaded target (the width from one embedded token).
    pub fn of(model: &dyn LanguageModel) -> Result<Self> {
        let probe = model.embed(&Array::from_slice(&[0i32], &[1, 1]))?;
        Ok(Self {
            hidden_size: probe.shape()[probe.ndim() - 1],
            vocab_size: model.vocab_size(),
            num_layers: model.make_caches().len(),
        })
    }
}

impl DsparkConfig {
    /// Whether this is the legacy head-less variant.
    pub fn is_dflash(&self) -> bool {
        self.variant == "dflash"
    }

    /// Number of tapped layers `m`.
    pub fn num_taps(&self) -> i32 {
        self.target_layer_ids.len() as i32
    }

    /// Width of the confidence head's input.
    pub fn confidence_input(&self) -> i32 {
        if self.confidence_head_with_markov {
            self.hidden_size + self.markov_rank
        } else {
            self.hidden_size
        }
    }

    /// Checks the config on its own: variant, geometry, taps, heads, calibration tables.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |reason: String| Err(EngineError::file(path, reason));
        if !matches!(self.variant.as_str(), "dspark" | "dflash") {
            return bad(format!(
                "`variant` is \"{}\"; mlxb reads \"dspark\" (and legacy \"dflash\") drafters; re-create it with `mlxb dspark-init`",
                self.variant
            ));
        }
        let dims = [
            ("hidden_size", self.hidden_size),
            ("vocab_size", self.vocab_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
        ];
        if let Some((name, v)) = dims.iter().find(|(_, v)| *v < 1) {
            return bad(format!("`{name}` is {v}; it must be at least 1"));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return bad(format!(
                "`num_key_value_heads` {} does not divide `num_attention_heads` {}; fix the config",
                self.num_key_value_heads, self.num_attention_heads
            ));
        }
        if self.block_size == 0 {
            return bad(
                "`block_size` is 0; a drafter proposes at least one token per round".into(),
            );
        }
        if self.target_layer_ids.is_empty() {
            return bad(
                "`target_layer_ids` is empty; the drafter needs at least one tapped target layer"
                    .into(),
            );
        }
        if self.target_layer_ids.iter().any(|&t| t < 0) {
            return bad(format!(
                "`target_layer_ids` {:?} has a negative id; mlxb taps decoder layer outputs only (id -1, the embedding output, is not supported)",
                self.target_layer_ids
            ));
        }
        if self.target_layer_ids.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!(
                "`target_layer_ids` {:?} must be strictly increasing",
                self.target_layer_ids
            ));
        }
        if self.mask_token_id < 0 || self.mask_token_id >= self.vocab_size as i64 {
            return bad(format!(
                "`mask_token_id` {} is outside the vocabulary of {} tokens",
                self.mask_token_id, self.vocab_size
            ));
        }
        let heads = self.seq_head != SeqHead::None
            || (self.confidence_head && self.confidence_head_with_markov);
        if heads && self.markov_rank < 1 {
            return bad(format!(
                "`markov_rank` is {} but the {:?} head needs W1/W2 of rank >= 1",
                self.markov_rank, self.seq_head
            ));
        }
        if self.confidence_head
            && self.confidence_head_with_markov
            && self.seq_head == SeqHead::None
        {
            return bad("the confidence head reads the Markov embedding W1 but `seq_head` is none; set `confidence_head_with_markov` to false".into());
        }
        for (name, table) in [
            ("thresholds", &self.thresholds),
            ("sts_temperatures", &self.sts_temperatures),
        ] {
            if let Some(t) = table {
                if t.len() != self.block_size {
                    return bad(format!(
                        "`{name}` has {} entries but `block_size` is {}; calibrate again (one entry per draft position)",
                        t.len(),
                        self.block_size
                    ));
                }
            }
        }
        if let Some(t) = &self.sts_temperatures {
            if t.iter().any(|&v| v.is_nan() || v <= 0.0) {
                return bad("`sts_temperatures` must all be positive".into());
            }
        }
        if let Some(t) = &self.thresholds {
            if t.iter().any(|v| !(0.0..=1.0).contains(v)) {
                return bad("`thresholds` must all lie in [0, 1]".into());
            }
        }
        if self.lookup_tokens == Some(0) {
            return bad(
                "`lookup_tokens` is 0; a lookup proposes at least one token (remove the field for the block size)"
                    .into(),
            );
        }
        Ok(())
    }

    /// Checks that the drafter fits `target` (width, vocabulary, tapped layers, layer count).
    pub fn check_target(&self, target: &TargetFacts, path: &Path) -> Result<()> {
        let bad = |reason: String| Err(EngineError::file(path, format!("{reason}; {REMEDY}")));
        if self.hidden_size != target.hidden_size {
            return bad(format!(
                "the drafter was made for hidden size {} but the target's is {}",
                self.hidden_size, target.hidden_size
            ));
        }
        if self.vocab_size != target.vocab_size {
            return bad(format!(
                "the drafter's vocabulary has {} tokens but the target's has {}",
                self.vocab_size, target.vocab_size
            ));
        }
        if let Some(n) = self.num_target_layers.filter(|&n| n != target.num_layers) {
            return bad(format!(
                "the drafter was made for a target with {n} layers but this one has {}",
                target.num_layers
            ));
        }
        let last = target.num_layers as i64 - 1;
        if let Some(t) = self.target_layer_ids.iter().find(|&&t| t >= last) {
            return bad(format!(
                "tapped layer {t} is out of range for a target with {} layers (taps must be below its last layer, {last})",
                target.num_layers
            ));
        }
        Ok(())
    }
}

/// The directory a user-given path names (a checkpoint directory, or a config file inside one).
pub fn checkpoint_dir(path: &Path) -> PathBuf {
    let is_config = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n == DSPARK_CONFIG_FILE || n == "config.json");
    match path.parent() {
        Some(parent) if is_config && path.is_file() => parent.to_path_buf(),
        _ => path.to_path_buf(),
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EngineError::file(path, format!("cannot read it ({e})")))?;
    serde_json::from_str(&text).map_err(|e| {
        EngineError::file(
            path,
            format!("is not valid JSON ({e}); fix or re-create the file"),
        )
    })
}

/// Whether `path` holds a DSpark checkpoint in either format (what `--draft-model` detection uses).
pub fn is_artifact(path: &Path) -> bool {
    let dir = checkpoint_dir(path);
    if dir.join(DSPARK_CONFIG_FILE).is_file() {
        return true;
    }
    read_json(&dir.join("config.json"))
        .ok()
        .is_some_and(|c| deepspec::architecture(&c).is_some())
}

/// Reads the config of the checkpoint at `path` in whichever format it is, validated on its own.
pub fn read_config(path: &Path) -> Result<(DsparkConfig, Format)> {
    let dir = checkpoint_dir(path);
    let mlxb = dir.join(DSPARK_CONFIG_FILE);
    let (config, format, file) = if mlxb.is_file() {
        let v = read_json(&mlxb)?;
        let c: DsparkConfig = serde_json::from_value(v).map_err(|e| {
            EngineError::file(&mlxb, format!("{e}; re-create it with `mlxb dspark-init`"))
        })?;
        (c, Format::Mlxb, mlxb)
    } else {
        let file = dir.join("config.json");
        if !file.is_file() {
            return Err(EngineError::file(
                &dir,
                format!("is not a DSpark checkpoint (neither {DSPARK_CONFIG_FILE} nor config.json); create one with `mlxb dspark-init`"),
            ));
        }
        let v = read_json(&file)?;
        (deepspec::read(&v, &file)?, Format::DeepSpec, file)
    };
    let mut config = config;
    if config.is_dflash() {
        config.seq_head = SeqHead::None;
        config.confidence_head = false;
    }
    config.validate(&file)?;
    Ok((config, format))
}

/// A checkpoint read from disk: its config, format and tensors (taken as the module is built).
pub struct Checkpoint {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Its config.
    pub config: DsparkConfig,
    /// Which format it was in.
    pub format: Format,
    /// Its tensors.
    pub weights: WeightStore,
}

/// Reads the checkpoint at `path` (config and tensors).
pub fn load(path: &Path) -> Result<Checkpoint> {
    let dir = checkpoint_dir(path);
    let (config, format) = read_config(&dir)?;
    // A quantized drafter carries mlx-lm's `quantization` section in the same file.
    let file = match format {
        Format::Mlxb => dir.join(DSPARK_CONFIG_FILE),
        Format::DeepSpec => dir.join("config.json"),
    };
    let quant = QuantConfig::from_config(&file, &read_json(&file)?)?;
    let weights = WeightStore::load(&dir, quant)?;
    Ok(Checkpoint {
        dir,
        config,
        format,
        weights,
    })
}

/// A target config's RoPE: `rope_theta` (top level or under `rope_parameters`, default 10000)
/// and its scaling section (`rope_scaling`, or `rope_parameters` when that carries a type).
pub fn target_rope(v: &Value) -> (f64, Option<Value>) {
    let params = v.get("rope_parameters").filter(|p| p.is_object());
    let theta = v
        .get("rope_theta")
        .and_then(Value::as_f64)
        .or_else(|| {
            params
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
        })
        .unwrap_or(10000.0);
    let scaling = v
        .get("rope_scaling")
        .filter(|s| !s.is_null())
        .or_else(|| params.filter(|p| p.get("rope_type").or_else(|| p.get("type")).is_some()))
        .cloned();
    (theta, scaling)
}

/// The directory and config of the mlxb-format checkpoint at `path`, which `what` (a patch,
/// e.g. "a calibration") is about to rewrite; DeepSpec-format checkpoints are refused.
pub fn patchable(path: &Path, what: &str) -> Result<(PathBuf, DsparkConfig)> {
    let dir = checkpoint_dir(path);
    let (config, format) = read_config(&dir)?;
    if format != Format::Mlxb {
        return Err(EngineError::file(
            &dir,
            format!("only mlxb-format drafters (dspark.json) can be given {what}"),
        ));
    }
    Ok((dir, config))
}

/// Writes `config` as `dspark.json` in `dir` atomically (temp file + rename): a reader sees the
/// old file or the new one, never a torn one.
pub fn write_config(dir: &Path, config: &DsparkConfig) -> Result<()> {
    let text = serde_json::to_string_pretty(config)
        .map_err(|e| EngineError::Runtime(format!("cannot serialize the drafter config ({e})")))?;
    let tmp = dir.join(format!("{DSPARK_CONFIG_FILE}.tmp"));
    let io = |e: std::io::Error| {
        EngineError::file(dir, format!("cannot write {DSPARK_CONFIG_FILE} ({e})"))
    };
    std::fs::write(&tmp, text + "\n").map_err(io)?;
    std::fs::rename(&tmp, dir.join(DSPARK_CONFIG_FILE)).map_err(io)
}

/// Writes a checkpoint in mlxb's format: the tensors to `model.safetensors`, then `dspark.json`.
pub fn save(dir: &Path, config: &DsparkConfig, tensors: &HashMap<String, Array>) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| EngineError::file(dir, format!("cannot create the directory ({e})")))?;
    write_weights(dir, tensors, None)?;
    write_config(dir, config)
}

/// Writes `tensors` (with safetensors `metadata`) as `model.safetensors` in `dir` atomically
/// (temp file + rename).
pub fn write_weights(
    dir: &Path,
    tensors: &HashMap<String, Array>,
    metadata: Option<&HashMap<String, String>>,
) -> Result<()> {
    let tmp = dir.join(format!("tmp-{WEIGHTS_FILE}"));
    Array::save_safetensors(tensors.iter(), metadata, &tmp)
        .map_err(|e| EngineError::file(&tmp, format!("cannot write the weights ({e})")))?;
    std::fs::rename(&tmp, dir.join(WEIGHTS_FILE))
        .map_err(|e| EngineError::file(dir, format!("cannot write {WEIGHTS_FILE} ({e})")))
}
