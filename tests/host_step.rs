//! The whole-step host decoder of `--perf-kernel on` (tier L3) on a tiny 4-bit llama and on a
//! tiny qwen2 mixed as a GGUF import with `--keep-quant` leaves it (biased q/k/v; 4-, 5- and
//! 8-bit layers; dense f32 layers and head):
//! - it stays close to L1 (mlx's own graph on the same weights) through a long prefill in
//!   sub-blocks and decode steps that cross the cache's 256-position growth;
//! - it is batch-invariant: a block of k tokens gives bit-identical logits, row for row, to
//!   k single-token steps, which is what makes speculative decoding under it lossless;
//! - greedy speculative decoding under it (n-gram, early-exit and DSpark drafters, and the
//!   opt-in VNNI path) equals its own greedy vanilla output token for token.

mod common;

use mlx_rs::{Array, Dtype};
use mlxb::engine::forks::Forks;
use mlxb::engine::kernels::{host_calls, host_steps};
use mlxb::engine::models::{self, Caches, ForwardOpts, LanguageModel};
use mlxb::spec::ngram::NgramSource;
use serde_json::json;
use std::path::Path;

const VOCAB: u32 = 384;

fn tiny_q4(dir: &Path) {
    common::make_model(dir, &common::tiny_llama(json!({})), "f32", Some(4));
}

fn tiny_qwen2_kept(dir: &Path) {
    let config = json!({
        "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "tie_word_embeddings": false
    });
    common::make_model_with(
        dir,
        &config,
        "f32",
        Some(4),
        &["--quant-group", "32", "--kept-mix"],
    );
}

/// Writes a tiny model into a directory.
type Maker = fn(&Path);

/// The tiny models every test here runs on.
const MODELS: [(&str, Maker); 2] = [
    ("llama 4-bit", tiny_q4),
    ("qwen2 kept mix", tiny_qwen2_kept),
];

fn perf_kernel() -> Forks {
    Forks {
        perf_kernel: true,
        ..Forks::default()
    }
}

fn ids_array(ids: &[u32]) -> Array {
    let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Array::from_slice(&v, &[1, v.len() as i32])
}

/// Log-probabilities of every position, `[L][V]`.
fn logprobs(logits: &Array) -> Vec<Vec<f32>> {
    let l = logits.as_dtype(Dtype::Float32).unwrap();
    let lp = l.subtract(l.logsumexp_axis(-1, true).unwrap()).unwrap();
    let v = *lp.shape().last().unwrap() as usize;
    lp.as_slice::<f32>()
        .chunks(v)
        .map(<[f32]>::to_vec)
        .collect()
}

fn forward(model: &mut dyn LanguageModel, ids: &[u32], caches: &mut Caches) -> Vec<Vec<f32>> {
    logprobs(&model.forward(&ids_array(ids), caches).unwrap())
}

#[test]
fn host_step_stays_close_to_l1_through_prefill_and_cache_growth() {
    for (name, make) in MODELS {
        eprintln!("{name}");
        stays_close_to_l1(make);
    }
}

/// How far a host step may be from L1, relative to the largest value compared: f32 sums in
/// other orders drift by about 1e-6. The log-probabilities of these random models are nearly
/// flat and hide most errors, so every layer's output is compared too (a dropped bias moves a
/// layer's output by a few percent).
const CLOSE: f32 = 1e-4;

/// The largest difference between `a` and `b` over the largest magnitude in `a` (infinite where
/// either has a NaN).
fn gap(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| {
        let d = (x - y).abs() / scale;
        if d.is_nan() {
            f32::INFINITY
        } else {
            m.max(d)
        }
    })
}

