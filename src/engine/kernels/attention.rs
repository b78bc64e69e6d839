//! bfloat16 attention on the host, computing what MLX's CPU backend computes for
//! `fast::scaled_dot_product_attention` (`--host-matvec on`, L1). On the CPU MLX runs its SDPA
//! as a graph of plain ops: the scaled queries times the keys per key/value head group, the
//! causal mask as `where(mask, scores, lowest)`, a precise softmax, times the values. Its two
//! products go to `simd_gemm`, which copies 16×16 tiles element by element on one thread: at a
//! 256-token SmolLM2 bf16 prompt they were over a third of the time.
//!
//! The same steps here, in MLX's order: each score is one f32 chain over the head dimension
//! (the host product of [`super::mlx_order`], `Sequential`), rounded to bfloat16; the softmax
//! takes each row's maximum, sums `exp(x - max)` (MLX's CPU `exp`) left to right, multiplies
//! each exponential by `1 / sum` and rounds; each output is one f32 chain over the keys (products
//! of two bfloat16 values are exact, so multiply-then-add is MLX's `c += a * b`), rounded.
//! [`super::super::cache_attention`] compares this with MLX's own SDPA once per head layout
//! before using it.

use super::elementwise::{bf16_mlx, bits_of, exp_mlx_slice, round_bf16};
use super::haswell_tiles::{paired_sum, paired_sums, PairedTiles, HASWELL_UNROLL_M};
use super::mlx_order::{self, Order, Weights};
use half::bf16;
use rayon::prelude::*;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Work (heads × queries × keys) below which one thread does all heads.
const PARALLEL_MIN_SCORES: usize = 1 << 12;

/// Head layout of one attention call (batch 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` is a multiple).
    pub kv_heads: usize,
    /// Queries (the new tokens).
    pub queries: usize,
    /// Keys (the cache, the new tokens included).
    pub keys: usize,
    /// Head dimension.
    pub dim: usize,
}

/// Attention of scaled queries `q` (`[heads, queries, dim]`) over `k` and `v` (`kv_heads`
/// heads of `keys × dim` row-major values each, the heads `kv_stride` values apart: a cache
/// view read in place), all bfloat16, into `out` (`[heads, queries, dim]`); `causal` masks key
/// `s` from query `t` when `s > keys - queries + t`. Errors when the lengths disagree with
/// `shape` or the CPU lacks the product kernels.
pub fn attend_bf16(
    q: &[bf16],
    (k, v, kv_stride): (&[bf16], &[bf16], usize),
    shape: AttentionShape,
    causal: bool,
    out: &mut [bf16],
) -> Result<(), String> {
    let AttentionShape {
        heads,
        kv_heads,
        queries,
        keys,
        dim,
    } = shape;
    if kv_heads == 0
        || !heads.is_multiple_of(kv_heads)
        || queries > keys
        || dim == 0
        || queries == 0
        || kv_stride < keys * dim
    {
        return Err(format!(
            "{shape:?} is not an attention layout the host takes"
        ));
    }
    let q_len = heads * queries * dim;
    let kv_len = (kv_heads - 1) * kv_stride + keys * dim;
    if q.len() != q_len || out.len() != q_len || k.len() != kv_len || v.len() != kv_len {
        return Err(format!("{shape:?}: array lengths disagree with the layout"));
    }
    let rep = heads / kv_heads;
    CALLS.fetch_add(1, Ordering::Relaxed);
    let head = |h: usize, out: &mut [bf16]| -> Result<(), String> {
        let g = h / rep;
        let kg = &k[g * kv_stride..g * kv_stride + keys * dim];
        let vg = &v[g * kv_stride..g * kv_stride + keys * dim];
        let qh: Vec<f32> = q[h * queries * dim..(h + 1) * queries * dim]
            .iter()
            .map(|x| x.to_f32())
            .collect();
        // SAFETY: `bf16` is `repr(transparent)` over `u16`.
        let k_bits = unsafe { bits_of(kg) };
        let scores = mlx_order::matmul(
            Weights::Bf16(k_bits),
            keys,
            dim,
            &qh,
            queries,
            &Order::Sequential,
            1,
        )?;
        let mut row = Vec::with_capacity(keys);
        let mut acc = vec![0.0f32; dim];
        for t in 0..queries {
            let visible = if causal { keys - queries + t + 1 } else { keys };
            row.clear();
            row.extend_from_slice(&scores[t * keys..t * keys + visible]);
            weigh_values(&mut row, |s| &vg[s * dim..(s + 1) * dim], &mut acc);
            for (o, a) in out[t * dim..(t + 1) * dim].iter_mut().zip(&acc) {
                *o = bf16_mlx(*a);
            }
        }
        Ok(())
    };
    let per_head = queries * dim;
    if heads * queries * keys < PARALLEL_MIN_SCORES {
        for (h, o) in out.chunks_exact_mut(per_head).enumerate() {
            head(h, o)?;
        }
        Ok(())
    } else {
        out.par_chunks_exact_mut(per_head)
            .enumerate()
            .try_for_each(|(h, o)| head(h, o))
    }
}

