//! Rebuilding `tokenizer.json` and `tokenizer_config.json` from a GGUF's tokenizer metadata.
//!
//! Two vocabulary kinds are supported, the ones llama.cpp calls `gpt2` (byte-level BPE with
//! explicit merges, e.g. SmolLM2) and `llama` (SentencePiece BPE with scores and byte fallback,
//! e.g. Gemma). The output follows what Hugging Face ships for those families, so both mlxb's
//! tokenizer loader and mlx-lm's (transformers) read it as-is.

use super::{GgufHeader, MetaValue};
use crate::engine::error::{EngineError, Result};
use serde_json::{json, Map, Value};
use std::collections::HashMap;

/// llama.cpp's token types.
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// The rebuilt tokenizer files and the special ids the model config needs.
#[derive(Debug)]
pub struct TokenizerFiles {
    /// Contents of tokenizer.json.
    pub tokenizer_json: Value,
    /// Contents of tokenizer_config.json.
    pub tokenizer_config: Value,
    /// Beginning-of-sequence id.
    pub bos_id: Option<u32>,
    /// Ids that end generation: EOS, then end-of-turn/end-of-message ids when the file has them.
    pub eos_ids: Vec<u32>,
    /// Padding id.
    pub pad_id: Option<u32>,
    /// Number of tokens.
    pub vocab_len: usize,
}

/// GPT-2's byte → printable-character table (`bytes_to_unicode`).
pub fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let cp = if printable {
            b
        } else {
            extra += 1;
            255 + extra
        };
        table[b as usize] = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

/// llama.cpp's `tokenizer.ggml.pre` → the normalizer and pre-tokenizer Hugging Face uses for
/// that family.
fn byte_level_pre_tokenizer(pre: &str) -> Option<(Value, Value)> {
    let pre_tok = byte_level_split(pre)?;
    // Qwen2's tokenizer composes Unicode (NFC) before it splits.
    let normalizer = if pre == "qwen2" {
        json!({"type": "NFC"})
    } else {
        Value::Null
    };
    Some((normalizer, pre_tok))
}

/// The byte-level pre-tokenizer of a `tokenizer.ggml.pre` name.
fn byte_level_split(pre: &str) -> Option<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let isolated_split = |regex: &str| {
        json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                byte_level(false)
            ]
        })
    };
    // Llama 3 groups digits in threes; Qwen2 splits every digit.
    const QWEN2_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    const LLAMA3_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    match pre {
        "default" | "gpt2" | "gpt-2" => Some(byte_level(true)),
        // Single digits, then GPT-2's split (llama.cpp's smollm/starcoder/refact rules).
        "smollm" | "starcoder" | "refact" => Some(json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]
        })),
        "llama3" | "llama-v3" | "llama-bpe" => Some(isolated_split(LLAMA3_SPLIT)),
        "qwen2" => Some(isolated_split(QWEN2_SPLIT)),
        _ => None,
    }
}

