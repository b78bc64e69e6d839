//! `--host-matvec on` (an L1 default): products of up to sixteen tokens (decode steps, verify
//! blocks) through dense f32/bf16/f16 layers run on the host in the summation order of MLX's
//! CPU matmul. Checked here against MLX's own
//! `x @ W.T` (the product mlx-lm computes on the same libmlx), bit for bit:
//! - every order and its edge cases (outputs not a multiple of four or sixteen, depths not a
//!   multiple of sixteen or below 32, a third panel) on random weights and inputs, in each dtype;
//! - the real SmolLM2 f32 weights, each shape the model uses, and their bf16 casts;
//! - tiny f32 and bf16 llamas decoding with the host path give the same logits as without it,
//!   and really take it;
//! - a wrong order is caught by the load-time check and the layer stays on MLX.
//!
//! The f32 orders are those of OpenBLAS's SkylakeX and Haswell kernels. On a machine whose
//! OpenBLAS picks other kernels (`mlxb --version` names them), f32 products may be refused:
//! there the suite checks that every accepted product still equals MLX's and the logits are
//! unchanged. The dense kernels run on AVX-512 or AVX2 (with FMA and F16C; `MLXB_DENSE_KERNEL=avx2`
//! runs this suite on the AVX2 path of an AVX-512 machine, as CI does); on a CPU with neither
//! there is no dense host kernel: the suite checks that every dense layer stays on MLX with the
//! logits unchanged, and says on stderr that the sums went unchecked. Quantized layers have an
//! AVX2 kernel too, checked wherever it runs.
//!
//! End-to-end parity with mlx-lm under the defaults is `model_parity`'s job.

mod common;

use mlx_rs::{ops, random, Array, Dtype};
use mlxb::engine::forks::Forks;
use mlxb::engine::kernels::attention::host_attention_calls;
use mlxb::engine::kernels::mlx_order::{self, F32Kernels, Order};
use mlxb::engine::kernels::quant_order::Path;
use mlxb::engine::kernels::{
    dense_calls, qdense_calls, refused_blocks, refused_shapes, HostDense, HostQDense,
};
use serde_json::json;

/// Whether this CPU runs the host kernels (AVX-512 or AVX2, with FMA and F16C). Where it does
/// not (older x86, other architectures), `--host-matvec` must leave every layer on MLX: the
/// tests then check that fallback instead (nothing pinned, logits unchanged, no host call) and
/// say so on stderr. An x86 CPU with AVX2, FMA and F16C must run them.
fn kernels_here() -> bool {
    let here = mlx_order::available();
    #[cfg(target_arch = "x86_64")]
    assert!(
        here || !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")),
        "this CPU has AVX2, FMA and F16C but no dense host kernel"
    );
    if !here {
        eprintln!(
            "this CPU has neither AVX-512 nor AVX2 with FMA and F16C: --host-matvec has no kernel \
             here, so this test checks that every layer stays on MLX, not the host sums"
        );
    }
    here
}

/// Whether this CPU runs the quantized host kernel (AVX-512 or AVX2, [`Path::best`]); where it
/// does not, quantized layers must stay on MLX.
fn quant_kernels_here() -> bool {
    let here = Path::best() != Path::Scalar;
    if !here {
        eprintln!(
            "this CPU has neither AVX-512 nor AVX2: quantized layers have no host kernel here, so \
             this test checks that they stay on MLX, not the host sums"
        );
    }
    here
}

/// Asserts the host product equals MLX's bit for bit for `x` (`[.., cols]`).
fn assert_same_bits(what: &str, h: &HostDense, w: &Array, x: &Array) {
    let ours = h.forward(x).unwrap().expect("a contiguous input is taken");
    let theirs = ops::matmul(x, w.t()).unwrap();
    assert_eq!(ours.shape(), theirs.shape(), "{what}: shape");
    let (a, b) = (common::bits(&ours), common::bits(&theirs));
    let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
    assert_eq!(
        differ,
        0,
        "{what}: {differ} of {} outputs differ from MLX",
        a.len()
    );
}

