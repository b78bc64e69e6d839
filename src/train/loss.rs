//! DeepSpec's loss (dspark-spec.md §2): `0.1 CE + 0.9 L1(p_d, p_t) + 1.0 BCE(conf, c*)`, weights
//! `exp(-k/4)` times the contiguous-prefix supervision mask, normalised by the global weight.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::take_along_axis;
use mlx_rs::{ops, Array, Dtype};

/// Loss weights: cross-entropy, L1 between distributions, confidence BCE (the paper's Eq. 12).
pub const LOSS_WEIGHTS: (f32, f32, f32) = (0.1, 0.9, 1.0);
/// `loss_decay_gamma` of DeepSpec's code: position weights `exp(-k / 4)`.
pub const LOSS_DECAY: f32 = 4.0;

/// Weighted sums of the three loss terms and of the weights (scalars, f32):
/// `(Σw·CE, Σw·L1, Σw·BCE, Σw)`. `logits`/`target_logits` `[.., V]`, `conf` `[..]` logits,
/// `targets` ids `[..]`, `weights` `[..]`. `c*` is detached.
pub fn loss_sums(
    logits: &Array,
    target_logits: &Array,
    conf: Option<&Array>,
    targets: &Array,
    weights: &Array,
) -> std::result::Result<[Array; 4], Exception> {
    let z = logits.as_dtype(Dtype::Float32)?;
    let lse = z.logsumexp_axis(-1, true)?;
    let logp = z.subtract(&lse)?;
    let picked = take_along_axis(&logp, &targets.expand_dims(-1)?, -1)?.squeeze_axes(&[-1])?;
    let ce = picked.negative()?;
    let pd = logp.exp()?;
    let pt = ops::softmax_axis(&target_logits.as_dtype(Dtype::Float32)?, -1, true)?;
    let pt = mlx_rs::stop_gradient(&pt)?;
    let l1 = pd.subtract(&pt)?.abs()?.sum_axis(-1, false)?;
    let w = weights.as_dtype(Dtype::Float32)?;
    let bce = match conf {
        Some(c) => {
            let one = Array::from_f32(1.0);
            let star = ops::clip(
                &one.subtract(&l1.multiply(Array::from_f32(0.5))?)?,
                (0.0f32, 1.0f32),
            )?;
            let star = mlx_rs::stop_gradient(&star)?;
            let x = c.as_dtype(Dtype::Float32)?;
            // BCE with logits: max(x,0) - x c* + log(1 + exp(-|x|)).
            ops::maximum(&x, Array::from_f32(0.0))?
                .subtract(&x.multiply(&star)?)?
                .add(&x.abs()?.negative()?.exp()?.log1p()?)?
        }
        None => ops::zeros_like(&l1)?,
    };
    let wsum = |t: &Array| t.multiply(&w)?.sum(false);
    Ok([wsum(&ce)?, wsum(&l1)?, wsum(&bce)?, w.sum(false)?])
}

/// The total loss `0.1 CE + 0.9 L1 + 1.0 BCE` from summed terms over a global weight.
pub fn total_loss(sums: &[Array; 4]) -> std::result::Result<Array, Exception> {
    let (a, b, c) = LOSS_WEIGHTS;
    let den = ops::maximum(&sums[3], Array::from_f32(1e-12))?;
    sums[0]
        .multiply(Array::from_f32(a))?
        .add(&sums[1].multiply(Array::from_f32(b))?)?
        .add(&sums[2].multiply(Array::from_f32(c))?)?
        .divide(&den)
}
