//! mlx-lm's logprobs tail, `logits - logsumexp(logits)`, on the host when a step's logits are
//! already there (the host decode step's), bit-identical to MLX's.
//!
//! Why: MLX on x86 Linux computes `logsumexp` one lane at a time with a libm `fmaf` call per
//! polynomial coefficient: over SmolLM2's 49,152 logits about half a millisecond a token on one
//! core while the other waits, 5-10 % of a 4-bit decode step. The host form takes MLX's own
//! `exp` in vector lanes ([`elementwise::exp_mlx_slice`]) and adds the terms in MLX's order.

use crate::engine::error::Result;
use crate::engine::kernels::{check_bits, elementwise, ready_f32};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use std::sync::OnceLock;

thread_local! {
    static HOST_CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many logprob rows the host computed on this thread (lets tests check the host path
/// ran; per thread, so tests side by side in one process do not count each other's).
pub fn host_logprobs_calls() -> usize {
    HOST_CALLS.with(std::cell::Cell::get)
}

/// Row `i` of a forward's logits `[1, L, V]` as `[1, V]`: a copy of the host's values when the
/// step left them there (so [`host_logprobs`] can stay there too), else MLX's lazy slice.
pub fn logits_row(logits: &Array, i: usize) -> Array {
    if let (Some(values), &[1, len, width]) = (ready_f32(logits), logits.shape()) {
        let (len, width) = (len as usize, width as usize);
        if i < len && values.len() == len * width {
            return Array::from_slice(&values[i * width..(i + 1) * width], &[1, width as i32]);
        }
    }
    logits.index((.., i as i32, ..))
}

/// `logits - logsumexp(logits, keepdims)` over the last axis of a `[1, V]` f32 row whose values
/// are already on the host, computed there; `None` (the caller runs MLX) for a row MLX has not
/// computed yet, another shape or dtype, a NaN, or when the host's `logsumexp` differed from
/// MLX's on the one-time probe.
pub fn host_logprobs(logits: &Array) -> Result<Option<Array>> {
    let Some(row) = ready_f32(logits) else {
        return Ok(None);
    };
    if logits.shape() != [1, row.len() as i32] || !host_matches_mlx()? {
        return Ok(None);
    }
    let mut scratch = Vec::new();
    let Some(lse) = elementwise::logsumexp_mlx(row, &mut scratch) else {
        return Ok(None);
    };
    scratch.clear();
    scratch.extend(row.iter().map(|v| v - lse));
    HOST_CALLS.with(|c| c.set(c.get() + 1));
    Ok(Some(Array::from_slice(&scratch, logits.shape())))
}

/// Whether the host's logprobs equal MLX's on a fixed probe: rows of logits over a wide range
/// of magnitudes (the exps' underflow included), one with an infinite maximum; decided once
/// per process.
fn host_matches_mlx() -> Result<bool> {
    static VERDICT: OnceLock<bool> = OnceLock::new();
    if let Some(v) = VERDICT.get() {
        return Ok(*v);
    }
    let mut rows: Vec<Vec<f32>> = [(4096, 30.0), (49_152, 12.0), (1000, 200.0)]
        .into_iter()
        .enumerate()
        .map(|(i, (n, scale))| {
            elementwise::probe_values(n, 0x9e37_79b9 + i as u64)
                .into_iter()
                .map(|v| (v * scale).clamp(-1e4, 1e4))
                .collect()
        })
        .collect();
    rows.push(vec![1.0, f32::INFINITY, -3.0]);
    let mut same = true;
    for row in &rows {
        let x = Array::from_slice(row, &[1, row.len() as i32]);
        let theirs = check_bits(&x.subtract(x.logsumexp_axis(-1, true)?)?)?;
        let mut scratch = Vec::new();
        let ours = elementwise::logsumexp_mlx(row, &mut scratch).map(|lse| {
            row.iter()
                .map(|v| (v - lse).to_bits())
                .collect::<Vec<u32>>()
        });
        same &= ours.as_ref() == Some(&theirs);
    }
    Ok(*VERDICT.get_or_init(|| same))
}
