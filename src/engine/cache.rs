//! Per-layer attention caches with mlx-lm 0.32.2's exact buffer behaviour (growth in steps of
//! 256, the rotating ring for sliding windows), and rollback (`trim`) for speculative decoding.

use super::cache_attention::AttentionPlan;
use super::error::Result;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, TryIndexMutOp};
use mlx_rs::{ops, Array};

/// `plan` and `set_plan` for a cache with a `plan` field.
macro_rules! plan {
    () => {
        fn plan(&self) -> $crate::engine::cache_attention::AttentionPlan {
            self.plan
        }

        fn set_plan(&mut self, plan: $crate::engine::cache_attention::AttentionPlan) {
            self.plan = plan;
        }
    };
}

/// `snapshot`, `restore` and `clone_box` for a `Clone` cache: its saved state is a clone of
/// the whole cache (MLX arrays are shared, not copied), put back by assignment.
macro_rules! clone_state {
    () => {
        fn snapshot(&self) -> $crate::engine::cache::CacheSnapshot {
            $crate::engine::cache::CacheSnapshot::new(self.clone())
        }

        fn restore(
            &mut self,
            snapshot: $crate::engine::cache::CacheSnapshot,
        ) -> $crate::engine::error::Result<()> {
            *self = snapshot.into_inner::<Self>()?;
            Ok(())
        }

        fn clone_box(&self) -> Option<Box<dyn $crate::engine::cache::KvCache>> {
            Some(Box::new(self.clone()))
        }
    };
}

/// `make_mask`, `trim` and `is_trimmable` of a cache whose positions are `0..offset` (mlx-lm's
/// `KVCache` and `QuantizedKVCache`: the mask follows the offset, trim only lowers it).
macro_rules! offset_semantics {
    () => {
        fn make_mask(
            &self,
            n: i32,
            window: Option<i32>,
            return_array: bool,
        ) -> $crate::engine::error::Result<$crate::engine::cache::AttentionMask> {
            $crate::engine::cache::offset_mask(n, self.offset, return_array, window)
        }

        fn trim(&mut self, n: i32) -> i32 {
            let n = n.min(self.offset);
            self.offset -= n;
            n
        }

        fn is_trimmable(&self) -> bool {
            true
        }
    };
}

/// The [`KvCache`] methods the left-padded batched key/value caches share (`keys`, `values`,
/// `offset` per row, `plan`); `$mlx` is mlx-lm's class, named where it has no quantized form.
macro_rules! batched_kv {
    ($mlx:literal) => {
        fn state(&self) -> Vec<mlx_rs::Array> {
            $crate::engine::cache::kv_state(&self.keys, &self.values)
        }

        clone_state!();

        plan!();

        fn rope_offsets(&self) -> Option<mlx_rs::Array> {
            Some(mlx_rs::Array::from_slice(
                &self.offset,
                &[self.offset.len() as i32],
            ))
        }

        fn as_batch_mut(&mut self) -> Option<&mut dyn $crate::engine::cache::BatchRows> {
            Some(self)
        }

        fn to_quantized(
            &self,
            _group_size: i32,
            _bits: i32,
        ) -> $crate::engine::error::Result<Option<Box<dyn $crate::engine::cache::KvCache>>> {
            Err($crate::engine::error::EngineError::Input(
                concat!(
                    "--kv-quant has no batched form (mlx-lm's ",
                    $mlx,
                    " has no to_quantized); use --kv-quant off or --max-batch 1"
                )
                .into(),
            ))
        }
    };
}

mod arrays;
mod batch;
mod batch_rotating;
mod quantized;
mod row_view;
pub use arrays::ArraysCache;
pub use batch::{BatchKvCache, BatchRows};
pub use batch_rotating::BatchRotatingKvCache;
pub use quantized::{QuantizedCache, QuantizedKv, KV_BITS};
pub use row_view::RowKvView;

/// The mask an attention call receives, as mlx-lm passes it to SDPA.
#[derive(Debug, Clone)]
pub enum AttentionMask {
    /// No mask (a single query token).
    None,
    /// SDPA's built-in causal mask (lower-right aligned).
    Causal,
    /// An explicit boolean mask.
    Array(Array),
}