/// The last position's log-probabilities and every layer's output there, through `forward_ext`.
fn last_position(model: &mut dyn LanguageModel, ids: &[u32], caches: &mut Caches) -> Vec<Vec<f32>> {
    let opts = ForwardOpts {
        exit_after: None,
        taps: (0..4).collect(),
    };
    let out = model.forward_ext(&ids_array(ids), caches, &opts).unwrap();
    let mut parts = vec![logprobs(&out.logits).pop().unwrap()];
    for t in &out.taps {
        let t = t.as_dtype(Dtype::Float32).unwrap();
        let d = *t.shape().last().unwrap() as usize;
        parts.push(t.as_slice::<f32>().chunks(d).last().unwrap().to_vec());
    }
    parts
}

/// The largest [`gap`] over the parts of [`last_position`].
fn worst_gap(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().zip(b).map(|(x, y)| gap(x, y)).fold(0.0, f32::max)
}

fn stays_close_to_l1(make: Maker) {
    let dir = tempfile::tempdir().unwrap();
    make(dir.path());
    let mut l1 = models::load(dir.path(), Forks::default()).unwrap().model;
    let mut host = models::load(dir.path(), perf_kernel()).unwrap().model;
    let (mut c1, mut ch) = (l1.make_caches(), host.make_caches());
    // 250 prompt tokens: the host step runs them in 8-token sub-blocks; decoding then
    // crosses position 256, where the cache buffers grow.
    let prompt = common::prompt_ids(250, VOCAB, 5);
    // Other tests in this binary run host steps concurrently, so counters only bound below.
    let before = host_steps();
    let (p1, ph) = (
        last_position(l1.as_mut(), &prompt, &mut c1),
        last_position(host.as_mut(), &prompt, &mut ch),
    );
    assert!(
        host_steps() - before >= prompt.len().div_ceil(8),
        "the prefill did not run on the host step"
    );
    let d = worst_gap(&p1, &ph);
    assert!(d < CLOSE, "prefill: the host step differs from L1 by {d}");
    let mut tok = common::argmax(&p1[0]) as u32;
    let mut worst = d;
    for step in 0..12 {
        let (before, calls) = (host_steps(), host_calls());
        let (a, b) = (
            last_position(l1.as_mut(), &[tok], &mut c1),
            last_position(host.as_mut(), &[tok], &mut ch),
        );
        assert!(host_steps() > before, "step {step} left the host step");
        // 4 layers x 7 projections + the tied head.
        assert!(
            host_calls() - calls >= 29,
            "step {step} left the host kernel"
        );
        let d = worst_gap(&a, &b);
        assert!(
            d < CLOSE,
            "step {step}: the host step differs from L1 by {d}"
        );
        worst = worst.max(d);
        tok = common::argmax(&a[0]) as u32;
    }
    assert_eq!(ch[0].offset(), 262);
    eprintln!("host step vs L1 over a 250-token prefill and 12 steps: max gap {worst:.3e}");
}

#[test]
fn a_block_gives_the_same_bits_as_single_token_steps() {
    for (name, make) in MODELS {
        eprintln!("{name}");
        block_equals_single_steps(make);
    }
}

fn block_equals_single_steps(make: Maker) {
    let dir = tempfile::tempdir().unwrap();
    make(dir.path());
    let mut a = models::load(dir.path(), perf_kernel()).unwrap().model;
    let mut b = models::load(dir.path(), perf_kernel()).unwrap().model;
    let (mut ca, mut cb) = (a.make_caches(), b.make_caches());
    let prompt = common::prompt_ids(20, VOCAB, 9);
    forward(a.as_mut(), &prompt, &mut ca);
    forward(b.as_mut(), &prompt, &mut cb);
    for k in [2, 5, 8] {
        let block = common::prompt_ids(k, VOCAB, k as u32);
        let together = forward(a.as_mut(), &block, &mut ca);
        let one_by_one: Vec<Vec<f32>> = block
            .iter()
            .map(|t| forward(b.as_mut(), &[*t], &mut cb).remove(0))
            .collect();
        for (j, (x, y)) in together.iter().zip(&one_by_one).enumerate() {
            let same = x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(
                same,
                "block of {k}: row {j} differs from its single-token step"
            );
        }
    }
}

