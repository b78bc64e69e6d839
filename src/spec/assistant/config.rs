//! The assistant checkpoint's config, how a directory is recognised as one, and the load
//! checks against the target (each refusal is one sentence naming the file and the fix).

use crate::engine::error::{EngineError, Result};
use crate::engine::models::gemma4_text::{Args, FULL, SLIDING};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// Tokens drafted per round when neither `--num-draft-tokens` nor the checkpoint's
/// `generation_config.json:num_assistant_tokens` says: the measured optima reported for these
/// drafters are 1–4 tokens (spec §6, §8), so the middle of that range.
pub const DEFAULT_DRAFT_TOKENS: usize = 3;

/// The top-level fields of a `gemma4_assistant` config.json (Hugging Face's defaults).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct AssistantConfig {
    /// `model_type` (must be `gemma4_assistant`, or the unified alias).
    pub model_type: Option<String>,
    /// `architectures`.
    pub architectures: Option<Vec<String>>,
    /// The target's hidden size B.
    pub backbone_hidden_size: i32,
    /// Whether the head is the centroid ("ordered embeddings") head.
    pub use_ordered_embeddings: bool,
    /// Clusters of the centroid head.
    pub num_centroids: i32,
    /// Clusters kept per step by the centroid head.
    pub centroid_intermediate_top_k: i32,
    /// Whether the LM head is the embedding table (required).
    pub tie_word_embeddings: bool,
    /// The drafter's own Gemma 4 text decoder config.
    pub text_config: Option<Value>,
}

impl Default for AssistantConfig {
    fn default() -> Self {
        Self {
            model_type: None,
            architectures: None,
            backbone_hidden_size: 1536,
            use_ordered_embeddings: false,
            num_centroids: 2048,
            centroid_intermediate_top_k: 32,
            tie_word_embeddings: true,
            text_config: None,
        }
    }
}

/// What the loader needs to know about the target.
#[derive(Debug, Clone)]
pub struct TargetLayout {
    /// Hidden size.
    pub hidden_size: i32,
    /// Vocabulary size.
    pub vocab_size: i32,
    /// Type of every layer that owns a KV cache (cache index = layer index).
    pub cached_types: Vec<String>,
    /// Sliding window of the sliding layers.
    pub sliding_window: i32,
    /// The parsed target args (for head shapes per layer type).
    pub args: Args,
}

/// A checked assistant: its config, its text args and the donor cache index per type.
#[derive(Debug, Clone)]
pub struct Checked {
    /// The top-level config.
    pub config: AssistantConfig,
    /// The drafter's text decoder args.
    pub text: Args,
    /// Per drafter layer: `(is_full, donor cache index of the target)`.
    pub donors: Vec<(bool, usize)>,
    /// Sliding window the drafter's sliding layers attend.
    pub sliding_window: i32,
}

pub use crate::spec::dspark::checkpoint::checkpoint_dir;

/// Reads a JSON file; a missing or malformed file is one sentence naming it.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read it ({e})"))
        .and_then(|t| {
            serde_json::from_str(&t).map_err(|e| format!("is not valid JSON ({e}); fix the file"))
        })
        .map_err(|reason| EngineError::file(path, reason))
}

/// Whether the config says Gemma 4 assistant (`model_type` or `architectures[0]`).
fn says_assistant(c: &Value) -> bool {
    let mt = c.get("model_type").and_then(Value::as_str);
    let arch = c
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str);
    matches!(
        mt,
        Some("gemma4_assistant") | Some("gemma4_unified_assistant")
    ) || matches!(
        arch,
        Some("Gemma4AssistantForCausalLM") | Some("Gemma4UnifiedAssistantForCausalLM")
    )
}

/// Whether `path` holds a Gemma 4 assistant checkpoint (its config.json says so, or the
/// directory is named `*-assistant` and has a config.json).
pub fn is_artifact(path: &Path) -> bool {
    let dir = checkpoint_dir(path);
    let config = dir.join("config.json");
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with("-assistant"));
    match read_json(&config) {
        Ok(c) => says_assistant(&c) || named,
        Err(_) => false,
    }
}

/// Tokens per round from the checkpoint's `generation_config.json:num_assistant_tokens`, if any.
pub fn num_assistant_tokens(path: &Path) -> Option<usize> {
    let g = read_json(&checkpoint_dir(path).join("generation_config.json")).ok()?;
    g.get("num_assistant_tokens")
        .and_then(Value::as_u64)
        .filter(|&n| n > 0)
        .map(|n| n as usize)
}

/// `--num-draft-tokens` if given, else the checkpoint's `num_assistant_tokens`, else
/// [`DEFAULT_DRAFT_TOKENS`].
pub fn draft_tokens(given: Option<usize>, path: &Path) -> usize {
    given
        .or_else(|| num_assistant_tokens(path))
        .unwrap_or(DEFAULT_DRAFT_TOKENS)
}