/// Builds the tokenizer files described by `h`'s `tokenizer.*` metadata.
pub fn build(h: &GgufHeader, arch: &str, context_length: Option<u64>) -> Result<TokenizerFiles> {
    let kind = h.str("tokenizer.ggml.model")?;
    let raw_tokens = h.strings("tokenizer.ggml.tokens")?;
    let n = raw_tokens.len();
    let types = token_types(h, n)?;
    let ids = SpecialIds::read(h, n)?;
    let add_space_prefix = h
        .bool_opt("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(false);

    let Pipeline {
        tokens,
        model,
        normalizer,
        pre_tokenizer,
        decoder,
        default_bos,
        byte_level,
    } = match kind {
        "gpt2" => gpt2_pipeline(h, &raw_tokens)?,
        "llama" => llama_pipeline(h, arch, &raw_tokens, ids.unk, add_space_prefix)?,
        other => {
            return Err(EngineError::file(
                &h.path,
                format!("uses the tokenizer model `{other}`, which mlxb cannot rebuild (it supports gpt2 byte-level BPE and llama SentencePiece BPE)"),
            ))
        }
    };

    let add_bos = h
        .bool_opt("tokenizer.ggml.add_bos_token")?
        .unwrap_or(default_bos)
        && ids.bos.is_some();
    let add_eos = h.bool_opt("tokenizer.ggml.add_eos_token")?.unwrap_or(false) && ids.eos.is_some();
    let tok = |i: Option<u32>| i.map(|i| tokens[i as usize].clone());
    let added = added_tokens(&raw_tokens, &tokens, &types, byte_level);
    let post_processor = post_processor(
        byte_level,
        template_processor(
            add_bos.then(|| tok(ids.bos)).flatten(),
            add_eos.then(|| tok(ids.eos)).flatten(),
            ids.bos,
            ids.eos,
        ),
    );
    let tokenizer_json = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": post_processor,
        "decoder": decoder, "model": model,
    });
    let named = [
        ("bos_token", tok(ids.bos)),
        ("eos_token", tok(ids.eos)),
        ("unk_token", tok(ids.unk)),
        ("pad_token", tok(ids.pad)),
    ];
    Ok(TokenizerFiles {
        tokenizer_json,
        tokenizer_config: tokenizer_config(h, add_bos, add_eos, named, context_length),
        bos_id: ids.bos,
        eos_ids: ids.eos_ids,
        pad_id: ids.pad,
        vocab_len: n,
    })
}

/// llama.cpp's type of every token (normal when the file has none).
fn token_types(h: &GgufHeader, n: usize) -> Result<Vec<i64>> {
    match h
        .get("tokenizer.ggml.token_type")
        .and_then(MetaValue::as_array)
    {
        Some(a) if a.len() == n => Ok(a.iter().map(|v| v.as_f64().unwrap_or(1.0) as i64).collect()),
        Some(_) => Err(h.missing("tokenizer.ggml.token_type", "one entry per token")),
        None => Ok(vec![1; n]),
    }
}

/// The special token ids of the metadata, each checked against the vocabulary size.
struct SpecialIds {
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    /// EOS, then the end-of-turn and end-of-message ids when present (no repeats).
    eos_ids: Vec<u32>,
}

impl SpecialIds {
    fn read(h: &GgufHeader, n: usize) -> Result<Self> {
        let id = |key: &str| -> Result<Option<u32>> {
            match h.uint_opt(key)? {
                Some(i) if (i as usize) < n => Ok(Some(i as u32)),
                Some(i) => Err(EngineError::file(
                    &h.path,
                    format!("metadata `{key}` is {i}, outside the vocabulary of {n} tokens; the file is corrupt"),
                )),
                None => Ok(None),
            }
        };
        let (bos, eos, unk, pad) = (
            id("tokenizer.ggml.bos_token_id")?,
            id("tokenizer.ggml.eos_token_id")?,
            id("tokenizer.ggml.unknown_token_id")?,
            id("tokenizer.ggml.padding_token_id")?,
        );
        let mut eos_ids: Vec<u32> = eos.into_iter().collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(i) = id(key)? {
                if !eos_ids.contains(&i) {
                    eos_ids.push(i);
                }
            }
        }
        Ok(Self {
            bos,
            eos,
            unk,
            pad,
            eos_ids,
        })
    }
}

/// The vocabulary-kind-specific parts of `tokenizer.json`.
struct Pipeline {
    /// Tokens as the rebuilt vocabulary spells them.
    tokens: Vec<String>,
    model: Value,
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    /// Whether BOS is added when the metadata does not say.
    default_bos: bool,
    /// Whether this is a byte-level vocabulary.
    byte_level: bool,
}

