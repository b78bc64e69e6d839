//! `--host-elementwise on` (an L1 default): SwiGLU, RMSNorm and residual adds, f32 and bf16, on
//! the host, operation for operation as MLX's CPU kernels. Checked against MLX itself (the kernels
//! mlx-lm runs on the same libmlx):
//! - the sigmoid alone and the whole `silu(gate) * up`, compiled (as mlx-lm's `@mx.compile`)
//!   and eager, over a strided sweep of every f32 bit pattern (`MLXB_SWEEP_STRIDE=1` sweeps
//!   all 2^32 by hand, ~12 minutes);
//! - RMSNorm against `fast::rms_norm` over widths, magnitudes and epsilons, in f32 and bf16;
//! - tiny f32 llamas give the same logits with and without it and really take it (SwiGLU in
//!   prompts and steps, norms in steps);
//! - the bfloat16 SwiGLU against MLX's compiled and eager kernels for every gate value, and a
//!   tiny bf16 llama with the same logits with and without the host paths.
//!
//! End-to-end parity with mlx-lm under the defaults is `model_parity`'s job.

mod common;

use mlx_rs::{ops, Array, Dtype};
use mlxb::engine::forks::Forks;
use mlxb::engine::kernels::dense_calls;
use mlxb::engine::kernels::elementwise;
use mlxb::engine::models::activations::{host_swiglu_calls, swiglu, SwiGlu};
use mlxb::engine::nn::host_norm_calls;
use serde_json::json;

