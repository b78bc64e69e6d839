//! Shared helpers for integration tests: locating the oracle env and running its Python.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Repository root (tests run with the package root as the working directory).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The oracle interpreter; a missing env is a loud failure, never a skip.
pub fn python() -> PathBuf {
    let py = root().join(".venv/bin/python");
    assert!(
        py.is_file(),
        "oracle env missing at {}: run scripts/setup.sh",
        py.display()
    );
    py
}

/// Runs `python script args...` in the oracle env and panics with its stderr on failure.
pub fn run_python(script: &Path, args: &[&str]) -> String {
    let out = Command::new(python())
        .arg(script)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .expect("failed to start the oracle python");
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Path to the compiled `mlxb` binary under test.
pub fn mlxb() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_mlxb"))
}

/// Creates a tiny random-weight model with mlx-lm's own classes (tests/oracle/make_model.py).
pub fn make_model(dir: &Path, config: &serde_json::Value, dtype: &str, quant_bits: Option<u32>) {
    make_model_with(dir, config, dtype, quant_bits, &[]);
}

/// [`make_model`] with extra make_model.py flags (e.g. `--no-tokenizer`, `--seed N`).
pub fn make_model_with(
    dir: &Path,
    config: &serde_json::Value,
    dtype: &str,
    quant_bits: Option<u32>,
    extra: &[&str],
) {
    let cfg = config.to_string();
    let mut args = vec![dir.to_str().unwrap(), cfg.as_str(), "--dtype", dtype];
    let bits = quant_bits.map(|b| b.to_string());
    if let Some(b) = &bits {
        args.extend(["--quant-bits", b.as_str()]);
    }
    args.extend_from_slice(extra);
    run_python(&root().join("tests/oracle/make_model.py"), &args);
}

/// Runs mlx-lm's generate_step through assets/oracle/mlx_lm_trace.py and loads its outputs
/// (`ids`, `logprobs`, optionally `prompt_logits`).
pub fn oracle_trace(
    request: &serde_json::Value,
) -> std::collections::HashMap<String, mlx_rs::Array> {
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    let out = dir.path().join("out.safetensors");
    std::fs::write(&req, request.to_string()).unwrap();
    run_python(
        &root().join("assets/oracle/mlx_lm_trace.py"),
        &[req.to_str().unwrap(), out.to_str().unwrap()],
    );
    mlx_rs::Array::load_safetensors(&out).unwrap()
}

/// Raw bits of an array (each item's pattern widened to u64), for bit-exact comparison.
pub fn bits(a: &mlx_rs::Array) -> Vec<u64> {
    mlxb::engine::bits::widened_bits(a).unwrap()
}

/// Token ids as `--prompt-ids` takes them: comma-separated.
pub fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// A JSON array of token ids (`generate --json`'s `token_ids`, a reference file's ids).
pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array of token ids: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// Deterministic prompt ids in [3, vocab) (skipping special tokens 0..3).
pub fn prompt_ids(n: usize, vocab: u32, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 7919 + salt * 104729) % (vocab - 3))
        .collect()
}

/// Greedy generation of `max_tokens` ids through mlxb's one loop, speculative when `source` is
/// given (`k` drafts per round, token-match verification); returns the ids and the drafter's
/// acceptance metrics.
pub fn greedy_ids(
    model: &mut dyn mlxb::engine::models::LanguageModel,
    prompt: &[u32],
    source: Option<Box<dyn mlxb::spec::source::DraftSource + '_>>,
    k: usize,
    max_tokens: usize,
) -> (Vec<i32>, Option<mlxb::spec::metrics::SpecMetrics>) {
    use mlxb::spec::executor::Speculation;
    let mut spec =
        source.map(|source| Speculation::new(source, k, mlxb::spec::source::VerifyMode::Match));
    let ids = greedy_ids_speculating(model, prompt, spec.as_mut(), max_tokens);
    (ids, spec.map(|s| s.metrics))
}

