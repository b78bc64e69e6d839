//! mlx-lm's `ArraysCache`: a fixed number of state slots a recurrent layer reads and replaces
//! whole on every step (qwen3_5's gated delta-net keeps `[conv_state, ssm_state]`).

use super::{AttentionMask, KvCache};
use crate::engine::error::{EngineError, Result};
use mlx_rs::Array;

/// Recurrent per-layer state. Not trimmable (the state after `n` tokens cannot be recovered
/// from the state after `n + k`); speculative rollback uses [`KvCache::snapshot`] /
/// [`KvCache::restore`], which are exact: the slots are immutable MLX arrays, replaced (never
/// written in place) by each step, so a snapshot is just their handles.
#[derive(Debug, Clone)]
pub struct ArraysCache {
    slots: Vec<Option<Array>>,
    offset: i32,
}

impl ArraysCache {
    /// `size` empty slots.
    pub fn new(size: usize) -> Self {
        Self {
            slots: vec![None; size],
            offset: 0,
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

    /// Records that `n` more tokens went through the layer (mlx-lm's `advance`).
    pub fn advance(&mut self, n: i32) {
        self.offset += n;
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

    /// `ArraysCache.make_mask`: no padding for a single sequence, so no mask.
    fn make_mask(
        &self,
        _n: i32,
        _window: Option<i32>,
        _return_array: bool,
    ) -> Result<AttentionMask> {
        Ok(AttentionMask::None)
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
}
