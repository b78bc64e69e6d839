//! DeepSpec's loss (dspark-spec.md §2): `0.1 CE + 0.9 L1(p_d, p_t) + 1.0 BCE(conf, c*)` (the term
//! weights are a training option), position weights
//! `exp(-k/4)` times the contiguous-prefix supervision mask, normalised by the global weight.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::take_along_axis;
use mlx_rs::{ops, Array, Dtype};

/// Weights of the loss terms: cross-entropy, L1 between distributions, confidence BCE, and
/// the KL divergence from the target's distribution (not in DeepSpec's loss).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossWeights {
    /// Cross-entropy against the sequence's token.
    pub ce: f32,
    /// L1 between the draft's and the target's distributions.
    pub l1: f32,
    /// Binary cross-entropy of the confidence head.
    pub conf: f32,
    /// KL(target ‖ draft) over the draft's vocabulary.
    #[serde(default)]
    pub kl: f32,
}

impl Default for LossWeights {
    /// DeepSpec's weights (the paper's Eq. 12): `0.1 CE + 0.9 L1 + 1.0 BCE`.
    fn default() -> Self {
        Self {
            ce: 0.1,
            l1: 0.9,
            conf: 1.0,
            kl: 0.0,
        }
    }
}

impl std::str::FromStr for LossWeights {
    type Err = String;

    /// `CE,L1,CONF[,KL]`: finite, non-negative numbers, not all of CE, L1 and KL zero.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || {
            format!(
                "expected three or four non-negative numbers CE,L1,CONF[,KL] with CE, L1 or KL \
                 above 0 (DeepSpec's are 0.1,0.9,1.0), got `{s}`"
            )
        };
        let parts: Vec<f32> = s
            .split(',')
            .map(|p| p.trim().parse::<f32>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| bad())?;
        if !parts.iter().all(|w| w.is_finite() && *w >= 0.0) {
            return Err(bad());
        }
        let w = match parts[..] {
            [ce, l1, conf] => Self {
                ce,
                l1,
                conf,
                kl: 0.0,
            },
            [ce, l1, conf, kl] => Self { ce, l1, conf, kl },
            _ => return Err(bad()),
        };
        if w.ce + w.l1 + w.kl > 0.0 {
            Ok(w)
        } else {
            Err(bad())
        }
    }
}

/// `loss_decay_gamma` of DeepSpec's code: position weights `exp(-k / 4)`.
pub const LOSS_DECAY: f32 = 4.0;

/// A reduced draft vocabulary seen from the target's ids: which target id is which draft id.
pub struct VocabMap {
    /// The draft ids' target ids `[Vd]` (uint32, ascending).
    pub target_ids: Array,
    /// Each target id's draft id `[V]` (int32; 0 where it has none).
    draft_of: Array,
    /// Whether each target id has a draft id `[V]` (f32 0/1).
    kept: Array,
}

impl VocabMap {
    /// The map of `ids` (ascending target ids below `vocab`).
    pub fn new(ids: &[u32], vocab: usize) -> Self {
        let mut draft_of = vec![0i32; vocab];
        let mut kept = vec![0f32; vocab];
        for (i, &t) in ids.iter().enumerate() {
            draft_of[t as usize] = i as i32;
            kept[t as usize] = 1.0;
        }
        Self {
            target_ids: Array::from_slice(ids, &[ids.len() as i32]),
            draft_of: Array::from_slice(&draft_of, &[vocab as i32]),
            kept: Array::from_slice(&kept, &[vocab as i32]),
        }
    }
}

/// The target's side of the loss at each supervised position.
pub struct Target {
    /// The target's next-token probabilities over the drafter's vocabulary `[.., Vd]` (the
    /// full vocabulary, or a reduced draft vocabulary's columns).
    probs: Array,
    /// The target's probability mass outside a reduced draft vocabulary `[..]` (`None` = 0).
    outside: Option<Array>,
    /// Supervised next tokens as drafter ids `[..]`.
    ids: Array,
    /// 1 where the supervised token has a drafter id, 0 where a reduced vocabulary lacks it
    /// (no cross-entropy there) `[..]`; `None` = all 1.
    ce_mask: Option<Array>,
}