/// One query's visible keys' score sums (`row`, f32, overwritten) to its attention output
/// before rounding (`acc`, one f32 chain per dimension over the keys, `value(s)` being key
/// `s`'s value row), in MLX's order: each score rounded to bfloat16, the softmax, then the
/// weighted values. The keys MLX's mask hides are left out: their score is bfloat16's lowest,
/// whose exponential is zero, so they change neither the maximum, nor the sum, nor the output.
fn weigh_values<'v>(row: &mut [f32], value: impl Fn(usize) -> &'v [bf16], acc: &mut [f32]) {
    round_bf16(row);
    softmax_row(row);
    acc.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `simd` names only instruction sets this CPU runs.
    unsafe {
        match mlx_order::simd() {
            Some(mlx_order::Simd::Avx512) => return sum_values_avx512(row, &value, acc),
            Some(mlx_order::Simd::Avx2) => return sum_values_avx2(row, &value, acc),
            None => {}
        }
    }
    sum_values(row, &value, acc);
}

/// `acc[d] += p_s · value(s)[d]` over the keys `s` in order (MLX's multiply, then add; the
/// product of a bfloat16 weight and a bfloat16 value is exact in f32). Compiled for the vector
/// width at hand: each dimension's chain is the same at any width.
#[inline(always)]
fn sum_values<'v>(row: &[f32], value: &impl Fn(usize) -> &'v [bf16], acc: &mut [f32]) {
    for (s, p) in row.iter().enumerate() {
        // A zero weight (an exponential that underflowed) adds a signed zero to a sum that
        // starts at +0 and so can never be -0: it changes nothing and is skipped.
        if *p == 0.0 {
            continue;
        }
        // Each value widened where it is read (a shift), not copied out per head.
        for (a, x) in acc.iter_mut().zip(value(s)) {
            *a += p * f32::from_bits(u32::from(x.to_bits()) << 16);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn sum_values_avx512<'v>(
    row: &[f32],
    value: &impl Fn(usize) -> &'v [bf16],
    acc: &mut [f32],
) {
    // The usual head widths with their sums held in registers across the keys.
    match acc.len() {
        64 => sum_values_in_registers::<4>(row, value, acc),
        128 => sum_values_in_registers::<8>(row, value, acc),
        _ => sum_values(row, value, acc),
    }
}

/// [`sum_values`] for heads of `V` sixteen-lane vectors, the sums kept in `V` registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn sum_values_in_registers<'v, const V: usize>(
    row: &[f32],
    value: &impl Fn(usize) -> &'v [bf16],
    acc: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut sums = [_mm512_setzero_ps(); V];
    for (s, p) in row.iter().enumerate() {
        if *p == 0.0 {
            continue;
        }
        // Value rows are head-wide (both callers cut them `acc.len()` long).
        let v = &value(s)[..16 * V];
        let weight = _mm512_set1_ps(*p);
        for (j, sum) in sums.iter_mut().enumerate() {
            let bits = _mm256_loadu_si256(v.as_ptr().add(16 * j).cast());
            let x = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)));
            *sum = _mm512_add_ps(*sum, _mm512_mul_ps(weight, x));
        }
    }
    for (j, sum) in sums.iter().enumerate() {
        _mm512_storeu_ps(acc.as_mut_ptr().add(16 * j), *sum);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_values_avx2<'v>(row: &[f32], value: &impl Fn(usize) -> &'v [bf16], acc: &mut [f32]) {
    sum_values(row, value, acc)
}

