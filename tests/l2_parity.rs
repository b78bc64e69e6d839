//! L2 against its oracle: mlx-optiq 0.7.7's `optiq eval` path (in `.venv-optiq`) with a
//! per-layer KV allocation in optiq's own `kv_config.json` format, and `mlxb parity --l2` on
//! the same allocation, bit for bit (ids and full-vocabulary logprobs), on tiny random models of
//! three families, mixed bits and group sizes, layers left at full precision, per-layer
//! quantized weights, the file beside the model or given with `--kv-config`.

mod common;

use mlxb::engine::plan::KvLayerQuant;
use serde_json::{json, Value};
use std::path::Path;

const PROMPT: &str = "The quick brown fox jumps over the lazy dog while the cat sleeps";

fn model(name: &str, config: Value, dtype: &str, mixed_weights: bool) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("l2_parity")
        .join(name);
    let extra: &[&str] = if mixed_weights {
        &["--mixed-quant"]
    } else {
        &[]
    };
    common::make_model_with(&dir, &config, dtype, mixed_weights.then_some(4), extra);
    dir
}

/// A tiny f32 llama with head dim 64 (room for KV groups of 32 and 64).
fn llama_f32(name: &str) -> std::path::PathBuf {
    model(
        name,
        common::tiny_llama(json!({"head_dim": 64})),
        "f32",
        false,
    )
}

/// optiq's format: `[{"layer_idx", "bits", "group_size"}]`, absent layers at full precision.
fn allocation(entries: &[(usize, i32, Option<i32>)]) -> Value {
    entries
        .iter()
        .map(|&(layer, bits, group)| match group {
            Some(g) => json!({"layer_idx": layer, "bits": bits, "group_size": g}),
            None => json!({"layer_idx": layer, "bits": bits}),
        })
        .collect()
}

fn parity(dir: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "parity",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        PROMPT,
        "--ignore-chat-template",
        "-m",
        "24",
        "--json",
    ];
    args.extend_from_slice(extra);
    let (code, out, err) = common::run_mlxb(&args);
    let report: Value = serde_json::from_str(out.trim())
        .unwrap_or_else(|_| panic!("no report (exit {code}): {err}"));
    assert_eq!(
        report["oracle"], "mlx-optiq 0.7.7 (optiq eval path)",
        "{report}"
    );
    assert_eq!(code, 0, "{report} {err}");
    assert_eq!(report["identical"], true, "{report}");
    assert_eq!(report["mlxb_steps"], 24, "{report}");
    report
}

/// Writes the allocation beside the model and checks `parity --l2`.
fn check_beside(dir: &Path, kv: &Value) {
    std::fs::write(dir.join("kv_config.json"), kv.to_string()).unwrap();
    parity(dir, &["--l2"]);
}

#[test]
fn l2_matches_optiq_llama_f32_mixed_bits_and_groups() {
    let dir = llama_f32("llama-f32");
    let kv = allocation(&[(0, 4, Some(64)), (1, 8, Some(32)), (3, 2, None)]);
    check_beside(&dir, &kv);

    // The allocation matters: the oracle answers differently from unquantized mlx-lm, so
    // agreeing with it is not agreeing on an unquantized run.
    let layers: Vec<Option<KvLayerQuant>> = vec![
        Some(KvLayerQuant {
            bits: 4,
            group_size: 64,
        }),
        Some(KvLayerQuant {
            bits: 8,
            group_size: 32,
        }),
        None,
        Some(KvLayerQuant {
            bits: 2,
            group_size: 64,
        }),
    ];
    let (_, ids, _) = common::run_mlxb(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        PROMPT,
        "--ignore-chat-template",
        "-m",
        "1",
        "--json",
    ]);
    let prompt: Vec<u32> = serde_json::from_str::<Value>(&ids).unwrap()["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let l2 = mlxb::oracle::optiq::trace(&dir, &layers, &prompt, 8, 2048).unwrap();
    let l1 = mlxb::oracle::mlx_lm::trace(&json!({
        "model": dir, "prompt_ids": prompt, "max_tokens": 8,
    }))
    .unwrap();
    let (a, b) = (l2.logprobs.unwrap(), l1.logprobs.unwrap());
    assert_ne!(
        common::bits(&a),
        common::bits(&b),
        "the allocation changed nothing"
    );
}

#[test]
fn l2_matches_optiq_qwen3_bf16_with_kv_config_flag() {
    let dir = model(
        "qwen3-bf16",
        common::tiny_qwen3(json!({"head_dim": 64})),
        "bf16",
        false,
    );
    let file = dir.parent().unwrap().join("qwen3-kv.json");
    let kv = allocation(&[(0, 3, Some(32)), (1, 5, Some(64)), (2, 6, Some(64))]);
    std::fs::write(&file, kv.to_string()).unwrap();
    let _ = std::fs::remove_file(dir.join("kv_config.json"));
    parity(&dir, &["--l2", "--kv-config", file.to_str().unwrap()]);
}