/// A layer's key/value cache.
pub trait KvCache {
    /// Number of tokens processed so far.
    fn offset(&self) -> i32;
    /// Stores new keys/values ([B, H, S, D]) and returns what attention should see.
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)>;
    /// The mask for `n` new queries (mlx-lm's `cache.make_mask`).
    fn make_mask(&self, n: i32, window: Option<i32>, return_array: bool) -> Result<AttentionMask>;
    /// Drops the last `n` tokens; returns how many were dropped.
    fn trim(&mut self, n: i32) -> i32;
    /// Whether `trim` is exact for this cache in its current state.
    fn is_trimmable(&self) -> bool;
    /// Arrays to evaluate after a prefill chunk.
    fn state(&self) -> Vec<Array>;
    /// Saves the whole state. Cheap: MLX arrays are immutable and shared, never copied.
    /// Speculative decoding restores it (then replays accepted tokens) where `trim` is inexact.
    fn snapshot(&self) -> CacheSnapshot;
    /// Puts back a state taken from this same cache by [`KvCache::snapshot`].
    fn restore(&mut self, snapshot: CacheSnapshot) -> Result<()>;
    /// The recurrent state slots when this is a linear-attention layer's [`ArraysCache`].
    fn as_arrays_mut(&mut self) -> Option<&mut ArraysCache> {
        None
    }
    /// The quantized keys/values when this is a [`QuantizedCache`] (attention then runs
    /// mlx-lm's quantized SDPA over it instead of reading `update_and_fetch`).
    fn as_quantized_mut(&mut self) -> Option<&mut QuantizedCache> {
        None
    }
    /// mlx-lm's `to_quantized(group_size, bits)`: the quantized copy of this cache, `Ok(None)`
    /// for kinds mlx-lm leaves alone (no `to_quantized`), an error where mlx-lm raises.
    fn to_quantized(&self, _group_size: i32, _bits: i32) -> Result<Option<Box<dyn KvCache>>> {
        Ok(None)
    }
    /// How attention layers compute over this cache (set from the forks by the generator).
    fn plan(&self) -> AttentionPlan {
        AttentionPlan::default()
    }
    /// Sets [`KvCache::plan`]; kinds without a plan ignore it (they always use the default).
    fn set_plan(&mut self, _plan: AttentionPlan) {}
    /// An independent copy of this cache of the same kind (arrays are shared, not copied),
    /// for drafters that start from the target's state; `None` where a kind cannot say.
    fn clone_box(&self) -> Option<Box<dyn KvCache>> {
        None
    }
    /// The keys and values `[B, H, n, D]` this cache still holds (all positions, or a sliding
    /// window's last ones), in position order and ending at [`KvCache::offset`], read without
    /// changing anything: for drafters that attend the target's own keys/values (the Gemma 4
    /// assistant). `Ok(None)` for kinds that do not expose them (quantized, recurrent).
    fn peek_kv(&self) -> Result<Option<(Array, Array)>> {
        Ok(None)
    }
    /// The buffers a full-attention cache stores, for the host decode step
    /// (`--perf-kernel on`), which reads past positions in place and appends through
    /// [`KvCache::update_and_fetch`]. [`StoredKv::Unsupported`] for every other kind.
    fn stored_kv(&self) -> StoredKv<'_> {
        StoredKv::Unsupported
    }
    /// Per row, the RoPE position of the next token when rows sit at different positions (a
    /// batched cache); `None` when [`KvCache::offset`] is everyone's position.
    fn rope_offsets(&self) -> Option<Array> {
        None
    }
    /// An empty batched cache of this kind for `rows` sequences (mlx-lm's `merge` of fresh
    /// caches); `None` for kinds that have no batched form here.
    fn empty_batch(&self, _rows: usize) -> Option<Box<dyn KvCache>> {
        None
    }
    /// The row operations when this is a batched cache ([`BatchKvCache`],
    /// [`BatchRotatingKvCache`]).
    fn as_batch_mut(&mut self) -> Option<&mut dyn BatchRows> {
        None
    }
}

/// What [`KvCache::stored_kv`] exposes.
pub enum StoredKv<'a> {
    /// Not a plain full-attention cache.
    Unsupported,
    /// A full-attention cache before its first update.
    Empty,
    /// Its key and value buffers `[B, H, capacity, D]`; the first `offset` positions are valid.
    Buffers(&'a Array, &'a Array),
}

/// An opaque saved cache state (see [`KvCache::snapshot`]).
pub struct CacheSnapshot(Box<dyn std::any::Any>);

impl CacheSnapshot {
    /// Wraps a cache's cloned state.
    pub fn new<T: 'static>(state: T) -> Self {
        Self(Box::new(state))
    }

    /// Unwraps a state saved by a cache of type `T`.
    pub fn into_inner<T: 'static>(self) -> Result<T> {
        self.0.downcast::<T>().map(|b| *b).map_err(|_| {
            super::error::EngineError::Runtime(
                "cache snapshot restored into a cache of another kind".into(),
            )
        })
    }
}