/// A random `rows × cols` weight in `dtype`, pinned when the load-time check accepts its
/// shape; a refused one is judged by [`judge_refusal`] and `None` returned.
fn pinned_weight(
    rows: i32,
    cols: i32,
    dtype: Dtype,
    seed: u64,
    f32_required: bool,
) -> Option<(Array, HostDense)> {
    let key = random::key(seed).unwrap();
    let w = random::normal::<f32>(&[rows, cols][..], 0.0, 0.05, &key)
        .unwrap()
        .as_dtype(dtype)
        .unwrap();
    let Some(h) = HostDense::new(&w).unwrap() else {
        judge_refusal(&format!("{dtype:?} {rows}x{cols}"), dtype, f32_required);
        return None;
    };
    Some((w, h))
}

/// Checks one shape: a product the load-time check accepts equals MLX's bit for bit on three
/// inputs.
fn check_shape(rows: i32, cols: i32, dtype: Dtype, seed: u64, f32_required: bool) {
    let what = format!("{dtype:?} {rows}x{cols}");
    let Some((w, h)) = pinned_weight(rows, cols, dtype, seed, f32_required) else {
        return;
    };
    for (i, scale) in [1.0f32, 1e-3, 40.0].into_iter().enumerate() {
        let k = random::key(seed * 31 + i as u64).unwrap();
        let x = random::normal::<f32>(&[1, 1, cols][..], 0.0, scale, &k)
            .unwrap()
            .as_dtype(dtype)
            .unwrap();
        assert_same_bits(&what, &h, &w, &x);
        let flat = x.reshape(&[1, cols]).unwrap();
        assert_same_bits(&what, &h, &w, &flat);
    }
}

/// A refused product is a failure unless it is f32 on a machine whose OpenBLAS sums f32 in
/// another order (the 16-bit orders are MLX's own code, the same on every CPU).
fn judge_refusal(what: &str, dtype: Dtype, f32_required: bool) {
    if !mlx_order::available() {
        return eprintln!("{what}: no host kernel on this CPU, stays on MLX");
    }
    assert!(
        dtype == Dtype::Float32 && !f32_required,
        "{what}: the load-time check found MLX summing differently"
    );
    eprintln!("{what}: refused here, stays on MLX");
}

#[test]
fn every_order_and_dtype_matches_mlx_bit_for_bit_on_random_weights() {
    kernels_here();
    // Orders on SkylakeX kernels; on Haswell kernels every one is panels of at most 320.
    let shapes = [
        (576, 576),   // lanes (SmolLM2 q/o)
        (192, 576),   // lanes (k/v)
        (576, 1536),  // lanes (down); Haswell: 320+320+320+288+288
        (1536, 576),  // panels 288+288 (gate/up)
        (4099, 576),  // panels, rows not a multiple of 16
        (7, 40),      // lanes, rows not a multiple of 4, depth not of 16
        (37, 100),    // lanes, three trailing rows
        (300, 20),    // depth below 32: panels
        (1201, 64),   // more than 1200 outputs: panels
        (1000, 1001), // over 10^6 multiply-adds: panels 448+277+276; Haswell 320+320+181+180
        (999, 1001),  // same, rows not a multiple of 16
    ];
    let f32_required = common::f32_host_order_expected();
    for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
        for (i, (rows, cols)) in shapes.into_iter().enumerate() {
            check_shape(rows, cols, dtype, 100 + i as u64, f32_required);
        }
    }
    if f32_required {
        // (Another test here refuses a shape on purpose; none of these may be.)
        let refused = refused_shapes();
        for (rows, cols) in shapes {
            assert!(
                !refused.contains(&(rows as usize, cols as usize)),
                "{rows}x{cols} refused"
            );
        }
    }
}

