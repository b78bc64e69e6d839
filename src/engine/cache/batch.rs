//! mlx-lm 0.32.2's `BatchKVCache`: one full-attention cache holding B sequences of different
//! lengths, left-padded so that every row ends at the same buffer index. Each row keeps its own
//! RoPE position (`offset`, an array) and the mask hides its padding. Sequences join
//! ([`BatchKvCache::extend`]) and leave ([`BatchKvCache::filter`]) between steps; a prefill of
//! right-padded prompts is turned into left padding afterwards ([`BatchKvCache::finalize`]).
//! Every buffer operation is mlx-lm's, in its order, because the buffer's length is a reduction
//! length of attention and so part of the bits.

use super::{append_kv, AttentionMask, KvCache};
use crate::engine::cache_attention::AttentionPlan;
use crate::engine::error::{EngineError, Result};
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array};

/// Batched full-attention cache (see the module docs).
#[derive(Clone)]
pub struct BatchKvCache {
    keys: Option<Array>,
    values: Option<Array>,
    /// Per row: padding positions before its first real one.
    left_padding: Vec<i32>,
    /// Per row: the RoPE position of its next token (`_idx - left_padding`).
    offset: Vec<i32>,
    /// Positions written so far, padding included (the same for every row).
    idx: i32,
    /// Per row: padding after its prompt in the prefill under way, moved to the left by
    /// [`BatchKvCache::finalize`].
    right_padding: Option<Vec<i32>>,
    /// Per row and position, whether the position is one of the row's own tokens (`[B, n]`,
    /// positions past `n` are): rejected drafts of a batched verify step stay in the buffer,
    /// hidden by the mask ([`BatchKvCache::hide_tail`]). `None` = nothing hidden.
    visible: Option<Array>,
    plan: AttentionPlan,
}

impl BatchKvCache {
    /// An empty cache for `left_padding.len()` rows (mlx-lm's `BatchKVCache(left_padding)`).
    pub fn new(left_padding: Vec<i32>) -> Self {
        Self {
            keys: None,
            values: None,
            offset: left_padding.iter().map(|p| -p).collect(),
            left_padding,
            idx: 0,
            right_padding: None,
            visible: None,
            plan: AttentionPlan::default(),
        }
    }

    /// Hides the last `counts[i]` written positions of row `i` from every later query (a
    /// verify step's rejected drafts) and takes them out of the row's RoPE position, without
    /// moving any key: each row's next token is then at its own next position, and its
    /// queries see exactly its kept tokens.
    pub fn hide_tail(&mut self, counts: &[i32]) -> Result<()> {
        if counts.iter().all(|&c| c == 0) {
            return Ok(());
        }
        let rows = self.rows() as i32;
        let positions = ops::arange::<_, i32>(0, self.idx, 1)?.expand_dims(0)?;
        let first_hidden = Array::from_slice(
            &counts.iter().map(|c| self.idx - c).collect::<Vec<_>>(),
            &[rows, 1],
        );
        let kept = positions.lt(&first_hidden)?;
        self.visible = Some(match self.visible_to(self.idx)? {
            Some(v) => v.logical_and(&kept)?,
            None => kept,
        });
        for (o, c) in self.offset.iter_mut().zip(counts) {
            *o -= c;
        }
        Ok(())
    }

    /// [`Self::visible`] over exactly `len` positions (`None` when nothing is hidden).
    fn visible_to(&self, len: i32) -> Result<Option<Array>> {
        let Some(v) = &self.visible else {
            return Ok(None);
        };
        let have = v.shape()[1];
        Ok(Some(if have >= len {
            v.index((.., ..len))
        } else {
            let rows = v.shape()[0];
            ops::concatenate(&[v.clone(), ops::ones::<bool>(&[rows, len - have])?], 1)?
        }))
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.offset.len()
    }