/// mlx-lm's `create_causal_mask(N, offset, window_size)`.
pub fn causal_mask(n: i32, offset: i32, window: Option<i32>) -> Result<Array> {
    let rinds = ops::arange::<_, i32>(0, offset + n, 1)?;
    let linds = if offset != 0 {
        ops::arange::<_, i32>(offset, offset + n, 1)?
    } else {
        rinds.clone()
    };
    let linds = linds.expand_dims(1)?;
    let rinds = rinds.expand_dims(0)?;
    let mut mask = linds.ge(&rinds)?;
    if let Some(w) = window {
        mask = mask.logical_and(&linds.lt(&rinds.add(Array::from_int(w))?)?)?;
    }
    Ok(mask)
}

/// mlx-lm's `cache.create_attention_mask(N, offset, return_array, window_size)`.
pub(crate) fn offset_mask(
    n: i32,
    offset: i32,
    return_array: bool,
    window: Option<i32>,
) -> Result<AttentionMask> {
    if window.is_some() || (n > 1 && return_array) {
        Ok(AttentionMask::Array(causal_mask(n, offset, window)?))
    } else if n == 1 {
        Ok(AttentionMask::None)
    } else {
        Ok(AttentionMask::Causal)
    }
}

/// Positions a cache buffer grows by (mlx-lm's `step`).
pub(crate) const STEP: i32 = 256;

/// `KVCache`: grows in steps of 256 positions; `trim` only lowers the offset.
#[derive(Default, Clone)]
pub struct FullCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: i32,
    plan: AttentionPlan,
}

impl FullCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The arrays of a key/value pair of buffers, keys first (none before the first update).
fn kv_state(keys: &Option<Array>, values: &Option<Array>) -> Vec<Array> {
    keys.iter().chain(values).cloned().collect()
}

fn prefix(a: &Array, n: i32) -> Array {
    a.index((Ellipsis, ..n, ..))
}

/// Grows a key/value pair of buffers by `n` zeroed positions along the sequence axis, shaped
/// and typed like `keys` and `values` (allocating them when there are none); with `keep` the
/// old buffers are first cut to their first `keep` positions.
fn grow_kv(
    buffers: (&mut Option<Array>, &mut Option<Array>),
    keys: &Array,
    values: &Array,
    n: i32,
    keep: Option<i32>,
) -> Result<()> {
    let (b, h) = (keys.shape()[0], keys.shape()[1]);
    let new_k = ops::zeros_dtype(&[b, h, n, keys.shape()[3]], keys.dtype())?;
    let new_v = ops::zeros_dtype(&[b, h, n, values.shape()[3]], values.dtype())?;
    let (k_slot, v_slot) = buffers;
    match (k_slot.take(), v_slot.take()) {
        (Some(k), Some(v)) => {
            let (k, v) = match keep {
                Some(p) => (prefix(&k, p), prefix(&v, p)),
                None => (k, v),
            };
            *k_slot = Some(ops::concatenate(&[k, new_k], 2)?);
            *v_slot = Some(ops::concatenate(&[v, new_v], 2)?);
        }
        _ => {
            *k_slot = Some(new_k);
            *v_slot = Some(new_v);
        }
    }
    Ok(())
}

/// mlx-lm's `KVCache.update_and_fetch` buffer step (also `BatchKVCache`'s): grows the buffers
/// in whole steps of [`STEP`] when `keys` do not fit after position `prev` (cutting them to
/// `prev` first when that is not a whole step), then writes `keys`/`values` there; returns the
/// buffers.
fn append_kv<'b>(
    buffers: (&'b mut Option<Array>, &'b mut Option<Array>),
    prev: i32,
    keys: &Array,
    values: &Array,
) -> Result<(&'b mut Array, &'b mut Array)> {
    let s = keys.shape()[2];
    let need_grow = match &*buffers.0 {
        None => true,
        Some(k) => prev + s > k.shape()[2],
    };
    if need_grow {
        let n = (STEP + s - 1) / STEP * STEP;
        let keep = (prev % STEP != 0).then_some(prev);
        grow_kv((&mut *buffers.0, &mut *buffers.1), keys, values, n, keep)?;
    }
    let (Some(k), Some(v)) = (buffers.0.as_mut(), buffers.1.as_mut()) else {
        unreachable!("buffers allocated above")
    };
    k.try_index_mut((Ellipsis, prev..prev + s, ..), keys)?;
    v.try_index_mut((Ellipsis, prev..prev + s, ..), values)?;
    Ok((k, v))
}

