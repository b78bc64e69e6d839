//! The host quantized mat-vec (`--perf-kernel on`) against MLX's own `quantized_matmul` on the
//! same packed weights: every kernel path (forced), one and two threads, 4-bit groups 32/64/128
//! and 8-bit, row counts that are not multiples of any SIMD width, random and real (SmolLM2
//! Q4_1/Q8_0) weights; then a tiny 4-bit model decoding with the host path, whose next-token
//! distributions stay close to L1's (KL reported).
//!
//! Tolerance (f32 activations and scales): the kernel and MLX sum the same products in a
//! different order, so each output may differ by rounding of a sum of `cols` terms; we allow
//! `|got - want| <= 1e-5 * (1 + sum_k |w_k x_k|)` (about `cols` times f32's epsilon of the
//! sum's magnitude, but far below any real error, which would be O(|w x|)).

mod common;

use mlx_rs::{ops, random, Array, Dtype};
use mlxb::engine::forks::Forks;
use mlxb::engine::kernels::{host_calls, HostQuant, Int8Input, KernelPath, Selection};
use mlxb::engine::weights::QuantSpec;
use serde_json::json;
use std::path::Path;

/// The kernel paths this CPU runs; every path the CPU supports must be among them.
fn paths() -> Vec<KernelPath> {
    let p: Vec<KernelPath> = KernelPath::ALL
        .into_iter()
        .filter(|p| p.available())
        .collect();
    assert!(p.contains(&KernelPath::Scalar));
    p
}

/// Checks the host kernel against `quantized_matmul` for `x` (`[.., cols]`) on every path.
fn check(what: &str, wq: &Array, scales: &Array, biases: &Array, spec: QuantSpec, x: &Array) {
    let want =
        ops::quantized_matmul(x, wq, scales, biases, true, spec.group_size, spec.bits).unwrap();
    // Per-output bound: sum_k |w_k x_k| with w dequantized by MLX.
    let w = ops::dequantize(wq, scales, biases, spec.group_size, spec.bits).unwrap();
    let mag = ops::matmul(ops::abs(x).unwrap(), ops::abs(&w).unwrap().t()).unwrap();
    let want = want.as_dtype(Dtype::Float32).unwrap();
    let (want, mag) = (want.as_slice::<f32>(), mag.as_slice::<f32>());
    // The VNNI path rounds the input to int8 per 32-element block; it differs from the exact
    // product by sum_k s_k q_k (x_k - x̂_k), bounded by sum_k |s_k q_k| |x_k - x̂_k|.
    let rounding = input_rounding_bound(wq, scales, biases, spec, x);
    let host = HostQuant::new(wq, scales, biases, spec).unwrap();
    // A path this CPU lacks must be refused, never run.
    for path in KernelPath::ALL.into_iter().filter(|p| !p.available()) {
        let err = host
            .forward_with(x, Selection { path, threads: 1 })
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("cannot run the {} kernel", path.name())),
            "{what} {}: {err}",
            path.name()
        );
    }
    for path in paths() {
        for threads in [1, 2] {
            let got = host.forward_with(x, Selection { path, threads }).unwrap();
            let mut shape = x.shape().to_vec();
            *shape.last_mut().unwrap() = wq.shape()[0];
            assert_eq!(got.shape(), &shape[..]);
            assert_eq!(got.dtype(), x.dtype());
            let got = got.as_dtype(Dtype::Float32).unwrap();
            let mut worst = 0.0f32;
            for (i, (g, w)) in got.as_slice::<f32>().iter().zip(want).enumerate() {
                let bound = match (&rounding, path) {
                    (Some(r), KernelPath::Avx512Vnni) => 1e-5 * (1.0 + mag[i]) + 1.001 * r[i],
                    _ => 1e-5 * (1.0 + mag[i]),
                };
                assert!(
                    (g - w).abs() <= bound,
                    "{what} {} x{threads}: output {i} is {g}, MLX says {w} (bound {bound})",
                    path.name()
                );
                worst = worst.max((g - w).abs() / (1.0 + mag[i]));
            }
            eprintln!(
                "{what} {:>6} x{threads}: max |diff|/(1+|w||x|) = {worst:.2e}",
                path.name()
            );
        }
    }
}

