//! bfloat16 attention on the host (`--host-matvec on`, L1): for every head layout, query and
//! key count, with and without the causal mask, the host result equals MLX's own
//! `fast::scaled_dot_product_attention` on the CPU (the op mlx-lm calls) bit for bit, with
//! keys and values contiguous and as cache views with room for more keys; calls it
//! does not reproduce (a mask array, other dtypes) are left to MLX.
//!
//! End-to-end parity with mlx-lm on bf16 models is `model_parity`'s and `host_elementwise`'s job.

mod common;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{random, Array, Dtype};
use mlxb::engine::cache::AttentionMask;
use mlxb::engine::cache_attention::host_attention;
use mlxb::engine::kernels::attention::host_attention_calls;
use mlxb::engine::kernels::mlx_order;
use mlxb::engine::models::attention::sdpa;

fn random_bf16(seed: u64, dims: [usize; 4], scale: f32) -> Array {
    let key = random::key(seed).unwrap();
    let dims: Vec<i32> = dims.iter().map(|d| *d as i32).collect();
    random::normal::<f32>(&dims[..], 0.0, scale, &key)
        .unwrap()
        .as_dtype(Dtype::Bfloat16)
        .unwrap()
}

#[test]
fn host_attention_equals_mlx_sdpa_bit_for_bit() {
    let here = mlx_order::available();
    if !here {
        eprintln!(
            "this CPU has no host product kernels: the host attention must decline every call"
        );
    }
    let layouts = [
        (9, 3, 64),
        (4, 4, 128),
        (8, 2, 64),
        (2, 1, 32),
        (14, 2, 64),
        (12, 2, 128),
    ];
    let calls = [
        (1, 1, false),
        (1, 300, false),
        (5, 5, true),
        (33, 80, true),
        (64, 64, true),
        (16, 200, false),
        (3, 517, true),
    ];
    let before = host_attention_calls();
    let mut taken = 0;
    for (l, (heads, kv_heads, dim)) in layouts.into_iter().enumerate() {
        let scale = 1.0 / (dim as f32).sqrt();
        for (c, (queries, keys, causal)) in calls.into_iter().enumerate() {
            for (i, spread) in [1.0f32, 4.0].into_iter().enumerate() {
                let seed = (100 * l + 10 * c + i) as u64 * 3;
                let q = random_bf16(seed, [1, heads, queries, dim], spread);
                // The second spread reads keys and values as a cache holds them: the first
                // `keys` rows of buffers with room for more (read in place, heads apart).
                let room = if i == 1 { 40 } else { 0 };
                let k = random_bf16(seed + 1, [1, kv_heads, keys + room, dim], spread).index((
                    ..,
                    ..,
                    ..keys as i32,
                    ..,
                ));
                let v = random_bf16(seed + 2, [1, kv_heads, keys + room, dim], 1.0).index((
                    ..,
                    ..,
                    ..keys as i32,
                    ..,
                ));
                let mask = if causal {
                    AttentionMask::Causal
                } else {
                    AttentionMask::None
                };
                let what = format!(
                    "{heads}/{kv_heads} heads of {dim}, {queries} queries over {keys} keys, \
                     causal {causal}, spread {spread}"
                );
                let Some(ours) = host_attention(&q, &k, &v, scale, &mask).unwrap() else {
                    assert!(!here, "{what}: declined on a CPU with the kernels");
                    continue;
                };
                let theirs = sdpa(&q, &k, &v, scale, &mask).unwrap();
                assert_eq!(ours.shape(), theirs.shape(), "{what}: shape");
                assert_eq!(ours.dtype(), Dtype::Bfloat16, "{what}: dtype");
                let (a, b) = (common::bits(&ours), common::bits(&theirs));
                let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
                assert_eq!(differ, 0, "{what}: {differ} of {} values differ", a.len());
                taken += 1;
            }
        }
    }
    assert_eq!(taken > 0, here, "{taken} calls on the host");
    assert!(host_attention_calls() - before >= taken);
}

#[test]
fn calls_the_host_does_not_reproduce_stay_on_mlx() {
    let q = random_bf16(1, [1, 4, 3, 64], 1.0);
    let k = random_bf16(2, [1, 2, 10, 64], 1.0);
    let v = random_bf16(3, [1, 2, 10, 64], 1.0);
    let mask = Array::from_slice(&[true; 30], &[3, 10]);
    assert!(
        host_attention(&q, &k, &v, 0.125, &AttentionMask::Array(mask))
            .unwrap()
            .is_none(),
        "a mask array was taken"
    );
    let f = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
    assert!(
        host_attention(&f(&q), &f(&k), &f(&v), 0.125, &AttentionMask::Causal)
            .unwrap()
            .is_none(),
        "f32 attention was taken"
    );
}

/// On an AVX-512 machine: every other test here again on the AVX2 kernels.
#[test]
fn the_avx2_path_passes_this_suite_too() {
    common::rerun_on_the_avx2_path("the_avx2_path_passes_this_suite_too");
}