/// Greedy ids of `model` for `prompt`, decoded by `spec` if given.
pub fn greedy_ids_speculating(
    model: &mut dyn mlxb::engine::models::LanguageModel,
    prompt: &[u32],
    spec: Option<&mut mlxb::spec::executor::Speculation<'_>>,
    max_tokens: usize,
) -> Vec<i32> {
    use mlxb::engine::generate::{Flow, GenerateConfig, Generator};
    use mlxb::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
    let mut sampler = Sampler::new(&SamplerConfig::default()).unwrap();
    let mut processors = LogitsProcessors::new(&ProcessorConfig::default()).unwrap();
    let mut g = Generator::new(model, &mut sampler, &mut processors);
    if let Some(spec) = spec {
        g = g.with_speculation(spec);
    }
    let mut ids = vec![];
    let cfg = GenerateConfig {
        max_tokens,
        prefill_step_size: 2048,
    };
    g.run(prompt, &cfg, |s| {
        ids.push(s.token as i32);
        Ok(Flow::Continue)
    })
    .unwrap();
    ids
}

/// The `mlxb` binary under test with `args`, to add environment, a working directory or pipes
/// to before running or spawning it.
pub fn mlxb_command(args: &[&str]) -> Command {
    let mut cmd = Command::new(mlxb());
    cmd.args(args);
    cmd
}

/// Runs `cmd` to completion with `stdin` as its whole input; returns (exit code, -1 when a
/// signal ended it; stdout; stderr).
pub fn run(cmd: &mut Command, stdin: &[u8]) -> (i32, String, String) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the `mlxb` binary with `args`; returns (exit code, stdout, stderr).
pub fn run_mlxb(args: &[&str]) -> (i32, String, String) {
    run_mlxb_env(args, &[])
}

/// [`run_mlxb`] with the variables of `env` set.
pub fn run_mlxb_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    run(mlxb_command(args).envs(env.iter().copied()), &[])
}

/// [`run_mlxb_env`] with stdout parsed as JSON (`Null` if it is not).
pub fn run_mlxb_json(args: &[&str], env: &[(&str, &str)]) -> (i32, serde_json::Value, String) {
    let (code, out, err) = run_mlxb_env(args, env);
    (
        code,
        serde_json::from_str(out.trim()).unwrap_or(serde_json::Value::Null),
        err,
    )
}

/// The `mlxb dspark-init` command line for a small drafter of a tiny target: one layer, γ = 4,
/// Markov rank 16, then `extra` flags (taps, head, ...).
pub fn dspark_init_args<'a>(model: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "dspark-init",
        "--model",
        model,
        "--out",
        out,
        "--layers",
        "1",
        "--gamma",
        "4",
        "--markov-rank",
        "16",
    ];
    args.extend_from_slice(extra);
    args
}

/// A `speculative` JSON object's counters, without its per-round times (which differ from run
/// to run), so two runs can be compared for what they drafted and accepted.
pub fn spec_counters(speculative: &serde_json::Value) -> serde_json::Value {
    let mut v = speculative.clone();
    if let Some(o) = v.as_object_mut() {
        o.retain(|k, _| !k.ends_with("_ms_per_round"));
    }
    v
}

/// Checks that mlxb refused `what` as it should: exit code 2, no panic, one line on stderr
/// (`err`) that mentions every one of `needles`.
#[track_caller]
pub fn assert_refused(what: &str, code: i32, err: &str, needles: &[&str]) {
    assert_eq!(
        code, 2,
        "{what}: expected exit code 2, got {code}; stderr: {err}"
    );
    assert!(
        !err.contains("panicked"),
        "{what}: panic instead of an error: {err}"
    );
    assert_eq!(
        err.trim().lines().count(),
        1,
        "{what}: error is not one line: {err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "{what}: error does not mention {n:?}: {err}"
        );
    }
}