/// One query head's bfloat16 attention as [`attend_bf16`] computes it, for the host decode
/// step ([`super::step`]), whose keys lie in two buffers: `past` (this key/value head's cached
/// keys and values, row-major, `past.0.len() / dim` of them) and `new` (the block's, likewise),
/// the first `visible` of them in that order seen by the query. `q` is the scaled query
/// (bfloat16 values, widened); `out` gets the output, rounded to bfloat16 and widened.
pub fn attend_bf16_query(
    q: &[f32],
    past: (&[bf16], &[bf16]),
    new: (&[bf16], &[bf16]),
    visible: usize,
    row: &mut Vec<f32>,
    out: &mut [f32],
) -> Result<(), String> {
    let dim = q.len();
    let (past_len, new_len) = (past.0.len() / dim.max(1), new.0.len() / dim.max(1));
    if dim == 0
        || out.len() != dim
        || past.1.len() != past.0.len()
        || new.1.len() != new.0.len()
        || visible == 0
        || visible > past_len + new_len
    {
        return Err(format!(
            "a query of {dim} over {past_len} cached and {new_len} new keys, {visible} visible"
        ));
    }
    row.clear();
    row.resize(visible, 0.0);
    let seen_past = visible.min(past_len);
    let (past_scores, new_scores) = row.split_at_mut(seen_past);
    for (keys, range, scores) in [
        (past.0, 0..seen_past, past_scores),
        (new.0, 0..visible - seen_past, new_scores),
    ] {
        if range.is_empty() {
            continue;
        }
        // SAFETY: `bf16` is `repr(transparent)` over `u16`.
        let bits = unsafe { bits_of(keys) };
        let rows = keys.len() / dim;
        mlx_order::block_rows(
            Weights::Bf16(bits),
            rows,
            dim,
            q,
            1,
            &Order::Sequential,
            range,
            scores,
        )?;
    }
    let value = |s: usize| {
        if s < past_len {
            &past.1[s * dim..(s + 1) * dim]
        } else {
            &new.1[(s - past_len) * dim..(s - past_len + 1) * dim]
        }
    };
    weigh_values(row, value, out);
    round_bf16(out);
    Ok(())
}

/// A bfloat16 query head (values widened) scaled as MLX's fallback scales it: one bfloat16
/// multiply by the scale made a bfloat16 (a weak scalar takes the query's dtype).
pub fn scale_bf16_query(q: &[f32], scale: f32, out: &mut [f32]) {
    let scale = bf16_mlx(scale).to_f32();
    for (o, v) in out.iter_mut().zip(q) {
        *o = bf16_mlx(v * scale).to_f32();
    }
}

/// MLX's precise softmax of one row of bfloat16 scores (given widened), in place, each result
/// already rounded to bfloat16 (and widened back).
fn softmax_row(row: &mut [f32]) {
    softmax_row_as(row, |p| bf16_mlx(p).to_f32());
}

/// MLX's precise softmax of one row in place: the maximum, `exp(x - max)` summed left to right,
/// each exponential times `1 / sum`, then `round` to the scores' dtype.
fn softmax_row_as(row: &mut [f32], round: impl Fn(f32) -> f32) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, x| m.max(*x));
    for x in row.iter_mut() {
        *x -= max;
    }
    exp_mlx_slice(row);
    let mut sum = 0.0f32;
    for e in row.iter() {
        sum += e;
    }
    let inv = 1.0 / sum;
    for e in row.iter_mut() {
        *e = round(*e * inv);
    }
}

static CALLS: AtomicUsize = AtomicUsize::new(0);

/// How many attention calls the host computed in this process (lets tests check that the host
/// path really ran).
pub fn host_attention_calls() -> usize {
    CALLS.load(Ordering::Relaxed)
}

/// Whether [`attend_f32_query`] computes an f32 attention of `queries` queries over `keys` keys
/// of width `dim` as MLX's CPU backend does, here ([`F32AttentionOrder::here`]).
pub fn f32_values_fit(queries: usize, keys: usize, dim: usize) -> bool {
    F32AttentionOrder::here(queries, keys, dim).is_some()
}