    /// `BatchKVCache.merge`: one row per entry holding that row's keys and values
    /// (`[1, H, n, D]`, `None`: empty), left-padded to the longest.
    pub fn merge(rows: &[Option<&(Array, Array)>]) -> Result<Self> {
        let len = |r: &Option<&(Array, Array)>| r.map_or(0, |(k, _)| k.shape()[2]);
        let longest = rows.iter().map(len).max().unwrap_or(0);
        let padding: Vec<i32> = rows.iter().map(|r| longest - len(r)).collect();
        let mut cache = Self::new(padding.clone());
        let Some((k0, v0)) = rows.iter().flatten().next() else {
            return Ok(cache);
        };
        let (h, dk, dv, dtype) = (k0.shape()[1], k0.shape()[3], v0.shape()[3], k0.dtype());
        let mut keys = Vec::with_capacity(rows.len());
        let mut values = Vec::with_capacity(rows.len());
        for (row, pad) in rows.iter().zip(&padding) {
            let k_pad = ops::zeros_dtype(&[1, h, *pad, dk], dtype)?;
            let v_pad = ops::zeros_dtype(&[1, h, *pad, dv], dtype)?;
            match row {
                Some((k, v)) => {
                    keys.push(ops::concatenate(&[k_pad, k.as_dtype(dtype)?], 2)?);
                    values.push(ops::concatenate(&[v_pad, v.as_dtype(dtype)?], 2)?);
                }
                None => {
                    keys.push(k_pad);
                    values.push(v_pad);
                }
            }
        }
        cache.keys = Some(ops::concatenate(&keys, 0)?);
        cache.values = Some(ops::concatenate(&values, 0)?);
        cache.offset = padding.iter().map(|p| longest - p).collect();
        cache.idx = longest;
        Ok(cache)
    }

    fn rows_kv(&self) -> RowsKv<'_> {
        RowsKv {
            keys: &self.keys,
            values: &self.values,
            idx: self.idx,
            left_padding: &self.left_padding,
        }
    }

    /// `extract(idx)`: row `row`'s real positions as its own keys and values `[1, H, n, D]`.
    pub fn extract(&self, row: usize) -> Result<Option<(Array, Array)>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(None);
        };
        let (r, p) = (row as i32, self.left_padding[row]);
        let cut = |a: &Array| a.index((r..r + 1, .., p..self.idx, ..));
        Ok(Some((cut(k).contiguous()?, cut(v).contiguous()?)))
    }
}

/// A batched key/value cache's rows as [`join_rows`] reads them.
pub(super) struct RowsKv<'a> {
    pub keys: &'a Option<Array>,
    pub values: &'a Option<Array>,
    /// The write index every row ends at.
    pub idx: i32,
    pub left_padding: &'a [i32],
}

/// Two sides' rows stacked by [`join_rows`], both padded so every row ends at `idx`.
pub(super) struct JoinedRows {
    pub keys: Array,
    pub values: Array,
    pub left_padding: Vec<i32>,
    pub idx: i32,
}

