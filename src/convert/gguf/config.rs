//! The MLX `config.json` and `generation_config.json` an imported GGUF gets: hyperparameters
//! read from its `{arch}.*` metadata, mapped as mlx-lm's model classes name them.

use super::{vocab, GgufHeader};
use crate::engine::error::{EngineError, Result};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// The architectures mlxb imports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Arch {
    Llama,
    Qwen2,
    Gemma3,
}

impl Arch {
    /// The `model_type` written to config.json.
    pub(super) fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3_text",
        }
    }
}

/// Hyperparameters read from `{arch}.*` metadata.
pub(super) struct Hparams {
    pub(super) arch: Arch,
    pub(super) prefix: String,
    pub(super) n_layer: u64,
    pub(super) hidden: u64,
    pub(super) ffn: u64,
    pub(super) n_head: u64,
    pub(super) n_head_kv: u64,
    pub(super) head_dim: u64,
    pub(super) eps: f64,
    pub(super) rope_theta: Option<f64>,
    pub(super) context: Option<u64>,
}

pub(super) fn hparams(h: &GgufHeader) -> Result<Hparams> {
    let prefix = h.str("general.architecture")?.to_owned();
    let arch = match prefix.as_str() {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "gemma3" => Arch::Gemma3,
        other => {
            return Err(EngineError::file(
                &h.path,
                format!("has architecture `{other}`, which mlxb cannot import (it imports llama, qwen2 and gemma3)"),
            ))
        }
    };
    let k = |s: &str| format!("{prefix}.{s}");
    let hidden = h.uint(&k("embedding_length"))?;
    let n_head = h.uint(&k("attention.head_count"))?;
    if n_head == 0 || hidden == 0 {
        return Err(h.missing(&k("attention.head_count"), "a positive integer"));
    }
    let n_head_kv = h.uint_opt(&k("attention.head_count_kv"))?.unwrap_or(n_head);
    let head_dim = h
        .uint_opt(&k("attention.key_length"))?
        .unwrap_or(hidden / n_head);
    if n_head_kv == 0 || n_head % n_head_kv != 0 || head_dim == 0 || head_dim % 2 != 0 {
        return Err(EngineError::file(
            &h.path,
            format!("has inconsistent attention metadata ({n_head} heads, {n_head_kv} key/value heads, head size {head_dim})"),
        ));
    }
    if arch == Arch::Qwen2 && head_dim * n_head != hidden {
        return Err(EngineError::file(
            &h.path,
            format!("has a head size of {head_dim} with {n_head} heads for a hidden size of {hidden}; a qwen2 model's head size is hidden size / heads"),
        ));
    }
    if let Some(v) = h.uint_opt(&k("attention.value_length"))? {
        if v != head_dim {
            return Err(EngineError::file(
                &h.path,
                "has different key and value head sizes, which mlxb cannot import",
            ));
        }
    }
    if let Some(r) = h.uint_opt(&k("rope.dimension_count"))? {
        if r != head_dim {
            return Err(EngineError::file(
                &h.path,
                format!("applies rotary embeddings to {r} of {head_dim} head dimensions (partial rotary), which mlxb cannot import"),
            ));
        }
    }
    if let Some(t) = h.get(&k("rope.scaling.type")).and_then(|v| v.as_str()) {
        if t != "none" && !(t == "linear" && arch == Arch::Gemma3) {
            return Err(EngineError::file(
                &h.path,
                format!("uses `{t}` rope scaling, which mlxb cannot import"),
            ));
        }
    }
    Ok(Hparams {
        arch,
        n_layer: h.uint(&k("block_count"))?,
        hidden,
        ffn: h.uint(&k("feed_forward_length"))?,
        n_head,
        n_head_kv,
        head_dim,
        eps: h
            .float_opt(&k("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| h.missing(&k("attention.layer_norm_rms_epsilon"), "a number"))?,
        rope_theta: h.float_opt(&k("rope.freq_base"))?,
        context: h.uint_opt(&k("context_length"))?,
        prefix,
    })
}

/// An f32 metadata value as JSON, written with its shortest decimal form (1e-05, not
/// 9.999999747378752e-06), as Hugging Face configs write it.
pub(super) fn f32_json(v: f64) -> Value {
    let short: f64 = format!("{}", v as f32).parse().unwrap_or(v);
    json!(short)
}

pub(super) fn one_or_many(ids: &[u32]) -> Value {
    match ids {
        [one] => json!(one),
        many => json!(many),
    }
}

pub(super) fn model_config(
    h: &GgufHeader,
    hp: &Hparams,
    tok: &vocab::TokenizerFiles,
    tied: bool,
) -> Result<Map<String, Value>> {
    let k = |s: &str| format!("{}.{s}", hp.prefix);
    // The embedding's row count is what the weights hold (vocabularies may be padded).
    let embedding_rows = h
        .tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .and_then(|t| t.dims.get(1).copied());
    let vocab_size = match embedding_rows {
        Some(rows) => rows,
        None => h
            .uint_opt(&k("vocab_size"))?
            .unwrap_or(tok.vocab_len as u64),
    };
    let mut c = Map::new();
    let mut set = |key: &str, v: Value| {
        c.insert(key.to_owned(), v);
    };
    set("hidden_size", json!(hp.hidden));
    set("num_hidden_layers", json!(hp.n_layer));
    set("intermediate_size", json!(hp.ffn));
    set("num_attention_heads", json!(hp.n_head));
    set("num_key_value_heads", json!(hp.n_head_kv));
    set("head_dim", json!(hp.head_dim));
    set("rms_norm_eps", f32_json(hp.eps));
    set("vocab_size", json!(vocab_size));
    set("tie_word_embeddings", json!(tied));
    if let Some(ctx) = hp.context {
        set("max_position_embeddings", json!(ctx));
    }
    if let Some(b) = tok.bos_id {
        set("bos_token_id", json!(b));
    }
    if !tok.eos_ids.is_empty() {
        set("eos_token_id", one_or_many(&tok.eos_ids));
    }
    if let Some(p) = tok.pad_id {
        set("pad_token_id", json!(p));
    }
    match hp.arch {
        Arch::Llama => {
            set("architectures", json!(["LlamaForCausalLM"]));
            set("model_type", json!("llama"));
            set("hidden_act", json!("silu"));
            set("attention_bias", json!(false));
            set("mlp_bias", json!(false));
            set("rope_theta", f32_json(hp.rope_theta.unwrap_or(10_000.0)));
            set("rope_scaling", Value::Null);
        }
        Arch::Qwen2 => {
            // mlx-lm's qwen2 always gives q/k/v a bias; its head size is hidden / heads.
            set("architectures", json!(["Qwen2ForCausalLM"]));
            set("model_type", json!("qwen2"));
            set("hidden_act", json!("silu"));
            set("rope_theta", f32_json(hp.rope_theta.unwrap_or(1_000_000.0)));
            set("rope_scaling", Value::Null);
        }
        Arch::Gemma3 => {
            // llama.cpp fixes what the GGUF does not store: every 6th layer is global, local
            // layers use rope base 10000, and queries are scaled by head_dim (hidden/heads for 27B).
            let pattern = h
                .uint_opt(&k("attention.sliding_window_pattern"))?
                .unwrap_or(6)
                .max(1);
            let layer_types: Vec<&str> = (0..hp.n_layer)
                .map(|i| {
                    if (i + 1) % pattern == 0 {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    }
                })
                .collect();
            let scalar = if hp.n_layer == 62 {
                hp.hidden / hp.n_head
            } else {
                hp.head_dim
            };
            let rope_scaling = match h.float_opt(&k("rope.scaling.factor"))? {
                Some(f)
                    if h.get(&k("rope.scaling.type")).and_then(|v| v.as_str())
                        == Some("linear") =>
                {
                    json!({"rope_type": "linear", "factor": f32_json(f)})
                }
                _ => Value::Null,
            };
            set("architectures", json!(["Gemma3ForCausalLM"]));
            set("model_type", json!("gemma3_text"));
            set("hidden_activation", json!("gelu_pytorch_tanh"));
            set("rope_theta", f32_json(hp.rope_theta.unwrap_or(1_000_000.0)));
            set("rope_local_base_freq", json!(10_000.0));
            set("rope_scaling", rope_scaling);
            set("query_pre_attn_scalar", json!(scalar));
            set(
                "sliding_window",
                json!(h.uint_opt(&k("attention.sliding_window"))?.unwrap_or(512)),
            );
            set("sliding_window_pattern", json!(pattern));
            set("layer_types", json!(layer_types));
            set("final_logit_softcapping", Value::Null);
            set("attn_logit_softcapping", Value::Null);
        }
    }
    Ok(c)
}

/// `generation_config.json`: the BOS, EOS and padding ids the vocabulary names.
pub(super) fn generation_config(tok: &vocab::TokenizerFiles) -> Value {
    let mut gen = Map::new();
    if let Some(b) = tok.bos_id {
        gen.insert("bos_token_id".into(), json!(b));
    }
    if !tok.eos_ids.is_empty() {
        gen.insert("eos_token_id".into(), one_or_many(&tok.eos_ids));
    }
    if let Some(p) = tok.pad_id {
        gen.insert("pad_token_id".into(), json!(p));
    }
    Value::Object(gen)
}

/// mlx-lm's `quantization` section: the most common bit width as the default, per-module
/// overrides for the others.
pub(super) fn quantization_section(bits: &BTreeMap<String, i32>) -> Option<Value> {
    let mut counts: BTreeMap<i32, usize> = BTreeMap::new();
    for &b in bits.values() {
        *counts.entry(b).or_default() += 1;
    }
    let default = counts
        .iter()
        .max_by_key(|(b, n)| (**n, -**b))
        .map(|(b, _)| *b)?;
    let mut q = Map::new();
    q.insert("group_size".into(), json!(32));
    q.insert("bits".into(), json!(default));
    q.insert("mode".into(), json!("affine"));
    for (module, &b) in bits {
        if b != default {
            q.insert(module.clone(), json!({"group_size": 32, "bits": b}));
        }
    }
    Some(Value::Object(q))
}
