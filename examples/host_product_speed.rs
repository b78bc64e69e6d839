//! Read rate of the dense host products for a few tokens, per dtype, order and thread count, on
//! a weight too large for the caches (so the numbers are the kernels' memory read rate), and of
//! the packed f32 copy the L1 host step and its verify blocks read (both cores).
//!
//!     cargo run --release --example host_product_speed
use mlxb::engine::kernels::mlx_order::{matmul, panels, Order, Weights};
use mlxb::engine::kernels::packed::PackedRows;
use std::time::Instant;

fn main() {
    let arg = std::env::args().nth(1);
    let (rows, cols) = match arg.as_deref().map(|a| a.split_once('x')) {
        Some(Some((r, c))) => (r.parse().unwrap(), c.parse().unwrap()),
        _ => (65536usize, 576usize),
    };
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect();
    let bf: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
    let packed = PackedRows::f32(&w, rows, cols, &panels(cols, 320));
    for tokens in [1usize, 2, 4, 8] {
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let cases = [
            ("f32 lanes", Weights::F32(&w), Order::Lanes, 4),
            (
                "f32 panels",
                Weights::F32(&w),
                Order::Panels(panels(cols, 320)),
                4,
            ),
            ("bf16", Weights::Bf16(&bf), Order::Sequential, 2),
        ];
        for (name, weights, order, bytes) in cases {
            if order == Order::Lanes && tokens > 1 {
                continue;
            }
            for threads in [1, 2] {
                let first = matmul(weights, rows, cols, &x, tokens, &order, threads);
                if let Err(why) = first {
                    println!("{name} x{tokens} threads {threads}: not on this CPU ({why})");
                    continue;
                }
                let run = || matmul(weights, rows, cols, &x, tokens, &order, threads).unwrap();
                let reps = (2_000_000_000 / (rows * cols)).clamp(12, 20_000);
                let t = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(run());
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                let gbs = (rows * cols * bytes) as f64 / s / 1e9;
                println!(
                    "{name} x{tokens} threads {threads}: {:.1} us, {gbs:.1} GB/s",
                    s * 1e6
                );
            }
        }
        if let Some(packed) = &packed {
            let held = packed.rows();
            let mut out = vec![0.0f32; tokens * held];
            let mut run = || {
                packed
                    .rows_into_shared(&x, tokens, 0..held, &mut out, held)
                    .unwrap()
            };
            run();
            let reps = (2_000_000_000 / (rows * cols)).clamp(12, 20_000);
            let t = Instant::now();
            for _ in 0..reps {
                run();
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            let gbs = (held * cols * 4) as f64 / s / 1e9;
            println!(
                "f32 packed x{tokens} threads 2: {:.1} us, {gbs:.1} GB/s",
                s * 1e6
            );
        }
    }
}