/// The sweep's stride over the 2^32 bit patterns (prime, so every exponent and low-bit
/// pattern is visited); `MLXB_SWEEP_STRIDE` overrides it.
fn stride() -> u64 {
    std::env::var("MLXB_SWEEP_STRIDE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(251)
}

/// Same bits, or both NaN (a NaN's payload is not a value).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Compares `host` with MLX's `mlx` over the sweep, chunk by chunk; returns values compared.
fn sweep(what: &str, mut mlx: impl FnMut(&Array) -> Array, host: impl Fn(&[f32], &mut [f32])) {
    let stride = stride();
    let chunk = 1u64 << 22;
    let mut start = 0u64;
    let mut compared = 0usize;
    while start < 1u64 << 32 {
        let xs: Vec<f32> = (0..chunk)
            .map(|i| start + i * stride)
            .take_while(|&b| b < 1u64 << 32)
            .map(|b| f32::from_bits(b as u32))
            .collect();
        if xs.is_empty() {
            break;
        }
        let theirs = mlx(&Array::from_slice(&xs, &[xs.len() as i32]));
        let theirs = theirs.as_slice::<f32>();
        let mut ours = vec![0.0; xs.len()];
        host(&xs, &mut ours);
        for (i, x) in xs.iter().enumerate() {
            assert!(
                same(ours[i], theirs[i]),
                "{what}({x:e} = {:#010x}): host {:e}, MLX {:e}",
                x.to_bits(),
                ours[i],
                theirs[i]
            );
        }
        compared += xs.len();
        start += chunk * stride;
    }
    assert!(
        compared as u64 >= (1u64 << 32) / stride,
        "{what}: sweep too short"
    );
}

#[test]
fn sigmoid_equals_mlx_over_the_bit_pattern_sweep() {
    sweep(
        "sigmoid",
        |x| ops::sigmoid(x).unwrap(),
        |xs, out| {
            for (o, &x) in out.iter_mut().zip(xs) {
                *o = elementwise::sigmoid_mlx(x);
            }
        },
    );
}

#[test]
fn swiglu_equals_mlx_compiled_and_eager_over_the_sweep() {
    if elementwise::vector_path().is_none() {
        // `swiglu` then runs its scalar form, the one this CPU uses; that is what is swept.
        eprintln!("this CPU has no vector path: the sweep checks the scalar form");
    }
    for compiled in [true, false] {
        let mut op = swiglu(compiled);
        // `up` of 1 isolates silu; a second pass uses varied `up` values (the final product).
        for up_of in [|_: f32| 1.0f32, |x: f32| 0.5 - x.abs().sqrt().min(3.0)] {
            sweep(
                &format!("swiglu (compiled {compiled})"),
                |g| {
                    let up = g
                        .as_slice::<f32>()
                        .iter()
                        .map(|&x| up_of(x))
                        .collect::<Vec<_>>();
                    let up = Array::from_slice(&up, g.shape());
                    op.call1(&[g.clone(), up]).unwrap()
                },
                |g, out| {
                    let up: Vec<f32> = g.iter().map(|&x| up_of(x)).collect();
                    elementwise::swiglu(g, &up, out);
                },
            );
        }
    }
}

#[test]
fn rms_norm_equals_mlx_over_widths_magnitudes_and_epsilons_in_f32_and_bf16() {
    for (i, (rows, dim)) in [(1, 576), (8, 64), (3, 2048), (5, 100), (2, 1)]
        .into_iter()
        .enumerate()
    {
        for (j, scale) in [1.0f32, 1e-4, 300.0].into_iter().enumerate() {
            for eps in [1e-5f32, 1e-6, 0.1] {
                let seed = (10 * i + j) as u64;
                let x: Vec<f32> = elementwise::probe_values(rows * dim, seed + 1)
                    .iter()
                    .map(|v| v * scale)
                    .collect();
                let w: Vec<f32> = elementwise::probe_values(dim, seed + 99)
                    .iter()
                    .map(|v| 1.0 + v.clamp(-0.9, 0.9))
                    .collect();
                let theirs = mlx_rs::fast::rms_norm(
                    Array::from_slice(&x, &[rows as i32, dim as i32]),
                    Some(&Array::from_slice(&w, &[dim as i32])),
                    eps,
                )
                .unwrap();
                let mut ours = vec![0.0; x.len()];
                elementwise::rms_norm(&x, &w, eps, &mut ours);
                let differ = ours
                    .iter()
                    .zip(theirs.as_slice::<f32>())
                    .filter(|(a, b)| !same(**a, **b))
                    .count();
                assert_eq!(differ, 0, "{rows}x{dim}, scale {scale}, eps {eps}");
                // The same row and weight in bfloat16 (MLX normalises in f32, rounds, then
                // multiplies by the weight in bfloat16).
                let x: Vec<half::bf16> = x.into_iter().map(elementwise::bf16_mlx).collect();
                let w: Vec<half::bf16> = w.into_iter().map(elementwise::bf16_mlx).collect();
                let theirs = mlx_rs::fast::rms_norm(
                    Array::from_slice(&x, &[rows as i32, dim as i32]),
                    Some(&Array::from_slice(&w, &[dim as i32])),
                    eps,
                )
                .unwrap();
                assert_eq!(theirs.dtype(), Dtype::Bfloat16);
                let mut ours = vec![half::bf16::ZERO; x.len()];
                elementwise::rms_norm_bf16(&x, &w, eps, &mut ours);
                let ours: Vec<u16> = ours.iter().map(|v| v.to_bits()).collect();
                let theirs: Vec<u16> = theirs
                    .as_slice::<half::bf16>()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let differ = ours.iter().zip(&theirs).filter(|(a, b)| a != b).count();
                assert_eq!(differ, 0, "bf16 {rows}x{dim}, scale {scale}, eps {eps}");
            }
        }
    }
}

#[test]
fn tiny_f32_llama_takes_the_host_paths_with_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &common::tiny_llama(json!({})), "f32", None);
    assert!(
        Forks::default().host_elementwise,
        "--host-elementwise is on by default in L1"
    );
    let on = common::per_layer_forks();
    let off = Forks {
        host_elementwise: false,
        ..on
    };
    let before = host_swiglu_calls();
    let norms_before = host_norm_calls();
    let mut t = common::Twins::prefill(dir.path(), off, on, 23, 5);
    t.assert_agree(8);
    // 4 layers, in the prompt and in each of the 8 steps.
    let calls = host_swiglu_calls() - before;
    assert!(calls >= 4 * 9, "the host SwiGLU ran {calls} times");
    // In each step, with the products on the host: both norms of every layer but the first
    // layer's input norm (the embedding is MLX's), and the final norm. Where f32 products stay
    // on MLX (another OpenBLAS order) the norms' inputs are lazy and they stay on MLX too.
    let norms = host_norm_calls() - norms_before;
    if common::f32_host_order_expected() {
        assert!(
            norms >= 8 * 8,
            "the host RMSNorm ran {norms} times in 8 steps"
        );
    } else {
        eprintln!("the host RMSNorm ran {norms} times in 8 steps");
    }
}

