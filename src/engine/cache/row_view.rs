//! One row of a batched cache seen as a single sequence's cache, read-only: what a drafter
//! that attends the target's keys and values (the Gemma 4 assistant) reads for its own
//! sequence when that sequence decodes in a batch ([`super::BatchRows::rows_kv`]).

use super::{AttentionMask, KvCache};
use crate::engine::error::{EngineError, Result};
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::Array;

/// A row's keys and values `[1, H, n, D]` (the last `n` of its `offset` positions, oldest
/// first), or none for a layer that lends none.
#[derive(Clone)]
pub struct RowKvView {
    kv: Option<(Array, Array)>,
    offset: i32,
}

impl RowKvView {
    /// The row's `kv` ending at position `offset`.
    pub fn new(kv: Option<(Array, Array)>, offset: i32) -> Self {
        Self { kv, offset }
    }

    /// The same row as it stood at `positions` (at most its offset): its later positions cut.
    pub fn truncated(&self, positions: i32) -> Self {
        let drop = (self.offset - positions).max(0);
        let kv = self.kv.as_ref().map(|(k, v)| {
            let keep = (k.shape()[2] - drop).max(0);
            let cut = |a: &Array| a.index((Ellipsis, ..keep, ..));
            (cut(k), cut(v))
        });
        Self {
            kv,
            offset: self.offset.min(positions),
        }
    }
}

fn read_only() -> EngineError {
    EngineError::Runtime("a row view of a batched cache is read-only".into())
}

impl KvCache for RowKvView {
    fn offset(&self) -> i32 {
        self.offset
    }

    fn update_and_fetch(&mut self, _keys: &Array, _values: &Array) -> Result<(Array, Array)> {
        Err(read_only())
    }

    fn make_mask(&self, _n: i32, _window: Option<i32>, _ret: bool) -> Result<AttentionMask> {
        Err(read_only())
    }

    fn trim(&mut self, _n: i32) -> i32 {
        0
    }

    fn is_trimmable(&self) -> bool {
        false
    }

    fn state(&self) -> Vec<Array> {
        self.kv
            .iter()
            .flat_map(|(k, v)| [k.clone(), v.clone()])
            .collect()
    }

    clone_state!();

    fn peek_kv(&self) -> Result<Option<(Array, Array)>> {
        Ok(self.kv.clone())
    }
}