/// The orders MLX's CPU SDPA sums an f32 attention of a block of queries over its keys in, the
/// same for every head of the block: decided once per block.
#[derive(Debug, Clone, PartialEq)]
pub struct F32AttentionOrder {
    /// The order OpenBLAS sums the whole `q · Kᵀ` in ([`mlx_order::F32Kernels::block_order`]).
    pub scores: Order,
    /// The panels of keys it sums `P · V` in ([`f32_value_panels`]).
    pub values: Vec<usize>,
    /// The outputs OpenBLAS's `HASWELL` kernels sum in two chains instead (blocks of four or
    /// more queries there); `None` where every output is one chain per panel.
    pub pairs: Option<AttentionPairs>,
}

/// The outputs of a block's two products that OpenBLAS's `HASWELL` 8×4 kernel tile sums in
/// two chains ([`PairedTiles`]; the block's queries are both products' columns).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionPairs {
    /// Of `q · Kᵀ`: rows are the keys.
    pub scores: PairedTiles,
    /// Of `P · V` (rows are the head dimension), per query: how many of its first outputs are
    /// summed in two chains (the same for every head, so counted once per block).
    pub value_split: Vec<usize>,
}

impl F32AttentionOrder {
    /// The orders for `queries` queries over `keys` keys of width `dim`, when this CPU's kernels
    /// run the scores' ([`mlx_order::takes_tokens`]) and the values' is known; `None` otherwise.
    pub fn here(queries: usize, keys: usize, dim: usize) -> Option<Self> {
        let kernels = mlx_order::F32Kernels::here();
        let scores = kernels.block_order(keys, dim, queries);
        if !mlx_order::takes_tokens(&scores, queries) {
            return None;
        }
        let values = f32_value_panels(queries, keys, dim)?;
        let pairs = match kernels {
            mlx_order::F32Kernels::Haswell => haswell_pairs(queries, keys, dim)?,
            _ => None,
        };
        Some(Self {
            scores,
            values,
            pairs,
        })
    }
}

/// The two-chain outputs of a block on the `HASWELL` kernels: `Some(None)` where there are none
/// (up to three queries); `None` where the order is not known here (the products past
/// OpenBLAS's threading threshold, whose driver cuts the columns otherwise, or a head wider
/// than one panel of the scores' depth).
fn haswell_pairs(queries: usize, keys: usize, dim: usize) -> Option<Option<AttentionPairs>> {
    let scores = PairedTiles::new(keys, queries)?;
    let values = PairedTiles::new(dim, queries)?;
    if !(0..queries).any(|c| scores.column_has_pairs(c) || values.column_has_pairs(c)) {
        return Some(None);
    }
    let one_panel = dim <= mlx_order::F32Kernels::Haswell.panel_depth();
    if queries * keys * dim > SINGLE_THREAD_MAX_MNK || !one_panel {
        return None;
    }
    let value_split = (0..queries)
        .map(|c| (0..dim).take_while(|&d| values.paired(d, c)).count())
        .collect();
    Some(Some(AttentionPairs {
        scores,
        value_split,
    }))
}

/// Largest `M·N·K` OpenBLAS runs a GEMM on one thread (`SMP_THRESHOLD_MIN` 65,536 times
/// `GEMM_MULTITHREAD_THRESHOLD` 4).
const SINGLE_THREAD_MAX_MNK: usize = 262_144;
/// Largest `M·N·K` the `SKYLAKEX`/`COOPERLAKE` small-matrix `NN` kernel takes.
const SMALL_NN_MAX_MNK: usize = 1_000_000;

/// How MLX's CPU backend sums the values product `P · V` of `queries` queries over `keys` keys
/// of width `dim`: the panels of keys OpenBLAS cuts it into, each output one fused multiply-add
/// chain per panel from zero and the panels added in order. The `SKYLAKEX`/`COOPERLAKE` kernel
/// sets sum up to `M·N·K = 10⁶` on their small-matrix `NN` kernel (one chain over all keys);
/// the `HASWELL` set always runs the GEMM driver, whose cut of the depth depends on whether it
/// runs on one thread (a halved remainder rounded up to a multiple of 8) or more (halved,
/// rounded up). `None` where the host does not know the order (the AVX-512 sets past the small
/// kernel: those calls are not checked against MLX).
pub fn f32_value_panels(queries: usize, keys: usize, dim: usize) -> Option<Vec<usize>> {
    let kernels = mlx_order::F32Kernels::here();
    let mnk = queries * keys * dim;
    if kernels != mlx_order::F32Kernels::Haswell {
        return (mnk <= SMALL_NN_MAX_MNK).then(|| vec![keys]);
    }
    let halving = if mnk > SINGLE_THREAD_MAX_MNK {
        mlx_order::Halving::Threaded
    } else {
        mlx_order::Halving::SingleThread {
            unroll: HASWELL_UNROLL_M,
        }
    };
    Some(mlx_order::driver_panels(
        keys,
        kernels.panel_depth(),
        halving,
    ))
}