#[test]
fn real_smollm2_weights_match_mlx_for_every_shape_in_f32_and_bf16() {
    kernels_here();
    let m = mlxb::convert::registry::find("smollm2-135m-instruct").unwrap();
    let dir = m.ensure(&mlxb::progress::Silent).unwrap();
    let t = Array::load_safetensors(dir.join("model.safetensors")).unwrap();
    let f32_required = common::f32_host_order_expected();
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.11.self_attn.o_proj.weight",
        "model.layers.29.mlp.gate_proj.weight",
        "model.layers.17.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ] {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let w = t[name].as_dtype(dtype).unwrap();
            let Some(h) = HostDense::new(&w).unwrap() else {
                judge_refusal(&format!("{name} {dtype:?}"), dtype, f32_required);
                continue;
            };
            let key = random::key(7).unwrap();
            let x = random::normal::<f32>(&[1, 1, w.shape()[1]][..], 0.0, 1.0, &key)
                .unwrap()
                .as_dtype(dtype)
                .unwrap();
            assert_same_bits(name, &h, &w, &x);
        }
    }
}

#[test]
fn tiny_f32_and_bf16_llamas_decode_on_the_host_path_with_the_same_logits() {
    let kernels = kernels_here();
    let f32_required = common::f32_host_order_expected();
    for dtype in ["f32", "bf16"] {
        let dir = tempfile::tempdir().unwrap();
        common::make_model(dir.path(), &common::tiny_llama(json!({})), dtype, None);
        assert!(
            Forks::default().host_matvec,
            "--host-matvec is on by default in L1"
        );
        let on = common::per_layer_forks();
        let off = Forks {
            host_matvec: false,
            ..on
        };
        let mut t = common::Twins::prefill(dir.path(), off, on, 9, 2);
        let (la, lb) = t.prefill.clone();
        assert_eq!(
            common::bits(&la),
            common::bits(&lb),
            "{dtype} prefill logits"
        );
        let before = dense_calls();
        let attention_before = host_attention_calls();
        let mut tok = last_argmax(&la);
        for step in 0..12 {
            let (pa, pb) = t.step(tok);
            assert_eq!(
                common::bits(&pa),
                common::bits(&pb),
                "{dtype} step {step} logits"
            );
            tok = last_argmax(&pa);
        }
        // 4 layers x 7 projections + the tied head, per step (f32 only where OpenBLAS sums
        // as the host path does; elsewhere the equal logits above are the fallback's check).
        let calls = dense_calls() - before;
        if !kernels {
            assert_eq!(
                calls, 0,
                "{dtype}: the host path ran on a CPU without its kernels"
            );
        } else if dtype == "bf16" || f32_required {
            assert!(
                calls >= 12 * 29,
                "{dtype}: the host path ran {calls} times in 12 steps"
            );
            // Every layer's attention too, for bfloat16 (f32 attention stays on MLX).
            let attention = host_attention_calls() - attention_before;
            assert!(
                dtype == "f32" || attention >= 12 * 4,
                "{dtype}: the host attention ran {attention} times in 12 steps"
            );
        } else {
            eprintln!("{dtype}: the host path ran {calls} times in 12 steps");
        }
    }
}

/// The greedy token after the last position of `[1, L, V]` logits.
fn last_argmax(logits: &Array) -> i32 {
    let v = *logits.shape().last().unwrap() as usize;
    let all = logits.as_dtype(Dtype::Float32).unwrap();
    common::argmax(&all.as_slice::<f32>()[all.size() - v..]) as i32
}

#[test]
fn a_wrong_order_is_caught_and_the_layer_stays_on_mlx() {
    let key = random::key(5).unwrap();
    let w = random::normal::<f32>(&[64, 576][..], 0.0, 0.05, &key).unwrap();
    if !kernels_here() {
        assert!(HostDense::with_order(&w, Order::Lanes).unwrap().is_none());
        assert!(HostDense::new(&w).unwrap().is_none());
        return;
    }
    // SkylakeX kernels sum this shape in lanes, Haswell's in two panels of 288; a single
    // sequential chain is neither (and every kernel path runs it).
    let wrong_order = Order::Panels(vec![576]);
    assert_ne!(F32Kernels::here().order(64, 576), wrong_order);
    let wrong = HostDense::with_order(&w, wrong_order).unwrap();
    assert!(
        wrong.is_none(),
        "a different summation order passed the check"
    );
    assert!(refused_shapes().contains(&(64, 576)));
    let right = HostDense::new(&w).unwrap();
    if common::f32_host_order_expected() {
        assert!(right.is_some(), "the right order was refused");
    }
}