/// The buffer work of mlx-lm's `extend` for left-padded key/value caches (`BatchKVCache` and
/// `BatchRotatingKVCache`): each side padded left to the larger write index and right to the
/// longer buffer (cut where it is longer than that), then stacked; `None` when neither side
/// holds keys yet.
pub(super) fn join_rows(a: RowsKv<'_>, b: RowsKv<'_>) -> Result<Option<JoinedRows>> {
    let (Some(k), Some(v)) = (
        b.keys.as_ref().or(a.keys.as_ref()),
        b.values.as_ref().or(a.values.as_ref()),
    ) else {
        return Ok(None);
    };
    let (h, dk, dv, dtype) = (k.shape()[1], k.shape()[3], v.shape()[3], k.dtype());
    let idx = a.idx.max(b.idx);
    let size = |c: &RowsKv<'_>| c.keys.as_ref().map_or(0, |k| k.shape()[2]);
    let longest = size(&a).max(size(&b));
    let pad = |c: &RowsKv<'_>| -> Result<(Array, Array, Vec<i32>)> {
        let rows = c.left_padding.len() as i32;
        let (mut k, mut v) = match (c.keys, c.values) {
            (Some(k), Some(v)) => (k.clone(), v.clone()),
            _ => (
                ops::zeros_dtype(&[rows, h, 0, dk], dtype)?,
                ops::zeros_dtype(&[rows, h, 0, dv], dtype)?,
            ),
        };
        let left = idx - c.idx;
        let mut right = longest - k.shape()[2] - left;
        if right < 0 {
            k = k.index((Ellipsis, ..right, ..));
            v = v.index((Ellipsis, ..right, ..));
            right = 0;
        }
        if left != 0 || right != 0 {
            let widths: &[(i32, i32)] = &[(0, 0), (0, 0), (left, right), (0, 0)];
            k = ops::pad(&k, widths, None, None)?;
            v = ops::pad(&v, widths, None, None)?;
        }
        Ok((k, v, c.left_padding.iter().map(|p| p + left).collect()))
    };
    let (k1, v1, p1) = pad(&a)?;
    let (k2, v2, p2) = pad(&b)?;
    Ok(Some(JoinedRows {
        keys: ops::concatenate(&[k1, k2], 0)?,
        values: ops::concatenate(&[v1, v2], 0)?,
        left_padding: p1.into_iter().chain(p2).collect(),
        idx,
    }))
}

/// Writes [`join_rows`]'s result into a cache's buffers, padding and index; `None` (neither side
/// holds keys yet) appends only the other side's padding, as mlx-lm's `extend` does.
pub(super) fn take_joined(
    [keys, values]: [&mut Option<Array>; 2],
    left_padding: &mut Vec<i32>,
    idx: &mut i32,
    joined: Option<JoinedRows>,
    other_padding: Vec<i32>,
) {
    match joined {
        Some(j) => {
            *keys = Some(j.keys);
            *values = Some(j.values);
            *left_padding = j.left_padding;
            *idx = j.idx;
        }
        None => left_padding.extend(other_padding),
    }
}

/// What a batched cache does to its rows between forwards (mlx-lm's `prepare`, `finalize`,
/// `filter` and `extend`, which every batched cache kind has).
pub trait BatchRows {
    /// `prepare(lengths=..., right_padding=...)`: the prefill about to run holds `lengths[i]`
    /// real tokens of row `i` followed by `right_padding[i]` pad tokens.
    fn prepare(&mut self, lengths: &[i32], right_padding: &[i32]);
    /// `finalize`: after that prefill, the pad positions become left padding, which the mask
    /// hides.
    fn finalize(&mut self) -> Result<()>;
    /// `filter(batch_indices)`: keeps rows `keep`, in that order.
    fn filter(&mut self, keep: &[usize]) -> Result<()>;
    /// `extend(other)`: appends the rows of `other`, a batched cache of the same kind.
    fn extend(&mut self, other: &mut dyn BatchRows) -> Result<()>;
    /// Itself, for [`BatchRows::extend`] to find the other side's kind.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
    /// Each row's keys and values `[1, H, n, D]` as its own single-sequence cache would hold
    /// them (its real, visible positions, oldest first), for drafters that attend the target's
    /// keys (the Gemma 4 assistant); `None` for kinds that hold none (recurrent) or before the
    /// first update.
    fn rows_kv(&self) -> Result<Option<Vec<(Array, Array)>>> {
        Ok(None)
    }
}

/// `other` as a cache of kind `T` (the other side of an `extend`).
pub(super) fn same_kind<T: Clone + 'static>(other: &mut dyn BatchRows) -> Result<T> {
    other
        .as_any_mut()
        .downcast_mut::<T>()
        .cloned()
        .ok_or_else(|| EngineError::Runtime("batched caches of different kinds were joined".into()))
}