#[test]
fn speculative_decoding_under_the_host_step_is_lossless() {
    for (name, make) in MODELS {
        eprintln!("{name}");
        speculation_is_lossless(make);
    }
}

fn speculation_is_lossless(make: Maker) {
    let dir = tempfile::tempdir().unwrap();
    make(dir.path());
    let mut model = models::load(dir.path(), perf_kernel()).unwrap().model;
    // A repetitive prompt, so the n-gram drafter proposes (and gets some accepted).
    let base = common::prompt_ids(10, VOCAB, 4);
    let prompt: Vec<u32> = base.iter().cycle().take(40).copied().collect();
    let (vanilla, _) = common::greedy_ids(model.as_mut(), &prompt, None, 0, 48);
    let source = Box::new(NgramSource::new(1, 3));
    let (spec, metrics) = common::greedy_ids(model.as_mut(), &prompt, Some(source), 4, 48);
    assert_eq!(spec, vanilla, "speculative ids differ from vanilla ids");
    let m = metrics.unwrap();
    assert!(
        m.accepted_tokens > 0,
        "no draft was accepted: {:?}",
        m.to_json()
    );
}

/// `mlxb generate --perf-kernel on` on `model` with `extra` flags and environment: exit code,
/// the generated ids (JSON), stderr.
fn cli_ids(model: &str, extra: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let args = [
        "generate",
        "--model",
        model,
        "--prompt",
        "a b a b a b a b a b",
        "--ignore-chat-template",
        "-m",
        "32",
        "--json",
        "--perf-kernel",
        "on",
    ];
    let (code, out, err) = common::run_mlxb_env(&[&args[..], extra].concat(), env);
    let ids = serde_json::from_str::<serde_json::Value>(&out)
        .map(|v| v["token_ids"].to_string())
        .unwrap_or_default();
    (code, ids, err)
}

#[test]
fn every_drafter_verifies_on_the_host_step_losslessly() {
    // The self (early exit) and DSpark (layer taps) drafters read the target through
    // `forward_ext` options the host step serves itself; vanilla and speculative ids match.
    for (name, make) in MODELS {
        eprintln!("{name}");
        every_drafter_is_lossless(make);
    }
}

fn every_drafter_is_lossless(make: Maker) {
    let dir = tempfile::tempdir().unwrap();
    make(dir.path());
    let model = dir.path().to_str().unwrap();
    let drafter = dir.path().join("drafter");
    let (code, _, err) = common::run_mlxb(
        &[
            &[
                "dspark-init",
                "--model",
                model,
                "--out",
                drafter.to_str().unwrap(),
            ][..],
            &common::TINY_DRAFTER,
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{err}");
    let (code, vanilla, err) = cli_ids(model, &[], &[]);
    assert_eq!(code, 0, "{err}");
    let drafters: [&[&str]; 3] = [
        &["--draft-kind", "ngram"],
        &["--draft-kind", "self", "--draft-layers", "2"],
        &["--drafter", drafter.to_str().unwrap()],
    ];
    for extra in drafters {
        let (code, spec, err) = cli_ids(model, extra, &[]);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert_eq!(
            spec, vanilla,
            "{extra:?}: speculative ids differ from vanilla"
        );
    }
}

#[test]
fn forced_vnni_path_keeps_speculative_decoding_lossless_or_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    tiny_q4(dir.path());
    let model = dir.path().to_str().unwrap();
    let env = [("MLXB_Q4_KERNEL", "avx512vnni")];
    let (code, vanilla, err) = cli_ids(model, &[], &env);
    if !mlxb::engine::kernels::KernelPath::Avx512Vnni.available() {
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("MLXB_Q4_KERNEL"), "{err}");
        return;
    }
    assert_eq!(code, 0, "{err}");
    let (code, spec, err) = cli_ids(model, &["--draft-kind", "ngram"], &env);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        spec, vanilla,
        "ngram speculative ids differ under the VNNI path"
    );
}