impl TargetLayout {
    /// Reads the target's config.json in `dir` (a `gemma4_text` model).
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let c = read_json(&path)?;
        if c.get("model_type").and_then(Value::as_str) != Some("gemma4_text") {
            return Err(EngineError::file(
                &path,
                "is not a gemma4_text model, and a Gemma 4 assistant drafter only drafts for gemma4_text targets; use another --draft-kind",
            ));
        }
        let args: Args = serde_json::from_value(c).map_err(|e| {
            EngineError::file(&path, format!("cannot be read as gemma4_text ({e})"))
        })?;
        let types = args.layer_types();
        let cached = (args.num_hidden_layers - args.num_kv_shared_layers).max(0) as usize;
        Ok(Self {
            hidden_size: args.hidden_size,
            vocab_size: args.vocab_size,
            cached_types: types.into_iter().take(cached).collect(),
            sliding_window: args.sliding_window,
            args,
        })
    }
}

/// `(kv heads, head_dim)` of a layer of the given kind under `a` (gemma4_text's rules).
pub fn kv_shape(a: &Args, full: bool) -> (i32, i32) {
    let head_dim = match a.global_head_dim {
        Some(g) if full && g != 0 => g,
        _ => a.head_dim,
    };
    let heads = match a.num_global_key_value_heads {
        Some(g) if full && a.attention_k_eq_v => g,
        _ => a.num_key_value_heads,
    };
    (heads, head_dim)
}

/// Reads and checks the assistant config in `dir` against `target`.
pub fn check(dir: &Path, target: &TargetLayout) -> Result<Checked> {
    let path = dir.join("config.json");
    let raw = read_json(&path)?;
    let bad = |reason: String| EngineError::file(&path, reason);
    if !says_assistant(&raw) {
        return Err(bad(
            "is not a Gemma 4 assistant config (model_type must be \"gemma4_assistant\"); pass an assistant checkpoint".into(),
        ));
    }
    let config: AssistantConfig = serde_json::from_value(raw).map_err(|e| {
        bad(format!(
            "has a malformed assistant field ({e}); fix the file"
        ))
    })?;
    let text_value = config
        .text_config
        .clone()
        .ok_or_else(|| bad("has no text_config; an assistant config needs one".into()))?;
    let text: Args = serde_json::from_value(text_value)
        .map_err(|e| bad(format!("has a malformed text_config ({e}); fix the file")))?;
    if config.backbone_hidden_size != target.hidden_size {
        return Err(bad(format!(
            "has backbone_hidden_size {} but the target's hidden size is {}; use the assistant trained for this target",
            config.backbone_hidden_size, target.hidden_size
        )));
    }
    if text.vocab_size != target.vocab_size {
        return Err(bad(format!(
            "has vocab_size {} but the target's is {}; use the assistant trained for this target",
            text.vocab_size, target.vocab_size
        )));
    }
    if !config.tie_word_embeddings {
        return Err(bad(
            "has tie_word_embeddings false, but the assistant's head must be its embedding table; use an assistant with a tied head".into(),
        ));
    }
    if text.hidden_size < 1 || text.num_hidden_layers < 1 || text.num_attention_heads < 1 {
        return Err(bad(
            "has a non-positive text_config hidden_size, num_hidden_layers or num_attention_heads; fix the file".into(),
        ));
    }
    if text.enable_moe_block || text.hidden_size_per_layer_input.is_some_and(|v| v != 0) {
        return Err(bad(
            "enables MoE or per-layer inputs in text_config, which Gemma 4 assistants do not have; fix the file".into(),
        ));
    }
    if config.use_ordered_embeddings {
        let (c, k) = (config.num_centroids, config.centroid_intermediate_top_k);
        if c < 1 || k < 1 || k > c || text.vocab_size % c != 0 {
            return Err(bad(format!(
                "has num_centroids {c} / centroid_intermediate_top_k {k}, which need 1 <= top_k <= centroids and centroids dividing vocab_size {}; fix the file",
                text.vocab_size
            )));
        }
    }
    let types = text.layer_types();
    let mut donors = Vec::with_capacity(types.len());
    for t in &types {
        let full = match t.as_str() {
            FULL => true,
            SLIDING => false,
            other => {
                return Err(bad(format!(
                    "names layer type \"{other}\"; use \"{FULL}\" or \"{SLIDING}\""
                )))
            }
        };
        let donor = target
            .cached_types
            .iter()
            .rposition(|x| x == t)
            .ok_or_else(|| {
                bad(format!(
                    "has a \"{t}\" layer but the target has no \"{t}\" layer with its own keys/values to borrow; use the assistant trained for this target"
                ))
            })?;
        let want = kv_shape(&target.args, full);
        let (kv_heads, head_dim) = kv_shape(&text, full);
        if (kv_heads, head_dim) != want {
            return Err(bad(format!(
                "gives its \"{t}\" layers {kv_heads} KV heads of width {head_dim}, but the target's donor layer {donor} has {} of width {}; use the assistant trained for this target",
                want.0, want.1
            )));
        }
        if kv_heads < 1 || text.num_attention_heads % kv_heads != 0 {
            return Err(bad(format!(
                "has num_attention_heads {} not a multiple of the {kv_heads} KV heads of its \"{t}\" layers; fix the file",
                text.num_attention_heads
            )));
        }
        donors.push((full, donor));
    }
    if text.sliding_window < 1 {
        return Err(bad(
            "has a text_config sliding_window below 1; fix the file".into(),
        ));
    }
    Ok(Checked {
        sliding_window: text.sliding_window.min(target.sliding_window),
        config,
        text,
        donors,
    })
}
