//! mlx-lm's logprobs tail, `logits - logsumexp(logits)`, on the host when a step's logits are
//! already there (the host decode step's, f32 or bfloat16), bit-identical to MLX's.
//!
//! Why: MLX on x86 Linux computes `logsumexp` one lane at a time with a libm `fmaf` call per
//! polynomial coefficient: over SmolLM2's 49,152 logits about half a millisecond a token on one
//! core while the other waits, 5-10 % of a 4-bit decode step. The host form takes MLX's own
//! `exp` in vector lanes ([`crate::engine::kernels::elementwise::exp_mlx_slice`]) and adds the
//! terms in MLX's order.

use crate::engine::error::Result;
use crate::engine::kernels::elementwise::{bf16_mlx, logsumexp_mlx, probe_values};
use crate::engine::kernels::{check_bits, ready_bf16, ready_f32};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use std::sync::OnceLock;

thread_local! {
    static HOST_CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static HOST_ARGMAX_CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many greedy picks the host made on this thread ([`host_argmax`]).
pub fn host_argmax_calls() -> usize {
    HOST_ARGMAX_CALLS.with(std::cell::Cell::get)
}

/// How many logprob rows the host computed on this thread (lets tests check the host path
/// ran; per thread, so tests side by side in one process do not count each other's).
pub fn host_logprobs_calls() -> usize {
    HOST_CALLS.with(std::cell::Cell::get)
}

/// A row of logits already on the host.
#[derive(Clone, Copy)]
enum HostRow<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
}

impl<'a> HostRow<'a> {
    /// The values of `a` when MLX has computed them (never evaluates).
    fn of(a: &'a Array) -> Option<Self> {
        ready_f32(a)
            .map(HostRow::F32)
            .or_else(|| ready_bf16(a).map(HostRow::Bf16))
    }

    /// [`HostRow::of`] a `[1, V]` row.
    fn of_row(a: &'a Array) -> Option<Self> {
        Self::of(a).filter(|row| a.shape() == [1, row.len() as i32])
    }

    fn len(self) -> usize {
        match self {
            HostRow::F32(v) => v.len(),
            HostRow::Bf16(v) => v.len(),
        }
    }

    /// Values `range` as a new `[1, n]` array of the same dtype.
    fn array(self, range: std::ops::Range<usize>) -> Array {
        let n = [1, range.len() as i32];
        match self {
            HostRow::F32(v) => Array::from_slice(&v[range], &n),
            HostRow::Bf16(v) => Array::from_slice(&v[range], &n),
        }
    }
}

/// Row `i` of a forward's logits `[1, L, V]` as `[1, V]`: a copy of the host's values when the
/// step left them there (so [`host_logprobs`] can stay there too), else MLX's lazy slice.
pub fn logits_row(logits: &Array, i: usize) -> Array {
    if let (Some(values), &[1, len, width]) = (HostRow::of(logits), logits.shape()) {
        let (len, width) = (len as usize, width as usize);
        if i < len && values.len() == len * width {
            return values.array(i * width..(i + 1) * width);
        }
    }
    logits.index((.., i as i32, ..))
}

/// `logits - logsumexp(logits, keepdims)` over the last axis of a `[1, V]` f32 or bfloat16 row
/// whose values are already on the host, computed there as MLX computes it (a bfloat16 row's
/// sum in f32, its `logsumexp` and each difference rounded to bfloat16); `None` (the caller
/// runs MLX) for a row MLX has not computed yet, another shape or dtype, a NaN, or when the
/// host's result differed from MLX's on the one-time probe.
pub fn host_logprobs(logits: &Array) -> Result<Option<Array>> {
    let Some(row) = HostRow::of_row(logits) else {
        return Ok(None);
    };
    if !host_matches_mlx(logits.dtype())? {
        return Ok(None);
    }
    let Some(out) = logprobs(row) else {
        return Ok(None);
    };
    HOST_CALLS.with(|c| c.set(c.get() + 1));
    Ok(Some(out))
}

