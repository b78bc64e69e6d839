//! Bad model directories give one clear sentence naming the file and the problem, exit code 2,
//! and no panic.

mod common;

use serde_json::json;
use std::path::Path;

/// Runs `mlxb generate` on `dir` and returns (exit code, stderr).
fn generate(dir: &Path) -> (i32, String) {
    let (code, _, err) = common::run_mlxb(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ]);
    (code, err)
}

fn expect_error(dir: &Path, needles: &[&str]) {
    let (code, err) = generate(dir);
    common::assert_refused(
        &format!("generate from {}", dir.display()),
        code,
        &err,
        needles,
    );
}

#[test]
fn bad_model_directories_are_clear_errors() {
    let base = tempfile::tempdir().unwrap();
    let good = base.path().join("good");
    common::make_model(
        &good,
        &common::tiny_llama(json!({"num_hidden_layers": 1})),
        "bf16",
        None,
    );
    let (code, err) = generate(&good);
    assert_eq!(code, 0, "the untouched model must work: {err}");

    let copy = |name: &str| {
        let d = base.path().join(name);
        common::copy_dir(&good, &d);
        d
    };

    let d = copy("unknown_type");
    common::edit_config(&d, |c| c["model_type"] = json!("nonesuch"));
    expect_error(&d, &["config.json", "nonesuch", "not supported"]);

    let d = copy("bad_heads");
    common::edit_config(&d, |c| c["num_key_value_heads"] = json!(3));
    expect_error(&d, &["config.json", "num_key_value_heads"]);

    let d = copy("missing_field");
    common::edit_config(&d, |c| {
        c.as_object_mut().unwrap().remove("hidden_size");
    });
    expect_error(&d, &["config.json", "hidden_size"]);

    let d = copy("misshaped");
    common::edit_config(&d, |c| c["intermediate_size"] = json!(96));
    expect_error(&d, &["mlp.gate_proj.weight", "shape"]);

    let d = copy("missing_tensor");
    common::edit_config(&d, |c| c["tie_word_embeddings"] = json!(false));
    expect_error(&d, &["lm_head.weight", "missing"]);

    let d = copy("extra_tensor");
    let extra = mlx_rs::Array::from_slice(&[0f32; 4], &[4]);
    mlx_rs::Array::save_safetensors(
        [("model.stray.weight", &extra)],
        None,
        d.join("model-extra.safetensors"),
    )
    .unwrap();
    expect_error(&d, &["unexpected tensor", "model.stray.weight"]);

    let d = copy("bad_bits");
    common::edit_config(&d, |c| {
        c["quantization"] = json!({"group_size": 64, "bits": 7})
    });
    expect_error(&d, &["config.json", "bits"]);

    let d = copy("bad_group");
    common::edit_config(&d, |c| {
        c["quantization"] = json!({"group_size": 48, "bits": 4})
    });
    expect_error(&d, &["config.json", "group_size"]);

    let d = copy("corrupt_header");
    let st = d.join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    bytes[8] = b'#';
    std::fs::write(&st, bytes).unwrap();
    expect_error(&d, &["model.safetensors", "corrupt"]);

    let d = copy("truncated");
    let st = d.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    expect_error(&d, &["model.safetensors", "truncated"]);

    let d = copy("bad_tokenizer");
    std::fs::write(d.join("tokenizer.json"), "{ not json").unwrap();
    expect_error(&d, &["tokenizer.json"]);

    let d = copy("no_weights");
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    expect_error(&d, &["safetensors"]);

    let d = copy("bad_json");
    std::fs::write(d.join("config.json"), "{").unwrap();
    expect_error(&d, &["config.json", "JSON"]);
}

#[test]
fn missing_model_directory_is_a_clear_error() {
    let (code, err) = generate(Path::new("/nonexistent/model"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("/nonexistent/model"), "{err}");
}

#[test]
fn zero_prefill_step_is_refused_before_anything_loads() {
    let (code, _, err) = common::run_mlxb(&[
        "generate",
        "--model",
        "/nonexistent",
        "--prefill-step-size",
        "0",
        "--prompt",
        "hi",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--prefill-step-size") && err.contains("must be at least 1"),
        "{err}"
    );
}
