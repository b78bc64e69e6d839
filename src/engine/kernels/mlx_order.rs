//! Products `Y = X · Wᵀ` summed in exactly the order MLX's CPU backend sums them, so that L1
//! decoding gets MLX's bits without MLX's matmul: up to [`MAX_TOKENS`] tokens (a decode step, a
//! speculative verify block) in every order, and any number of tokens (a prompt) for 16-bit
//! weights.
//!
//! Why: for one token MLX's CPU matmul is far from the memory roofline. f32 goes to
//! `cblas_sgemm`, where OpenBLAS either re-packs the whole weight matrix on every call (its
//! GEMM driver, ~37 % of an f32 decode step in `sgemm_incopy`) or runs its small-matrix kernel
//! on one thread; bf16/f16 go to MLX's own `simd_gemm`, which copies 16×16 blocks element by
//! element (SmolLM2 bf16 decodes at 5 % of its roofline). Reading the weights in place on both
//! cores is faster, and summing in the same order keeps every bit.
//!
//! The orders (MLX 0.32.4's CPU backend, OpenBLAS 0.3.21; which f32 order a shape gets depends
//! on the kernel set OpenBLAS picked for the CPU, see [`F32Kernels`]):
//! - **f32, Lanes** (`SKYLAKEX` only): MLX calls row-major `sgemm(NoTrans, Trans)`, which
//!   OpenBLAS runs as column-major `TN` with `M` = outputs, `N` = tokens, `K` = inputs, on its
//!   small-matrix kernel when `M·N·K ≤ 10⁶`, `M·N ≤ 1200` and `K ≥ 32`: per output and token
//!   sixteen lanes, lane
//!   `l` a fused multiply-add chain over `k ≡ l (mod 16)` (a short last chunk masked to
//!   zeros), then the lanes added pairwise: outputs in the whole groups of four at the front
//!   in the kernel's 4×4-transpose order `((l0+l1)+(l2+l3))` per 128-bit quarter, quarters
//!   `(q0+q1)+(q2+q3)`; the rest in `_mm512_reduce_add_ps`'s halving order (`l + 8`, `+ 4`,
//!   `+ 2`, `+ 1`).
//! - **f32, Panels** (OpenBLAS's GEMM driver, every other f32 product; on `HASWELL` kernels
//!   every f32 product): `K` cut into panels of at most the kernel set's depth (448 on
//!   `SKYLAKEX`, 320 on `COOPERLAKE` and `HASWELL`; a remainder below twice that is halved,
//!   rounding up), each
//!   panel a fused multiply-add chain from zero in `k` order, the panels added to the output in
//!   order. Each output of each token is its own chain, so a block of tokens sums every value
//!   exactly as that token alone would.
//! - **bf16/f16, Sequential** (MLX's `simd_gemm` with f32 accumulation): one f32 sum per
//!   output in `k` order; each product of two 16-bit floats is exact in f32, so a fused
//!   multiply-add gives the same bits as MLX's multiply-then-add. MLX rounds the sum to the
//!   weight's dtype, which the caller does with MLX's own cast. `simd_gemm` walks the output in
//!   16×16 tiles but each output's chain runs over `k` alone, so the order does not depend on
//!   the number of tokens: prompts of any length take it ([`takes_tokens`]), through a kernel
//!   that widens and transposes each sixteen weight rows once per call and then runs every
//!   token past them (MLX's own `simd_gemm` copies its tiles element by element, single
//!   threaded: SmolLM2 bf16 prefilled at ~35 tokens/s on it).
//!
//! Nothing here assumes the running library really sums that way: [`super::dense`] compares
//! each weight shape with MLX's own product before using it, so another BLAS, CPU or version
//! costs speed, never bits.

use super::pair;
use std::ops::Range;

/// Largest `M·N·K` OpenBLAS hands its small-matrix kernel.
const SMALL_MAX_MNK: f64 = 1e6;
/// Largest `M·N` (outputs × tokens) the small-matrix `TN` kernel takes.
const SMALL_MAX_OUTPUTS: usize = 1200;
/// Smallest depth the small-matrix `TN` kernel takes.
const SMALL_MIN_DEPTH: usize = 32;
/// Lanes of the small-matrix kernel's accumulators (one AVX-512 register).
const LANES: usize = 16;
/// Most tokens one host product takes in the f32 orders (a verify block of up to sixteen
/// tokens): longer f32 products stay on OpenBLAS, whose blocked GEMM is as fast as the host
/// kernels there.
pub const MAX_TOKENS: usize = LANES;
/// Tokens past which a 16-bit product packs its weights once per call ([`x86::packed_rows`])
/// instead of transposing them per eight tokens.
const PACKED_MIN_TOKENS: usize = MAX_TOKENS + 1;
/// Weights below which one thread does the whole product (a fork/join costs more).
const PARALLEL_MIN_WEIGHTS: usize = 1 << 16;
/// Chunks a product's rows are cut into for the two threads to claim one at a time.
const CHUNKS: usize = 8;

/// How MLX's CPU backend sums a single-token product.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Order {
    /// f32, OpenBLAS's small-matrix kernel: sixteen strided lanes, then a lane reduction.
    Lanes,
    /// f32, OpenBLAS's GEMM driver: sequential panels of these depths.
    Panels(Vec<usize>),
    /// bf16/f16, MLX's `simd_gemm`: one sequential f32 sum per output.
    Sequential,
}