#[test]
fn l2_matches_optiq_qwen3_5_linear_and_full_attention() {
    // Linear-attention layers have no KV to quantize: both sides leave them alone.
    let dir = model(
        "qwen3_5-f32",
        common::tiny_qwen3_5(json!({"head_dim": 64})),
        "f32",
        false,
    );
    check_beside(
        &dir,
        &allocation(&[
            (0, 4, None),
            (1, 4, Some(64)),
            (2, 8, None),
            (3, 3, Some(32)),
        ]),
    );
}

#[test]
fn l2_matches_optiq_with_per_layer_quantized_weights() {
    // Weights quantized per layer by mlx_lm's quant_predicate (odd layers 8-bit, others 4-bit).
    let dir = model(
        "llama-mixed-weights",
        common::tiny_llama(json!({"head_dim": 64, "hidden_size": 128})),
        "bf16",
        true,
    );
    let config: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert!(
        config["quantization"]["model.layers.1.self_attn.q_proj"]["bits"] == 8,
        "no per-layer weight bits: {}",
        config["quantization"]
    );
    check_beside(
        &dir,
        &allocation(&[(0, 8, None), (2, 4, Some(32)), (3, 4, None)]),
    );
}

#[test]
fn optiq_allocations_mlxb_cannot_run_are_refused() {
    let dir = llama_f32("llama-refusals");
    let cases: [(Value, &[&str]); 4] = [
        (allocation(&[(0, 7, None)]), &["kv_config.json", "7 bits"]),
        (allocation(&[(9, 4, None)]), &["kv_config.json", "layer 9"]),
        (
            allocation(&[(1, 4, None), (1, 8, None)]),
            &["layer 1", "twice"],
        ),
        (
            json!({"layer_bits": [4, 4, 4, 4]}),
            &["kv_config.json", "list"],
        ),
    ];
    for (kv, needles) in cases {
        std::fs::write(dir.join("kv_config.json"), kv.to_string()).unwrap();
        let (code, _, err) = common::run_mlxb(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--l2",
            "-m",
            "2",
        ]);
        common::assert_refused("an optiq allocation mlxb cannot run", code, &err, needles);
    }
    // Outside --kv-quant config the file beside the model is not read; given explicitly it is
    // refused with the way to use it.
    let (code, _, err) = common::run_mlxb(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--kv-config",
        dir.join("kv_config.json").to_str().unwrap(),
        "-m",
        "2",
    ]);
    common::assert_refused(
        "--kv-config without --kv-quant config",
        code,
        &err,
        &["--kv-quant config"],
    );
}

#[test]
fn flags_and_bench_matrix_use_the_l2_oracle() {
    let dir = llama_f32("llama-matrix");
    std::fs::write(
        dir.join("kv_config.json"),
        allocation(&[(0, 4, None), (2, 8, Some(32))]).to_string(),
    )
    .unwrap();
    let (code, out, err) =
        common::run_mlxb(&["flags", "--l2", "--model", dir.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let flags: Value = serde_json::from_str(&out).unwrap();
    let source = flags["kv_config_source"].as_str().unwrap();
    assert!(
        source.contains("kv_config.json")
            && source.contains("1 at 4 bits, 1 at 8 bits, 2 at full precision"),
        "{source}"
    );
    assert!(flags["oracle"]
        .as_str()
        .unwrap()
        .contains("mlx-optiq 0.7.7"));

    // optiq's file wins over config.json's `kv_quantization`, and says so.
    common::edit_config(&dir, |c| {
        c["kv_quantization"] = json!({"layer_bits": [8, 8, 8, 8]});
    });
    let (code, _, err) = common::run_mlxb(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--l2",
        "-m",
        "1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("kv_config.json wins over `kv_quantization`"),
        "{err}"
    );
    common::edit_config(&dir, |c| {
        c.as_object_mut().unwrap().remove("kv_quantization");
    });

    let (code, out, err) = common::run_mlxb(&[
        "bench",
        "--model",
        dir.to_str().unwrap(),
        "--matrix",
        "-p",
        "16",
        "-n",
        "8",
        "-r",
        "1",
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Value> = serde_json::from_str(&out).unwrap();
    // The first configuration that keeps L2 is measured (`--l2` itself is the same one).
    let l2: Vec<&Value> = rows
        .iter()
        .filter(|r| r["keeps"] == "L2" && r.get("skipped").is_none())
        .collect();
    assert!(!l2.is_empty(), "no measured L2 row: {rows:?}");
    for r in l2 {
        assert_eq!(r["l2_identical"], true, "{r}");
        assert!(r.get("kl_mean").is_none(), "{r}");
    }
}