/// llama.cpp's `gpt2` vocabulary: byte-level BPE with explicit merges.
fn gpt2_pipeline(h: &GgufHeader, raw_tokens: &[&str]) -> Result<Pipeline> {
    let pre = h
        .get("tokenizer.ggml.pre")
        .and_then(MetaValue::as_str)
        .unwrap_or("default");
    let (normalizer, pre_tok) = byte_level_pre_tokenizer(pre).ok_or_else(|| {
        EngineError::file(
            &h.path,
            format!(
                "uses the pre-tokenizer `{pre}`, which mlxb cannot rebuild (it knows default/gpt2, smollm, llama-bpe and qwen2)"
            ),
        )
    })?;
    let table = byte_to_char();
    let alphabet: std::collections::HashSet<char> = table.iter().copied().collect();
    let tokens: Vec<String> = raw_tokens
        .iter()
        .map(|t| {
            if t.chars().all(|c| alphabet.contains(&c)) {
                (*t).to_owned()
            } else {
                t.bytes().map(|b| table[b as usize]).collect()
            }
        })
        .collect();
    let merges: Vec<Value> = h
        .strings("tokenizer.ggml.merges")?
        .iter()
        .map(|m| {
            let (l, r) = m.split_once(' ').unwrap_or((m, ""));
            json!([l, r])
        })
        .collect();
    let model = json!({
        "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
        "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
        "vocab": vocab_map(&tokens), "merges": merges,
    });
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    Ok(Pipeline {
        tokens,
        model,
        normalizer,
        pre_tokenizer: pre_tok,
        decoder,
        default_bos: false,
        byte_level: true,
    })
}

/// llama.cpp's `llama` vocabulary: SentencePiece BPE with scores and byte fallback.
fn llama_pipeline(
    h: &GgufHeader,
    arch: &str,
    raw_tokens: &[&str],
    unk: Option<u32>,
    add_space_prefix: bool,
) -> Result<Pipeline> {
    let n = raw_tokens.len();
    // SentencePiece writes spaces as U+2581; llama.cpp's GGUFs sometimes store plain spaces.
    let tokens: Vec<String> = raw_tokens
        .iter()
        .map(|t| t.replace(' ', "\u{2581}"))
        .collect();
    let scores: Vec<f64> = if arch.starts_with("gemma") {
        // Gemma's merge order is the order of the vocabulary, as transformers rebuilds it.
        (0..n).map(|i| -(i as f64)).collect()
    } else {
        match h.get("tokenizer.ggml.scores").and_then(MetaValue::as_array) {
            Some(a) if a.len() == n => a.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect(),
            _ => return Err(h.missing("tokenizer.ggml.scores", "one score per token")),
        }
    };
    let unk_token = unk.map(|i| tokens[i as usize].clone());
    let merges = spm_merges(&tokens, &scores);
    let model = json!({
        "type": "BPE", "dropout": null, "unk_token": unk_token, "continuing_subword_prefix": null,
        "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
        "vocab": vocab_map(&tokens), "merges": merges,
    });
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let normalizer = if add_space_prefix {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, replace]})
    } else {
        replace
    };
    let mut steps = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        steps.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let decoder = json!({"type": "Sequence", "decoders": steps});
    Ok(Pipeline {
        tokens,
        model,
        normalizer,
        pre_tokenizer: Value::Null,
        decoder,
        default_bos: true,
        byte_level: false,
    })
}

/// `added_tokens`: the control and user-defined tokens.
fn added_tokens(
    raw_tokens: &[&str],
    tokens: &[String],
    types: &[i64],
    byte_level: bool,
) -> Vec<Value> {
    let alphabet: Option<std::collections::HashSet<char>> =
        byte_level.then(|| byte_to_char().iter().copied().collect());
    (0..tokens.len())
        .filter(|&i| types[i] == TYPE_CONTROL || types[i] == TYPE_USER_DEFINED)
        // A control token outside the byte alphabet is a llama.cpp mislabel (transformers skips it too).
        .filter(|&i| alphabet.as_ref().is_none_or(|a| raw_tokens[i].chars().all(|c| a.contains(&c))))
        .map(|i| {
            json!({
                "id": i, "content": tokens[i], "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": types[i] == TYPE_CONTROL,
            })
        })
        .collect()
}

