//! mlx-lm 0.32.2's `BatchRotatingKVCache`: the sliding-window ring of [`super::RotatingCache`]
//! holding B sequences, left-padded like [`super::BatchKvCache`]. Prefill chunks are appended
//! whole (the ring keeps `max_size - 1` past positions so that every query sees its window),
//! single-token steps write in place and wrap; right padding from a batched prefill is rolled
//! to the left so that it never evicts a row's real positions. Every buffer operation is
//! mlx-lm's, in its order: the buffer's length and order are part of attention's bits.

use super::batch::{dynamic_roll, join_rows, keep_rows, same_kind, take_joined, BatchRows, RowsKv};
use super::{grow_kv, roll, AttentionMask, KvCache, STEP};
use crate::engine::cache_attention::AttentionPlan;
use crate::engine::error::{EngineError, Result};
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, TryIndexMutOp};
use mlx_rs::{ops, Array};

/// Batched sliding-window cache (see the module docs).
#[derive(Clone)]
pub struct BatchRotatingKvCache {
    keys: Option<Array>,
    values: Option<Array>,
    /// Per row: padding positions before its first real one (may go negative once the ring has
    /// evicted them).
    left_padding: Vec<i32>,
    /// Per row: the RoPE position of its next token.
    offset: Vec<i32>,
    max_size: i32,
    /// The next write position in the buffer (`_idx`).
    idx: i32,
    /// Positions written so far, padding included (`_offset`).
    written: i32,
    /// Whether the buffer has wrapped (its oldest position is at `idx`).
    rotated: bool,
    /// Per row, during a right-padded prefill: the offset its real tokens end at (`_lengths`).
    lengths: Option<Vec<i32>>,
    plan: AttentionPlan,
}

fn both(keys: &Option<Array>, values: &Option<Array>) -> Result<(Array, Array)> {
    match (keys, values) {
        (Some(k), Some(v)) => Ok((k.clone(), v.clone())),
        _ => Err(EngineError::Runtime(
            "a batched sliding-window cache has keys without values".into(),
        )),
    }
}

impl BatchRotatingKvCache {
    /// An empty ring of `max_size` positions for `left_padding.len()` rows.
    pub fn new(max_size: i32, left_padding: Vec<i32>) -> Self {
        Self {
            keys: None,
            values: None,
            offset: left_padding.iter().map(|p| -p).collect(),
            left_padding,
            max_size,
            idx: 0,
            written: 0,
            rotated: false,
            lengths: None,
            plan: AttentionPlan::default(),
        }
    }

    fn rows(&self) -> usize {
        self.offset.len()
    }

