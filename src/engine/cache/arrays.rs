//! mlx-lm's `ArraysCache`: a fixed number of state slots a recurrent layer reads and replaces
//! whole on every step (qwen3_5's gated delta-net keeps `[conv_state, ssm_state]`). The same
//! cache holds a batch: rows are the slots' first axis, and during a batched prefill the cache
//! knows each row's padding (`left_padding`, `lengths`), from which it makes the mask that keeps
//! pad tokens out of the state.

use super::batch::{same_kind, take_rows, BatchRows};
use super::{AttentionMask, KvCache};
use crate::engine::error::{EngineError, Result};
use mlx_rs::{ops, Array};

/// Recurrent per-layer state. Not trimmable (the state after `n` tokens cannot be recovered
/// from the state after `n + k`); speculative rollback uses [`KvCache::snapshot`] /
/// [`KvCache::restore`], which are exact: the slots are immutable MLX arrays, replaced (never
/// written in place) by each step, so a snapshot is just their handles.
#[derive(Debug, Clone)]
pub struct ArraysCache {
    slots: Vec<Option<Array>>,
    offset: i32,
    /// Per row of a batch: positions before its first real token in the next input.
    left_padding: Option<Vec<i32>>,
    /// Per row of a batched prefill: its real tokens from the start of the next input.
    lengths: Option<Vec<i32>>,
}

impl ArraysCache {
    /// `size` empty slots.
    pub fn new(size: usize) -> Self {
        Self {
            slots: vec![None; size],
            offset: 0,
            left_padding: None,
            lengths: None,
        }
    }

    /// The array in slot `i` (`cache[i]`), `None` before the first step.
    pub fn get(&self, i: usize) -> Option<&Array> {
        self.slots.get(i).and_then(Option::as_ref)
    }

    /// Replaces slot `i` (`cache[i] = a`).
    pub fn set(&mut self, i: usize, a: Array) -> Result<()> {
        let n = self.slots.len();
        let slot = self.slots.get_mut(i).ok_or_else(|| {
            EngineError::Runtime(format!("recurrent cache has {n} slots, not {}", i + 1))
        })?;
        *slot = Some(a);
        Ok(())
    }

    /// Per row of a batched prefill, where its real tokens end in the next input (`lengths`).
    pub fn lengths(&self) -> Option<&[i32]> {
        self.lengths.as_deref()
    }

    /// Records that `n` more tokens went through the layer (mlx-lm's `advance`).
    pub fn advance(&mut self, n: i32) {
        self.offset += n;
        for v in self.lengths.iter_mut().chain(self.left_padding.iter_mut()) {
            v.iter_mut().for_each(|x| *x -= n);
        }
    }

    /// `batch_size`: rows, read from the first filled slot, else the padding records.
    fn rows(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .map(|a| a.shape()[0] as usize)
            .next()
            .or(self.left_padding.as_ref().map(Vec::len))
            .or(self.lengths.as_ref().map(Vec::len))
            .unwrap_or(1)
    }
}

/// `cat(a, b)` of `ArraysCache.extend`: a side without the array counts as zeros.
fn cat_slots(a: Option<Array>, b: Option<Array>, rows: (usize, usize)) -> Result<Option<Array>> {
    let like = match (&a, &b) {
        (_, Some(x)) | (Some(x), None) => x.clone(),
        (None, None) => return Ok(None),
    };
    let zeros = |n: usize| -> Result<Array> {
        let mut shape = like.shape().to_vec();
        shape[0] = n as i32;
        Ok(ops::zeros_dtype(&shape, like.dtype())?)
    };
    let a = a.map_or_else(|| zeros(rows.0), Ok)?;
    let b = b.map_or_else(|| zeros(rows.1), Ok)?;
    Ok(Some(ops::concatenate(&[a, b], 0)?))
}

/// The same `cat` for a per-row record.
fn cat_rows(a: Option<Vec<i32>>, b: Option<Vec<i32>>, rows: (usize, usize)) -> Option<Vec<i32>> {
    if a.is_none() && b.is_none() {
        return None;
    }
    let mut out = a.unwrap_or_else(|| vec![0; rows.0]);
    out.extend(b.unwrap_or_else(|| vec![0; rows.1]));
    Some(out)
}

impl BatchRows for ArraysCache {
    fn prepare(&mut self, lengths: &[i32], _right_padding: &[i32]) {
        self.lengths = Some(lengths.to_vec());
    }

    fn finalize(&mut self) -> Result<()> {
        self.lengths = None;
        self.left_padding = None;
        Ok(())
    }

    fn filter(&mut self, keep: &[usize]) -> Result<()> {
        for slot in self.slots.iter_mut() {
            if let Some(a) = slot {
                *slot = Some(take_rows(a, keep)?);
            }
        }
        let pick = |v: &Vec<i32>| keep.iter().map(|&i| v[i]).collect();
        self.left_padding = self.left_padding.as_ref().map(pick);
        self.lengths = self.lengths.as_ref().map(pick);
        Ok(())
    }

    fn extend(&mut self, other: &mut dyn BatchRows) -> Result<()> {
        let other: ArraysCache = same_kind(other)?;
        let rows = (self.rows(), other.rows());
        let slots = std::mem::take(&mut self.slots);
        self.slots = slots
            .into_iter()
            .zip(other.slots)
            .map(|(a, b)| cat_slots(a, b, rows))
            .collect::<Result<_>>()?;
        self.left_padding = cat_rows(self.left_padding.take(), other.left_padding, rows);
        self.lengths = cat_rows(self.lengths.take(), other.lengths, rows);
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl KvCache for ArraysCache {
    fn offset(&self) -> i32 {
        self.offset
    }

    fn update_and_fetch(&mut self, _keys: &Array, _values: &Array) -> Result<(Array, Array)> {
        Err(EngineError::Runtime(
            "a recurrent (linear-attention) layer cache holds no keys/values".into(),
        ))
    }

    /// `ArraysCache.make_mask(N)`: none for a single sequence; in a batch, per row and input
    /// position `[B, N]`, whether the token is real (past its left padding, within its length).
    fn make_mask(
        &self,
        n: i32,
        _window: Option<i32>,
        _return_array: bool,
    ) -> Result<AttentionMask> {
        let pos = ops::arange::<_, i32>(0, n, 1)?.expand_dims(0)?;
        let column = |v: &Vec<i32>| Array::from_slice(v, &[v.len() as i32, 1]);
        let mut mask = match &self.left_padding {
            Some(p) => Some(pos.ge(column(p))?),
            None => None,
        };
        if let Some(l) = &self.lengths {
            let within = pos.lt(column(l))?;
            mask = Some(match mask {
                Some(m) => m.logical_and(&within)?,
                None => within,
            });
        }
        Ok(mask.map_or(AttentionMask::None, AttentionMask::Array))
    }

    fn trim(&mut self, _n: i32) -> i32 {
        0
    }

    fn is_trimmable(&self) -> bool {
        false
    }

    fn state(&self) -> Vec<Array> {
        self.slots.iter().flatten().cloned().collect()
    }

    clone_state!();

    fn as_arrays_mut(&mut self) -> Option<&mut ArraysCache> {
        Some(self)
    }

    /// mlx-lm's `ArraysCache.merge` of fresh caches: empty slots, every row unpadded.
    fn empty_batch(&self, rows: usize) -> Option<Box<dyn KvCache>> {
        let mut batch = ArraysCache::new(self.slots.len());
        batch.left_padding = Some(vec![0; rows]);
        Some(Box::new(batch))
    }

    fn as_batch_mut(&mut self) -> Option<&mut dyn BatchRows> {
        Some(self)
    }
}