#[test]
fn other_dtypes_and_mismatched_tokens_stay_on_mlx() {
    let kernels = kernels_here();
    let w = Array::from_slice(&[3i32; 64 * 32], &[64, 32]);
    assert!(
        HostDense::new(&w).unwrap().is_none(),
        "an int32 weight was pinned"
    );
    let w = Array::from_slice(&[0.5f32; 64 * 32], &[64, 32])
        .as_dtype(Dtype::Bfloat16)
        .unwrap();
    let Some(h) = HostDense::new(&w).unwrap() else {
        assert!(!kernels, "a bf16 weight was refused");
        return;
    };
    // An f32 token through a bf16 weight is an f32 product in MLX (another order): refused.
    let x = Array::from_slice(&[0.25f32; 32], &[1, 32]);
    assert!(h.forward(&x).unwrap().is_none());
}

/// Verify blocks (2 to 16 tokens) through every order and dtype: an accepted block equals
/// MLX's product bit for bit; 16-bit blocks (MLX's own `simd_gemm` order, the same on every
/// CPU) must be accepted; an f32 block size MLX's BLAS sums otherwise is refused and stays on
/// MLX, which the test reports and checks.
#[test]
fn verify_blocks_of_up_to_sixteen_tokens_match_mlx_bit_for_bit() {
    let kernels = kernels_here();
    let shapes = [
        (576, 576),   // lanes up to 2 tokens on SkylakeX, then panels
        (192, 576),   // lanes up to 6 tokens on SkylakeX
        (576, 1536),  // panels
        (1536, 576),  // panels
        (4099, 576),  // panels, rows not a multiple of 8
        (37, 100),    // lanes, rows not a multiple of 4
        (300, 20),    // depth below 32 and not a multiple of 16
        (1000, 1001), // three panels
    ];
    let mut accepted = 0;
    for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
        for (i, (rows, cols)) in shapes.into_iter().enumerate() {
            let what = format!("{dtype:?} {rows}x{cols}");
            let f32_required = common::f32_host_order_expected();
            let Some((w, h)) = pinned_weight(rows, cols, dtype, 300 + i as u64, f32_required)
            else {
                continue;
            };
            for tokens in 2..=16 {
                let k = random::key(tokens as u64 * 7 + i as u64).unwrap();
                let x = random::normal::<f32>(&[1, tokens, cols][..], 0.0, 1.0, &k)
                    .unwrap()
                    .as_dtype(dtype)
                    .unwrap();
                let what = format!("{what} x{tokens}");
                if h.forward(&x).unwrap().is_some() {
                    assert_same_bits(&what, &h, &w, &x);
                    accepted += 1;
                } else {
                    assert_eq!(dtype, Dtype::Float32, "{what}: a 16-bit block was refused");
                    assert!(
                        refused_blocks().contains(&(rows as usize, cols as usize, tokens as usize)),
                        "{what}: declined without a refusal on record"
                    );
                    eprintln!("{what}: MLX sums this f32 block otherwise here, stays on MLX");
                }
            }
        }
    }
    assert_eq!(accepted > 0, kernels, "{accepted} blocks on the host path");
    // Past sixteen tokens an f32 layer is OpenBLAS's.
    let w = Array::from_slice(&[0.5f32; 64 * 32], &[64, 32]);
    let x = Array::from_slice(&[0.25f32; 17 * 32], &[1, 17, 32]);
    assert!(!HostDense::takes(&x));
    if let Some(h) = HostDense::new(&w).unwrap() {
        assert!(
            h.forward(&x).unwrap().is_none(),
            "17 f32 tokens on the host path"
        );
    }
}