/// One scaled query `q` (`dim` values) of f32 attention over one key/value head, in MLX's CPU
/// SDPA order: the head's keys lie in two buffers, the cache's rows (`past`) then the step's
/// new ones (`new`), which together are the one product MLX forms; `keys` is their total and
/// the first `visible` are not masked. Each score is the host product in `order.scores`; then
/// MLX's precise softmax (the maximum, `exp(x - max)` summed left to right, each times
/// `1 / sum`); then each output is one fused multiply-add chain over each of `order.values`'
/// panels of keys from zero, the panels added in order. Where `order.pairs` says OpenBLAS's
/// `Haswell` kernel sums a score or an output in its 8×4 tile, it is summed in that tile's two
/// chains instead ([`super::haswell_tiles`]). `scores` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn attend_f32_query(
    q: &[f32],
    (past_k, past_v): (&[f32], &[f32]),
    (new_k, new_v): (&[f32], &[f32]),
    keys: usize,
    visible: usize,
    order: &F32AttentionOrder,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) -> Result<(), String> {
    let dim = q.len();
    let past = past_k.len() / dim.max(1);
    if dim == 0
        || out.len() != dim
        || past_v.len() != past_k.len()
        || new_v.len() != new_k.len()
        || past + new_k.len() / dim != keys
        || visible == 0
        || visible > keys
    {
        return Err(format!(
            "an f32 query of {dim} over {keys} keys ({visible} visible) from buffers of {} and {} values",
            past_k.len(),
            new_k.len()
        ));
    }
    scores.resize(keys, 0.0);
    // The block's queries sit where its new keys do (a causal block): this one is query
    // `visible - past - 1` of `new`, and the small-matrix order reduces a score by both.
    let new = keys - past;
    let query = (visible.saturating_sub(past + 1), new.max(1));
    let (cached, block) = (0..past, 0..new);
    // The query's column in both products (its place in the block), where some of its sums
    // take the Haswell kernel's two chains.
    let column = visible - past - 1;
    let pairs = order.pairs.as_ref();
    match pairs.filter(|p| p.scores.column_has_pairs(column)) {
        Some(pairs) => {
            let query = PairedQuery {
                q,
                tiles: &pairs.scores,
                column,
            };
            let (old, fresh) = scores.split_at_mut(past);
            paired_scores(&query, past_k, 0, old);
            paired_scores(&query, new_k, past, fresh);
        }
        None => {
            mlx_order::token_rows(
                past_k,
                0,
                keys,
                dim,
                q,
                query,
                &order.scores,
                cached,
                &mut scores[..past],
            )?;
            mlx_order::token_rows(
                new_k,
                past,
                keys,
                dim,
                q,
                query,
                &order.scores,
                block,
                &mut scores[past..],
            )?;
        }
    }
    // Masked keys take the lowest finite value, as MLX's `where` writes: their exponential is
    // then exactly zero.
    for s in &mut scores[visible..] {
        *s = f32::MIN;
    }
    softmax_row_as(scores, |p| p);
    if order.values.iter().sum::<usize>() != keys {
        return Err(format!(
            "value panels {:?} do not cover {keys} keys",
            order.values
        ));
    }
    let rows = |s: usize| {
        if s < past {
            &past_v[s * dim..(s + 1) * dim]
        } else {
            &new_v[(s - past) * dim..(s - past + 1) * dim]
        }
    };
    // A zero weight adds a signed zero to a chain that starts at +0 (see `attend_bf16`), and
    // masked keys weigh zero: both are skipped. Where the Haswell kernel pairs this query's
    // outputs, the panel's odd keys of each whole group of eight go to a second chain (`odd`,
    // for the paired outputs `..split`), added at the end.
    let split = pairs.map_or(0, |p| p.value_split[column]);
    let mut odd = vec![0.0f32; split];
    let mut chain = |keys: Range<usize>, acc: &mut [f32]| {
        acc.fill(0.0);
        odd.fill(0.0);
        let whole = keys.start + keys.len() / 8 * 8;
        let end = keys.end.min(visible);
        for (s, p) in scores.iter().enumerate().take(end).skip(keys.start) {
            if *p == 0.0 {
                continue;
            }
            if split > 0 && s < whole && (s - keys.start) % 2 == 1 {
                fma_row(&mut odd, *p, &rows(s)[..split]);
                fma_row(&mut acc[split..], *p, &rows(s)[split..]);
            } else {
                fma_row(acc, *p, rows(s));
            }
        }
        acc.iter_mut().zip(&odd).for_each(|(a, o)| *a += o);
    };
    let mut start = 0;
    let mut part = Vec::new();
    for (i, &depth) in order.values.iter().enumerate() {
        let keys = start..start + depth;
        start += depth;
        if i == 0 {
            chain(keys, out);
        } else if keys.start < visible {
            part.resize(dim, 0.0);
            chain(keys, &mut part);
            out.iter_mut().zip(&part).for_each(|(o, p)| *o += p);
        }
    }
    CALLS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// One query of a block on the `HASWELL` kernels: its values, and where the kernel sums its
/// scores in the 8×4 tile (`tiles`, the query being column `column`).
struct PairedQuery<'a> {
    q: &'a [f32],
    tiles: &'a PairedTiles,
    column: usize,
}