/// The OpenBLAS kernel set whose f32 order MLX's matmul follows on this machine. OpenBLAS picks
/// one per CPU at start-up (`openblas_get_corename`); the set decides both whether small
/// products go to a small-matrix kernel and how deep the GEMM driver's panels are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F32Kernels {
    /// `SKYLAKEX` (AVX-512 Intel): small products on the small-matrix kernel
    /// ([`Order::Lanes`]), the rest in panels of 448.
    SkylakeX,
    /// `COOPERLAKE` (AVX-512 with bf16, Intel and AMD Zen 4 hosts): SkylakeX's small-matrix
    /// kernel, the rest in panels of 320 (measured against MLX on a Zen 4 host that OpenBLAS
    /// 0.3.21 reports as Cooperlake, with 8-token blocks of depth 576, 1001 and 1536).
    Cooperlake,
    /// `HASWELL` (AVX2; also what 0.3.21 picks on some AMD Zen 4 hosts): no small-matrix
    /// kernel, every product in panels of 320 (measured against MLX on a Zen 4 host,
    /// `tests/host_matvec.rs`).
    Haswell,
}

impl F32Kernels {
    /// The kernel set for an OpenBLAS core name. `Zen` runs OpenBLAS's Haswell kernels with the
    /// same depths (not measured here); any other name, or no OpenBLAS, is taken for SkylakeX.
    /// A wrong guess costs speed only: [`super::dense`] compares each shape with MLX first.
    pub fn of_core(core: Option<&str>) -> Self {
        match core {
            Some("Haswell" | "Zen") => F32Kernels::Haswell,
            Some("Cooperlake") => F32Kernels::Cooperlake,
            _ => F32Kernels::SkylakeX,
        }
    }

    /// The kernel set of the OpenBLAS this process runs (looked up once).
    pub fn here() -> Self {
        static HERE: std::sync::OnceLock<F32Kernels> = std::sync::OnceLock::new();
        *HERE.get_or_init(|| Self::of_core(crate::engine::runtime::blas_core().as_deref()))
    }

    /// The GEMM driver's single-precision panel depth (`SGEMM_DEFAULT_Q`).
    pub fn panel_depth(self) -> usize {
        match self {
            F32Kernels::SkylakeX => 448,
            F32Kernels::Cooperlake | F32Kernels::Haswell => 320,
        }
    }

    /// The order OpenBLAS uses for one f32 token through a `rows × cols` weight.
    pub fn order(self, rows: usize, cols: usize) -> Order {
        self.block_order(rows, cols, 1)
    }

    /// The order OpenBLAS uses for `tokens` f32 tokens through a `rows × cols` weight (the
    /// small-matrix kernel's limits count outputs times tokens).
    pub fn block_order(self, rows: usize, cols: usize, tokens: usize) -> Order {
        let outputs = rows * tokens;
        let mnk = outputs as f64 * cols as f64;
        let small = mnk <= SMALL_MAX_MNK && outputs <= SMALL_MAX_OUTPUTS && cols >= SMALL_MIN_DEPTH;
        if small && self != F32Kernels::Haswell {
            Order::Lanes
        } else {
            Order::Panels(panels(cols, self.panel_depth()))
        }
    }
}

/// A weight matrix (`rows × cols`, row-major) in one of the dtypes the kernels read.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    /// f32 (summed in [`Order::Lanes`] or [`Order::Panels`]).
    F32(&'a [f32]),
    /// bfloat16 bits (summed in [`Order::Sequential`]).
    Bf16(&'a [u16]),
    /// IEEE half bits (summed in [`Order::Sequential`]).
    F16(&'a [u16]),
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) | Weights::F16(w) => w.len(),
        }
    }

    /// The order MLX sums this dtype's `rows × cols` product of `tokens` tokens in.
    pub fn order(&self, rows: usize, cols: usize, tokens: usize) -> Order {
        match self {
            Weights::F32(_) => F32Kernels::here().block_order(rows, cols, tokens),
            Weights::Bf16(_) | Weights::F16(_) => Order::Sequential,
        }
    }
}

/// The GEMM driver's cut of `depth` into panels, as its threaded form makes it (the one a
/// single-token product deep enough to be cut at all runs on: M·N·K is then past OpenBLAS's
/// threading threshold). The single-threaded form rounds a halved remainder up to a multiple
/// of 16 instead, which differs for some depths; the load-time check catches that case.
pub fn panels(depth: usize, panel: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = depth;
    while left > 0 {
        let p = if left >= 2 * panel {
            panel
        } else if left > panel {
            left.div_ceil(2)
        } else {
            left
        };
        out.push(p);
        left -= p;
    }
    out
}

/// Whether a product of `tokens` tokens in `order` is one the host kernels reproduce: 1 to
/// [`MAX_TOKENS`] in the f32 orders, any positive number in MLX's 16-bit order.
pub fn takes_tokens(order: &Order, tokens: usize) -> bool {
    tokens >= 1 && (tokens <= MAX_TOKENS || *order == Order::Sequential)
}