/// Drafter options for a `kind` drafter from `draft_model`: 3 tokens a round, token-match
/// verification, and the n-gram and DSpark settings at their flag defaults.
pub fn spec_options(
    kind: mlxb::spec::factory::DraftKind,
    draft_model: Option<&Path>,
) -> mlxb::spec::factory::SpecOptions {
    mlxb::spec::factory::SpecOptions {
        kind,
        draft_model: draft_model.map(Path::to_path_buf),
        num_draft_tokens: 3,
        draft_layers: None,
        ngram_max: 3,
        ngram_min: 1,
        verify: mlxb::spec::source::VerifyMode::Match,
        dspark_min_conf: None,
        dspark_prune: Default::default(),
        lookup_first: None,
        lookup_tokens: None,
        lookup_table: Default::default(),
    }
}

/// Rewrites `dir/config.json` through `f`.
pub fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut c);
    std::fs::write(p, c.to_string()).unwrap();
}

/// `dspark-init` flags for the smallest drafter the tests build (1 layer, block 4, Markov
/// rank 16).
pub const TINY_DRAFTER: [&str; 6] = ["--layers", "1", "--gamma", "4", "--markov-rank", "16"];

/// `base` (a JSON object) with the fields of `extra` (another) added or replaced.
pub fn with(base: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    let mut c = base;
    c.as_object_mut()
        .expect("a config object")
        .extend(extra.as_object().expect("an object of fields").clone());
    c
}

/// The tiny llama config most tests build (4 layers, width 64, vocabulary 384, tied head), with
/// `extra` fields added or replaced.
pub fn tiny_llama(extra: serde_json::Value) -> serde_json::Value {
    with(
        serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "vocab_size": 384, "tie_word_embeddings": true
        }),
        extra,
    )
}

/// A tiny qwen3 config (4 layers, width 64, head dim 16, vocabulary 384, untied head), with
/// `extra` fields added or replaced.
pub fn tiny_qwen3(extra: serde_json::Value) -> serde_json::Value {
    with(
        serde_json::json!({
            "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 384, "max_position_embeddings": 512, "rope_theta": 10000.0,
            "tie_word_embeddings": false
        }),
        extra,
    )
}

/// A tiny gemma2 config with attention and final soft-caps (2 layers, width 64, vocabulary
/// 384), with `extra` fields added or replaced.
pub fn tiny_gemma2(extra: serde_json::Value) -> serde_json::Value {
    with(
        serde_json::json!({
            "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 384, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0
        }),
        extra,
    )
}

/// A tiny gemma3_text config with a sliding window of 8 on every other layer (4 layers, width
/// 64, vocabulary 384).
pub fn tiny_gemma3() -> serde_json::Value {
    serde_json::json!({
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6,
        "vocab_size": 384, "sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 32,
        "rope_theta": 10000.0, "rope_local_base_freq": 10000.0, "max_position_embeddings": 512
    })
}

/// A tiny gemma4_text config: layers sliding, sliding, full, sliding, sliding (window 8), the
/// last two sharing earlier layers' keys/values, per-layer input embeddings (width 64,
/// vocabulary 384), with `extra` fields added or replaced.
pub fn tiny_gemma4(extra: serde_json::Value) -> serde_json::Value {
    with(
        serde_json::json!({
            "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 5, "intermediate_size": 64,
            "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 32, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": 384, "vocab_size_per_layer_input": 384,
            "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16, "sliding_window": 8,
            "sliding_window_pattern": 3
        }),
        extra,
    )
}

/// A tiny qwen3_5 config: linear-attention and full-attention layers alternating (4 layers,
/// width 64, head dim 16, partial rotary factor 0.5, vocabulary 384), with `extra` fields added
/// or replaced.
pub fn tiny_qwen3_5(extra: serde_json::Value) -> serde_json::Value {
    with(
        serde_json::json!({
            "model_type": "qwen3_5", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 384, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        }),
        extra,
    )
}

/// Kullback-Leibler divergence `KL(p || q)` of two log-probability vectors, in f64.
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    p.iter()
        .zip(q)
        .map(|(a, b)| f64::from(a.exp()) * f64::from(a - b))
        .sum()
}

