//! The packed copies the L1 host step makes for recurring verify blocks: an f32 weight whose
//! one-token product OpenBLAS sums on its small-matrix kernel but whose 8-token blocks it sums
//! in panels gets a copy at the 64th such block, not before (writing it costs about what a
//! hundred rounds save), and the blocks read it from then on. Its own process: the packed
//! product counters are global.

mod common;

use mlx_rs::Array;
use mlxb::engine::forks::Forks;
use mlxb::engine::kernels::exact_steps_here;
use mlxb::engine::kernels::mlx_order::{self, F32Kernels};
use mlxb::engine::kernels::packed::packed_calls;
use mlxb::engine::models;
use serde_json::json;

#[test]
fn recurring_blocks_get_their_packed_copies_at_the_64th() {
    // Query projection 192 × 64 and head 384 × 64: one token on the small-matrix kernel, eight
    // tokens on the GEMM driver; every other product stays on the small-matrix kernel.
    let config = common::tiny_llama(json!({"num_hidden_layers": 2, "rope_theta": 10000.0,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32}));
    let dir = tempfile::tempdir().unwrap();
    common::make_model(dir.path(), &config, "f32", None);
    let mut loaded = models::load(dir.path(), Forks::default()).unwrap();
    loaded.model.prepare_host_step().unwrap();
    let model = loaded.model.as_mut();
    let mut caches = model.make_caches();
    let ids = |ids: &[u32]| {
        let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        Array::from_slice(&v, &[1, v.len() as i32])
    };
    model
        .forward(&ids(&common::prompt_ids(40, 384, 1)), &mut caches)
        .unwrap();
    let steps = exact_steps_here();
    let mut reads = Vec::new();
    for b in 0..66u32 {
        let before = packed_calls().1;
        let logits = model
            .forward(&ids(&common::prompt_ids(8, 384, 2 + b)), &mut caches)
            .unwrap();
        logits.eval().unwrap();
        reads.push(packed_calls().1 - before);
    }
    let taken = exact_steps_here() - steps;
    if !mlx_order::available() {
        eprintln!("no host kernels on this CPU: every block on MLX, no copy");
        assert_eq!((taken, reads.iter().sum::<usize>()), (0, 0));
    } else if F32Kernels::here() == F32Kernels::Haswell {
        // OpenBLAS's `Haswell` kernels sum every f32 product in panels: the one-token copies
        // made at load serve blocks of one to three tokens; longer ones take the per-layer
        // path there (see `model_parity`).
        eprintln!("OpenBLAS Haswell kernels: no small-matrix order, no verify-block copies");
        assert_eq!(taken, 0, "8-token blocks on Haswell kernels");
    } else {
        assert_eq!(taken, 66, "blocks taken by the L1 host step");
        assert!(
            reads[..63].iter().all(|&r| r == 0),
            "a copy before the 64th block: {reads:?}"
        );
        assert!(
            reads[63..].iter().all(|&r| r > 0),
            "no copy read from the 64th block: {reads:?}"
        );
    }
}
