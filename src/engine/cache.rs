//! Per-layer attention caches with mlx-lm 0.32.2's exact buffer behaviour (growth in steps of
//! 256, the rotating ring for sliding windows), and rollback (`trim`) for speculative decoding.

use super::cache_attention::AttentionPlan;
use super::error::Result;
use super::kernels::elementwise::bf16_mlx;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, TryIndexMutOp};
use mlx_rs::{ops, Array, Dtype};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    /// What [`KvCache::update_and_fetch`] stores for `m` new positions of a batch of one,
    /// written straight into the stored buffers from the host (`keys`/`values` `[H, m, D]`;
    /// a bfloat16 cache's values held widened to f32) with no MLX op, for the host decode
    /// step. Only where this cache alone holds its buffers (no snapshot or clone shares them),
    /// they are evaluated and the positions fit; `Ok(false)` changes nothing, and the caller
    /// appends through `update_and_fetch`.
    fn append_in_place(&mut self, _keys: &[f32], _values: &[f32], _m: usize) -> Result<bool> {
        Ok(false)
    }
    /// The mask for `n` new queries (mlx-lm's `cache.make_mask`).
    fn make_mask(&self, n: i32, window: Option<i32>, return_array: bool) -> Result<AttentionMask>;
    /// Drops the last `n` tokens; returns how many were dropped.
    fn trim(&mut self, n: i32) -> i32;
    /// Whether `trim` is exact for this cache in its current state.
    fn is_trimmable(&self) -> bool;
    /// Whether `trim` is exact in every state this cache can reach (a full cache: it only
    /// lowers the offset), so a rewind needs no snapshot of it (and none holds its buffers,
    /// which a block may then write in place).
    fn trims_exactly_always(&self) -> bool {
        false
    }
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
    /// Shared by every copy of this cache (snapshots, clones) that holds the same
    /// `keys`/`values`: the buffers may be written in place only while no other copy holds
    /// them (a count of 1) and no copy ever appended through MLX from them while they were
    /// shared (the flag: such an append may still be a lazy op reading them). Renewed by each
    /// MLX append, whose output no copy shares (MLX reuses an input buffer only when nothing
    /// else holds it, and copies otherwise).
    holders: Arc<AtomicBool>,
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

