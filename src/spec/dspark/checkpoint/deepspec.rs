//! DeepSpec's Hugging Face format read into a [`DsparkConfig`]: `config.json` holds a copy of
//! the target's text config plus the DSpark fields, under `architectures: [Qwen3DSparkModel |
//! Gemma4DSparkModel]`.

use super::{target_rope, DsparkConfig, LayerStyle, SeqHead};
use crate::engine::error::{EngineError, Result};
use serde_json::Value;
use std::path::Path;

/// `architectures[0]` of a config.json, if it names a DSpark model.
pub(super) fn architecture(config: &Value) -> Option<&str> {
    config
        .get("architectures")?
        .get(0)?
        .as_str()
        .filter(|a| a.ends_with("DSparkModel"))
}

fn int(v: &Value, key: &str, file: &Path) -> Result<i64> {
    v.get(key).and_then(Value::as_i64).ok_or_else(|| {
        EngineError::file(
            file,
            format!("`{key}` is missing or not an integer; a DeepSpec DSpark config.json has it"),
        )
    })
}

fn opt_int(v: &Value, key: &str) -> Option<i64> {
    v.get(key).and_then(Value::as_i64)
}

/// DeepSpec's config.json (`deepspec/modeling/dspark/{qwen3,gemma4}/config.py`).
pub(super) fn read(v: &Value, file: &Path) -> Result<DsparkConfig> {
    let arch = v
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or("(none)");
    let style = match arch {
        "Qwen3DSparkModel" => LayerStyle::Qwen3,
        "Gemma4DSparkModel" => LayerStyle::Gemma4,
        other => {
            return Err(EngineError::file(
                file,
                format!("architectures[0] is \"{other}\"; mlxb loads Qwen3DSparkModel and Gemma4DSparkModel drafters (or its own dspark.json)"),
            ))
        }
    };
    let d = int(v, "hidden_size", file)? as i32;
    let heads = int(v, "num_attention_heads", file)? as i32;
    let taps = v
        .get("target_layer_ids")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
        .ok_or_else(|| {
            EngineError::file(
                file,
                "`target_layer_ids` is missing or not a list of integers",
            )
        })?;
    let markov_rank = opt_int(v, "markov_rank").unwrap_or(256) as i32;
    let seq_head = match (
        markov_rank,
        v.get("markov_head_type").and_then(Value::as_str),
    ) {
        (0, _) => SeqHead::None,
        (_, None | Some("vanilla")) => SeqHead::Markov,
        (_, Some("rnn")) => SeqHead::Rnn,
        (_, Some("gated")) => SeqHead::Gated,
        (_, Some(other)) => {
            return Err(EngineError::file(
                file,
                format!("`markov_head_type` \"{other}\" is unknown (known: vanilla, rnn, gated)"),
            ))
        }
    };
    let flag = |key: &str, default: bool| v.get(key).and_then(Value::as_bool).unwrap_or(default);
    let mut c = DsparkConfig {
        variant: "dspark".into(),
        layer_style: style,
        hidden_size: d,
        vocab_size: int(v, "vocab_size", file)? as i32,
        num_hidden_layers: int(v, "num_hidden_layers", file)? as i32,
        num_attention_heads: heads,
        num_key_value_heads: opt_int(v, "num_key_value_heads").unwrap_or(heads as i64) as i32,
        head_dim: opt_int(v, "head_dim").unwrap_or((d / heads.max(1)) as i64) as i32,
        intermediate_size: int(v, "intermediate_size", file)? as i32,
        rms_norm_eps: v
            .get("rms_norm_eps")
            .and_then(Value::as_f64)
            .unwrap_or(1e-6),
        rope_theta: 10000.0,
        block_size: int(v, "block_size", file)?.max(0) as usize,
        target_layer_ids: taps,
        num_target_layers: opt_int(v, "num_target_layers").map(|n| n.max(0) as usize),
        mask_token_id: int(v, "mask_token_id", file)?,
        seq_head,
        markov_rank,
        confidence_head: flag("enable_confidence_head", true),
        confidence_head_with_markov: flag("confidence_head_with_markov", true) && markov_rank > 0,
        target_model_type: v
            .get("target_text_model_type")
            .or_else(|| v.get("model_type"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        ..DsparkConfig::default()
    };
    match style {
        LayerStyle::Qwen3 => {
            let (theta, scaling) = target_rope(v);
            c.rope_theta = theta;
            c.rope_scaling = scaling;
        }
        LayerStyle::Gemma4 => gemma4_fields(&mut c, v, file)?,
    }
    Ok(c)
}

/// Gemma4 specifics: global head geometry, K==V, scale 1, the full-attention (proportional,
/// partial) RoPE, the final soft-cap and the `sqrt(d)` embedding scale.
fn gemma4_fields(c: &mut DsparkConfig, v: &Value, file: &Path) -> Result<()> {
    if v.get("enable_moe_block").and_then(Value::as_bool) == Some(true) {
        return Err(EngineError::file(
            file,
            "`enable_moe_block` is true; DeepSpec's Gemma4 drafter has dense layers only",
        ));
    }
    if let Some(g) = opt_int(v, "global_head_dim").filter(|&g| g > 0) {
        c.head_dim = g as i32;
    }
    c.attention_k_eq_v = v
        .get("attention_k_eq_v")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if c.attention_k_eq_v {
        if let Some(n) = opt_int(v, "num_global_key_value_heads") {
            c.num_key_value_heads = n as i32;
        }
    }
    c.attention_scale = Some(1.0);
    c.scale_embeddings = true;
    c.final_logit_softcapping = match v.get("final_logit_softcapping") {
        Some(Value::Null) => None,
        Some(x) => x.as_f64(),
        None => Some(30.0),
    };
    let full = v
        .get("rope_parameters")
        .and_then(|p| p.get("full_attention"))
        .cloned()
        .unwrap_or_else(|| {
            serde_json::json!({
                "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"
            })
        });
    c.rope_theta = full
        .get("rope_theta")
        .and_then(Value::as_f64)
        .unwrap_or(1_000_000.0);
    c.rope_scaling = Some(full);
    Ok(())
}