/// The index of the largest value of a `[1, V]` row already on the host, as MLX's `argmax`
/// picks it ([`first_greatest`]); `None` for a row MLX has not computed yet.
pub fn host_argmax(logprobs: &Array) -> Option<u32> {
    let row = HostRow::of_row(logprobs)?;
    HOST_ARGMAX_CALLS.with(|c| c.set(c.get() + 1));
    Some(match row {
        HostRow::F32(x) => first_greatest(x.iter().copied()),
        HostRow::Bf16(x) => first_greatest(x.iter().map(|v| v.to_f32())),
    } as u32)
}

/// The index of the first of the greatest values, NaNs never chosen unless nothing else is
/// (then 0): MLX's `argmax` starts from the lowest value and replaces it only with a greater
/// one.
pub fn first_greatest(values: impl Iterator<Item = f32>) -> usize {
    let (mut best, mut at) = (f32::NEG_INFINITY, 0);
    for (i, v) in values.enumerate() {
        if v > best {
            (best, at) = (v, i);
        }
    }
    at
}

/// The logprobs of one host row (`None` for a row with a NaN).
fn logprobs(row: HostRow<'_>) -> Option<Array> {
    let n = [1, row.len() as i32];
    match row {
        HostRow::F32(x) => {
            let lse = logsumexp_mlx(x)?;
            let out: Vec<f32> = x.iter().map(|v| v - lse).collect();
            Some(Array::from_slice(&out, &n))
        }
        HostRow::Bf16(x) => {
            let wide: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
            let lse = bf16_mlx(logsumexp_mlx(&wide)?).to_f32();
            let out: Vec<half::bf16> = wide.iter().map(|v| bf16_mlx(v - lse)).collect();
            Some(Array::from_slice(&out, &n))
        }
    }
}

/// Whether the host's logprobs of `dtype` rows equal MLX's on a fixed probe: rows of logits
/// over a wide range of magnitudes (the exps' underflow included), one with an infinite
/// maximum; decided once per process and dtype (f32 and bfloat16; others never match).
fn host_matches_mlx(dtype: Dtype) -> Result<bool> {
    static F32: OnceLock<bool> = OnceLock::new();
    static BF16: OnceLock<bool> = OnceLock::new();
    let verdict = match dtype {
        Dtype::Float32 => &F32,
        Dtype::Bfloat16 => &BF16,
        _ => return Ok(false),
    };
    if let Some(v) = verdict.get() {
        return Ok(*v);
    }
    let mut rows: Vec<Vec<f32>> = [(4096, 30.0), (49_152, 12.0), (1000, 200.0)]
        .into_iter()
        .enumerate()
        .map(|(i, (n, scale))| {
            probe_values(n, 0x9e37_79b9 + i as u64)
                .into_iter()
                .map(|v| (v * scale).clamp(-1e4, 1e4))
                .collect()
        })
        .collect();
    rows.push(vec![1.0, f32::INFINITY, -3.0]);
    let mut same = true;
    for row in &rows {
        let x = Array::from_slice(row, &[1, row.len() as i32]).as_dtype(dtype)?;
        x.eval()?;
        let theirs = check_bits(&x.subtract(x.logsumexp_axis(-1, true)?)?)?;
        let ours = HostRow::of(&x)
            .and_then(logprobs)
            .map(|a| check_bits(&a))
            .transpose()?;
        same &= ours.as_ref() == Some(&theirs);
    }
    Ok(*verdict.get_or_init(|| same))
}

#[cfg(test)]
mod tests {
    use super::first_greatest;

    #[test]
    fn first_greatest_takes_the_first_of_equals() {
        let pick = |v: &[f32]| first_greatest(v.iter().copied());
        assert_eq!(pick(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(pick(&[2.0]), 0);
    }
}