/// The post-processor: byte-level vocabularies put ByteLevel before the BOS/EOS template.
fn post_processor(byte_level: bool, template: Option<Value>) -> Value {
    match (byte_level, template) {
        (true, None) => {
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
        }
        (true, Some(t)) => json!({"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}, t]}),
        (false, p) => p.unwrap_or(Value::Null),
    }
}

/// `tokenizer_config.json`: the fast-tokenizer class, BOS/EOS flags, the named special tokens
/// present, the context length and the chat template when the file has them.
fn tokenizer_config(
    h: &GgufHeader,
    add_bos: bool,
    add_eos: bool,
    named: [(&str, Option<String>); 4],
    context_length: Option<u64>,
) -> Value {
    let mut cfg = Map::new();
    cfg.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    cfg.insert("add_bos_token".into(), json!(add_bos));
    cfg.insert("add_eos_token".into(), json!(add_eos));
    for (key, token) in named {
        if let Some(t) = token {
            cfg.insert(key.into(), json!(t));
        }
    }
    cfg.insert("clean_up_tokenization_spaces".into(), json!(false));
    if let Some(c) = context_length {
        cfg.insert("model_max_length".into(), json!(c));
    }
    if let Some(t) = h.get("tokenizer.chat_template").and_then(MetaValue::as_str) {
        cfg.insert("chat_template".into(), json!(t));
    }
    Value::Object(cfg)
}

fn vocab_map(tokens: &[String]) -> Value {
    let mut m = Map::new();
    for (i, t) in tokens.iter().enumerate() {
        m.insert(t.clone(), json!(i));
    }
    Value::Object(m)
}

/// A `TemplateProcessing` post-processor adding BOS and/or EOS, as transformers builds it.
fn template_processor(
    bos: Option<String>,
    eos: Option<String>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
) -> Option<Value> {
    if bos.is_none() && eos.is_none() {
        return None;
    }
    let special = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    let part = |s: &str, type_id: u32| {
        let mut v = Vec::new();
        v.extend(bos.as_deref().map(|b| special(b, type_id)));
        v.push(seq(s, type_id));
        v.extend(eos.as_deref().map(|e| special(e, type_id)));
        v
    };
    let mut specials = Map::new();
    for (t, i) in [(bos.as_deref(), bos_id), (eos.as_deref(), eos_id)] {
        if let (Some(t), Some(i)) = (t, i) {
            specials.insert(t.to_owned(), json!({"id": t, "ids": [i], "tokens": [t]}));
        }
    }
    let mut pair = part("A", 0);
    pair.extend(part("B", 1));
    Some(
        json!({"type": "TemplateProcessing", "single": part("A", 0), "pair": pair, "special_tokens": specials}),
    )
}

/// Merges implied by a SentencePiece BPE vocabulary, exactly as transformers'
/// `generate_merges` derives them: every split of every token into two vocabulary pieces,
/// ordered by the token's score (best first), then by longer left piece, then longer right piece.
pub fn spm_merges(tokens: &[String], scores: &[f64]) -> Vec<[String; 2]> {
    let mut vocab: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.as_str(), i);
    }
    // dict(zip(tokens, scores)): first occurrence fixes the order, the last one the score.
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    let mut score_of: HashMap<&str, f64> = HashMap::with_capacity(tokens.len());
    for (t, &s) in tokens.iter().zip(scores) {
        if score_of.insert(t.as_str(), s).is_none() {
            order.push(t.as_str());
        }
    }
    struct Merge<'a> {
        l: &'a str,
        r: &'a str,
        score: f64,
        ll: usize,
        rl: usize,
    }
    let mut merges: Vec<Merge> = Vec::new();
    for t in order {
        let score = score_of[t];
        let mut local: Vec<Merge> = t
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = t.split_at(at);
                (vocab.contains_key(l) && vocab.contains_key(r)).then(|| Merge {
                    l,
                    r,
                    score,
                    ll: l.chars().count(),
                    rl: r.chars().count(),
                })
            })
            .collect();
        local.sort_by_key(|m| (vocab[m.l], vocab[m.r]));
        merges.extend(local);
    }
    // Python's sorted(..., reverse=True) is stable: equal keys keep their order.
    merges.sort_by(|a, b| {
        b.score
            .partial_cmp(&a.score)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(b.ll.cmp(&a.ll))
            .then(b.rl.cmp(&a.rl))
    });
    merges
        .into_iter()
        .map(|m| [m.l.to_owned(), m.r.to_owned()])
        .collect()
}