/// Prompts through 16-bit weights (MLX's `simd_gemm` order, whose sums do not depend on the
/// token count): products of 17 to 300 tokens take the host path and equal MLX's bit for bit,
/// on SmolLM2's shapes and on rows and depths that are not multiples of sixteen.
#[test]
fn prompts_through_sixteen_bit_weights_match_mlx_bit_for_bit() {
    let kernels = kernels_here();
    let shapes = [
        (576, 576),
        (192, 576),
        (1536, 576),
        (576, 1536),
        (37, 100),
        (300, 20),
    ];
    let mut accepted = 0;
    for dtype in [Dtype::Bfloat16, Dtype::Float16] {
        for (i, (rows, cols)) in shapes.into_iter().enumerate() {
            let Some((w, h)) = pinned_weight(rows, cols, dtype, 500 + i as u64, true) else {
                continue;
            };
            for tokens in [17, 31, 35, 64, 100, 300] {
                let k = random::key(tokens as u64 * 11 + i as u64).unwrap();
                let x = random::normal::<f32>(&[1, tokens, cols][..], 0.0, 1.0, &k)
                    .unwrap()
                    .as_dtype(dtype)
                    .unwrap();
                assert!(HostDense::takes(&x));
                let what = format!("{dtype:?} {rows}x{cols} x{tokens}");
                assert!(h.forward(&x).unwrap().is_some(), "{what}: refused");
                assert_same_bits(&what, &h, &w, &x);
                accepted += 1;
            }
        }
    }
    assert_eq!(accepted > 0, kernels, "{accepted} prompts on the host path");
}

/// L1 quantized layers with f32 or bf16 scales (`--keep-quant` imports): the host product in MLX's
/// `quantized_matmul` order equals MLX's bit for bit for 1 to 40 tokens, on SmolLM2's and
/// Qwen2.5-0.5B's shapes, every MLX width (2, 3, 4, 5, 6, 8 bits) and group sizes 32/64/128,
/// rows that are not whole groups of sixteen included.
#[test]
fn quantized_layers_of_every_width_match_mlx_bit_for_bit() {
    let kernels = quant_kernels_here();
    let shapes = [
        (576, 576, 4, 32),
        (1536, 576, 4, 64),
        (192, 576, 8, 32),
        (576, 1536, 4, 128),
        (37, 256, 8, 64),
        (896, 896, 5, 32),
        (130, 384, 6, 64),
        (64, 256, 3, 32),
        (48, 256, 2, 128),
        (4864, 896, 5, 32),
        (33, 192, 6, 32),
    ];
    let mut accepted = 0;
    for (i, (rows, cols, bits, group)) in shapes.into_iter().enumerate() {
        let key = random::key(700 + i as u64).unwrap();
        let w = random::normal::<f32>(&[rows, cols][..], 0.0, 0.05, &key).unwrap();
        let (wq, scales, biases) = ops::quantize(&w, group, bits).unwrap();
        assert_eq!(scales.dtype(), Dtype::Float32);
        let bf = |a: &Array| a.as_dtype(Dtype::Bfloat16).unwrap();
        let (scales, biases) = if i % 2 == 1 {
            (bf(&scales), bf(&biases))
        } else {
            (scales, biases)
        };
        let what = format!("{rows}x{cols} {bits}-bit groups of {group}");
        let Some(h) = HostQDense::new(&wq, &scales, &biases, bits, group).unwrap() else {
            assert!(!kernels, "{what}: refused on a CPU with the kernels");
            continue;
        };
        for tokens in [1, 2, 5, 16, 17, 40] {
            let k = random::key(tokens as u64 * 13 + i as u64).unwrap();
            let x = random::normal::<f32>(&[1, tokens, cols][..], 0.0, 1.0, &k)
                .unwrap()
                .as_dtype(scales.dtype())
                .unwrap();
            let ours = h
                .forward(&x)
                .unwrap()
                .expect("an input of the layer's dtype is taken");
            let theirs =
                ops::quantized_matmul(&x, &wq, &scales, &biases, true, group, bits).unwrap();
            assert_bits_equal(&format!("{what} x{tokens}"), &ours, &theirs);
            accepted += 1;
        }
    }
    assert_eq!(
        accepted > 0,
        kernels,
        "{accepted} quantized products on the host"
    );
}

