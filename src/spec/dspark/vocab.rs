//! A reduced draft vocabulary, in the speculators format: `d2t` `[Vd]` holds, for each draft
//! id `i`, the offset to its target id (`target = i + d2t[i]`, ascending), and the optional
//! `t2d` `[V]` marks the target ids that have a draft id.
//!
//! Why: a drafter scores every vocabulary entry at every block position, and on a small target
//! the output head is a fifth of the model's weights, read once per round. Scoring only the
//! tokens the target actually produces (a few thousand of SmolLM2's 49,152) makes that read
//! proportionally smaller. It is draft-side only: the target verifies every proposal, so the
//! output never changes; a token outside the set simply cannot be proposed.

use crate::engine::error::Result;
use crate::engine::models::LanguageModel;
use crate::engine::nn::Linear;
use crate::engine::weights::WeightStore;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array, Dtype};

/// The draft ids' target ids.
pub struct DraftVocab {
    /// Target id of each draft id `[Vd]` (uint32, ascending).
    target_ids: Array,
}

impl DraftVocab {
    /// Reads `d2t` (and `t2d`, when present) from `w`; `None` when the checkpoint has no
    /// reduced vocabulary. Every id must land inside the target's `vocab` of ids, ascending,
    /// and agree with `t2d`.
    pub fn read(w: &mut WeightStore, vocab: i32) -> Result<Option<Self>> {
        if !w.contains("d2t") {
            if w.contains("t2d") {
                return Err(w.err(
                    "has `t2d` without `d2t`; a reduced draft vocabulary needs both or `d2t` alone"
                        .into(),
                ));
            }
            return Ok(None);
        }
        let d2t = w.take_any("d2t")?;
        if d2t.ndim() != 1 || d2t.size() == 0 {
            return Err(w.err(format!(
                "tensor `d2t` has shape {:?}; it maps each draft id to a target id offset [Vd]",
                d2t.shape()
            )));
        }
        let offsets = d2t.as_dtype(Dtype::Int64)?;
        let ids: Vec<i64> = offsets
            .as_slice::<i64>()
            .iter()
            .enumerate()
            .map(|(i, &o)| i as i64 + o)
            .collect();
        let ascending = ids.windows(2).all(|p| p[0] < p[1]);
        if !ascending || ids[0] < 0 || ids[ids.len() - 1] >= vocab as i64 {
            return Err(w.err(format!(
                "tensor `d2t` maps draft ids outside the target's {vocab} ids or out of order; its target ids (i + d2t[i]) must ascend within 0..{vocab}"
            )));
        }
        if w.contains("t2d") {
            let t2d = w.take_any("t2d")?.as_dtype(Dtype::Bool)?;
            let marks: Vec<bool> = t2d.as_slice::<bool>().to_vec();
            let agree = marks.len() == vocab as usize
                && marks.iter().filter(|&&m| m).count() == ids.len()
                && ids.iter().all(|&t| marks[t as usize]);
            if !agree {
                return Err(w.err(
                    "tensors `t2d` and `d2t` disagree; t2d must mark exactly the target ids that d2t maps to".into(),
                ));
            }
        }
        let ids: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        Ok(Some(Self {
            target_ids: Array::from_slice(&ids, &[ids.len() as i32]),
        }))
    }

    /// A vocabulary of the given target ids (ascending, as [`crate::train::draft_vocab`]
    /// chooses them).
    pub fn from_ids(ids: &[u32]) -> Self {
        Self {
            target_ids: Array::from_slice(ids, &[ids.len() as i32]),
        }
    }

    /// The target id of each draft id `[Vd]` (uint32, ascending).
    pub fn target_ids(&self) -> &Array {
        &self.target_ids
    }

    /// Draft ids.
    pub fn size(&self) -> usize {
        self.target_ids.size()
    }

    /// A map `[n] → [V]` restricted to the draft ids, as a dense layer `[n] → [Vd]` (its weight
    /// `[Vd, n]` row-major, evaluated; on the host path when `host_matvec`): `map` applied to
    /// the identity `[n, n]` gives its weights exactly (each output one product with 1.0), so
    /// this works for dense and quantized maps alike.
    pub fn restrict(
        &self,
        map: impl Fn(&Array) -> Result<Array>,
        n: i32,
        dtype: Dtype,
        host_matvec: bool,
    ) -> Result<Linear> {
        Ok(Linear::dense_host(self.rows(map, n, dtype)?, host_matvec))
    }

    /// The target's output-head rows at the draft ids `[Vd, n]` in `dtype`, evaluated: read
    /// directly when the target hands them out ([`LanguageModel::lm_head_rows`]), else through
    /// `head` applied to the identity ([`Self::rows`]).
    pub fn target_head_rows(
        &self,
        target: &dyn LanguageModel,
        head: impl Fn(&Array) -> Result<Array>,
        n: i32,
        dtype: Dtype,
    ) -> Result<Array> {
        match target.lm_head_rows(&self.target_ids)? {
            Some(rows) => {
                let rows = rows.as_dtype(dtype)?;
                rows.eval()?;
                Ok(rows)
            }
            None => self.rows(head, n, dtype),
        }
    }

    /// The rows of a map `[n] → [V]` at the draft ids, `[Vd, n]`, evaluated (see
    /// [`Self::restrict`]).
    pub fn rows(
        &self,
        map: impl Fn(&Array) -> Result<Array>,
        n: i32,
        dtype: Dtype,
    ) -> Result<Array> {
        let eye = ops::eye::<f32>(n, None, None)?.as_dtype(dtype)?;
        let rows = map(&eye)?.t().take_axis(&self.target_ids, 0)?;
        rows.eval()?;
        Ok(rows)
    }

    /// The target ids of draft ids `[..]`.
    pub fn to_target(&self, draft_ids: &Array) -> Result<Array> {
        Ok(self.target_ids.take_axis(draft_ids, 0)?)
    }

    /// Probabilities over the draft ids `[n, Vd]` spread onto the target's `[n, V]` (zeros
    /// elsewhere), as the rejection rule reads a proposal's distribution.
    pub fn to_target_probs(&self, probs: &Array, vocab: i32) -> Result<Array> {
        let n = probs.shape()[0];
        let zeros = ops::zeros_dtype(&[n, vocab], probs.dtype())?;
        let idx = ops::broadcast_to(
            self.target_ids.index((ops::indexing::NewAxis, ..)),
            &[n, self.size() as i32],
        )?;
        Ok(zeros.put_along_axis(&idx, probs, -1)?)
    }
}
