//! Acceptance policies. Token match needs nothing but the target's own sampled token; the
//! rejection rule (Leviathan et al. / Chen et al.) needs the target distribution `p` and the
//! drafter's `q`, and is lossless in distribution: accept `d` with probability
//! `min(1, p(d)/q(d))`, otherwise resample from `max(p - q, 0)` normalized.

use crate::engine::error::Result;
use crate::engine::sample::Sampler;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, random, Array, Dtype};

/// The target's sampling distribution for one row: the sampler's filters, then
/// `softmax(logprobs / temp)` — what `categorical` draws from. `temp == 0` → one-hot argmax.
pub fn target_distribution(sampler: &mut Sampler, logprobs: &Array, temp: f64) -> Result<Array> {
    if temp == 0.0 {
        let vocab = logprobs.shape()[logprobs.ndim() - 1];
        let best = ops::indexing::argmax_axis(logprobs, -1, true)?;
        let ids = ops::arange::<_, i32>(0, vocab, 1)?;
        return Ok(ids.eq(&best)?.as_dtype(Dtype::Float32)?);
    }
    let filtered = sampler.filter(logprobs)?;
    let scaled = filtered
        .as_dtype(Dtype::Float32)?
        .multiply(Array::from_f32((1.0 / temp) as f32))?;
    Ok(ops::softmax_axis(&scaled, -1, true)?)
}

/// Result of checking one drafted token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Keep the drafted token.
    Accept,
    /// Reject it and emit this token instead.
    Replace(u32),
}

/// The rejection rule for drafted token `d` with target distribution `p` (`[1, V]` or `[V]`)
/// and draft distribution `q` (`None` = the draft was deterministic, q one-hot at `d`).
pub fn reject_step(p: &Array, q: Option<&Array>, d: u32) -> Result<Decision> {
    let p = p.reshape(&[-1])?;
    let p_d = p.index(d as i32).try_item_cast::<f32>()?;
    let q_d = match q {
        Some(q) => q.reshape(&[-1])?.index(d as i32).try_item_cast::<f32>()?,
        None => 1.0,
    };
    let u = random::uniform::<_, f32>(0.0, 1.0, &[], None)?.try_item_cast::<f32>()?;
    if q_d > 0.0 && u < (p_d / q_d).min(1.0) {
        return Ok(Decision::Accept);
    }
    let residual = match q {
        Some(q) => ops::maximum(p.subtract(q.reshape(&[-1])?)?, Array::from_f32(0.0))?,
        None => {
            let vocab = p.shape()[0];
            let not_d = ops::arange::<_, i32>(0, vocab, 1)?.ne(Array::from_int(d as i32))?;
            p.multiply(not_d.as_dtype(Dtype::Float32)?)?
        }
    };
    let total = residual.sum(None)?.try_item_cast::<f32>()?;
    // p == q exactly (residual empty) only happens when acceptance was certain; fall back to p.
    let dist = if total > 0.0 { residual } else { p.clone() };
    let token = random::categorical(ops::log(&dist)?, -1, None, None)?.try_item_cast::<u32>()?;
    Ok(Decision::Replace(token))
}
