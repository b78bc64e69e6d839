//! A dense weight re-laid for the L1 host step's products ([`super::step`]) where MLX sums one
//! chain per output: a bfloat16 product (`simd_gemm`: one f32 chain over the whole depth) and an
//! f32 one on OpenBLAS's GEMM driver (one chain per panel of the depth, the panels added in
//! order). The row-major kernels ([`super::mlx_order`]) vectorise those across outputs by
//! transposing a block of rows in registers for every sixteen values of depth, reading as many
//! rows side by side: more shuffles and more memory streams than a decode token has time for.
//! Here the transposition is done once, when the step is built: each group of [`Simd`]-width
//! rows stores, for every column, the rows' values side by side (bfloat16: every pair of
//! columns as one 32-bit word per row, the first column's value in the high half, the order in
//! which `vdpbf16ps` adds a pair). A product then streams each group once, one vector per
//! column (bfloat16: per pair, both halves widened with a shift and a mask, or both multiplied
//! and added by one `vdpbf16ps` where that is exact, see [`dot_product_is_exact`]), each added
//! to its row's chain in column order: the same sums as MLX, with every lane busy. It costs a
//! second copy of the weights it is made for. A bfloat16 prompt's products read the copy too
//! ([`super::dense::HostDense`]): their chains do not depend on the number of tokens, and a
//! block of tokens runs past each group while it sits in the first-level cache.

use super::mlx_order::{simd, Order, Simd, CHUNKS, PARALLEL_MIN_WEIGHTS};
use super::pages::HostCopy;
use super::pair;
use rayon::prelude::*;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

static BF16_CALLS: AtomicUsize = AtomicUsize::new(0);
static F32_CALLS: AtomicUsize = AtomicUsize::new(0);
static DOT_CALLS: AtomicUsize = AtomicUsize::new(0);

/// How many bfloat16 products took the `vdpbf16ps` kernel in this process, the one-time checks
/// not counted (lets tests require it where the CPU has it).
pub fn dot_calls() -> usize {
    DOT_CALLS.load(Ordering::Relaxed)
}

/// How many products the packed kernels computed in this process, bfloat16 and f32 (lets tests
/// check that the host step really read a packed copy).
pub fn packed_calls() -> (usize, usize) {
    (
        BF16_CALLS.load(Ordering::Relaxed),
        F32_CALLS.load(Ordering::Relaxed),
    )
}

/// Tokens one pass over a group of rows serves (one accumulator each).
const TOKEN_BLOCK: usize = 4;

/// What a packed weight's words hold, and the order its chains run in.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Layout {
    /// bfloat16 pairs of columns; one chain over the whole depth.
    Bf16Pairs,
    /// f32 columns; one chain per panel of these depths, the panels added in order.
    F32Panels(Vec<usize>),
}

/// A `rows × cols` weight in the column-interleaved layout (see the module docs); rows past
/// the last whole group are not held (the caller sums them from the row-major weight).
#[derive(Debug)]
pub struct PackedRows {
    words: HostCopy<u32>,
    layout: Layout,
    simd: Simd,
    /// Rows per group (the vector width in f32 lanes).
    lanes: usize,
    /// Rows held (whole groups).
    rows: usize,
    cols: usize,
    /// Bit `t`: products of `t` tokens matched MLX's (see [`PackedRows::set_checked`]).
    checked: AtomicU32,
    /// For a bfloat16 copy on a CPU with `vdpbf16ps` and no subnormal weight: the exponent of
    /// the finest spacing any nonzero weight lies on (see [`dot_product_is_exact`]).
    dot_grid: Option<i32>,
}

/// The exponent of the smallest bfloat16 step (unit in the last place) among the nonzero
/// values `bits`, `None` when one is subnormal, infinite or NaN (which `vdpbf16ps` would treat
/// otherwise than MLX's chain). `i32::MAX` when every value is zero.
fn bf16_grid(bits: impl Iterator<Item = u16>) -> Option<i32> {
    let mut finest = i32::MAX;
    for b in bits {
        let exponent = i32::from((b >> 7) & 0xFF);
        match exponent {
            0 if b & 0x7F == 0 => continue,
            0 | 255 => return None,
            e => finest = finest.min(e - 127 - 7),
        }
    }
    Some(finest)
}