/// A tiny 4-bit llama (f32 scales) gives the same logits with and without `--host-matvec`,
/// and really takes the quantized host path.
#[test]
fn a_tiny_4bit_llama_takes_the_quantized_host_path_with_the_same_logits() {
    let kernels = quant_kernels_here();
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &common::tiny_llama(json!({})), "f32", Some(4));
    let off = Forks {
        host_matvec: false,
        ..Forks::default()
    };
    let before = qdense_calls();
    let mut t = common::Twins::prefill(dir.path(), off, Forks::default(), 23, 5);
    t.assert_agree(6);
    let calls = qdense_calls() - before;
    assert_eq!(calls > 0, kernels, "{calls} quantized host products");
}

/// A biased 16-bit layer (qwen2's q/k/v projections): the host's `bias + x · Wᵀ` equals MLX's
/// `addmm` bit for bit for decode steps, verify blocks and prompts, on Qwen2.5-Coder-0.5B's
/// shapes; an f32 layer's (OpenBLAS adds the bias its own way) is left to MLX.
#[test]
fn biased_16bit_layers_match_mlx_addmm_bit_for_bit() {
    let kernels = kernels_here();
    let mut accepted = 0;
    for (i, (rows, cols)) in [(896, 896), (128, 896), (1536, 1536), (37, 256)]
        .into_iter()
        .enumerate()
    {
        let key = random::key(900 + i as u64).unwrap();
        let w = random::normal::<f32>(&[rows, cols][..], 0.0, 0.05, &key)
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let key = random::key(950 + i as u64).unwrap();
        let bias = random::normal::<f32>(&[rows][..], 0.0, 2.0, &key)
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let what = format!("{rows}x{cols} bf16 with a bias");
        let Some(h) = HostDense::new(&w).unwrap() else {
            assert!(!kernels, "{what}: refused on a CPU with the kernels");
            continue;
        };
        for tokens in [1, 3, 16, 17, 40] {
            let k = random::key(tokens as u64 * 31 + i as u64).unwrap();
            let x = random::normal::<f32>(&[1, tokens, cols][..], 0.0, 1.0, &k)
                .unwrap()
                .as_dtype(Dtype::Bfloat16)
                .unwrap();
            let ours = h
                .forward_biased(&x, &bias)
                .unwrap()
                .unwrap_or_else(|| panic!("{what} x{tokens}: refused"));
            let theirs = ops::addmm(&bias, &x, w.t(), None, None).unwrap();
            assert_bits_equal(&format!("{what} x{tokens}"), &ours, &theirs);
            accepted += 1;
        }
        let plain = h
            .forward(&x_of(cols))
            .unwrap()
            .expect("the plain product too");
        assert_eq!(plain.dtype(), Dtype::Bfloat16);
    }
    assert_eq!(
        accepted > 0,
        kernels,
        "{accepted} biased products on the host"
    );
    let w32 = random::normal::<f32>(&[64, 128][..], 0.0, 0.05, &random::key(7).unwrap()).unwrap();
    let b32 = random::normal::<f32>(&[64][..], 0.0, 1.0, &random::key(8).unwrap()).unwrap();
    if let Some(h) = HostDense::new(&w32).unwrap() {
        let x =
            random::normal::<f32>(&[1, 1, 128][..], 0.0, 1.0, &random::key(9).unwrap()).unwrap();
        assert!(
            h.forward_biased(&x, &b32).unwrap().is_none(),
            "f32 addmm stays on MLX"
        );
    }
}

/// One bf16 token of depth `cols`.
fn x_of(cols: i32) -> Array {
    random::normal::<f32>(&[1, 1, cols][..], 0.0, 1.0, &random::key(11).unwrap())
        .unwrap()
        .as_dtype(Dtype::Bfloat16)
        .unwrap()
}

/// `ours` and `theirs` hold the same bits, or the test fails naming how many differ.
fn assert_bits_equal(what: &str, ours: &Array, theirs: &Array) {
    let (a, b) = (common::bits(ours), common::bits(theirs));
    let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
    assert_eq!(differ, 0, "{what}: {differ} of {} differ", a.len());
}

/// On an AVX-512 machine: every other test here again on the AVX2 kernels.
#[test]
fn the_avx2_path_passes_this_suite_too() {
    common::rerun_on_the_avx2_path("the_avx2_path_passes_this_suite_too");
}