/// Per output, `sum_k |s_k q_k| |x_k - x̂_k|` where `x̂` is the VNNI path's int8-rounded input
/// (`None` when that path does not apply: another CPU, or columns not a multiple of 64).
fn input_rounding_bound(
    wq: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
    x: &Array,
) -> Option<Vec<f32>> {
    let cols = *x.shape().last().unwrap() as usize;
    if !KernelPath::Avx512Vnni.available() || !cols.is_multiple_of(64) {
        return None;
    }
    let xf = x.as_dtype(Dtype::Float32).unwrap();
    let xs = xf.as_slice::<f32>();
    let (m, bits) = (xs.len() / cols, spec.bits as usize);
    let rounded = Int8Input::new(xs, m, cols, bits);
    let dx: Vec<f32> = (0..m * cols)
        .map(|i| (xs[i] - rounded.rounded(i / cols, i % cols, bits)).abs())
        .collect();
    let zero = ops::zeros_like(biases).unwrap();
    let sq = ops::dequantize(wq, scales, &zero, spec.group_size, spec.bits).unwrap();
    let sq = ops::abs(sq.as_dtype(Dtype::Float32).unwrap()).unwrap();
    let dx = Array::from_slice(&dx, &[m as i32, cols as i32]);
    let bound = ops::matmul(&dx, sq.t()).unwrap();
    Some(bound.as_slice::<f32>().to_vec())
}

fn random_case(seed: u64, rows: i32, cols: i32, group: i32, bits: i32, m: i32) {
    let (kw, kx) = random::split(random::key(seed).unwrap(), 2).unwrap();
    let w = random::normal::<f32>(&[rows, cols][..], 0.0, 0.05, &kw).unwrap();
    let (wq, scales, biases) = ops::quantize(&w, group, bits).unwrap();
    let x = random::uniform::<_, f32>(-1.0, 1.0, &[1, m, cols][..], &kx).unwrap();
    let spec = QuantSpec {
        group_size: group,
        bits,
    };
    let what = format!("random {rows}x{cols} g{group} {bits}-bit m={m}");
    check(&what, &wq, &scales, &biases, spec, &x);
}

#[test]
fn random_4bit_weights_match_mlx_on_every_path() {
    // (rows, cols, group, m): odd row counts (not multiples of 8 or 16), every group size,
    // single-token and small verify blocks, and sizes above the threading threshold.
    for (i, &(rows, cols, group, m)) in [
        (1, 32, 32, 1),
        (7, 64, 32, 3),
        (13, 128, 64, 1),
        (33, 192, 64, 8),
        (101, 256, 128, 2),
        (17, 576, 64, 5),
        (1537, 576, 32, 1),
        (575, 1536, 32, 4),
        (999, 640, 128, 7),
    ]
    .iter()
    .enumerate()
    {
        random_case(i as u64, rows, cols, group, 4, m);
    }
}

#[test]
fn random_8bit_weights_match_mlx_on_every_path() {
    for (i, &(rows, cols, group, m)) in [(5, 32, 32, 1), (129, 256, 64, 3), (3001, 576, 32, 1)]
        .iter()
        .enumerate()
    {
        random_case(100 + i as u64, rows, cols, group, 8, m);
    }
}

#[test]
fn bf16_activations_and_scales_come_back_in_bf16() {
    // The kernel reads bf16 as f32 and returns bf16; MLX computes in bf16, so the bound here is
    // bf16's (8 bits of mantissa) rather than the f32 one.
    let key = random::key(7).unwrap();
    let w = random::normal::<f32>(&[67, 256][..], 0.0, 0.05, &key).unwrap();
    let (wq, s, b) = ops::quantize(w.as_dtype(Dtype::Bfloat16).unwrap(), 64, 4).unwrap();
    let x = random::uniform::<_, f32>(-1.0, 1.0, &[1, 1, 256][..], &key).unwrap();
    let x = x.as_dtype(Dtype::Bfloat16).unwrap();
    let spec = QuantSpec {
        group_size: 64,
        bits: 4,
    };
    let want = ops::quantized_matmul(&x, &wq, &s, &b, true, 64, 4).unwrap();
    let want = want.as_dtype(Dtype::Float32).unwrap();
    let host = HostQuant::new(&wq, &s, &b, spec).unwrap();
    let got = host.forward(&x).unwrap();
    assert_eq!(got.dtype(), Dtype::Bfloat16);
    let got = got.as_dtype(Dtype::Float32).unwrap();
    let scale = want
        .as_slice::<f32>()
        .iter()
        .fold(0f32, |a, v| a.max(v.abs()));
    for (g, w) in got.as_slice::<f32>().iter().zip(want.as_slice::<f32>()) {
        assert!((g - w).abs() <= 2e-2 * (1.0 + scale), "{g} vs {w}");
    }
}

/// The cached SmolLM2 GGUF imported with `--keep-quant` (its own Q4_1 / Q8_0 blocks).
fn smollm2_keep_quant(out: &Path) -> std::collections::HashMap<String, Array> {
    let m = mlxb::convert::registry::find("smollm2-135m-instruct").unwrap();
    let gguf = m.ensure_gguf(&mlxb::progress::Silent).unwrap();
    let (code, _, err) = common::run_mlxb(&[
        "convert",
        "--gguf",
        gguf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--keep-quant",
    ]);
    assert_eq!(code, 0, "{err}");
    Array::load_safetensors(out.join("model.safetensors")).unwrap()
}