    fn rows_kv(&self) -> RowsKv<'_> {
        RowsKv {
            keys: &self.keys,
            values: &self.values,
            idx: self.idx,
            left_padding: &self.left_padding,
        }
    }

    /// `_temporal_order`: unwraps a rotated buffer so that positions run oldest to newest.
    fn temporal_order(&mut self) -> Result<()> {
        if self.rotated {
            let (k, v) = both(&self.keys, &self.values)?;
            self.keys = Some(roll(&k, -self.idx, 2)?);
            self.values = Some(roll(&v, -self.idx, 2)?);
            self.idx = k.shape()[2];
            self.rotated = false;
        }
        Ok(())
    }

    /// Rolls each row right by how far its written positions run past its real length (a
    /// right-padded prefill), turning that padding into left padding.
    fn roll_out_padding(&mut self, lengths: &[i32]) -> Result<()> {
        let shifts: Vec<i32> = self
            .offset
            .iter()
            .zip(lengths)
            .map(|(o, l)| (o - l).max(0))
            .collect();
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            let by = Array::from_slice(&shifts, &[shifts.len() as i32, 1]);
            self.keys = Some(dynamic_roll(k, &by)?);
            self.values = Some(dynamic_roll(v, &by)?);
        }
        for (row, s) in shifts.iter().enumerate() {
            self.left_padding[row] += s;
            self.offset[row] -= s;
        }
        Ok(())
    }

    /// `_update_concat`: a chunk of several tokens appended after the window's last
    /// `max_size - 1` positions.
    fn update_concat(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if self.keys.is_none() {
            self.keys = Some(keys.clone());
            self.values = Some(values.clone());
        } else {
            self.temporal_order()?;
            let (mut k, mut v) = both(&self.keys, &self.values)?;
            if k.shape()[2] > self.idx {
                k = k.index((Ellipsis, ..self.idx, ..));
                v = v.index((Ellipsis, ..self.idx, ..));
            }
            self.keys = Some(k);
            self.values = Some(v);
            if let Some(lengths) = self.lengths.clone() {
                self.roll_out_padding(&lengths)?;
            }
            let (k, v) = both(&self.keys, &self.values)?;
            let trim = self.idx - self.max_size + 1;
            let cut = |a: &Array| {
                if trim > 0 {
                    a.index((Ellipsis, trim.., ..))
                } else {
                    a.clone()
                }
            };
            if trim > 0 {
                for p in &mut self.left_padding {
                    *p -= trim;
                }
            }
            self.keys = Some(ops::concatenate(&[cut(&k), keys.clone()], 2)?);
            self.values = Some(ops::concatenate(&[cut(&v), values.clone()], 2)?);
        }
        let s = keys.shape()[2];
        for o in &mut self.offset {
            *o += s;
        }
        self.written += s;
        let (k, v) = both(&self.keys, &self.values)?;
        self.idx = k.shape()[2];
        Ok((k, v))
    }

    /// `_update_in_place`: one token written at the ring's position, growing the buffer in
    /// steps of 256 up to `max_size` first.
    fn update_in_place(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if self.lengths.is_some() {
            return Err(EngineError::Runtime(
                "a batched sliding-window cache decoded before its prefill was finalized".into(),
            ));
        }
        let s = keys.shape()[2];
        let prev = self.written;
        let grow = match &self.keys {
            None => true,
            Some(k) => prev >= k.shape()[2] && k.shape()[2] < self.max_size,
        };
        if grow {
            let n = STEP.min(self.max_size - prev);
            grow_kv((&mut self.keys, &mut self.values), keys, values, n, None)?;
            self.idx = prev;
        }
        let (mut k, mut v) = both(&self.keys, &self.values)?;
        let trim = k.shape()[2] - self.max_size;
        if trim > 0 {
            k = k.index((Ellipsis, trim.., ..));
            v = v.index((Ellipsis, trim.., ..));
            self.idx = self.max_size;
            for p in &mut self.left_padding {
                *p -= trim;
            }
        }
        if self.idx == self.max_size {
            self.rotated = true;
            self.idx = 0;
        }
        if self.rotated {
            for p in &mut self.left_padding {
                *p -= s;
            }
        }
        k.try_index_mut((Ellipsis, self.idx..self.idx + s, ..), keys)?;
        v.try_index_mut((Ellipsis, self.idx..self.idx + s, ..), values)?;
        self.written += s;
        for o in &mut self.offset {
            *o += s;
        }
        self.idx += s;
        let out = if self.written < k.shape()[2] {
            (
                k.index((Ellipsis, ..self.written, ..)),
                v.index((Ellipsis, ..self.written, ..)),
            )
        } else {
            (k.clone(), v.clone())
        };
        self.keys = Some(k);
        self.values = Some(v);
        Ok(out)
    }
}

impl BatchRows for BatchRotatingKvCache {
    /// Records where each row's real tokens end, so that appending never evicts them.
    fn prepare(&mut self, lengths: &[i32], right_padding: &[i32]) {
        if right_padding.iter().any(|&p| p > 0) {
            self.lengths = Some(
                lengths
                    .iter()
                    .zip(&self.offset)
                    .map(|(l, o)| l + o)
                    .collect(),
            );
        }
    }

    fn finalize(&mut self) -> Result<()> {
        if let Some(lengths) = self.lengths.take() {
            self.roll_out_padding(&lengths)?;
        }
        Ok(())
    }

    fn filter(&mut self, keep: &[usize]) -> Result<()> {
        let rows = [&mut self.offset, &mut self.left_padding];
        keep_rows(&mut self.keys, &mut self.values, rows, keep)
    }