/// The scores of the query against the key rows `w` (the first of them key `first` of the
/// block's product), each summed as OpenBLAS's `HASWELL` kernel sums it: in the 8×4 tile's two
/// chains where the tiles say so, one chain otherwise.
fn paired_scores(query: &PairedQuery<'_>, w: &[f32], first: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if mlx_order::available() {
        // SAFETY: the host kernels run only where the CPU has AVX2 and FMA.
        unsafe { paired_scores_fma(query, w, first, out) };
        return;
    }
    score_rows(query, w, first, out);
}

/// [`paired_scores`] compiled for FMA, so that its `mul_add`s are single instructions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn paired_scores_fma(query: &PairedQuery<'_>, w: &[f32], first: usize, out: &mut [f32]) {
    score_rows(query, w, first, out)
}

/// The loop of [`paired_scores`]. Four paired keys at a time run their eight chains side by
/// side (each chain's adds depend on each other, the keys' do not).
#[inline(always)]
fn score_rows(query: &PairedQuery<'_>, w: &[f32], first: usize, out: &mut [f32]) {
    let q = query.q;
    let dim = q.len();
    let paired = |r: usize| query.tiles.paired(first + r, query.column);
    let mut r = 0;
    while r < out.len() {
        if r + 4 <= out.len() && (r..r + 4).all(paired) {
            let keys: [&[f32]; 4] = std::array::from_fn(|i| &w[(r + i) * dim..(r + i + 1) * dim]);
            let sums = paired_sums(dim, |d, acc: [f32; 4]| {
                std::array::from_fn(|i| q[d].mul_add(keys[i][d], acc[i]))
            });
            out[r..r + 4].copy_from_slice(&sums);
            r += 4;
            continue;
        }
        let key = &w[r * dim..(r + 1) * dim];
        out[r] = if paired(r) {
            paired_sum(dim, |d, acc| q[d].mul_add(key[d], acc))
        } else {
            q.iter()
                .zip(key)
                .fold(0.0, |acc, (a, b)| a.mul_add(*b, acc))
        };
        r += 1;
    }
}

/// `acc[d] = fma(w, v[d], acc[d])` for every `d`, each rounded once.
fn fma_row(acc: &mut [f32], w: f32, v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if mlx_order::available() {
        // SAFETY: the host kernels run only where the CPU has AVX2 and FMA.
        unsafe { fma_row_avx2(acc, w, v) };
        return;
    }
    for (a, x) in acc.iter_mut().zip(v) {
        *a = w.mul_add(*x, *a);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_row_avx2(acc: &mut [f32], w: f32, v: &[f32]) {
    for (a, x) in acc.iter_mut().zip(v) {
        *a = w.mul_add(*x, *a);
    }
}