/// Index of the largest value (the first of equal ones).
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0
}

/// With a wrapped sliding window (`wraps`), rollback must have gone through snapshot + replay;
/// otherwise every rewind is a trim.
pub fn assert_rollback_path(m: &mlxb::spec::metrics::SpecMetrics, wraps: bool) {
    assert_eq!(
        m.replays > 0,
        wraps,
        "unexpected rollback path: {:?}",
        m.to_json()
    );
}

/// Copies the flat directory `from` (a model or drafter directory) into a new directory `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// One model directory loaded twice under two fork sets, each with its own caches, after both
/// prefilled the same prompt: the A/B setup of the kernel tests.
pub struct Twins {
    pub a: Box<dyn mlxb::engine::models::LanguageModel>,
    pub b: Box<dyn mlxb::engine::models::LanguageModel>,
    pub ca: mlxb::engine::models::Caches,
    pub cb: mlxb::engine::models::Caches,
    /// The prefill logits of `a` and `b`.
    pub prefill: (mlx_rs::Array, mlx_rs::Array),
}

impl Twins {
    /// Loads `dir` under `a` and `b` and prefills `n` prompt ids (vocabulary 384, `salt`).
    pub fn prefill(
        dir: &Path,
        a: mlxb::engine::forks::Forks,
        b: mlxb::engine::forks::Forks,
        n: usize,
        salt: u32,
    ) -> Self {
        // Each model's caches carry its forks' attention plan, as the generator sets it.
        let la = mlxb::engine::models::load(dir, a).unwrap();
        let lb = mlxb::engine::models::load(dir, b).unwrap();
        let (mut ma, mut mb) = (la.model, lb.model);
        let (mut ca, mut cb) = (ma.make_caches(), mb.make_caches());
        la.plan.prepare(&mut ca);
        lb.plan.prepare(&mut cb);
        let prompt: Vec<i32> = prompt_ids(n, 384, salt).iter().map(|&v| v as i32).collect();
        let ids = mlx_rs::Array::from_slice(&prompt, &[1, prompt.len() as i32]);
        let la = ma.forward(&ids, &mut ca).unwrap();
        let lb = mb.forward(&ids, &mut cb).unwrap();
        Self {
            a: ma,
            b: mb,
            ca,
            cb,
            prefill: (la, lb),
        }
    }

    /// One decode step of both models on `token`; returns their logits.
    pub fn step(&mut self, token: i32) -> (mlx_rs::Array, mlx_rs::Array) {
        let x = mlx_rs::Array::from_slice(&[token], &[1, 1]);
        (
            self.a.forward(&x, &mut self.ca).unwrap(),
            self.b.forward(&x, &mut self.cb).unwrap(),
        )
    }

    /// The prompt logits, then those of `steps` single-token steps, are the same bits.
    #[allow(dead_code)]
    pub fn assert_agree(&mut self, steps: i32) {
        let (la, lb) = self.prefill.clone();
        assert_eq!(bits(&la), bits(&lb), "prefill logits");
        let mut tok = 7;
        for step in 0..steps {
            let (pa, pb) = self.step(tok);
            assert_eq!(bits(&pa), bits(&pb), "step {step} logits");
            tok = (tok * 31 + step + 11) % 384;
        }
    }
}

/// Whether this machine's f32 products must take the `--host-matvec` path. That path sums in
/// the order of OpenBLAS's SkylakeX, Cooperlake or Haswell kernels (`engine::kernels::mlx_order`,
/// each measured against MLX); where OpenBLAS runs one of those the engine's load-time check
/// must accept f32 products. Elsewhere MLX may sum f32 in another order, the check refuses those
/// products and they stay on MLX: the suites then check that fallback (whatever is accepted
/// equals MLX bit for bit, logits unchanged) and say so on stderr.
pub fn f32_host_order_expected() -> bool {
    use mlxb::engine::kernels::mlx_order::{simd, Simd};
    let core = mlxb::engine::runtime::blas_core();
    let expected = match core.as_deref() {
        Some("Haswell") => true,
        // The small-matrix kernel's lane order is AVX-512's own: on the AVX2 path
        // (`MLXB_DENSE_KERNEL=avx2` on an AVX-512 machine) those shapes stay on MLX.
        Some("SkylakeX" | "Cooperlake") => simd() != Some(Simd::Avx2),
        _ => false,
    };
    if !expected {
        eprintln!(
            "OpenBLAS core {core:?} with the {:?} host kernels: f32 host products may be refused \
             here, so this test checks the fallback to MLX for them",
            simd()
        );
    }
    expected
}

