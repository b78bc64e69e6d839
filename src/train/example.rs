//! Training examples and their anchors (dspark-spec.md §2.2): one cached sequence of the target
//! ([`Example`]), the seeded stream that picks anchors and sequence order ([`SplitMix`]), and the
//! teacher-forced layout of one sequence's anchors ([`AnchorBatch`]).

use crate::engine::error::{EngineError, Result};
use crate::engine::models::LanguageModel;
use mlx_rs::{ops, Array, Dtype};

use super::loss::LOSS_DECAY;

/// A training example: one sequence of the target's cache (dspark-spec.md §2.2).
#[derive(Clone)]
pub struct Example {
    /// Token ids `[S]`.
    pub ids: Vec<u32>,
    /// Loss mask `[S]` (assistant tokens).
    pub mask: Vec<bool>,
    /// Raw tapped layer outputs, concatenated: `[S, m*d]`.
    pub taps: Array,
    /// The target's final post-norm hidden states `[S, d]`.
    pub last_hidden: Array,
}

/// Runs the target over `ids` and returns the example (taps + final hidden states).
pub fn extract_example(
    target: &mut dyn LanguageModel,
    ids: &[u32],
    mask: &[bool],
    tap_layers: &[usize],
) -> Result<Example> {
    let n = target.make_caches().len();
    let mut caches = target.make_caches();
    let mut taps = tap_layers.to_vec();
    taps.push(n - 1);
    let opts = crate::engine::models::ForwardOpts {
        exit_after: None,
        taps: taps.clone(),
    };
    let input = Array::from_slice(
        &ids.iter().map(|&t| t as i32).collect::<Vec<_>>(),
        &[1, ids.len() as i32],
    );
    let out = target.forward_ext(&input, &mut caches, &opts)?;
    let mut t = out.taps;
    let last = t
        .pop()
        .ok_or_else(|| EngineError::Runtime("the target returned no taps".into()))?;
    let last_hidden = target.final_norm(&last)?.squeeze_axes(&[0])?;
    let taps = ops::concatenate(&t, -1)?.squeeze_axes(&[0])?;
    let (taps, last_hidden) = (
        taps.as_dtype(Dtype::Bfloat16)?,
        last_hidden.as_dtype(Dtype::Bfloat16)?,
    );
    mlx_rs::transforms::eval([&taps, &last_hidden])?;
    Ok(Example {
        ids: ids.to_vec(),
        mask: mask.to_vec(),
        taps,
        last_hidden,
    })
}

/// One sequence's anchors, laid out for [`super::forward::Frozen::forward`] and
/// [`super::loss::loss_sums`].
pub struct AnchorBatch {
    /// Anchor positions `p_a` (ascending).
    pub anchors: Vec<usize>,
    /// Block input ids `[A, γ]`: the anchor token then `MASK`.
    pub block_ids: Array,
    /// The sequential head's previous tokens `[A, γ]`: `x_{p+k}` (teacher forcing).
    pub prev_ids: Array,
    /// Supervised next tokens `x*_k = x_{p+k+1}` `[A, γ]` (0 where unsupervised).
    pub targets: Array,
    /// Rows `p+k` of the target's hidden states that give `p_t` `[A, γ]`.
    pub target_rows: Array,
    /// Loss weights `exp(-k/4)` times the contiguous-prefix mask `[A, γ]`.
    pub weights: Array,
}

/// SplitMix64: the deterministic stream behind sequence order and anchors.
pub struct SplitMix(u64);

impl SplitMix {
    /// A stream for `seed` mixed with `salt`.
    pub fn new(seed: u64, salt: u64) -> Self {
        let mut s = Self(seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        s.next_u64();
        s
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// DeepSpec's `sample_anchor_positions`: candidates `p ∈ [0, S-2]` with `mask[p]` and
/// `mask[p+1]`, up to `n` drawn without replacement, sorted.
pub fn sample_anchors(mask: &[bool], n: usize, rng: &mut SplitMix) -> Vec<usize> {
    let mut cands: Vec<usize> = (0..mask.len().saturating_sub(1))
        .filter(|&p| mask[p] && mask[p + 1])
        .collect();
    rng.shuffle(&mut cands);
    cands.truncate(n);
    cands.sort_unstable();
    cands
}

/// Lays out the anchors of `ex` for a block of `gamma` with mask token `mask_id`: supervision of
/// slot k needs `p+k+1 < S` and `mask[p+k+1]`, as a contiguous prefix.
pub fn anchor_batch(ex: &Example, anchors: &[usize], gamma: usize, mask_id: i64) -> AnchorBatch {
    let s = ex.ids.len();
    let a = anchors.len();
    let (mut block, mut prev, mut tgt, mut rows, mut w) = (
        Vec::with_capacity(a * gamma),
        Vec::with_capacity(a * gamma),
        Vec::with_capacity(a * gamma),
        Vec::with_capacity(a * gamma),
        Vec::with_capacity(a * gamma),
    );
    for &p in anchors {
        let mut alive = true;
        for k in 0..gamma {
            block.push(if k == 0 {
                ex.ids[p] as i32
            } else {
                mask_id as i32
            });
            let row = (p + k).min(s - 1);
            prev.push(ex.ids[row] as i32);
            rows.push(row as i32);
            let next = p + k + 1;
            alive = alive && next < s && ex.mask[next];
            tgt.push(if alive { ex.ids[next] as i32 } else { 0 });
            w.push(if alive {
                (-(k as f32) / LOSS_DECAY).exp()
            } else {
                0.0
            });
        }
    }
    let shape = [a as i32, gamma as i32];
    AnchorBatch {
        anchors: anchors.to_vec(),
        block_ids: Array::from_slice(&block, &shape),
        prev_ids: Array::from_slice(&prev, &shape),
        targets: Array::from_slice(&tgt, &shape),
        target_rows: Array::from_slice(&rows, &shape),
        weights: Array::from_slice(&w, &shape),
    }
}