/// Whether this CPU runs the kernels (written for AVX-512 with FMA, the CPUs whose OpenBLAS
/// kernels they mirror).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `y = x · Wᵀ` for one token in f32 (the 16-bit token widened exactly): [`matmul`] of one
/// token.
pub fn matvec(
    w: Weights<'_>,
    rows: usize,
    cols: usize,
    x: &[f32],
    order: &Order,
    threads: usize,
) -> Result<Vec<f32>, String> {
    matmul(w, rows, cols, x, 1, order, threads)
}

/// `Y = X · Wᵀ` for `tokens` tokens in f32: `w` is `rows × cols` row-major, `x` is
/// `tokens × cols` and the result `tokens × rows`, both row-major. With `threads` ≥ 2 the rows
/// are cut into chunks that this thread and the [`pair`] helper claim one at a time; the cut
/// never changes a bit (each output is summed alone). Errors when the CPU lacks the kernels,
/// the order does not fit the dtype, or the lengths disagree.
pub fn matmul(
    w: Weights<'_>,
    rows: usize,
    cols: usize,
    x: &[f32],
    tokens: usize,
    order: &Order,
    threads: usize,
) -> Result<Vec<f32>, String> {
    if !available() {
        return Err("this CPU has no AVX-512 and FMA for the host product".into());
    }
    if cols == 0 || !takes_tokens(order, tokens) {
        return Err(format!(
            "{tokens} tokens through a depth of {cols} in {order:?}: the host product takes depths of 1 or more and 1 to {MAX_TOKENS} tokens (any number in the 16-bit order)"
        ));
    }
    if w.len() != rows * cols || x.len() != tokens * cols {
        return Err(format!(
            "shape mismatch: {rows}x{cols} weight of {} values, input of {} for {tokens} tokens",
            w.len(),
            x.len()
        ));
    }
    let fits = matches!(
        (w, order),
        (Weights::F32(_), Order::Lanes | Order::Panels(_))
            | (Weights::Bf16(_) | Weights::F16(_), Order::Sequential)
    );
    if !fits {
        return Err(format!("{order:?} is not an order for {w:?}-typed weights"));
    }
    // Chunks of whole 16-row groups (the kernels' vector paths) shared with the helper thread
    // ([`pair::share`]); small products stay on this one.
    let chunk_rows = if threads < 2 || rows * cols < PARALLEL_MIN_WEIGHTS {
        rows
    } else {
        (rows.div_ceil(CHUNKS).div_ceil(LANES) * LANES).max(LANES)
    }
    .max(1);
    let mut y = vec![0.0f32; tokens * rows];
    if tokens == 1 {
        let parts: Vec<std::sync::Mutex<&mut [f32]>> = y
            .chunks_mut(chunk_rows)
            .map(std::sync::Mutex::new)
            .collect();
        pair::share(parts.len(), &|i| {
            let mut out = super::lock(&parts[i]);
            let start = i * chunk_rows;
            let end = start + out.len();
            rows_into(w, rows, cols, x, 1, order, start..end, &mut out);
        });
        return Ok(y);
    }
    // A block's chunk is `tokens × chunk` outputs, not contiguous in `y`: each is summed into
    // its own buffer and copied into place.
    let parts: Vec<std::sync::Mutex<Vec<f32>>> = (0..rows.div_ceil(chunk_rows))
        .map(|_| std::sync::Mutex::new(Vec::new()))
        .collect();
    pair::share(parts.len(), &|i| {
        let start = i * chunk_rows;
        let end = (start + chunk_rows).min(rows);
        let mut out = vec![0.0f32; tokens * (end - start)];
        rows_into(w, rows, cols, x, tokens, order, start..end, &mut out);
        *super::lock(&parts[i]) = out;
    });
    for (i, part) in parts.into_iter().enumerate() {
        let out = part.into_inner().unwrap_or_else(|p| p.into_inner());
        let start = i * chunk_rows;
        let len = out.len() / tokens;
        for (t, row) in out.chunks_exact(len).enumerate() {
            y[t * rows + start..t * rows + start + len].copy_from_slice(row);
        }
    }
    Ok(y)
}