impl KvCache for FullCache {
    fn offset(&self) -> i32 {
        self.offset
    }

    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (k, v) = append_kv(
            (&mut self.keys, &mut self.values),
            self.offset,
            keys,
            values,
        )?;
        self.offset += keys.shape()[2];
        if self.offset < k.shape()[2] {
            Ok((prefix(k, self.offset), prefix(v, self.offset)))
        } else {
            Ok((k.clone(), v.clone()))
        }
    }

    offset_semantics!();

    fn state(&self) -> Vec<Array> {
        kv_state(&self.keys, &self.values)
    }

    clone_state!();

    fn to_quantized(&self, group_size: i32, bits: i32) -> Result<Option<Box<dyn KvCache>>> {
        let kv = match (&self.keys, &self.values) {
            (Some(k), Some(v)) => Some((k, v)),
            _ => None,
        };
        Ok(Some(Box::new(QuantizedCache::from_full(
            kv,
            self.offset,
            group_size,
            bits,
            self.plan,
        )?)))
    }

    plan!();

    fn peek_kv(&self) -> Result<Option<(Array, Array)>> {
        Ok(match (&self.keys, &self.values) {
            (Some(k), Some(v)) => Some((prefix(k, self.offset), prefix(v, self.offset))),
            _ => None,
        })
    }

    fn empty_batch(&self, rows: usize) -> Option<Box<dyn KvCache>> {
        Some(Box::new(BatchKvCache::new(vec![0; rows])))
    }

    fn stored_kv(&self) -> StoredKv<'_> {
        match (&self.keys, &self.values) {
            (Some(k), Some(v)) => StoredKv::Buffers(k, v),
            _ => StoredKv::Empty,
        }
    }
}

/// `RotatingKVCache(max_size, keep)`: a ring of `max_size` positions for sliding-window layers.
#[derive(Clone)]
pub struct RotatingCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: i32,
    max_size: i32,
    keep: i32,
    idx: i32,
    plan: AttentionPlan,
}

impl RotatingCache {
    /// An empty ring holding at most `max_size` positions, never evicting the first `keep`.
    pub fn new(max_size: i32, keep: i32) -> Self {
        Self {
            keys: None,
            values: None,
            offset: 0,
            max_size,
            keep,
            idx: 0,
            plan: AttentionPlan::default(),
        }
    }

    fn trim_concat(&self, trim_size: i32, v: &Array, append: Option<&Array>) -> Result<Array> {
        let mut parts = if trim_size > 0 {
            vec![
                v.index((Ellipsis, ..self.keep, ..)),
                v.index((Ellipsis, (trim_size + self.keep).., ..)),
            ]
        } else {
            vec![v.clone()]
        };
        if let Some(a) = append {
            parts.push(a.clone());
        }
        Ok(ops::concatenate(&parts, 2)?)
    }

    fn temporal_order(&self, v: &Array) -> Result<Array> {
        let len = v.shape()[2];
        if self.idx == len {
            Ok(v.clone())
        } else if self.idx < self.offset {
            Ok(ops::concatenate(
                &[
                    v.index((Ellipsis, ..self.keep, ..)),
                    v.index((Ellipsis, self.idx.., ..)),
                    v.index((Ellipsis, self.keep..self.idx, ..)),
                ],
                2,
            )?)
        } else {
            Ok(v.index((Ellipsis, ..self.idx, ..)))
        }
    }

    fn update_concat(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        match (self.keys.take(), self.values.take()) {
            (Some(k), Some(v)) => {
                let k = self.temporal_order(&k)?;
                let v = self.temporal_order(&v)?;
                self.idx = k.shape()[2];
                let trim_size = self.idx - self.max_size + 1;
                self.keys = Some(self.trim_concat(trim_size, &k, Some(keys))?);
                self.values = Some(self.trim_concat(trim_size, &v, Some(values))?);
            }
            _ => {
                self.keys = Some(keys.clone());
                self.values = Some(values.clone());
            }
        }
        self.offset += keys.shape()[2];
        let k = self.keys.clone().unwrap_or_else(|| keys.clone());
        let v = self.values.clone().unwrap_or_else(|| values.clone());
        self.idx = k.shape()[2];
        Ok((k, v))
    }