thread_local! {
    static IN_PLACE_APPENDS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many [`KvCache::append_in_place`] writes this thread has made (per thread, so tests
/// running side by side do not count each other's).
pub fn in_place_appends_here() -> usize {
    IN_PLACE_APPENDS.with(std::cell::Cell::get)
}

/// Where `m` new positions go in an evaluated, row-contiguous `[1, H, capacity, D]` f32 or
/// bfloat16 buffer, from position `at`.
struct HostBuffer {
    data: HostData,
    heads: usize,
    capacity: usize,
    dim: usize,
    at: usize,
    m: usize,
}

enum HostData {
    F32(*mut f32),
    Bf16(*mut half::bf16),
}

impl HostBuffer {
    /// `None` unless `a` is such a buffer with room for `m` positions at `at` and `len` is
    /// `H · m · D` values.
    fn of(a: &Array, at: usize, m: usize, len: usize) -> Option<Self> {
        let shape = a.shape();
        let [1, heads, capacity, dim] = shape[..] else {
            return None;
        };
        let (heads, capacity, dim) = (heads as usize, capacity as usize, dim as usize);
        if at + m > capacity || len != heads * m * dim {
            return None;
        }
        // `try_as_slice` evaluates and checks the dtype and row-contiguity; the pointer is
        // then taken from MLX itself, not from the shared slice.
        let data = match a.dtype() {
            Dtype::Float32 => {
                a.try_as_slice::<f32>().ok()?;
                // SAFETY: an evaluated float32 array, its data pointer read through mlx-c.
                HostData::F32(unsafe { mlx_sys::mlx_array_data_float32(a.as_ptr()) } as *mut f32)
            }
            Dtype::Bfloat16 => {
                a.try_as_slice::<half::bf16>().ok()?;
                // SAFETY: an evaluated bfloat16 array, its data pointer read through mlx-c.
                HostData::Bf16(
                    unsafe { mlx_sys::mlx_array_data_bfloat16(a.as_ptr()) } as *mut half::bf16
                )
            }
            _ => return None,
        };
        Some(Self {
            data,
            heads,
            capacity,
            dim,
            at,
            m,
        })
    }

    /// Copies `new` (`[H, m, D]`) to positions `at..at + m` of every head (bfloat16 buffers
    /// take each value narrowed as the MLX append's input is, [`bf16_mlx`]; exact for values a
    /// bfloat16 step made).
    ///
    /// # Safety
    /// Nothing else may read or write those positions of the buffer meanwhile.
    unsafe fn write(&self, new: &[f32]) {
        let row = self.m * self.dim;
        for (h, src) in new.chunks_exact(row).enumerate().take(self.heads) {
            let start = (h * self.capacity + self.at) * self.dim;
            match self.data {
                HostData::F32(p) => {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), p.add(start), row);
                }
                HostData::Bf16(p) => {
                    let dst = std::slice::from_raw_parts_mut(p.add(start), row);
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = bf16_mlx(*s);
                    }
                }
            }
        }
    }
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
        let fetched = if self.offset < k.shape()[2] {
            (prefix(k, self.offset), prefix(v, self.offset))
        } else {
            (k.clone(), v.clone())
        };
        if Arc::strong_count(&self.holders) > 1 {
            self.holders.store(true, Ordering::Relaxed);
        }
        self.holders = Arc::default();
        Ok(fetched)
    }

    fn append_in_place(&mut self, keys: &[f32], values: &[f32], m: usize) -> Result<bool> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(false);
        };
        let shared = Arc::strong_count(&self.holders) != 1 || self.holders.load(Ordering::Relaxed);
        if shared || self.offset < 0 {
            return Ok(false);
        }
        let at = self.offset as usize;
        let (Some(k_at), Some(v_at)) = (
            HostBuffer::of(k, at, m, keys.len()),
            HostBuffer::of(v, at, m, values.len()),
        ) else {
            return Ok(false);
        };
        // SAFETY: both buffers were checked (evaluated, row-contiguous, shaped for `m` more
        // positions at `at`), and no other cache or snapshot holds or reads them (`holders`); views
        // handed out earlier cover positions below the offset, which this does not touch.
        unsafe {
            k_at.write(keys);
            v_at.write(values);
        }
        self.offset += m as i32;
        IN_PLACE_APPENDS.with(|n| n.set(n.get() + 1));
        Ok(true)
    }

    offset_semantics!();

    fn trims_exactly_always(&self) -> bool {
        true
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    const HEADS: usize = 2;
    const DIM: usize = 4;

    /// `m` positions of `[1, HEADS, m, DIM]` values starting at `from`.
    fn values(from: f32, m: usize) -> Vec<f32> {
        (0..HEADS * m * DIM).map(|i| from + i as f32).collect()
    }

    fn array(v: &[f32], m: usize) -> Array {
        Array::from_slice(v, &[1, HEADS as i32, m as i32, DIM as i32])
    }

    fn append_mlx(c: &mut dyn KvCache, k: &[f32], v: &[f32], m: usize) {
        c.update_and_fetch(&array(k, m), &array(v, m)).unwrap();
        mlx_rs::transforms::eval(&c.state()).unwrap();
    }

    /// The keys and values the cache holds, as MLX reads them (copied out of the views).
    fn held(c: &dyn KvCache) -> (Vec<f32>, Vec<f32>) {
        let (k, v) = c.peek_kv().unwrap().unwrap();
        let read = |a: &Array| {
            let a = ops::add(a, Array::from_f32(0.0)).unwrap();
            a.as_slice::<f32>().to_vec()
        };
        (read(&k), read(&v))
    }

    #[test]
    fn in_place_appends_store_what_update_and_fetch_stores() {
        let (mut fast, mut reference) = (FullCache::new(), FullCache::new());
        assert!(!fast
            .append_in_place(&values(0.0, 1), &values(50.0, 1), 1)
            .unwrap());
        for c in [&mut fast, &mut reference] {
            append_mlx(c, &values(0.0, 3), &values(50.0, 3), 3);
        }
        let before = in_place_appends_here();
        for (i, m) in [1usize, 2, 1].into_iter().enumerate() {
            let (k, v) = (values(100.0 * i as f32, m), values(1000.0 + i as f32, m));
            assert!(fast.append_in_place(&k, &v, m).unwrap(), "append {i}");
            append_mlx(&mut reference, &k, &v, m);
        }
        assert_eq!(in_place_appends_here() - before, 3);
        assert_eq!(fast.offset(), reference.offset());
        assert_eq!(held(&fast), held(&reference));
        // After a trim the next write replaces the dropped positions, as a slice update does.
        fast.trim(2);
        reference.trim(2);
        assert!(fast
            .append_in_place(&values(7.0, 1), &values(8.0, 1), 1)
            .unwrap());
        append_mlx(&mut reference, &values(7.0, 1), &values(8.0, 1), 1);
        assert_eq!(held(&fast), held(&reference));
        // Positions past the buffer's capacity go through update_and_fetch.
        let m = STEP as usize;
        assert!(!fast
            .append_in_place(&values(0.0, m), &values(0.0, m), m)
            .unwrap());
    }

    /// A speculative block's checkpoint holds no full cache: the block appends to it in place,
    /// and a rewind takes it back by trimming, also where another cache must be restored and
    /// the kept positions replayed.
    #[test]
    fn a_checkpoint_leaves_full_caches_to_be_written_in_place() {
        use crate::engine::rollback::{rewind, Checkpoint, Rewind};
        // A two-position window that the block wraps: a trim cannot take it back.
        let mut caches: Vec<Box<dyn KvCache>> = vec![
            Box::new(FullCache::new()),
            Box::new(RotatingCache::new(2, 0)),
        ];
        for c in caches.iter_mut() {
            append_mlx(c.as_mut(), &values(0.0, 2), &values(50.0, 2), 2);
        }
        let mut reference = FullCache::new();
        append_mlx(&mut reference, &values(0.0, 2), &values(50.0, 2), 2);
        for replays in [false, true] {
            let checkpoint = Checkpoint::take(&caches, 2);
            let block = (values(10.0, 2), values(60.0, 2));
            assert!(
                caches[0].append_in_place(&block.0, &block.1, 2).unwrap(),
                "the checkpoint held the full cache's buffers"
            );
            if replays {
                append_mlx(caches[1].as_mut(), &block.0, &block.1, 2);
            } else {
                caches.truncate(1);
            }
            // Keep the block's first position: replay feeds it again through `replay`.
            let first = |x: &[f32]| -> Vec<f32> {
                (0..HEADS)
                    .flat_map(|h| x[h * 2 * DIM..][..DIM].to_vec())
                    .collect()
            };
            let (k, v) = (first(&block.0), first(&block.1));
            let how = rewind(&mut caches, checkpoint, 4, 3, &[7], |ids, caches| {
                assert_eq!(ids, [7]);
                for c in caches.iter_mut() {
                    append_mlx(c.as_mut(), &k, &v, 1);
                }
                Ok(())
            })
            .unwrap();
            assert_eq!(
                how,
                if replays {
                    Rewind::Replayed
                } else {
                    Rewind::Trimmed
                }
            );
            append_mlx(&mut reference, &k, &v, 1);
            assert_eq!(caches[0].offset(), 3);
            assert_eq!(held(caches[0].as_ref()), held(&reference));
            if !replays {
                // Back to two positions for the replaying round, beside a fresh window.
                caches[0].trim(1);
                reference.trim(1);
                let mut window: Box<dyn KvCache> = Box::new(RotatingCache::new(2, 0));
                append_mlx(window.as_mut(), &values(0.0, 2), &values(50.0, 2), 2);
                caches.push(window);
            }
        }
    }

    #[test]
    fn shared_buffers_are_never_written_in_place() {
        let mut c = FullCache::new();
        append_mlx(&mut c, &values(0.0, 2), &values(50.0, 2), 2);
        let saved = c.snapshot();
        assert!(!c
            .append_in_place(&values(9.0, 1), &values(9.0, 1), 1)
            .unwrap());
        assert_eq!(c.offset(), 2);
        drop(saved);
        assert!(c
            .append_in_place(&values(9.0, 1), &values(9.0, 1), 1)
            .unwrap());

        let twin = c.clone_box().unwrap();
        let twin_held = held(twin.as_ref());
        assert!(!c
            .append_in_place(&values(5.0, 1), &values(5.0, 1), 1)
            .unwrap());
        // An MLX append gives this cache buffers of its own again; the twin keeps its values
        // through every write that follows.
        append_mlx(&mut c, &values(5.0, 1), &values(5.0, 1), 1);
        c.trim(2);
        assert!(c
            .append_in_place(&values(-1.0, 1), &values(-2.0, 1), 1)
            .unwrap());
        assert_eq!(held(twin.as_ref()), twin_held);
    }

    #[test]
    fn a_buffer_a_copy_appended_from_is_never_written_in_place() {
        let mut c = FullCache::new();
        append_mlx(&mut c, &values(0.0, 3), &values(50.0, 3), 3);
        let mut twin = c.clone_box().unwrap();
        // The twin's MLX append reads the shared buffers lazily: until this cache has buffers
        // of its own, writing them (even below the twin's positions, after a trim) could
        // change what the twin's append copies.
        twin.update_and_fetch(&array(&values(5.0, 1), 1), &array(&values(5.0, 1), 1))
            .unwrap();
        c.trim(2);
        assert!(!c
            .append_in_place(&values(-1.0, 1), &values(-2.0, 1), 1)
            .unwrap());
        mlx_rs::transforms::eval(&twin.state()).unwrap();
        let (twin_keys, _) = held(twin.as_ref());
        // Head 0's first three positions, as appended before the copy.
        assert_eq!(&twin_keys[..3 * DIM], &values(0.0, 3)[..3 * DIM]);
        append_mlx(&mut c, &values(-1.0, 1), &values(-2.0, 1), 1);
        assert!(c
            .append_in_place(&values(3.0, 1), &values(3.0, 1), 1)
            .unwrap());
    }
}