/// Outputs `range` of the product of `tokens` tokens into `out` (`tokens × range.len()`,
/// checked by [`matmul`]).
#[allow(clippy::too_many_arguments)]
fn rows_into(
    w: Weights<'_>,
    rows: usize,
    cols: usize,
    x: &[f32],
    tokens: usize,
    order: &Order,
    range: Range<usize>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `matmul` checked `available()` and every length.
    unsafe {
        let whole = [cols];
        let panels: &[usize] = match order {
            Order::Panels(p) => p,
            _ => &whole,
        };
        match (w, order) {
            (Weights::F32(w), Order::Lanes) => {
                // The small-matrix kernel's shapes are small: each token runs alone over rows
                // still in cache from the token before.
                let len = range.len();
                let mut r = range.start;
                while r < range.end {
                    let end = (r + x86::LANE_ROWS).min(range.end);
                    for t in 0..tokens {
                        let xt = &x[t * cols..(t + 1) * cols];
                        let o = t * len + r - range.start;
                        x86::lanes(w, rows, cols, xt, r..end, &mut out[o..o + end - r]);
                    }
                    r = end;
                }
            }
            (Weights::F32(w), _) => {
                x86::token_panels(&x86::RowsF32(w), cols, x, tokens, panels, range, out)
            }
            (Weights::Bf16(w), _) if tokens >= PACKED_MIN_TOKENS => {
                x86::packed_rows(&x86::RowsBf16(w), cols, x, tokens, range, out)
            }
            (Weights::F16(w), _) if tokens >= PACKED_MIN_TOKENS => {
                x86::packed_rows(&x86::RowsF16(w), cols, x, tokens, range, out)
            }
            (Weights::Bf16(w), _) => {
                x86::token_panels(&x86::RowsBf16(w), cols, x, tokens, panels, range, out)
            }
            (Weights::F16(w), _) => {
                x86::token_panels(&x86::RowsF16(w), cols, x, tokens, panels, range, out)
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, rows, cols, x, tokens, order, range, out);
        unreachable!("matmul refuses CPUs without the kernels");
    }
}

/// Sums sixteen lane totals the way the small-matrix kernel's 4×4-transpose reduction does.
fn reduce_quads(a: &[f32; LANES]) -> f32 {
    let q = |i: usize| (a[4 * i] + a[4 * i + 1]) + (a[4 * i + 2] + a[4 * i + 3]);
    (q(0) + q(1)) + (q(2) + q(3))
}

/// Sums sixteen lane totals in `_mm512_reduce_add_ps`'s halving order.
fn reduce_halving(a: &[f32; LANES]) -> f32 {
    let mut v = *a;
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            v[i] += v[i + width];
        }
    }
    v[0]
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{reduce_halving, reduce_quads, LANES};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Rows the lane kernel sums together (independent chains that hide the FMA latency).
    const GROUP: usize = 8;
    /// Rows a block of tokens runs through the lane kernel one token after the other (their
    /// weights stay in the first-level cache between tokens).
    pub(super) const LANE_ROWS: usize = 2 * GROUP;

    /// The small-matrix kernel's order for outputs `range` (`rows` in all decide which outputs
    /// are in whole groups of four).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn lanes(
        w: &[f32],
        rows: usize,
        cols: usize,
        x: &[f32],
        range: Range<usize>,
        out: &mut [f32],
    ) {
        let quads_end = rows & !3;
        let full = cols / LANES * LANES;
        let tail = (cols - full) as u32;
        let mask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
        let xp = x.as_ptr();
        let mut r = range.start;
        while r < range.end {
            let n = GROUP.min(range.end - r);
            let mut acc = [_mm512_setzero_ps(); GROUP];
            let base = w.as_ptr().add(r * cols);
            let mut c = 0;
            let ahead = r + 2 * GROUP <= range.end;
            while c < full {
                if ahead {
                    // The next group's rows at the same offset (see `Rows::prefetch`).
                    for g in GROUP..2 * GROUP {
                        _mm_prefetch::<_MM_HINT_T0>(base.add(g * cols + c).cast());
                    }
                }
                let xv = _mm512_loadu_ps(xp.add(c));
                for (g, a) in acc.iter_mut().enumerate().take(n) {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(base.add(g * cols + c)), xv, *a);
                }
                c += LANES;
            }
            if tail > 0 {
                let xv = _mm512_maskz_loadu_ps(mask, xp.add(c));
                for (g, a) in acc.iter_mut().enumerate().take(n) {
                    let wv = _mm512_maskz_loadu_ps(mask, base.add(g * cols + c));
                    *a = _mm512_fmadd_ps(wv, xv, *a);
                }
            }
            for (g, a) in acc.iter().enumerate().take(n) {
                let mut lanes = [0.0f32; LANES];
                _mm512_storeu_ps(lanes.as_mut_ptr(), *a);
                let row = r + g;
                out[row - range.start] = if row < quads_end {
                    reduce_quads(&lanes)
                } else {
                    reduce_halving(&lanes)
                };
            }
            r += n;
        }
    }

    /// Row-major weights the chain kernel reads sixteen values (or one) at a time, widened to
    /// f32 exactly.
    pub(super) trait Rows {
        /// Values `k..k + 16` of row `r` (`cols` per row) as sixteen f32 lanes.
        unsafe fn load16(&self, r: usize, cols: usize, k: usize) -> __m512;
        /// Value `k` of row `r` as f32.
        unsafe fn get(&self, r: usize, cols: usize, k: usize) -> f32;
        /// Asks for the cache line holding value `k` of row `r` (the kernels read sixteen
        /// rows side by side, more streams than the hardware prefetcher follows).
        unsafe fn prefetch(&self, r: usize, cols: usize, k: usize);
    }

    /// f32 rows.
    pub(super) struct RowsF32<'a>(pub &'a [f32]);
    /// bfloat16 rows (bits).
    pub(super) struct RowsBf16<'a>(pub &'a [u16]);
    /// IEEE half rows (bits).
    pub(super) struct RowsF16<'a>(pub &'a [u16]);

    impl Rows for RowsF32<'_> {
        #[inline(always)]
        unsafe fn prefetch(&self, r: usize, cols: usize, k: usize) {
            _mm_prefetch::<_MM_HINT_T0>(self.0.as_ptr().add(r * cols + k).cast());
        }
        #[inline(always)]
        unsafe fn load16(&self, r: usize, cols: usize, k: usize) -> __m512 {
            _mm512_loadu_ps(self.0.as_ptr().add(r * cols + k))
        }
        #[inline(always)]
        unsafe fn get(&self, r: usize, cols: usize, k: usize) -> f32 {
            *self.0.get_unchecked(r * cols + k)
        }
    }

    impl Rows for RowsBf16<'_> {
        #[inline(always)]
        unsafe fn prefetch(&self, r: usize, cols: usize, k: usize) {
            _mm_prefetch::<_MM_HINT_T0>(self.0.as_ptr().add(r * cols + k).cast());
        }
        #[inline(always)]
        unsafe fn load16(&self, r: usize, cols: usize, k: usize) -> __m512 {
            let h = _mm256_loadu_si256(self.0.as_ptr().add(r * cols + k).cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        #[inline(always)]
        unsafe fn get(&self, r: usize, cols: usize, k: usize) -> f32 {
            f32::from_bits(u32::from(*self.0.get_unchecked(r * cols + k)) << 16)
        }
    }

    impl Rows for RowsF16<'_> {
        #[inline(always)]
        unsafe fn prefetch(&self, r: usize, cols: usize, k: usize) {
            _mm_prefetch::<_MM_HINT_T0>(self.0.as_ptr().add(r * cols + k).cast());
        }
        #[inline(always)]
        unsafe fn load16(&self, r: usize, cols: usize, k: usize) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(self.0.as_ptr().add(r * cols + k).cast()))
        }
        #[inline(always)]
        unsafe fn get(&self, r: usize, cols: usize, k: usize) -> f32 {
            half::f16::from_bits(*self.0.get_unchecked(r * cols + k)).to_f32()
        }
    }

    /// Per panel one FMA chain per output and token in `k` order, the panels added in order
    /// (OpenBLAS's GEMM driver for f32; one panel of the whole depth is MLX's `simd_gemm` for
    /// 16-bit weights). Sixteen outputs run side by side: a 16×16 block of weights transposed in
    /// registers gives, for each `k`, the sixteen outputs' weights as one vector, which then
    /// meets up to eight tokens (one broadcast value each) before the next block is read, so
    /// the weights are read and transposed once per eight tokens. Outputs past the last whole
    /// group of sixteen, and depths past the last whole block, are done one value at a time in
    /// the same order. `out` (`tokens × range.len()`) must start at zero: each panel's sums are
    /// added to it.
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    pub(super) unsafe fn token_panels<R: Rows>(
        w: &R,
        cols: usize,
        x: &[f32],
        tokens: usize,
        panels: &[usize],
        range: Range<usize>,
        out: &mut [f32],
    ) {
        let mut t0 = 0;
        while t0 < tokens {
            let n = (tokens - t0).min(TOKEN_BLOCK);
            let at = TokenBlock {
                x: &x[t0 * cols..(t0 + n) * cols],
                out: &mut out[t0 * range.len()..(t0 + n) * range.len()],
            };
            match n {
                1 => token_block::<R, 1>(w, cols, at, panels, range.clone()),
                2 => token_block::<R, 2>(w, cols, at, panels, range.clone()),
                3 => token_block::<R, 3>(w, cols, at, panels, range.clone()),
                4 => token_block::<R, 4>(w, cols, at, panels, range.clone()),
                5 => token_block::<R, 5>(w, cols, at, panels, range.clone()),
                6 => token_block::<R, 6>(w, cols, at, panels, range.clone()),
                7 => token_block::<R, 7>(w, cols, at, panels, range.clone()),
                _ => token_block::<R, 8>(w, cols, at, panels, range.clone()),
            }
            t0 += n;
        }
    }

    /// Tokens [`token_panels`] takes through one pass over the weights (their accumulators and
    /// a transposed block fill the 32 vector registers with room to spare).
    const TOKEN_BLOCK: usize = 8;

    /// Up to [`TOKEN_BLOCK`] tokens (`x`, `N × cols`) and their outputs (`N × range.len()`).
    struct TokenBlock<'a> {
        x: &'a [f32],
        out: &'a mut [f32],
    }

    /// [`token_panels`] for exactly `N` tokens.
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    unsafe fn token_block<R: Rows, const N: usize>(
        w: &R,
        cols: usize,
        at: TokenBlock<'_>,
        panels: &[usize],
        range: Range<usize>,
    ) {
        let len = range.len();
        let (x, out) = (at.x.as_ptr(), at.out.as_mut_ptr());
        let mut r = range.start;
        while r + LANES <= range.end {
            let o = r - range.start;
            let mut k0 = 0;
            for &depth in panels {
                let mut acc = [_mm512_setzero_ps(); N];
                let mut k = k0;
                while k + LANES <= k0 + depth {
                    if r + 2 * LANES <= range.end {
                        for g in 0..LANES {
                            w.prefetch(r + LANES + g, cols, k);
                        }
                    }
                    let rows: [__m512; LANES] = std::array::from_fn(|g| w.load16(r + g, cols, k));
                    for (j, c) in transpose16(rows).iter().enumerate() {
                        for (t, a) in acc.iter_mut().enumerate() {
                            let xv = _mm512_set1_ps(*x.add(t * cols + k + j));
                            *a = _mm512_fmadd_ps(*c, xv, *a);
                        }
                    }
                    k += LANES;
                }
                while k < k0 + depth {
                    let col: [f32; LANES] = std::array::from_fn(|g| w.get(r + g, cols, k));
                    let c = _mm512_loadu_ps(col.as_ptr());
                    for (t, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(c, _mm512_set1_ps(*x.add(t * cols + k)), *a);
                    }
                    k += 1;
                }
                for (t, a) in acc.iter().enumerate() {
                    let dst = out.add(t * len + o);
                    _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), *a));
                }
                k0 += depth;
            }
            r += LANES;
        }
        while r < range.end {
            for t in 0..N {
                let mut total = 0.0f32;
                let mut k0 = 0;
                for &depth in panels {
                    let mut acc = 0.0f32;
                    for k in k0..k0 + depth {
                        acc = w.get(r, cols, k).mul_add(*x.add(t * cols + k), acc);
                    }
                    total += acc;
                    k0 += depth;
                }
                *out.add(t * len + r - range.start) = total;
            }
            r += 1;
        }
    }

    /// Tokens [`packed_rows`] runs past a packed group of rows at once (one accumulator each,
    /// plus the weight vector: half the vector registers).
    const PACKED_TOKENS: usize = 14;

    /// One f32 chain per output and token over the whole depth in `k` order (MLX's 16-bit
    /// order) for many tokens: each group of sixteen rows is widened and transposed once into a
    /// `cols × 16` buffer (one vector per `k`, in the second-level cache), which every token
    /// then reads [`PACKED_TOKENS`] at a time. Rows past the last whole group of sixteen are
    /// done one value at a time in the same order. Writes every output of `out`
    /// (`tokens × range.len()`).
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    pub(super) unsafe fn packed_rows<R: Rows>(
        w: &R,
        cols: usize,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) {
        let len = range.len();
        let mut packed = vec![0.0f32; cols * LANES];
        let mut r = range.start;
        while r + LANES <= range.end {
            pack_rows(w, cols, r, &mut packed);
            let mut t0 = 0;
            while t0 < tokens {
                let n = (tokens - t0).min(PACKED_TOKENS);
                let block = PackedBlock {
                    packed: &packed,
                    cols,
                    x: &x[t0 * cols..(t0 + n) * cols],
                    out: &mut out[t0 * len..(t0 + n) * len],
                    len,
                    at: r - range.start,
                };
                match n {
                    PACKED_TOKENS => packed_block::<PACKED_TOKENS>(block),
                    1 => packed_block::<1>(block),
                    2 => packed_block::<2>(block),
                    3 => packed_block::<3>(block),
                    4 => packed_block::<4>(block),
                    5 => packed_block::<5>(block),
                    6 => packed_block::<6>(block),
                    7 => packed_block::<7>(block),
                    8 => packed_block::<8>(block),
                    9 => packed_block::<9>(block),
                    10 => packed_block::<10>(block),
                    11 => packed_block::<11>(block),
                    12 => packed_block::<12>(block),
                    _ => packed_block::<13>(block),
                }
                t0 += n;
            }
            r += LANES;
        }
        for r in r..range.end {
            for t in 0..tokens {
                let xt = &x[t * cols..(t + 1) * cols];
                let mut acc = 0.0f32;
                for (k, xk) in xt.iter().enumerate() {
                    acc = w.get(r, cols, k).mul_add(*xk, acc);
                }
                out[t * len + r - range.start] = acc;
            }
        }
    }

    /// Rows `r..r + 16` widened to f32 and transposed into `packed` (`cols × 16`: the sixteen
    /// rows' value `k` side by side at `16 k`).
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    unsafe fn pack_rows<R: Rows>(w: &R, cols: usize, r: usize, packed: &mut [f32]) {
        let dst = packed.as_mut_ptr();
        let mut k = 0;
        while k + LANES <= cols {
            let rows: [__m512; LANES] = std::array::from_fn(|g| w.load16(r + g, cols, k));
            for (j, c) in transpose16(rows).iter().enumerate() {
                _mm512_storeu_ps(dst.add((k + j) * LANES), *c);
            }
            k += LANES;
        }
        for k in k..cols {
            for g in 0..LANES {
                *dst.add(k * LANES + g) = w.get(r + g, cols, k);
            }
        }
    }

    /// Up to [`PACKED_TOKENS`] tokens (`x`, `N × cols`) past one packed group of sixteen rows;
    /// their outputs go to columns `at..at + 16` of `out` (`N` rows of `len`).
    struct PackedBlock<'a> {
        packed: &'a [f32],
        cols: usize,
        x: &'a [f32],
        out: &'a mut [f32],
        len: usize,
        at: usize,
    }

    /// [`packed_rows`] for exactly `N` tokens.
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    unsafe fn packed_block<const N: usize>(b: PackedBlock<'_>) {
        let (p, x, cols) = (b.packed.as_ptr(), b.x.as_ptr(), b.cols);
        let mut acc = [_mm512_setzero_ps(); N];
        for k in 0..cols {
            let wv = _mm512_loadu_ps(p.add(k * LANES));
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(wv, _mm512_set1_ps(*x.add(t * cols + k)), *a);
            }
        }
        for (t, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(b.out.as_mut_ptr().add(t * b.len + b.at), *a);
        }
    }

    /// Sixteen rows of sixteen values, returned as sixteen columns: element `g` of column `j`
    /// is row `g`'s value `j`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    unsafe fn transpose16(r: [__m512; LANES]) -> [__m512; LANES] {
        // 32-bit interleave of row pairs, then 64-bit interleave of pair pairs: `u[4q + e]`
        // holds, per 128-bit lane L, value 4L + e of rows 4q..4q + 4.
        let mut u = [_mm512_setzero_ps(); LANES];
        for q in 0..4 {
            let (a, b, c, d) = (r[4 * q], r[4 * q + 1], r[4 * q + 2], r[4 * q + 3]);
            let t0 = _mm512_castps_pd(_mm512_unpacklo_ps(a, b));
            let t1 = _mm512_castps_pd(_mm512_unpackhi_ps(a, b));
            let t2 = _mm512_castps_pd(_mm512_unpacklo_ps(c, d));
            let t3 = _mm512_castps_pd(_mm512_unpackhi_ps(c, d));
            u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
            u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
            u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
            u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
        }
        // Gather lane L of the four row quads into column 4L + e.
        let mut c = [_mm512_setzero_ps(); LANES];
        for e in 0..4 {
            let even_lo = _mm512_shuffle_f32x4::<0x88>(u[e], u[4 + e]);
            let odd_lo = _mm512_shuffle_f32x4::<0xDD>(u[e], u[4 + e]);
            let even_hi = _mm512_shuffle_f32x4::<0x88>(u[8 + e], u[12 + e]);
            let odd_hi = _mm512_shuffle_f32x4::<0xDD>(u[8 + e], u[12 + e]);
            c[e] = _mm512_shuffle_f32x4::<0x88>(even_lo, even_hi);
            c[8 + e] = _mm512_shuffle_f32x4::<0xDD>(even_lo, even_hi);
            c[4 + e] = _mm512_shuffle_f32x4::<0x88>(odd_lo, odd_hi);
            c[12 + e] = _mm512_shuffle_f32x4::<0xDD>(odd_lo, odd_hi);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_follow_the_gemm_driver() {
        assert_eq!(panels(576, 448), vec![288, 288]);
        assert_eq!(panels(1536, 448), vec![448, 448, 320, 320]);
        assert_eq!(panels(1000, 448), vec![448, 276, 276]);
        assert_eq!(panels(448, 448), vec![448]);
        assert_eq!(panels(10, 448), vec![10]);
        assert_eq!(panels(3000, 448).iter().sum::<usize>(), 3000);
        assert_eq!(panels(1536, 320), vec![320, 320, 320, 288, 288]);
        assert_eq!(panels(576, 320), vec![288, 288]);
    }

    #[test]
    fn small_f32_products_take_the_lane_order_on_avx512_kernel_sets_only() {
        let sk = F32Kernels::SkylakeX;
        assert_eq!(sk.order(576, 576), Order::Lanes);
        assert_eq!(sk.order(192, 576), Order::Lanes);
        assert_eq!(sk.order(1536, 576), Order::Panels(vec![288, 288]));
        assert_eq!(sk.order(576, 16), Order::Panels(vec![16]));
        assert_eq!(sk.order(1200, 833), Order::Lanes);
        assert_eq!(sk.order(1200, 834), Order::Panels(vec![417, 417]));
        let hw = F32Kernels::Haswell;
        assert_eq!(hw.order(576, 576), Order::Panels(vec![288, 288]));
        assert_eq!(
            hw.order(576, 1536),
            Order::Panels(vec![320, 320, 320, 288, 288])
        );
        assert_eq!(hw.order(7, 40), Order::Panels(vec![40]));
        let cl = F32Kernels::Cooperlake;
        assert_eq!(cl.order(576, 1536), Order::Lanes);
        assert_eq!(
            cl.block_order(576, 1536, 8),
            Order::Panels(vec![320, 320, 320, 288, 288])
        );
        assert_eq!(
            cl.block_order(576, 1001, 8),
            Order::Panels(vec![320, 320, 181, 180])
        );
    }

    #[test]
    fn core_names_pick_their_kernel_sets() {
        assert_eq!(F32Kernels::of_core(Some("Haswell")), F32Kernels::Haswell);
        assert_eq!(F32Kernels::of_core(Some("Zen")), F32Kernels::Haswell);
        assert_eq!(F32Kernels::of_core(Some("SkylakeX")), F32Kernels::SkylakeX);
        assert_eq!(
            F32Kernels::of_core(Some("Cooperlake")),
            F32Kernels::Cooperlake
        );
        assert_eq!(F32Kernels::of_core(None), F32Kernels::SkylakeX);
    }

    #[test]
    fn the_two_lane_reductions_differ_where_openblas_does() {
        // Lane 0 holds 1, lanes 4 and 12 hold half an ulp of 1 each. Halving pairs lane 4
        // with lane 12 first (one whole ulp, which survives); the quad order adds each half
        // ulp to 1 on its own (ties to even: lost both times).
        let half_ulp = f32::EPSILON / 2.0;
        let mut a = [0.0f32; LANES];
        a[0] = 1.0;
        a[4] = half_ulp;
        a[12] = half_ulp;
        assert_eq!(reduce_halving(&a), 1.0 + f32::EPSILON);
        assert_eq!(reduce_quads(&a), 1.0);
        // Lanes 1 and 3 meet inside their quad first in the quad order.
        let mut b = [0.0f32; LANES];
        b[8] = 1.0;
        b[1] = half_ulp;
        b[3] = half_ulp;
        assert_eq!(reduce_quads(&b), 1.0 + f32::EPSILON);
    }

    /// [`matvec`]'s product where this CPU runs the kernels. Where it does not (no
    /// AVX-512/FMA: AVX2-only x86, other architectures) the call must be refused rather than
    /// run instructions the CPU lacks: that refusal is checked and `None` returned.
    fn product(
        w: Weights<'_>,
        rows: usize,
        cols: usize,
        x: &[f32],
        order: &Order,
        threads: usize,
    ) -> Option<Vec<f32>> {
        let y = matvec(w, rows, cols, x, order, threads);
        if available() {
            return Some(y.unwrap());
        }
        let err = y.unwrap_err();
        assert!(err.contains("AVX-512"), "{order:?}: {err}");
        None
    }

    fn case(rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
        // Multiples of 1/64 in [-50/64, 50/64]: exact in f32, bf16 and f16 alike.
        let w = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let x = (0..cols)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0)
            .collect();
        (w, x)
    }

    /// A plain float64 product, for a loose sanity bound on the f32 orders (the bit-exact
    /// check against MLX lives with the MLX-facing code in `dense` and `tests/host_matvec.rs`).
    #[test]
    fn f32_orders_are_close_to_a_float64_product() {
        for (rows, cols) in [(7, 40), (37, 100), (64, 576), (1500, 960)] {
            let (w, x) = case(rows, cols);
            for ord in [
                Order::Lanes,
                Order::Panels(panels(cols, F32Kernels::SkylakeX.panel_depth())),
                Order::Panels(panels(cols, F32Kernels::Haswell.panel_depth())),
            ] {
                for threads in [1, 2, 3] {
                    let Some(y) = product(Weights::F32(&w), rows, cols, &x, &ord, threads) else {
                        continue;
                    };
                    for (r, v) in y.iter().enumerate() {
                        let want: f64 = (0..cols)
                            .map(|c| w[r * cols + c] as f64 * x[c] as f64)
                            .sum();
                        assert!((*v as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()));
                    }
                }
            }
        }
    }

    /// 16-bit weights: every output equals a scalar left-to-right f32 sum, bit for bit.
    #[test]
    fn sixteen_bit_weights_sum_left_to_right() {
        for (rows, cols) in [(7, 40), (37, 100), (64, 576), (301, 1001)] {
            let (w, x) = case(rows, cols);
            let bf: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            let hf: Vec<u16> = w
                .iter()
                .map(|v| half::f16::from_f32(*v).to_bits())
                .collect();
            for (name, weights) in [("bf16", Weights::Bf16(&bf)), ("f16", Weights::F16(&hf))] {
                let Some(y) = product(weights, rows, cols, &x, &Order::Sequential, 2) else {
                    continue;
                };
                for (r, v) in y.iter().enumerate() {
                    let mut want = 0.0f32;
                    for c in 0..cols {
                        want += w[r * cols + c] * x[c];
                    }
                    assert_eq!(v.to_bits(), want.to_bits(), "{name} row {r}");
                }
            }
        }
        let f = [0.0f32; 4];
        assert!(matvec(Weights::F32(&f), 2, 2, &f[..2], &Order::Sequential, 1).is_err());
    }

    /// Prompt-sized 16-bit products (the packed kernel, any token count): every output of
    /// every token equals a scalar left-to-right f32 sum of exact products, bit for bit, with
    /// values whose sums round (unlike [`case`]'s); f32 orders refuse them.
    #[test]
    fn long_sixteen_bit_products_sum_left_to_right_for_every_token() {
        let mut seed = 0x2545_f491_u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            // A bf16 value of either sign in [0.25, 4): sign bit, one of four exponents, seven
            // mantissa bits (exact in f32; a product of two of them is too).
            let sign = (seed & 1) << 31;
            let exponent = (125 + (seed >> 1) % 4) << 23;
            let mantissa = ((seed >> 8) & 0x7f) << 16;
            f32::from_bits(sign | exponent | mantissa)
        };
        let (rows, cols) = (37, 100);
        let w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
        let bf: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let wide: Vec<f32> = bf
            .iter()
            .map(|b| f32::from_bits(u32::from(*b) << 16))
            .collect();
        for tokens in [17, 35, 100] {
            let x: Vec<f32> = (0..tokens * cols).map(|_| next()).collect();
            if !available() {
                continue;
            }
            let y = matmul(
                Weights::Bf16(&bf),
                rows,
                cols,
                &x,
                tokens,
                &Order::Sequential,
                2,
            )
            .unwrap();
            for t in 0..tokens {
                for r in 0..rows {
                    let mut want = 0.0f32;
                    for c in 0..cols {
                        want += wide[r * cols + c] * x[t * cols + c];
                    }
                    let got = y[t * rows + r];
                    assert_eq!(got.to_bits(), want.to_bits(), "x{tokens} token {t} row {r}");
                }
            }
            let f32_order = Order::Panels(vec![cols]);
            assert!(matmul(Weights::F32(&w), rows, cols, &x, tokens, &f32_order, 1).is_err());
        }
    }
}