/// The single-stream loop's greedy tokens and logprobs for `prompt`.
pub fn single_stream(
    loaded: &mut mlxb::engine::models::LoadedModel,
    prompt: &[u32],
    max_tokens: usize,
    prefill_step_size: usize,
) -> Vec<(u32, mlx_rs::Array)> {
    use mlxb::engine::generate::{Flow, GenerateConfig, Generator};
    use mlxb::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
    let mut sampler = Sampler::new(&SamplerConfig::default()).unwrap();
    let mut processors = LogitsProcessors::new(&ProcessorConfig::default()).unwrap();
    let plan = loaded.plan.clone();
    let cfg = GenerateConfig {
        max_tokens,
        prefill_step_size,
    };
    let mut alone = vec![];
    Generator::new(loaded.model.as_mut(), &mut sampler, &mut processors)
        .with_plan(&plan)
        .run(prompt, &cfg, |s| {
            alone.push((s.token, s.logprobs.clone()));
            Ok(Flow::Continue)
        })
        .unwrap();
    alone
}

/// Two-sample chi-square of two count vectors over the categories with at least 10 counts in
/// all, and how many categories that is (the degrees of freedom, plus one).
pub fn two_sample_chi_square(a: &[f64], b: &[f64]) -> (f64, usize) {
    let mut chi2 = 0.0;
    let mut bins = 0;
    for (&x, &y) in a.iter().zip(b) {
        let total = x + y;
        if total < 10.0 {
            continue;
        }
        let e = total / 2.0;
        chi2 += (x - e).powi(2) / e + (y - e).powi(2) / e;
        bins += 1;
    }
    (chi2, bins)
}

/// On a CPU whose host kernels run on AVX-512, runs this test binary again as on an AVX2-only
/// machine: the AVX2 kernels (`MLXB_DENSE_KERNEL=avx2`) beside OpenBLAS's `Haswell` kernels
/// (`OPENBLAS_CORETYPE=Haswell`, what OpenBLAS picks there), every test but `me`; requires it
/// to pass with at least one test run, so AVX-512 machines hold the AVX2 path to MLX's bits
/// too. Inside that rerun, and where the CPU has no AVX-512 (the AVX2 path is then the default
/// one), it does nothing.
pub fn rerun_on_the_avx2_path(me: &str) {
    use mlxb::engine::kernels::mlx_order::Simd;
    if std::env::var_os("MLXB_DENSE_KERNEL").is_some() || !Simd::Avx512.runs_here() {
        eprintln!("not rerunning on the AVX2 path: already there, or no AVX-512 on this CPU");
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--skip", me])
        .env("MLXB_DENSE_KERNEL", "avx2")
        .env("OPENBLAS_CORETYPE", "Haswell")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "on the AVX2 path:\n{text}");
    let ran = text
        .lines()
        .filter_map(|l| l.strip_prefix("test result: ok. "))
        .filter_map(|l| l.split(' ').next()?.parse::<usize>().ok())
        .sum::<usize>();
    assert!(ran > 0, "no test ran on the AVX2 path:\n{text}");
}

/// L1's default forks with the whole host step off (`--host-step off`), so a decode runs the
/// per-layer host paths a test means to compare (the whole step is checked in model_parity.rs).
pub fn per_layer_forks() -> mlxb::engine::forks::Forks {
    mlxb::engine::forks::Forks {
        host_step: false,
        ..mlxb::engine::forks::Forks::default()
    }
}