    /// Both sides are put in temporal order when their rings differ, then padded so that every
    /// row ends at the larger write position.
    fn extend(&mut self, other: &mut dyn BatchRows) -> Result<()> {
        let mut other: BatchRotatingKvCache = same_kind(other)?;
        if self.keys.is_none() && other.keys.is_none() {
            self.left_padding.extend(other.left_padding);
            self.offset.extend(other.offset);
            return Ok(());
        }
        if self.rotated != other.rotated || self.idx != other.idx {
            self.temporal_order()?;
            other.temporal_order()?;
        }
        let joined = join_rows(self.rows_kv(), other.rows_kv())?;
        take_joined(
            [&mut self.keys, &mut self.values],
            &mut self.left_padding,
            &mut self.idx,
            joined,
            other.left_padding,
        );
        self.offset.extend(other.offset);
        self.written = self.written.max(other.written);
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    /// The ring in temporal order (put in order once for all rows), each row from its first
    /// real position (its padding, counted from the oldest position, may already have been
    /// evicted).
    fn rows_kv(&self) -> Result<Option<Vec<(Array, Array)>>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(None);
        };
        let ordered = |a: &Array| -> Result<Array> {
            Ok(if self.rotated {
                roll(a, -self.idx, 2)?
            } else {
                a.index((Ellipsis, ..self.idx.min(a.shape()[2]), ..))
            })
        };
        let (k, v) = (ordered(k)?, ordered(v)?);
        let rows = self.left_padding.iter().enumerate().map(|(row, &padding)| {
            let (r, first) = (row as i32, padding.max(0));
            let cut = |a: &Array| a.index((r..r + 1, .., first.., ..));
            (cut(&k), cut(&v))
        });
        Ok(Some(rows.collect()))
    }
}

impl KvCache for BatchRotatingKvCache {
    fn offset(&self) -> i32 {
        self.written
    }

    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if keys.shape()[2] == 1 {
            self.update_in_place(keys, values)
        } else {
            self.update_concat(keys, values)
        }
    }

    /// Always an array `[B, 1, N, L]`: the window, each row's padding, and for a single token
    /// in a wrapped ring the same roll as the buffer.
    fn make_mask(&self, n: i32, window: Option<i32>, _return_array: bool) -> Result<AttentionMask> {
        let window = window.unwrap_or(self.max_size);
        let offset = (self.max_size - 1).min(self.written);
        let mask = super::causal_mask(n, offset, Some(window))?;
        let mut shift = 0;
        // A block of several tokens after single-token steps have wrapped the ring (a verify
        // block; mlx-lm only prefills blocks before the ring wraps) is appended to the ring in
        // temporal order, whose write position is the ring's full length.
        let idx = match &self.keys {
            Some(k) if n > 1 && self.rotated => k.shape()[2],
            _ => self.idx,
        };
        let trim = idx - self.max_size + i32::from(n > 1);
        if trim > 0 {
            shift += trim;
        }
        let rotated = n == 1 && (self.rotated || self.idx >= self.max_size);
        if rotated {
            shift += 1;
        }
        let padding: Vec<i32> = self.left_padding.iter().map(|p| p - shift).collect();
        let padding = Array::from_slice(&padding, &[self.rows() as i32, 1, 1, 1]);
        let rinds = ops::arange::<_, i32>(0, offset + n, 1)?.expand_dims(0)?;
        let mut mask = mask.logical_and(&rinds.ge(&padding)?)?;
        if rotated {
            let idx = if self.idx >= self.max_size {
                0
            } else {
                self.idx
            };
            mask = roll(&mask, idx + 1, -1)?;
        }
        Ok(AttentionMask::Array(mask))
    }

    fn trim(&mut self, n: i32) -> i32 {
        let n = n.min(self.written);
        self.written -= n;
        self.idx -= n;
        for o in &mut self.offset {
            *o -= n;
        }
        n
    }

    fn is_trimmable(&self) -> bool {
        self.written < self.max_size
    }

    batched_kv!("BatchRotatingKVCache");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_without_keys_join_with_their_padding() -> Result<()> {
        // mlx-lm's extend: when neither side holds keys, only the padding is concatenated.
        let mut a = BatchRotatingKvCache::new(8, vec![1]);
        let mut b = BatchRotatingKvCache::new(8, vec![2, 0]);
        a.extend(&mut b)?;
        assert_eq!(
            (a.left_padding.as_slice(), a.offset.as_slice()),
            (&[1, 2, 0][..], &[-1, -2, 0][..])
        );
        Ok(())
    }
}