impl Target {
    /// The target side from its logits over the full vocabulary `[.., V]` and the supervised
    /// target ids `[..]`, seen through `map` when the drafter has a reduced vocabulary.
    pub fn new(
        logits: &Array,
        ids: &Array,
        map: Option<&VocabMap>,
    ) -> std::result::Result<Self, Exception> {
        let pt = ops::softmax_axis(&logits.as_dtype(Dtype::Float32)?, -1, true)?;
        let pt = mlx_rs::stop_gradient(&pt)?;
        Ok(match map {
            None => Self {
                probs: pt,
                outside: None,
                ids: ids.clone(),
                ce_mask: None,
            },
            Some(m) => {
                let probs = pt.take_axis(&m.target_ids, -1)?;
                let outside = Array::from_f32(1.0).subtract(&probs.sum_axis(-1, false)?)?;
                Self {
                    probs,
                    outside: Some(ops::maximum(&outside, Array::from_f32(0.0))?),
                    ids: m.draft_of.take_axis(ids, 0)?,
                    ce_mask: Some(m.kept.take_axis(ids, 0)?),
                }
            }
        })
    }
}

/// Weighted sums of the loss terms and of the weights (scalars, f32):
/// `(Σw·CE, Σw·L1, Σw·BCE, Σw·KL, Σw)`. `logits` `[.., Vd]`, `conf` `[..]` logits, `weights` `[..]`.
/// L1 is the distance between the draft and target distributions over the whole target
/// vocabulary: mass the target puts outside a reduced vocabulary counts in full. `c*` is
/// detached.
pub fn loss_sums(
    logits: &Array,
    target: &Target,
    conf: Option<&Array>,
    weights: &Array,
) -> std::result::Result<[Array; 5], Exception> {
    let z = logits.as_dtype(Dtype::Float32)?;
    let lse = z.logsumexp_axis(-1, true)?;
    let logp = z.subtract(&lse)?;
    let picked = take_along_axis(&logp, &target.ids.expand_dims(-1)?, -1)?.squeeze_axes(&[-1])?;
    let ce = match &target.ce_mask {
        Some(m) => picked.negative()?.multiply(m)?,
        None => picked.negative()?,
    };
    let pd = logp.exp()?;
    let l1 = pd.subtract(&target.probs)?.abs()?.sum_axis(-1, false)?;
    let l1 = match &target.outside {
        Some(o) => l1.add(o)?,
        None => l1,
    };
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
    // KL over the draft's ids: Σ p_t (log p_t - log p_d), 0·log 0 taken as 0.
    let log_pt = ops::maximum(&target.probs, Array::from_f32(f32::MIN_POSITIVE))?.log()?;
    let kl = target
        .probs
        .multiply(&log_pt.subtract(&logp)?)?
        .sum_axis(-1, false)?;
    let wsum = |t: &Array| t.multiply(&w)?.sum(false);
    Ok([
        wsum(&ce)?,
        wsum(&l1)?,
        wsum(&bce)?,
        wsum(&kl)?,
        w.sum(false)?,
    ])
}

/// The total loss `ce·CE + l1·L1 + conf·BCE + kl·KL` from summed terms over a global weight.
pub fn total_loss(
    sums: &[Array; 5],
    weights: LossWeights,
) -> std::result::Result<Array, Exception> {
    let coefficients = [weights.ce, weights.l1, weights.conf, weights.kl];
    let mut total = ops::zeros::<f32>(&[])?;
    for (sum, c) in sums.iter().zip(coefficients) {
        total = total.add(&sum.multiply(Array::from_f32(c))?)?;
    }
    total.divide(&ops::maximum(&sums[4], Array::from_f32(1e-12))?)
}