/// `filter`'s common part for key/value caches: the buffers and the per-row records cut to rows
/// `keep`, in that order.
pub(super) fn keep_rows(
    keys: &mut Option<Array>,
    values: &mut Option<Array>,
    per_row: [&mut Vec<i32>; 2],
    keep: &[usize],
) -> Result<()> {
    if let (Some(k), Some(v)) = (keys.as_ref(), values.as_ref()) {
        let (k, v) = (take_rows(k, keep)?, take_rows(v, keep)?);
        *keys = Some(k);
        *values = Some(v);
    }
    for record in per_row {
        *record = keep.iter().map(|&i| record[i]).collect();
    }
    Ok(())
}

/// Rows `keep` of `a` along its first axis.
pub(super) fn take_rows(a: &Array, keep: &[usize]) -> Result<Array> {
    let rows = Array::from_slice(
        &keep.iter().map(|&i| i as i32).collect::<Vec<_>>(),
        &[keep.len() as i32],
    );
    Ok(a.take_axis(&rows, 0)?)
}

impl BatchRows for BatchKvCache {
    /// Each row's positions past its padding, less those a verify step hid (the mask of
    /// hidden positions read once for all rows).
    fn rows_kv(&self) -> Result<Option<Vec<(Array, Array)>>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(None);
        };
        let Some(visible) = self.visible_to(self.idx)? else {
            // Keys are held, so every row has its own.
            let rows = (0..self.rows()).filter_map(|r| self.extract(r).transpose());
            return Ok(Some(rows.collect::<Result<_>>()?));
        };
        let shown = visible.as_dtype(mlx_rs::Dtype::Uint8)?;
        eval([&shown])?;
        let shown = shown.try_as_slice::<u8>().map_err(|e| {
            EngineError::Runtime(format!("cannot read the rows' visible keys ({e})"))
        })?;
        let width = self.idx.max(0) as usize;
        let mut out = Vec::with_capacity(self.rows());
        for (row, &padding) in self.left_padding.iter().enumerate() {
            let (r, first) = (row as i32, padding.max(0) as usize);
            let kept: Vec<i32> = (first..width)
                .filter(|&p| shown[row * width + p] != 0)
                .map(|p| p as i32)
                .collect();
            let at = Array::from_slice(&kept, &[kept.len() as i32]);
            let pick = |a: &Array| a.index((r..r + 1, .., .., ..)).take_axis(&at, 2);
            out.push((pick(k)?, pick(v)?));
        }
        Ok(Some(out))
    }

    fn prepare(&mut self, _lengths: &[i32], right_padding: &[i32]) {
        if right_padding.iter().any(|&p| p > 0) {
            self.right_padding = Some(right_padding.to_vec());
        }
    }

    /// Rolls each row right by its right padding (over the whole buffer).
    fn finalize(&mut self) -> Result<()> {
        let Some(padding) = self.right_padding.take() else {
            return Ok(());
        };
        let shifts = Array::from_slice(&padding, &[padding.len() as i32, 1]);
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            self.keys = Some(dynamic_roll(k, &shifts)?);
            self.values = Some(dynamic_roll(v, &shifts)?);
        }
        for (row, p) in padding.iter().enumerate() {
            self.offset[row] -= p;
            self.left_padding[row] += p;
        }
        Ok(())
    }

    /// Also drops the leading positions that every remaining row pads.
    fn filter(&mut self, keep: &[usize]) -> Result<()> {
        let rows = [&mut self.offset, &mut self.left_padding];
        keep_rows(&mut self.keys, &mut self.values, rows, keep)?;
        if let Some(v) = &self.visible {
            self.visible = Some(take_rows(v, keep)?);
        }
        let shift = self.left_padding.iter().copied().min().unwrap_or(0);
        if shift > 0 {
            if let (Some(k), Some(v)) = (&self.keys, &self.values) {
                self.keys = Some(k.index((Ellipsis, shift.., ..)));
                self.values = Some(v.index((Ellipsis, shift.., ..)));
            }
            if let Some(v) = &self.visible {
                self.visible = Some(v.index((.., shift..)));
            }
            self.idx -= shift;
            for p in &mut self.left_padding {
                *p -= shift;
            }
        }
        Ok(())
    }

    /// Pads both sides' buffers so that every row ends at the larger of the two indices.
    fn extend(&mut self, other: &mut dyn BatchRows) -> Result<()> {
        let other: BatchKvCache = same_kind(other)?;
        if self.visible.is_some() || other.visible.is_some() {
            // Each side's visibility, left-aligned to the joined write index like its keys
            // (the added positions are left padding, which the mask hides anyway).
            let idx = self.idx.max(other.idx);
            let side = |c: &BatchKvCache| -> Result<Array> {
                let rows = c.rows() as i32;
                let own = match c.visible_to(c.idx)? {
                    Some(v) => v,
                    None => ops::ones::<bool>(&[rows, c.idx])?,
                };
                Ok(ops::concatenate(
                    &[ops::ones::<bool>(&[rows, idx - c.idx])?, own],
                    1,
                )?)
            };
            self.visible = Some(ops::concatenate(&[side(self)?, side(&other)?], 0)?);
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
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// mlx-lm's `dynamic_roll(x, shifts, axis=2)`: row `b` of `x` (`[B, H, L, D]`) rolled right by
/// `shifts[b]` (`[B, 1]`) along the sequence axis.
pub(super) fn dynamic_roll(x: &Array, shifts: &Array) -> Result<Array> {
    let n = x.shape()[2];
    let positions = ops::arange::<_, i32>(0, n, 1)?.expand_dims(1)?;
    let shifts = shifts.expand_dims_axes(&[2, 3])?;
    let idx = positions.subtract(&shifts)?.remainder(Array::from_int(n))?;
    Ok(mlx_rs::ops::indexing::take_along_axis(x, &idx, 2)?)
}

impl KvCache for BatchKvCache {
    fn offset(&self) -> i32 {
        self.idx
    }

    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let s = keys.shape()[2];
        let (k, v) = append_kv((&mut self.keys, &mut self.values), self.idx, keys, values)?;
        let (k, v) = (k.clone(), v.clone());
        for o in &mut self.offset {
            *o += s;
        }
        self.idx += s;
        Ok((
            k.index((Ellipsis, ..self.idx, ..)),
            v.index((Ellipsis, ..self.idx, ..)),
        ))
    }

    /// mlx-lm's `create_causal_mask(N, offset=_idx, window_size, left_padding)`: always an
    /// array (`[B, 1, N, _idx + N]`), since rows differ.
    fn make_mask(&self, n: i32, window: Option<i32>, _return_array: bool) -> Result<AttentionMask> {
        let causal = super::causal_mask(n, self.idx, window)?;
        let rows = self.rows() as i32;
        let padding = Array::from_slice(&self.left_padding, &[rows, 1, 1, 1]);
        let rinds = ops::arange::<_, i32>(0, self.idx + n, 1)?.expand_dims(0)?;
        let mask = causal.logical_and(&padding.le(&rinds)?)?;
        Ok(AttentionMask::Array(
            match self.visible_to(self.idx + n)? {
                Some(v) => mask.logical_and(&v.reshape(&[rows, 1, 1, self.idx + n])?)?,
                None => mask,
            },
        ))
    }

    fn trim(&mut self, n: i32) -> i32 {
        let n = n.min(self.idx);
        self.idx -= n;
        if let Some(v) = &self.visible {
            if v.shape()[1] > self.idx {
                self.visible = Some(v.index((.., ..self.idx)));
            }
        }
        for o in &mut self.offset {
            *o -= n;
        }
        n
    }

    fn is_trimmable(&self) -> bool {
        true
    }

    batched_kv!("BatchKVCache");
}