#[test]
fn real_smollm2_q4_1_and_q8_0_weights_match_mlx_on_every_path() {
    let dir = tempfile::tempdir().unwrap();
    let t = smollm2_keep_quant(&dir.path().join("smol"));
    let key = random::key(3).unwrap();
    for (name, bits, m) in [
        ("model.layers.0.self_attn.q_proj", 4, 1),
        ("model.layers.7.mlp.down_proj", 4, 1),
        ("model.layers.29.mlp.gate_proj", 4, 4),
        ("model.embed_tokens", 8, 1),
    ] {
        let get = |s: &str| t[&format!("{name}.{s}")].clone();
        let (wq, scales, biases) = (get("weight"), get("scales"), get("biases"));
        let cols = wq.shape()[1] * 32 / bits;
        let x = random::normal::<f32>(&[1, m, cols][..], 0.0, 1.0, &key).unwrap();
        let spec = QuantSpec {
            group_size: 32,
            bits,
        };
        check(&format!("smollm2 {name}"), &wq, &scales, &biases, spec, &x);
    }
}

/// Full-vocabulary log-probabilities of the last position.
fn logprobs(logits: &Array) -> Vec<f32> {
    let last = logits.shape()[1] - 1;
    let l = logits
        .take_axis(Array::from_int(last), 1)
        .unwrap()
        .as_dtype(Dtype::Float32)
        .unwrap();
    let lp = l.subtract(l.logsumexp_axis(-1, true).unwrap()).unwrap();
    lp.as_slice::<f32>().to_vec()
}

#[test]
fn tiny_4bit_model_decodes_with_the_host_kernel_close_to_l1() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &common::tiny_llama(json!({})), "f32", Some(4));
    let on = Forks {
        perf_kernel: true,
        ..Forks::default()
    };
    // The 12-token prefill runs on the host step too (two sub-blocks): close, not identical.
    let mut t = common::Twins::prefill(dir.path(), Forks::default(), on, 12, 1);
    let (la, lb) = t.prefill.clone();
    let d = common::kl(&logprobs(&la), &logprobs(&lb));
    assert!(d.is_finite() && d < 1e-4, "prefill: KL(L1 || kernel) = {d}");
    let before = host_calls();
    let mut worst = 0.0f64;
    let mut tok = common::argmax(&logprobs(&la));
    for step in 0..16 {
        let (ya, yb) = t.step(tok as i32);
        let (pa, pb) = (logprobs(&ya), logprobs(&yb));
        let d = common::kl(&pa, &pb);
        assert!(
            d.is_finite() && d < 1e-4,
            "step {step}: KL(L1 || kernel) = {d}"
        );
        worst = worst.max(d);
        tok = common::argmax(&pa);
    }
    // 4 layers x 7 projections + the tied 4-bit head, per step.
    let calls = host_calls() - before;
    assert!(
        calls >= 16 * 29,
        "the host kernel ran {calls} times in 16 steps"
    );
    eprintln!("tiny 4-bit llama, 16 decode steps: max KL(L1 || perf-kernel) = {worst:.3e}");
}

#[test]
fn generate_with_perf_kernel_on_alone_produces_tokens() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model_with(
        dir.path(),
        &common::tiny_llama(json!({})),
        "bf16",
        Some(4),
        &["--quant-group", "32"],
    );
    let model = dir.path().to_str().unwrap();
    let args = |on: &str| {
        vec![
            "generate",
            "--model",
            model,
            "--prompt",
            "hello",
            "-m",
            "8",
            "--json",
            "--perf-kernel",
            on,
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>()
    };
    for on in ["off", "on"] {
        let a = args(on);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let (code, out, err) = common::run_mlxb(&a);
        assert_eq!(code, 0, "--perf-kernel {on}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        let ids = v["token_ids"].as_array().unwrap();
        assert_eq!(ids.len(), 8, "{v}");
        assert!(
            ids.iter().all(|i| i.as_u64().is_some_and(|i| i < 384)),
            "{v}"
        );
    }
}

#[test]
fn a_bad_forced_kernel_is_one_sentence_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &common::tiny_llama(json!({})), "f32", Some(4));
    let (code, _, err) = common::run_mlxb_env(
        &[
            "generate",
            "--model",
            dir.path().to_str().unwrap(),
            "--prompt",
            "hi",
            "-m",
            "2",
            "--perf-kernel",
            "on",
        ],
        &[("MLXB_Q4_KERNEL", "neon")],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("MLXB_Q4_KERNEL") && err.contains("avx2"),
        "{err}"
    );
}