/// Whether `vdpbf16ps` sums a product of weights on `weight` and inputs on `input` (grids of
/// [`bf16_grid`]) exactly as MLX's chain: it adds each pair's two products in turn, each
/// rounded to nearest (the products of two bfloat16 values are exact in f32), but treats
/// subnormal inputs as zero and flushes subnormal results. Every product is then a multiple
/// of `2^(weight + input)`, and so is every partial sum; with that at least the smallest
/// normal f32 (`2^-126`), no nonzero value it meets is subnormal.
fn dot_product_is_exact(weight: i32, input: i32) -> bool {
    weight.saturating_add(input) >= -126
}

/// Whether this CPU runs the bfloat16 dot-product kernel (see [`dot_calls`]): AVX-512 with
/// `AVX512_BF16` (`MLXB_BF16_DOT=off` keeps the multiply-add kernels, to compare).
pub fn dot_available() -> bool {
    static HERE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HERE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            simd() == Some(Simd::Avx512)
                && std::is_x86_feature_detected!("avx512bf16")
                && std::env::var("MLXB_BF16_DOT").as_deref() != Ok("off")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

impl PackedRows {
    /// Packs the row-major bfloat16 bits `w` (`rows × cols`) for this CPU's vector width;
    /// `None` when the CPU has no host kernels, the depth is odd, or there is no whole group.
    pub fn bf16(w: &[u16], rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(2) || w.len() != rows * cols {
            return None;
        }
        // Column `2p` in the high half: `vdpbf16ps` adds a pair's high product first.
        let mut packed = Self::pack(rows, cols, Layout::Bf16Pairs, |row, p| {
            let pair = &w[row * cols + 2 * p..][..2];
            (u32::from(pair[0]) << 16) | u32::from(pair[1])
        })?;
        if dot_available() {
            packed.dot_grid = bf16_grid(w[..packed.rows * cols].iter().copied());
        }
        Some(packed)
    }

    /// Packs the row-major f32 `w` (`rows × cols`) for products summed in `panels` (depths
    /// adding up to `cols`); `None` when the CPU has no host kernels, the panels do not cover
    /// the depth, or there is no whole group.
    pub fn f32(w: &[f32], rows: usize, cols: usize, panels: &[usize]) -> Option<Self> {
        if w.len() != rows * cols || panels.iter().sum::<usize>() != cols || panels.contains(&0) {
            return None;
        }
        Self::pack(rows, cols, Layout::F32Panels(panels.to_vec()), |row, k| {
            w[row * cols + k].to_bits()
        })
    }

    /// The layout's words (`word(row, column)`, a column being a pair for bfloat16) for every
    /// whole group of this CPU's width.
    fn pack(
        rows: usize,
        cols: usize,
        layout: Layout,
        word: impl Fn(usize, usize) -> u32 + Sync,
    ) -> Option<Self> {
        let simd = simd()?;
        let lanes = match simd {
            Simd::Avx512 => 16,
            Simd::Avx2 => 8,
        };
        if cols == 0 || rows < lanes {
            return None;
        }
        let held = rows / lanes * lanes;
        let columns = match layout {
            Layout::Bf16Pairs => cols / 2,
            Layout::F32Panels(_) => cols,
        };
        // Both cores write (most of the time is the kernel zero-filling fresh pages, which it
        // does on the faulting core).
        let mut words = HostCopy::zeroed(held * columns)?;
        words
            .par_chunks_exact_mut(lanes * columns)
            .enumerate()
            .for_each(|(g, group)| {
                for lane in 0..lanes {
                    for c in 0..columns {
                        group[c * lanes + lane] = word(g * lanes + lane, c);
                    }
                }
            });
        Some(Self {
            words,
            layout,
            simd,
            lanes,
            rows: held,
            cols,
            checked: AtomicU32::new(0),
            dot_grid: None,
        })
    }

    /// Records that products of `tokens` tokens (up to 31) matched MLX's: [`PackedRows::takes`]
    /// accepts only such token counts.
    pub(super) fn set_checked(&self, tokens: usize) {
        if tokens < 32 {
            self.checked.fetch_or(1 << tokens, Ordering::Relaxed);
        }
    }

    /// Whether a product of `tokens` tokens summed in `order` is this copy's to compute: its
    /// order, and a token count checked against MLX.
    pub fn takes(&self, order: &Order, tokens: usize) -> bool {
        tokens < 32
            && self.checked.load(Ordering::Relaxed) & (1 << tokens) != 0
            && self.sums_in(order)
    }

    /// Whether a product summed in `order` is summed as this copy sums it.
    pub(super) fn sums_in(&self, order: &Order) -> bool {
        match (&self.layout, order) {
            (Layout::Bf16Pairs, Order::Sequential) => true,
            (Layout::F32Panels(mine), Order::Panels(theirs)) => mine == theirs,
            _ => false,
        }
    }

    /// Rows held (a multiple of the group size): the rest stay on the row-major weight.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows per group: a range handed to [`PackedRows::rows_into`] starts and ends on one.
    pub fn group(&self) -> usize {
        self.lanes
    }

    /// The whole groups this copy holds within `rows`: the outputs of a product over `rows`
    /// that it computes (an empty range where it holds none; the rows before and after it
    /// take the row-major weight).
    pub fn groups_within(&self, rows: &Range<usize>) -> Range<usize> {
        let g = self.lanes;
        let start = (rows.start.div_ceil(g) * g).min(rows.end);
        start..(rows.end.min(self.rows) / g * g).max(start)
    }

    /// Outputs `range` (whole groups within [`PackedRows::rows`]) of `x · Wᵀ` for `tokens`
    /// tokens (`x`: `tokens × cols`; for bfloat16, bfloat16 values widened) into `out`
    /// (token-major, `tokens × range.len()`), on this thread. Errors when the lengths or the
    /// range disagree.
    pub fn rows_into(
        &self,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), String> {
        self.product_into(x, tokens, range, out, true)
    }

    /// [`PackedRows::rows_into`] shared with the [`pair`] helper thread (chunks of whole
    /// groups claimed one at a time; the cut never changes a bit), into the first
    /// `range.len()` columns of `out`'s token rows of `stride` values: a prompt's product
    /// written straight into the rows it is part of.
    pub fn rows_into_shared(
        &self,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) -> Result<(), String> {
        self.check_lengths(x, tokens, &range, out.len(), stride)?;
        let groups = range.len() / self.lanes;
        let per_chunk = if range.len() * self.cols < PARALLEL_MIN_WEIGHTS {
            groups
        } else {
            groups.div_ceil(CHUNKS)
        }
        .max(1);
        let shared = SharedOut(out.as_mut_ptr());
        let pairs = self.dot_pairs(x);
        self.count(pairs.is_some());
        pair::share(groups.div_ceil(per_chunk), &|i| {
            let first = i * per_chunk;
            let end = (first + per_chunk).min(groups);
            let chunk = range.start + first * self.lanes..range.start + end * self.lanes;
            // SAFETY: `check_lengths` checked `out` against every token row and column of
            // `range`; the chunks' columns are disjoint, so no two threads write one value.
            unsafe {
                let out = shared.at(first * self.lanes);
                self.run(x, pairs.as_deref(), tokens, chunk, out, stride)
            }
        });
        Ok(())
    }

    fn count(&self, dot: bool) {
        let calls = match self.layout {
            Layout::Bf16Pairs => &BF16_CALLS,
            Layout::F32Panels(_) => &F32_CALLS,
        };
        calls.fetch_add(1, Ordering::Relaxed);
        if dot {
            DOT_CALLS.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// [`PackedRows::rows_into`] for the one-time check against MLX, which [`packed_calls`]
    /// does not count.
    pub(super) fn check_rows_into(
        &self,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), String> {
        self.product_into(x, tokens, range, out, false)
    }

    /// [`PackedRows::rows_into`] on this thread, counted in [`packed_calls`] and [`dot_calls`]
    /// when `counted`.
    fn product_into(
        &self,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: &mut [f32],
        counted: bool,
    ) -> Result<(), String> {
        self.check_lengths(x, tokens, &range, out.len(), range.len())?;
        let pairs = self.dot_pairs(x);
        if counted {
            self.count(pairs.is_some());
        }
        let (out, stride) = (out.as_mut_ptr(), range.len());
        // SAFETY: the lengths were checked above.
        unsafe { self.run(x, pairs.as_deref(), tokens, range, out, stride) };
        Ok(())
    }

    /// Errors unless `x` holds `tokens` rows of the depth, `range` is whole groups within the
    /// held rows, and `out` holds `tokens` rows of `stride ≥ range.len()` values.
    fn check_lengths(
        &self,
        x: &[f32],
        tokens: usize,
        range: &Range<usize>,
        out: usize,
        stride: usize,
    ) -> Result<(), String> {
        let rows_fit = range.end <= self.rows
            && range.start <= range.end
            && range.start.is_multiple_of(self.lanes)
            && range.end.is_multiple_of(self.lanes);
        let out_fits = stride >= range.len()
            && tokens
                .checked_sub(1)
                .is_none_or(|t| t * stride + range.len() <= out);
        if x.len() != tokens * self.cols || !rows_fit || !out_fits {
            return Err(format!(
                "rows {range:?} of {} packed in groups of {} for {tokens} tokens of {} values, output {out} in rows of {stride}",
                self.rows,
                self.lanes,
                x.len(),
            ));
        }
        Ok(())
    }

    /// The kernels on this CPU's vector width.
    ///
    /// # Safety
    /// [`PackedRows::check_lengths`] accepted `x`, `tokens`, `range` and an output of `tokens`
    /// rows of `stride` values from `out`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &self,
        x: &[f32],
        pairs: Option<&[u32]>,
        tokens: usize,
        range: Range<usize>,
        out: *mut f32,
        stride: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `pack` took `simd` from the CPU's own sets, `dot_grid` is set only where
        // `vdpbf16ps` runs and `pairs` only with it; the caller checked the lengths.
        unsafe {
            match (pairs, self.simd) {
                (Some(pairs), _) => x86::rows_dot(self, pairs, tokens, range, out, stride),
                (None, Simd::Avx512) => x86::rows_avx512(self, x, tokens, range, out, stride),
                (None, Simd::Avx2) => x86::rows_avx2(self, x, tokens, range, out, stride),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (x, pairs, tokens, range, out, stride);
            unreachable!("no host kernels off x86_64: `pack` packs nothing");
        }
    }

    /// The input as the dot-product kernel reads it (each token's pairs of bfloat16 values,
    /// the first in the high half), when this copy takes that kernel and the input's values
    /// keep its sums exact ([`dot_product_is_exact`]); `None` sends the product to the
    /// multiply-add kernels.
    fn dot_pairs(&self, x: &[f32]) -> Option<Vec<u32>> {
        let weight = self.dot_grid?;
        // The values are bfloat16 ones, widened: their low halves are zero.
        if x.iter().any(|v| v.to_bits() & 0xFFFF != 0) {
            return None;
        }
        let input = bf16_grid(x.iter().map(|v| (v.to_bits() >> 16) as u16))?;
        if !dot_product_is_exact(weight, input) {
            return None;
        }
        Some(
            x.chunks_exact(2)
                .map(|p| (p[0].to_bits() & 0xFFFF_0000) | (p[1].to_bits() >> 16))
                .collect(),
        )
    }
}

/// The output of a shared product: each thread writes its own chunk's columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

// SAFETY: the chunks of [`PackedRows::rows_into_shared`] write disjoint values of one buffer
// that outlives [`pair::share`].
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn at(self, column: usize) -> *mut f32 {
        self.0.wrapping_add(column)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::mlx_order::x86::Lane as Vector;
    use super::{Layout, PackedRows, TOKEN_BLOCK};
    use std::arch::x86_64::*;
    use std::ops::Range;

    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    pub(super) unsafe fn rows_avx512(
        w: &PackedRows,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: *mut f32,
        stride: usize,
    ) {
        rows::<__m512>(w, x, tokens, range, out, stride)
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn rows_avx2(
        w: &PackedRows,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: *mut f32,
        stride: usize,
    ) {
        rows::<__m256>(w, x, tokens, range, out, stride)
    }

    /// Where one pass reads and writes: groups `group..` of the packed weight, `T` tokens.
    struct Pass<'a> {
        w: &'a PackedRows,
        x: *const f32,
        out: *mut f32,
        /// Values per token row of `out`.
        len: usize,
        /// The first group, and where its outputs start in a token's row of `out`.
        group: usize,
        at: usize,
    }

    /// Every group of `range` for every token. A decode token runs two groups side by side (two
    /// independent chains hide the multiply-add's latency). A block of tokens runs group by
    /// group, each group past all the tokens (up to `V::PACKED_TOKENS` bfloat16 chains in the
    /// registers at once) before the next: the weight is read from memory once per block, the
    /// group's repeats hit the first-level cache. f32 panels run two groups past
    /// [`TOKEN_BLOCK`] tokens at a time (eight chains, as many as two multiply-add units need
    /// to stay busy), their running totals kept in `out` between panels.
    #[inline(always)]
    unsafe fn rows<V: Vector>(
        w: &PackedRows,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: *mut f32,
        stride: usize,
    ) {
        let lanes = w.lanes;
        let (first, last) = (range.start / lanes, range.end / lanes);
        let pass = |group: usize, t0: usize| Pass {
            w,
            x: x.as_ptr().add(t0 * w.cols),
            out: out.add(t0 * stride),
            len: stride,
            group,
            at: (group - first) * lanes,
        };
        if tokens == 1 {
            let mut g = first;
            while g < last {
                if g + 2 <= last {
                    pass_groups::<V, 2, 1>(pass(g, 0));
                    g += 2;
                } else {
                    pass_groups::<V, 1, 1>(pass(g, 0));
                    g += 1;
                }
            }
            return;
        }
        let block = match w.layout {
            Layout::Bf16Pairs => V::PACKED_TOKENS,
            Layout::F32Panels(_) => TOKEN_BLOCK,
        };
        let mut g = first;
        while g < last {
            let two = g + 2 <= last && matches!(w.layout, Layout::F32Panels(_));
            let mut t0 = 0;
            while t0 < tokens {
                let n = (tokens - t0).min(block);
                let p = pass(g, t0);
                if two {
                    by_tokens!(n, pass_groups::<V, 2>(p));
                } else {
                    by_tokens!(n, pass_groups::<V, 1>(p));
                }
                t0 += n;
            }
            g += if two { 2 } else { 1 };
        }
    }

    /// Every group of `range` for every token through `vdpbf16ps`: per pair of columns one
    /// instruction adds both products to each row's chain, the high (first) one first, each
    /// rounded ([`super::dot_product_is_exact`] says when that is MLX's chain). A decode token
    /// runs four groups side by side (four chains hide the instruction's latency), a block of
    /// tokens up to [`DOT_TOKENS`] per pass over one group.
    ///
    /// # Safety
    /// The CPU runs AVX-512F and AVX512_BF16; `pairs` holds `tokens` rows of `cols / 2` words,
    /// `range` is whole groups of `w` and `out` holds `tokens` rows of `stride` values.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn rows_dot(
        w: &PackedRows,
        pairs: &[u32],
        tokens: usize,
        range: Range<usize>,
        out: *mut f32,
        stride: usize,
    ) {
        let (lanes, half) = (w.lanes, w.cols / 2);
        let (first, last) = (range.start / lanes, range.end / lanes);
        let pass = |group: usize, t0: usize| DotPass {
            words: w.words.as_ptr().add(group * lanes * half),
            half,
            pairs: pairs.as_ptr().add(t0 * half),
            out: out.add(t0 * stride + (group - first) * lanes),
            stride,
        };
        if tokens == 1 {
            let mut g = first;
            while g < last {
                if g + 4 <= last {
                    dot_pass::<4, 1>(pass(g, 0));
                    g += 4;
                } else {
                    dot_pass::<1, 1>(pass(g, 0));
                    g += 1;
                }
            }
            return;
        }
        for g in first..last {
            let mut t0 = 0;
            while t0 < tokens {
                let n = (tokens - t0).min(DOT_TOKENS);
                let p = pass(g, t0);
                by_tokens!(n, dot_pass::<1>(p));
                t0 += n;
            }
        }
    }

    /// Tokens one dot-product pass runs past a group (one accumulator each).
    const DOT_TOKENS: usize = 14;

    /// Where one dot-product pass reads and writes: `G` groups from `words`, `T` tokens.
    struct DotPass {
        words: *const u32,
        /// Pairs of columns per row (words per row and token).
        half: usize,
        pairs: *const u32,
        out: *mut f32,
        stride: usize,
    }

    /// `G` consecutive groups past `T` tokens; the total starts at zero as the multiply-add
    /// kernels' does.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn dot_pass<const G: usize, const T: usize>(p: DotPass) {
        let mut acc = [[_mm512_setzero_ps(); T]; G];
        for k in 0..p.half {
            for (g, chains) in acc.iter_mut().enumerate() {
                let wv: __m512bh = std::mem::transmute(_mm512_loadu_si512(
                    p.words.add((g * p.half + k) * 16).cast(),
                ));
                for (t, a) in chains.iter_mut().enumerate() {
                    let xv: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*p.pairs.add(t * p.half + k) as i32));
                    *a = _mm512_dpbf16_ps(*a, wv, xv);
                }
            }
        }
        for (g, chains) in acc.iter().enumerate() {
            for (t, a) in chains.iter().enumerate() {
                let total = _mm512_add_ps(_mm512_setzero_ps(), *a);
                _mm512_storeu_ps(p.out.add(t * p.stride + g * 16), total);
            }
        }
    }

    /// `G` groups past `T` tokens: each output's chains in the layout's order, the total (from
    /// zero, each panel's chain added in order) stored.
    #[inline(always)]
    unsafe fn pass_groups<V: Vector, const G: usize, const T: usize>(p: Pass<'_>) {
        let (lanes, cols) = (p.w.lanes, p.w.cols);
        let out = |g: usize, t: usize| p.out.add(t * p.len + p.at + g * lanes);
        match &p.w.layout {
            Layout::Bf16Pairs => {
                let pairs = cols / 2;
                let base = p.w.words.as_ptr().add(p.group * lanes * pairs);
                let mut acc = [[V::zero(); T]; G];
                for k in 0..pairs {
                    for (g, chains) in acc.iter_mut().enumerate() {
                        // Column `2k` in the high halves (the dot-product kernel's order).
                        let (odd, even) = V::load_pair(base.add((g * pairs + k) * lanes));
                        for (t, a) in chains.iter_mut().enumerate() {
                            let xt = p.x.add(t * cols + 2 * k);
                            *a = V::fmadd(even, V::splat(*xt), *a);
                            *a = V::fmadd(odd, V::splat(*xt.add(1)), *a);
                        }
                    }
                }
                add_to_out(&out, &acc, false);
            }
            Layout::F32Panels(panels) => {
                let base = p.w.words.as_ptr().add(p.group * lanes * cols);
                let mut k0 = 0;
                for (i, &depth) in panels.iter().enumerate() {
                    let mut acc = [[V::zero(); T]; G];
                    for k in k0..k0 + depth {
                        for (g, chains) in acc.iter_mut().enumerate() {
                            let wv = V::load(base.add((g * cols + k) * lanes).cast());
                            for (t, a) in chains.iter_mut().enumerate() {
                                *a = V::fmadd(wv, V::splat(*p.x.add(t * cols + k)), *a);
                            }
                        }
                    }
                    // The running total waits in `out` (the first-level cache) between
                    // panels, so the registers hold only the chains.
                    add_to_out(&out, &acc, i > 0);
                    k0 += depth;
                }
            }
        }
    }

    /// Stores each chain of `acc` added to the total so far: the value `out(g, t)` points at
    /// where `running`, zero otherwise (a total starts at zero, as the kernels' do).
    #[inline(always)]
    unsafe fn add_to_out<V: Vector, const G: usize, const T: usize>(
        out: &impl Fn(usize, usize) -> *mut f32,
        acc: &[[V; T]; G],
        running: bool,
    ) {
        for (g, chains) in acc.iter().enumerate() {
            for (t, a) in chains.iter().enumerate() {
                let before = if running {
                    V::load(out(g, t))
                } else {
                    V::zero()
                };
                V::store(out(g, t), V::add(before, *a));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kernels::elementwise::{bf16_mlx, probe_values};
    use crate::engine::kernels::mlx_order::tests::panel_chains;

    /// One f32 chain over the columns in order: an independent scalar computation of MLX's
    /// `simd_gemm` sum for output `r` of token `t`.
    fn scalar_chain(w: &[u16], x: &[f32], cols: usize, r: usize, t: usize) -> f32 {
        let mut acc = 0.0f32;
        for k in 0..cols {
            let wk = f32::from_bits(u32::from(w[r * cols + k]) << 16);
            acc = wk.mul_add(x[t * cols + k], acc);
        }
        acc
    }

    fn bf16_probe(n: usize, seed: u64) -> Vec<f32> {
        probe_values(n, seed)
            .into_iter()
            .map(|v| bf16_mlx(v).to_f32())
            .collect()
    }

    /// Every whole group's outputs equal one f32 chain per output over the columns in order,
    /// for 1-9, 14, 15 and 29 tokens (a decode token's two-group pass, the token blocks of
    /// either width and remainders), ranges of one group and of several, on a shape whose rows
    /// end past the last whole group.
    #[test]
    fn packed_products_are_one_chain_per_output_in_column_order() {
        let (rows, cols) = (53, 38);
        let w: Vec<u16> = probe_values(rows * cols, 0x243f_6a88)
            .into_iter()
            .map(|v| bf16_mlx(v).to_bits())
            .collect();
        let Some(packed) = PackedRows::bf16(&w, rows, cols) else {
            assert!(
                simd().is_none(),
                "a CPU with host kernels packs an even depth"
            );
            return;
        };
        let g = packed.group();
        assert_eq!(packed.rows(), rows / g * g);
        for tokens in (1..=9).chain([14, 15, 29]) {
            let x = bf16_probe(tokens * cols, 0x85a3_08d3 + tokens as u64);
            for range in [0..packed.rows(), g..2 * g, 0..g] {
                let mut out = vec![f32::NAN; tokens * range.len()];
                packed
                    .rows_into(&x, tokens, range.clone(), &mut out)
                    .unwrap();
                for t in 0..tokens {
                    for (i, r) in range.clone().enumerate() {
                        assert_eq!(
                            out[t * range.len() + i].to_bits(),
                            scalar_chain(&w, &x, cols, r, t).to_bits(),
                            "token {t}, row {r} of {range:?}"
                        );
                    }
                }
            }
        }
    }

    /// The shared product (a prompt's: chunks claimed by both threads, written into wider
    /// token rows) gives the same chains, in the columns of its range only.
    #[test]
    fn shared_products_write_the_same_chains_into_their_columns() {
        let (rows, cols, tokens, stride) = (256, 320, 17, 300);
        let w: Vec<u16> = probe_values(rows * cols, 0x4528_21e6)
            .into_iter()
            .map(|v| bf16_mlx(v).to_bits())
            .collect();
        let Some(packed) = PackedRows::bf16(&w, rows, cols) else {
            assert!(simd().is_none());
            return;
        };
        let range = 16..240;
        assert!(
            range.len() * cols >= PARALLEL_MIN_WEIGHTS,
            "cut into chunks"
        );
        let x = bf16_probe(tokens * cols, 0x38d0_1377);
        let at = 5;
        let mut out = vec![f32::NAN; tokens * stride];
        packed
            .rows_into_shared(&x, tokens, range.clone(), &mut out[at..], stride)
            .unwrap();
        for t in 0..tokens {
            for c in 0..stride {
                let v = out[t * stride + c];
                match (c + range.start)
                    .checked_sub(at)
                    .filter(|r| range.contains(r))
                {
                    Some(r) => assert_eq!(
                        v.to_bits(),
                        scalar_chain(&w, &x, cols, r, t).to_bits(),
                        "token {t}, row {r}"
                    ),
                    None => assert!(v.is_nan(), "token {t}, column {c} written"),
                }
            }
        }
        let mut short = vec![0.0; (tokens - 1) * stride + range.len() - 1];
        assert!(packed
            .rows_into_shared(&x, tokens, range, &mut short, stride)
            .is_err());
    }

    /// The f32 layout: per panel one chain per output in column order, the panels' sums added
    /// to a total that starts at zero (OpenBLAS's GEMM driver), against a scalar computation.
    #[test]
    fn packed_f32_products_are_panel_chains_added_in_order() {
        let (rows, cols) = (40, 29);
        let panels = [12, 9, 8];
        let w = probe_values(rows * cols, 0x1319_8a2e);
        let Some(packed) = PackedRows::f32(&w, rows, cols, &panels) else {
            assert!(simd().is_none(), "a CPU with host kernels packs f32 panels");
            return;
        };
        for tokens in 1..=6 {
            let x = probe_values(tokens * cols, 0x0370_7344 + tokens as u64);
            let range = 0..packed.rows();
            let mut out = vec![f32::NAN; tokens * range.len()];
            packed
                .rows_into(&x, tokens, range.clone(), &mut out)
                .unwrap();
            for t in 0..tokens {
                for r in range.clone() {
                    let row = &w[r * cols..(r + 1) * cols];
                    let total = panel_chains(row, &x[t * cols..(t + 1) * cols], &panels);
                    assert_eq!(
                        out[t * range.len() + r].to_bits(),
                        total.to_bits(),
                        "token {t}, row {r}"
                    );
                }
            }
        }
        assert!(
            PackedRows::f32(&w, rows, cols, &[12, 9]).is_none(),
            "panels short of the depth"
        );
    }

    /// The dot-product kernel adds a pair's first column first, each product rounded: on a
    /// row whose sum depends on the order (1 + 2^-24 - 1 is 0 left to right, 2^-24 otherwise)
    /// it gives the chain's bits, and an input whose values would meet subnormals (which
    /// `vdpbf16ps` flushes) takes the multiply-add kernels instead, with the same bits.
    #[test]
    fn dot_products_keep_the_chain_order_and_refuse_subnormal_risks() {
        let (rows, cols) = (32, 64);
        let mut w = vec![0u16; rows * cols];
        for r in 0..rows {
            // Columns 2 and 3 share a pair: their order decides the sum.
            w[r * cols + 1] = bf16_mlx(1.0).to_bits();
            w[r * cols + 2] = bf16_mlx(2f32.powi(-24)).to_bits();
            w[r * cols + 3] = bf16_mlx(-1.0).to_bits();
            w[r * cols + 4 + r % 7] = bf16_mlx(0.5 + r as f32).to_bits();
        }
        let Some(packed) = PackedRows::bf16(&w, rows, cols) else {
            assert!(simd().is_none());
            return;
        };
        // Every row equal to its chain; whether the dot kernel computed them.
        let took_dot = |packed: &PackedRows, w: &[u16], x: &[f32]| {
            let before = dot_calls();
            let mut out = vec![f32::NAN; rows];
            packed.rows_into(x, 1, 0..rows, &mut out).unwrap();
            for (r, v) in out.iter().enumerate() {
                let chain = scalar_chain(w, x, cols, r, 0);
                assert_eq!(v.to_bits(), chain.to_bits(), "row {r}");
            }
            dot_calls() > before
        };
        let mut x = vec![0.0f32; cols];
        x[..4].fill(1.0);
        x[5] = 3.0;
        assert_eq!(took_dot(&packed, &w, &x), dot_available(), "where it runs");
        // 2^-100 times a weight of 2^-30 lies far below f32's smallest normal.
        x[12] = bf16_mlx(2f32.powi(-100)).to_f32();
        w[12] = bf16_mlx(2f32.powi(-30)).to_bits();
        let packed = PackedRows::bf16(&w, rows, cols).unwrap();
        assert!(
            !took_dot(&packed, &w, &x),
            "an input that could meet subnormals"
        );
        assert!(dot_product_is_exact(-60, -66) && !dot_product_is_exact(-60, -67));
        assert_eq!(bf16_grid([0x3F80, 0x0000, 0x8000].into_iter()), Some(-7));
        assert_eq!(bf16_grid([0x0001].into_iter()), None, "subnormal");
        assert_eq!(bf16_grid([0x7F80].into_iter()), None, "infinite");
    }

    #[test]
    fn refuses_odd_depths_and_ranges_off_the_groups() {
        let w = vec![0u16; 32 * 7];
        assert!(PackedRows::bf16(&w, 32, 7).is_none());
        let w = vec![0u16; 32 * 8];
        if let Some(p) = PackedRows::bf16(&w, 32, 8) {
            let mut out = vec![0.0; 3];
            assert!(p.rows_into(&[0.0; 8], 1, 1..4, &mut out).is_err());
            let mut out = vec![0.0; 32];
            assert!(p.rows_into(&[0.0; 7], 1, 0..32, &mut out).is_err());
        }
    }
}