/// bfloat16 SwiGLU: the host form (MLX's own `silu` tabulated over every bfloat16 value, then
/// one rounded multiply) equals MLX's compiled and eager kernels for every gate value, each with
/// up values of every magnitude and both signs, infinities and NaNs included.
#[test]
fn bf16_swiglu_equals_mlx_for_every_gate_value() {
    let gate: Vec<half::bf16> = (0..=u16::MAX).map(half::bf16::from_bits).collect();
    let n = gate.len() as i32;
    let gate = Array::from_slice(&gate, &[n]);
    for compiled in [true, false] {
        let forks = Forks {
            compiled_activations: compiled,
            ..Forks::default()
        };
        let mut host = SwiGlu::new(&forks);
        let mut mlx = swiglu(compiled);
        for seed in 0..4u16 {
            // Every bit pattern as `up` too, rotated against the gate by a different amount
            // each pass.
            let up: Vec<half::bf16> = (0..=u16::MAX)
                .map(|i| half::bf16::from_bits(i.wrapping_mul(40503).wrapping_add(seed * 7919)))
                .collect();
            let up = Array::from_slice(&up, &[n]);
            let before = host_swiglu_calls();
            let ours = host.apply(&gate, &up).unwrap();
            assert_eq!(
                host_swiglu_calls(),
                before + 1,
                "the bf16 SwiGLU did not take the host path (compiled {compiled})"
            );
            let theirs = mlx.call1(&[gate.clone(), up.clone()]).unwrap();
            let (a, b) = (common::bits(&ours), common::bits(&theirs));
            let differ: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
            assert!(
                differ.is_empty(),
                "compiled {compiled}, pass {seed}: {} of {} values differ from MLX, first at gate \
                 bits {:#06x}",
                differ.len(),
                a.len(),
                differ[0]
            );
        }
    }
}

#[test]
fn a_tiny_bf16_llama_takes_the_host_products_and_swiglu_with_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &common::tiny_llama(json!({})), "bf16", None);
    let off = Forks {
        host_elementwise: false,
        host_matvec: false,
        ..Forks::default()
    };
    let before = host_swiglu_calls();
    let norms_before = host_norm_calls();
    let products_before = dense_calls();
    // A 23-token prompt (past the 16-token verify-block limit: the prompt path of the host
    // products), then single-token steps.
    let mut t = common::Twins::prefill(dir.path(), off, common::per_layer_forks(), 23, 5);
    assert_eq!(t.prefill.0.dtype(), Dtype::Bfloat16);
    t.assert_agree(8);
    let calls = host_swiglu_calls() - before;
    let norms = host_norm_calls() - norms_before;
    let products = dense_calls() - products_before;
    if elementwise::vector_path().is_some() {
        // 4 layers, in the prompt and in each of the 8 steps.
        assert!(calls >= 4 * 9, "the host SwiGLU ran {calls} times");
        assert!(products >= 4 * 7 * 9, "{products} host products");
        // In each step every norm but the first layer's input norm (the embedding is MLX's).
        assert!(
            norms >= 8 * 8,
            "the host RMSNorm ran {norms} times in 8 steps"
        );
    } else {
        eprintln!("no vector path here: {calls} host SwiGLUs, {norms} norms, {products} products");
    }
}

/// On an AVX-512 machine: every other test here again on the AVX2 kernels.
#[test]
fn the_avx2_path_passes_this_suite_too() {
    common::rerun_on_the_avx2_path("the_avx2_path_passes_this_suite_too");
}
