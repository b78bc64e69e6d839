//! `mlxb models`: the supported types, and for a directory whether it is supported and why not;
//! a config field of the new families that is missing or inconsistent is one sentence naming
//! the field, exit code 2.

mod common;

use serde_json::{json, Value};

/// Runs `mlxb models [args]` and returns (exit code, stdout, stderr).
fn models(args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["models"];
    all.extend_from_slice(args);
    common::run_mlxb(&all)
}

/// Checks `dir` is supported, then that each config edit makes it unsupported with an error
/// naming `field` (restoring the config after each).
/// A config field and an edit that makes it bad.
type BadEdit<'a> = (&'a str, fn(&mut Value));

fn check_family(config: Value, dtype: &str, edits: &[BadEdit]) {
    let dir = tempfile::tempdir().unwrap();
    common::make_model_with(dir.path(), &config, dtype, None, &["--no-tokenizer"]);
    let d = dir.path().to_str().unwrap();
    let (code, out, err) = models(&["--model", d]);
    assert_eq!(code, 0, "the untouched model must be supported: {err}");
    assert!(
        out.contains("supported") && out.contains(config["model_type"].as_str().unwrap()),
        "{out}"
    );
    let original = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    for (field, edit) in edits {
        common::edit_config(dir.path(), edit);
        let (code, _, err) = models(&["--model", d]);
        common::assert_refused(&format!("a bad `{field}`"), code, &err, &[field]);
        std::fs::write(dir.path().join("config.json"), &original).unwrap();
    }
}

#[test]
fn lists_supported_types() {
    let (code, out, _) = models(&[]);
    assert_eq!(code, 0);
    for t in [
        "llama",
        "gemma2",
        "gemma3_text",
        "gemma4_text",
        "minicpm",
        "qwen3_moe",
        "qwen3_5",
        "qwen3_5_moe",
    ] {
        assert!(out.lines().any(|l| l.trim() == t), "{t} not listed: {out}");
    }
    let (code, out, _) = models(&["--json"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v["model_types"].as_array().unwrap().len() >= 8);
}

#[test]
fn unsupported_directories_say_why() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = models(&["--model", dir.path().to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("config.json"), "{err}");
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "mamba2"}"#,
    )
    .unwrap();
    let (code, out, err) = models(&["--model", dir.path().to_str().unwrap(), "--json"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("mamba2") && err.contains("not supported"),
        "{err}"
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["supported"], false);
}

#[test]
fn gemma2_and_minicpm_bad_fields() {
    check_family(
        json!({"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 64}),
        "bf16",
        &[
            ("head_dim", |c| {
                c.as_object_mut().unwrap().remove("head_dim");
            }),
            ("num_key_value_heads", |c| {
                c["num_key_value_heads"] = json!(3)
            }),
            ("final_logit_softcapping", |c| {
                c["final_logit_softcapping"] = json!(0.0)
            }),
        ],
    );
    check_family(
        json!({"model_type": "minicpm", "hidden_size": 64, "dim_model_base": 16, "num_hidden_layers": 1,
            "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 64, "scale_depth": 1.4, "scale_emb": 12}),
        "bf16",
        &[
            ("scale_depth", |c| {
                c.as_object_mut().unwrap().remove("scale_depth");
            }),
            ("dim_model_base", |c| c["dim_model_base"] = json!(0)),
        ],
    );
}

#[test]
fn moe_bad_expert_counts() {
    check_family(
        json!({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "moe_intermediate_size": 32, "rope_theta": 10000.0,
            "tie_word_embeddings": true, "max_position_embeddings": 512, "norm_topk_prob": true}),
        "f32",
        &[
            ("num_experts_per_tok", |c| {
                c["num_experts_per_tok"] = json!(5)
            }),
            ("decoder_sparse_step", |c| {
                c["decoder_sparse_step"] = json!(0)
            }),
            ("mlp_only_layers", |c| {
                c.as_object_mut().unwrap().remove("mlp_only_layers");
            }),
        ],
    );
}

#[test]
fn hybrid_and_gemma4_bad_layouts() {
    check_family(
        json!({"model_type": "qwen3_5", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 64,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "full_attention_interval": 2}),
        "bf16",
        &[
            ("num_hidden_layers", |c| {
                c["full_attention_interval"] = json!(3)
            }),
            ("linear_num_value_heads", |c| {
                c["linear_num_value_heads"] = json!(3)
            }),
            ("num_experts_per_tok", |c| {
                c["num_experts"] = json!(2);
                c["num_experts_per_tok"] = json!(3);
            }),
        ],
    );
    check_family(
        json!({"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 64,
            "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 16, "num_key_value_heads": 2,
            "vocab_size": 64, "vocab_size_per_layer_input": 64, "num_kv_shared_layers": 1,
            "hidden_size_per_layer_input": 8, "sliding_window": 8, "sliding_window_pattern": 2}),
        "bf16",
        &[
            ("layer_types", |c| {
                c["layer_types"] = json!(["sliding_attention", "full_attention"])
            }),
            ("num_kv_shared_layers", |c| {
                c["num_kv_shared_layers"] = json!(3)
            }),
            ("top_k_experts", |c| {
                c["enable_moe_block"] = json!(true);
                c["num_experts"] = json!(2);
                c["top_k_experts"] = json!(4);
                c["moe_intermediate_size"] = json!(16);
            }),
        ],
    );
}
