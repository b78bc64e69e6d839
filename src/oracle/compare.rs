//! The bit-for-bit comparison of mlxb's greedy steps with an oracle's (`mlxb parity`, and
//! `bench --matrix` against the L2 oracle).

use crate::engine::bits::same_bits;
use crate::engine::error::{EngineError, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

/// The comparison of one run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ParityReport {
    /// The oracle compared with (filled in by `run`).
    pub oracle: String,
    /// Steps the oracle produced.
    pub oracle_steps: usize,
    /// Steps mlxb produced.
    pub mlxb_steps: usize,
    /// First step whose token id or logprob bits differ.
    pub first_divergence: Option<usize>,
    /// Largest |mlxb - oracle| over all compared logprobs (in f32).
    pub max_abs_diff: f32,
    /// Whether ids and logprobs are bit-identical at every step.
    pub identical: bool,
}

/// Compares mlxb's steps (token, logprobs) with the oracle's ids and `[steps, V]` logprobs.
pub fn compare(
    ours: &[(u32, Array)],
    oracle_ids: &[i32],
    oracle_lp: Option<&Array>,
) -> Result<ParityReport> {
    let mut first = None;
    let mut max_diff = 0f32;
    let n = ours.len().max(oracle_ids.len());
    for i in 0..n {
        let (Some((id, lp)), Some(&oid)) = (ours.get(i), oracle_ids.get(i)) else {
            first.get_or_insert(i);
            break;
        };
        let Some(olp_all) = oracle_lp else {
            return Err(EngineError::Runtime(
                "the oracle's trace has token ids but no logprobs to compare".into(),
            ));
        };
        let olp = olp_all.index(i as i32);
        let diff = lp
            .as_dtype(Dtype::Float32)?
            .subtract(olp.as_dtype(Dtype::Float32)?)?
            .abs()?
            .max(None)?
            .try_item_exact::<f32>()?;
        max_diff = max_diff.max(diff);
        let same = *id as i64 == oid as i64 && same_bits(lp, &olp)?;
        if !same && first.is_none() {
            first = Some(i);
        }
    }
    Ok(ParityReport {
        oracle: String::new(),
        oracle_steps: oracle_ids.len(),
        mlxb_steps: ours.len(),
        first_divergence: first,
        max_abs_diff: max_diff,
        identical: first.is_none() && ours.len() == oracle_ids.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(ids: &[u32], lps: &[[f32; 2]]) -> Vec<(u32, Array)> {
        ids.iter()
            .zip(lps)
            .map(|(&id, lp)| (id, Array::from_slice(lp, &[2])))
            .collect()
    }

    fn oracle(lps: &[[f32; 2]]) -> Array {
        let flat: Vec<f32> = lps.iter().flatten().copied().collect();
        Array::from_slice(&flat, &[lps.len() as i32, 2])
    }

    #[test]
    fn identical_steps_compare_identical() -> anyhow::Result<()> {
        let lps = [[-0.5, -1.0], [-0.25, f32::NAN]];
        let r = compare(&steps(&[3, 4], &lps), &[3, 4], Some(&oracle(&lps)))?;
        assert!(r.identical && r.first_divergence.is_none(), "{r:?}");
        Ok(())
    }

    #[test]
    fn a_signed_zero_a_token_or_a_missing_step_is_a_divergence() -> anyhow::Result<()> {
        let lps = [[-0.5, 0.0], [-0.25, -1.0]];
        let signed = [[-0.5, -0.0], [-0.25, -1.0]];
        let r = compare(&steps(&[3, 4], &signed), &[3, 4], Some(&oracle(&lps)))?;
        assert_eq!((r.first_divergence, r.identical), (Some(0), false));
        assert_eq!(
            r.max_abs_diff, 0.0,
            "the values agree; only the bits differ"
        );
        let r = compare(&steps(&[3, 5], &lps), &[3, 4], Some(&oracle(&lps)))?;
        assert_eq!(r.first_divergence, Some(1));
        let r = compare(&steps(&[3], &lps), &[3, 4], Some(&oracle(&lps)))?;
        assert_eq!((r.first_divergence, r.identical), (Some(1), false));
        Ok(())
    }

    #[test]
    fn a_trace_without_logprobs_is_an_error_not_a_pass() {
        let lps = [[-0.5, -1.0]];
        assert!(compare(&steps(&[3], &lps), &[3], None).is_err());
        let r = compare(&[], &[], None).map(|r| r.identical);
        assert!(matches!(r, Ok(true)), "{r:?}");
    }
}