    fn update_in_place(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let s = keys.shape()[2];
        let prev = self.offset;
        let grow = match &self.keys {
            None => true,
            Some(k) => prev >= k.shape()[2] && k.shape()[2] < self.max_size,
        };
        if grow {
            let new_size = STEP.min(self.max_size - prev);
            grow_kv(
                (&mut self.keys, &mut self.values),
                keys,
                values,
                new_size,
                None,
            )?;
            self.idx = prev;
        }
        let (Some(mut k), Some(mut v)) = (self.keys.take(), self.values.take()) else {
            unreachable!("buffers allocated above")
        };
        let trim_size = k.shape()[2] - self.max_size;
        if trim_size > 0 {
            k = self.trim_concat(trim_size, &k, None)?;
            v = self.trim_concat(trim_size, &v, None)?;
            self.idx = self.max_size;
        }
        if self.idx == self.max_size {
            self.idx = self.keep;
        }
        k.try_index_mut((Ellipsis, self.idx..self.idx + s, ..), keys)?;
        v.try_index_mut((Ellipsis, self.idx..self.idx + s, ..), values)?;
        self.offset += s;
        self.idx += s;
        let out = if self.offset < k.shape()[2] {
            (prefix(&k, self.offset), prefix(&v, self.offset))
        } else {
            (k.clone(), v.clone())
        };
        self.keys = Some(k);
        self.values = Some(v);
        Ok(out)
    }
}

impl KvCache for RotatingCache {
    fn offset(&self) -> i32 {
        self.offset
    }

    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if keys.shape()[2] == 1 {
            self.update_in_place(keys, values)
        } else {
            self.update_concat(keys, values)
        }
    }

    fn make_mask(&self, n: i32, window: Option<i32>, return_array: bool) -> Result<AttentionMask> {
        if n > 1 {
            let window = window.unwrap_or(self.max_size);
            let offset = (self.max_size - 1).min(self.offset);
            if offset + n > window || return_array {
                return Ok(AttentionMask::Array(causal_mask(n, offset, Some(window))?));
            }
            return Ok(AttentionMask::Causal);
        }
        let Some(window) = window else {
            return Ok(AttentionMask::None);
        };
        if self.offset >= window && self.max_size > window {
            let mut idx = self.idx;
            if idx >= self.max_size {
                idx = 0;
            }
            let mask_size = if self.offset < self.max_size {
                self.offset + 1
            } else {
                self.max_size
            };
            let mask =
                ops::arange::<_, i32>(0, mask_size, 1)?.ge(Array::from_int(mask_size - window))?;
            return Ok(AttentionMask::Array(roll(&mask, idx + 1, 0)?));
        }
        Ok(AttentionMask::None)
    }

    fn trim(&mut self, n: i32) -> i32 {
        let n = n.min(self.offset);
        self.offset -= n;
        self.idx -= n;
        n
    }

    fn is_trimmable(&self) -> bool {
        self.offset < self.max_size
    }

    fn state(&self) -> Vec<Array> {
        kv_state(&self.keys, &self.values)
    }

    clone_state!();

    /// mlx-lm raises `NotImplementedError("RotatingKVCache Quantization NYI")`.
    fn to_quantized(&self, _group_size: i32, _bits: i32) -> Result<Option<Box<dyn KvCache>>> {
        Err(super::error::EngineError::Input(
            "--kv-quant cannot quantize a sliding-window (rotating) KV cache, as in mlx-lm (RotatingKVCache quantization is not implemented); use --kv-quant off, or --kv-quant config with 0 bits for the sliding layers".into(),
        ))
    }

    plan!();

    fn peek_kv(&self) -> Result<Option<(Array, Array)>> {
        Ok(match (&self.keys, &self.values) {
            (Some(k), Some(v)) => Some((self.temporal_order(k)?, self.temporal_order(v)?)),
            _ => None,
        })
    }

    /// mlx-lm's `BatchRotatingKVCache.merge` of fresh caches (which has no `keep`).
    fn empty_batch(&self, rows: usize) -> Option<Box<dyn KvCache>> {
        (self.keep == 0).then(|| -> Box<dyn KvCache> {
            Box::new(BatchRotatingKvCache::new(self.max_size, vec![0; rows]))
        })
    }
}

/// `mx.roll(a, shift, axis)`: element i along `axis` moves to (i + shift) mod n (a copy, so
/// the bits are the input's).
pub(super) fn roll(a: &Array, shift: i32, axis: i32) -> Result<Array> {
    let axis = if axis < 0 {
        axis + a.ndim() as i32
    } else {
        axis
    };
    let n = a.shape()[axis as usize];
    let s = shift.rem_euclid(n.max(1));
    if s == 0 {
        return Ok(a.clone());
    }
    let cut = ops::split_at_indices(a, &[n - s], axis)?;
    Ok(ops::concatenate(&[&cut[1], &cut[0]], axis)?)
}
