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
//!   threaded: SmolLM2 bf16 prefilled at ~35 tokens/s on it); a weight the host step has
//!   packed at load is read from that copy instead ([`super::packed`]).
//!
//! The kernels run on AVX-512 or AVX2 ([`Simd`]): each output's chain is the same at either
//! width. Nothing here assumes the running library really sums that way: [`super::dense`]
//! compares each weight shape with MLX's own product before using it, so another BLAS, CPU or
//! version costs speed, never bits.

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
pub(super) const PARALLEL_MIN_WEIGHTS: usize = 1 << 16;
/// Chunks a product's rows are cut into for the two threads to claim one at a time.
pub(super) const CHUNKS: usize = 8;

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
    driver_panels(depth, panel, Halving::Threaded)
}

/// How OpenBLAS's GEMM driver halves a remainder deeper than one panel but not two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Halving {
    /// Its threaded form: half, rounded up.
    Threaded,
    /// Its single-threaded form: half, rounded up to a multiple of the kernel's `UNROLL_M`.
    SingleThread {
        /// The kernel set's `GEMM_UNROLL_M`.
        unroll: usize,
    },
}

/// The GEMM driver's cut of `depth` into panels of up to `panel`, a remainder between one and
/// two panels halved as `halving` says.
pub fn driver_panels(depth: usize, panel: usize, halving: Halving) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = depth;
    while left > 0 {
        let p = if left >= 2 * panel {
            panel
        } else if left > panel {
            match halving {
                Halving::Threaded => left.div_ceil(2),
                Halving::SingleThread { unroll } => (left / 2).div_ceil(unroll) * unroll,
            }
        } else {
            left
        };
        out.push(p);
        left -= p;
    }
    out
}

/// Whether a product of `tokens` tokens in `order` is one the host kernels reproduce on this
/// CPU: 1 to [`MAX_TOKENS`] in the f32 orders, any positive number in MLX's 16-bit order; the
/// small-matrix kernel's order only with AVX-512.
pub fn takes_tokens(order: &Order, tokens: usize) -> bool {
    takes_tokens_on(simd(), order, tokens)
}

fn takes_tokens_on(simd: Option<Simd>, order: &Order, tokens: usize) -> bool {
    let lanes_ok = *order != Order::Lanes || simd == Some(Simd::Avx512);
    simd.is_some()
        && lanes_ok
        && tokens >= 1
        && (tokens <= MAX_TOKENS || *order == Order::Sequential)
}

/// The instruction set the host products run on. Every order but [`Order::Lanes`] is one chain
/// per output, so the vector width changes speed, never bits; the small-matrix kernel's lane
/// order is AVX-512's own (OpenBLAS picks those kernels on AVX-512 CPUs only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    /// Sixteen outputs per vector (AVX-512F/BW with FMA and F16C).
    Avx512,
    /// Eight outputs per vector (AVX2 with FMA and F16C).
    Avx2,
}

impl Simd {
    /// The fastest set this CPU runs.
    fn fastest() -> Option<Simd> {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if !(has!("f16c") && has!("fma")) {
                return None;
            }
            if has!("avx512f") && has!("avx512bw") {
                return Some(Simd::Avx512);
            }
            if has!("avx2") {
                return Some(Simd::Avx2);
            }
        }
        None
    }

    /// Whether this CPU runs the set.
    pub fn runs_here(self) -> bool {
        matches!(
            (self, Simd::fastest()),
            (_, Some(Simd::Avx512)) | (Simd::Avx2, Some(Simd::Avx2))
        )
    }
}

/// The set the host products run on: the fastest this CPU has, or the narrower one
/// `MLXB_DENSE_KERNEL=avx2` asks for (to run the AVX2 path on an AVX-512 machine); `None`
/// where the CPU has neither (products stay on MLX).
pub fn simd() -> Option<Simd> {
    static CHOSEN: std::sync::OnceLock<Option<Simd>> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let fastest = Simd::fastest();
        match std::env::var("MLXB_DENSE_KERNEL").as_deref() {
            Err(_) => fastest,
            Ok("avx512") if Simd::Avx512.runs_here() => Some(Simd::Avx512),
            Ok("avx2") if Simd::Avx2.runs_here() => Some(Simd::Avx2),
            Ok(asked) => {
                eprintln!(
                    "mlxb: MLXB_DENSE_KERNEL={asked:?} is not a path this CPU runs (avx512 or avx2); using {fastest:?}"
                );
                fastest
            }
        }
    })
}

/// Whether this CPU runs the host products (AVX2 or AVX-512, with FMA and F16C).
pub fn available() -> bool {
    simd().is_some()
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
    matmul_on(simd(), w, rows, cols, x, tokens, order, threads)
}

/// [`matmul`] on the instruction set `simd` (the tests run every set this CPU has).
#[allow(clippy::too_many_arguments)]
fn matmul_on(
    simd: Option<Simd>,
    w: Weights<'_>,
    rows: usize,
    cols: usize,
    x: &[f32],
    tokens: usize,
    order: &Order,
    threads: usize,
) -> Result<Vec<f32>, String> {
    let Some(simd) = simd.filter(|s| s.runs_here()) else {
        return Err(
            "this CPU has neither AVX-512 nor AVX2 (with FMA and F16C) for the host product".into(),
        );
    };
    if cols == 0 || !takes_tokens_on(Some(simd), order, tokens) {
        return Err(format!(
            "{tokens} tokens through a depth of {cols} in {order:?} on {simd:?}: the host product takes depths of 1 or more and 1 to {MAX_TOKENS} tokens (any number in the 16-bit order), the small-matrix order on AVX-512 only"
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
            rows_into(simd, w, rows, cols, x, 1, order, start..end, &mut out);
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
        rows_into(simd, w, rows, cols, x, tokens, order, start..end, &mut out);
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
    simd: Simd,
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
    // SAFETY: `matmul_on` checked that the CPU runs `simd` (and AVX-512 for the lane order)
    // and every length.
    unsafe {
        let whole = [cols];
        let panels: &[usize] = match order {
            Order::Panels(p) => p,
            _ => &whole,
        };
        let packed = tokens >= PACKED_MIN_TOKENS;
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
                        let quads_end = quad_reduced_rows(rows, t, tokens);
                        x86::lanes(w, quads_end, cols, xt, r..end, &mut out[o..o + end - r]);
                    }
                    r = end;
                }
            }
            (Weights::F32(w), _) => {
                x86::token_panels_on(simd, &x86::RowsF32(w), cols, x, tokens, panels, range, out)
            }
            (Weights::Bf16(w), _) if packed => {
                x86::packed_rows_on(simd, &x86::RowsBf16(w), cols, x, tokens, range, out)
            }
            (Weights::F16(w), _) if packed => {
                x86::packed_rows_on(simd, &x86::RowsF16(w), cols, x, tokens, range, out)
            }
            (Weights::Bf16(w), _) => {
                x86::token_panels_on(simd, &x86::RowsBf16(w), cols, x, tokens, panels, range, out)
            }
            (Weights::F16(w), _) => {
                x86::token_panels_on(simd, &x86::RowsF16(w), cols, x, tokens, panels, range, out)
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (simd, w, rows, cols, x, tokens, order, range, out);
        unreachable!("matmul refuses CPUs without the kernels");
    }
}

/// The instruction set an f32 product of `tokens` tokens at depth `cols` in `order` runs on here,
/// or why none does.
fn f32_simd(order: &Order, tokens: usize, cols: usize) -> Result<Simd, String> {
    let Some(simd) = simd().filter(|s| s.runs_here()) else {
        return Err("this CPU has neither AVX-512 nor AVX2 for the host product".into());
    };
    if cols == 0 || !takes_tokens_on(Some(simd), order, tokens) || *order == Order::Sequential {
        return Err(format!("{tokens} f32 tokens in {order:?} on {simd:?}"));
    }
    Ok(simd)
}

/// Outputs `range` of a block of tokens' product `x · Wᵀ` (`x`: `tokens × cols`, f32 or 16-bit
/// values widened) in `order` into `out` (token-major, `tokens × range.len()`), on this thread:
/// what the host decode step ([`super::step`]) runs per share of rows for a decode token or a
/// speculative verify block, each weight read once per few tokens. Errors when the CPU lacks
/// the kernels for `order` or the lengths disagree.
#[allow(clippy::too_many_arguments)]
pub fn block_rows(
    w: Weights<'_>,
    rows: usize,
    cols: usize,
    x: &[f32],
    tokens: usize,
    order: &Order,
    range: Range<usize>,
    out: &mut [f32],
) -> Result<(), String> {
    let simd = match w {
        Weights::F32(_) => f32_simd(order, tokens, cols)?,
        Weights::Bf16(_) | Weights::F16(_) => match simd() {
            Some(simd)
                if *order == Order::Sequential && takes_tokens_on(Some(simd), order, tokens) =>
            {
                simd
            }
            _ => {
                return Err(format!(
                    "no host kernel for {tokens} 16-bit tokens in {order:?}"
                ))
            }
        },
    };
    if w.len() != rows * cols
        || range.end > rows
        || x.len() != tokens * cols
        || out.len() != tokens * range.len()
    {
        return Err(format!(
            "rows {range:?} of {rows}x{cols} ({} values), input {} for {tokens} tokens, output {}",
            w.len(),
            x.len(),
            out.len()
        ));
    }
    // The panel kernel adds each panel's sum to the output.
    out.fill(0.0);
    rows_into(simd, w, rows, cols, x, tokens, order, range, out);
    Ok(())
}

/// Outputs `range` of one f32 token's product `x · Wᵀ` in `order` into `out` (`range.len()`
/// values), on this thread, where `w` holds the rows of a product `rows` outputs wide that start
/// at output `first`, and the token is `token` of a block of `tokens` (the small-matrix order
/// reduces an output by where it sits in the whole product, see [`quad_reduced_rows`]). What
/// the host decode step ([`super::step`]) and its attention run per share of rows: an
/// attention's keys lie in two buffers (the cache and the step's new ones) yet are one product.
/// Errors when the CPU lacks the kernels for `order` or the lengths disagree.
#[allow(clippy::too_many_arguments)]
pub fn token_rows(
    w: &[f32],
    first: usize,
    rows: usize,
    cols: usize,
    x: &[f32],
    (token, tokens): (usize, usize),
    order: &Order,
    range: Range<usize>,
    out: &mut [f32],
) -> Result<(), String> {
    let simd = f32_simd(order, 1, cols)?;
    if range.end * cols > w.len()
        || x.len() != cols
        || out.len() != range.len()
        || first + range.end > rows
        || token >= tokens
    {
        return Err(format!(
            "rows {range:?} (from {first} of {rows}) of {} values at depth {cols}, input {}, output {}",
            w.len(),
            x.len(),
            out.len()
        ));
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: checked just above: the CPU runs `simd` (AVX-512 for the lane order) and every
    // length fits.
    unsafe {
        match order {
            Order::Lanes => {
                let quads_end = quad_reduced_rows(rows, token, tokens).saturating_sub(first);
                x86::lanes(w, quads_end, cols, x, range, out);
            }
            Order::Panels(panels) => {
                // The panel kernel adds each panel's sum to the output.
                out.fill(0.0);
                x86::token_panels_on(simd, &x86::RowsF32(w), cols, x, 1, panels, range, out)
            }
            Order::Sequential => unreachable!("refused above"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (
            w, first, rows, cols, x, token, tokens, order, range, out, simd,
        );
        unreachable!("no kernels off x86_64");
    }
    Ok(())
}

/// The outputs before which the small-matrix `TN` kernel sums token `token` of a block of
/// `tokens` with its 4×4-transpose reduction ([`reduce_quads`]); the rest take
/// `_mm512_reduce_add_ps`'s ([`reduce_halving`]). The kernel walks outputs and tokens in groups
/// of four: a group of four outputs is transposed and reduced together whatever the tokens, and
/// the outputs left over past the last such group are reduced with the same transpose when
/// their token lies in a group of four tokens, alone otherwise.
fn quad_reduced_rows(rows: usize, token: usize, tokens: usize) -> usize {
    if token < tokens & !3 {
        usize::MAX
    } else {
        rows & !3
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
pub(super) mod x86 {
    use super::{reduce_halving, reduce_quads, Simd, LANES};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Rows the lane kernel sums together (independent chains that hide the FMA latency).
    const GROUP: usize = 8;
    /// Rows a block of tokens runs through the lane kernel one token after the other (their
    /// weights stay in the first-level cache between tokens).
    pub(super) const LANE_ROWS: usize = 2 * GROUP;

    /// The small-matrix kernel's order for outputs `range` (rows of `w` before `quads_end`, the
    /// product's whole groups of four, take the 4×4-transpose reduction).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn lanes(
        w: &[f32],
        quads_end: usize,
        cols: usize,
        x: &[f32],
        range: Range<usize>,
        out: &mut [f32],
    ) {
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

    /// A vector of f32 lanes the chain kernels run on: sixteen (AVX-512) or eight (AVX2). Each
    /// output's chain is the same whatever the width, so both give the same bits.
    pub(in crate::engine::kernels) trait Lane: Copy {
        /// Lanes per vector (outputs summed side by side).
        const N: usize;
        /// Tokens [`token_panels`] runs past one transposed block of weights (their
        /// accumulators, the block and a broadcast must fit the vector registers).
        const TOKEN_BLOCK: usize;
        /// Tokens [`packed_rows`] runs past a packed group of rows at once (one accumulator
        /// each, plus the weight vector and a broadcast).
        const PACKED_TOKENS: usize;
        unsafe fn zero() -> Self;
        unsafe fn splat(v: f32) -> Self;
        /// `a · b + c`, rounded once.
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
        unsafe fn add(a: Self, b: Self) -> Self;
        /// The lanes' sum, in an order fixed per width (for products whose bits match
        /// nothing, [`super::super::any_order`]).
        unsafe fn sum(self) -> f32;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn store(p: *mut f32, v: Self);
        /// `N` bfloat16 values widened exactly.
        unsafe fn load_bf16(p: *const u16) -> Self;
        /// `N` IEEE half values widened exactly.
        unsafe fn load_f16(p: *const u16) -> Self;
        /// `N` 32-bit words, each two bfloat16 values: the low halves and the high halves,
        /// widened exactly ([`super::super::packed`]'s layout).
        unsafe fn load_pair(p: *const u32) -> (Self, Self);
        /// The first `N` entries are `N` rows of `N` values; returns them as columns (element
        /// `g` of column `j` is row `g`'s value `j`) in the first `N` entries.
        unsafe fn transpose(rows: [Self; LANES]) -> [Self; LANES];
    }

    impl Lane for __m512 {
        const N: usize = 16;
        const TOKEN_BLOCK: usize = 8;
        const PACKED_TOKENS: usize = 14;
        #[inline(always)]
        unsafe fn zero() -> Self {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> Self {
            _mm512_set1_ps(v)
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            _mm512_reduce_add_ps(self)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: Self) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> Self {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> Self {
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
        }
        #[inline(always)]
        unsafe fn load_pair(p: *const u32) -> (Self, Self) {
            let v = _mm512_loadu_si512(p.cast());
            let low = _mm512_slli_epi32::<16>(v);
            let high = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
            (_mm512_castsi512_ps(low), _mm512_castsi512_ps(high))
        }
        #[inline(always)]
        unsafe fn transpose(r: [Self; LANES]) -> [Self; LANES] {
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

    impl Lane for __m256 {
        const N: usize = 8;
        const TOKEN_BLOCK: usize = 4;
        const PACKED_TOKENS: usize = 12;
        #[inline(always)]
        unsafe fn zero() -> Self {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> Self {
            _mm256_set1_ps(v)
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            let halves = _mm_add_ps(
                _mm256_castps256_ps128(self),
                _mm256_extractf128_ps::<1>(self),
            );
            let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
            _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: Self) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> Self {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> Self {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        }
        #[inline(always)]
        unsafe fn load_pair(p: *const u32) -> (Self, Self) {
            let v = _mm256_loadu_si256(p.cast());
            let low = _mm256_slli_epi32::<16>(v);
            let high = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
            (_mm256_castsi256_ps(low), _mm256_castsi256_ps(high))
        }
        #[inline(always)]
        unsafe fn transpose(r: [Self; LANES]) -> [Self; LANES] {
            // Interleave row pairs (`t`), then pair pairs (`s[2q + h]` holds values h, h + 4 of
            // rows 4q'..; per 128-bit half: value j of four rows), then join the halves.
            let mut t = [_mm256_setzero_ps(); 8];
            for p in 0..4 {
                t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);
                t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);
            }
            // `s[4h + j]`: rows 4h..4h + 4, value j in the low half and j + 4 in the high one.
            let mut s = [_mm256_setzero_ps(); 8];
            for h in 0..2 {
                let (a, b, c, d) = (t[4 * h], t[4 * h + 1], t[4 * h + 2], t[4 * h + 3]);
                s[4 * h] = _mm256_shuffle_ps::<0x44>(a, c);
                s[4 * h + 1] = _mm256_shuffle_ps::<0xEE>(a, c);
                s[4 * h + 2] = _mm256_shuffle_ps::<0x44>(b, d);
                s[4 * h + 3] = _mm256_shuffle_ps::<0xEE>(b, d);
            }
            let mut c = [_mm256_setzero_ps(); LANES];
            for j in 0..4 {
                c[j] = _mm256_permute2f128_ps::<0x20>(s[j], s[4 + j]);
                c[4 + j] = _mm256_permute2f128_ps::<0x31>(s[j], s[4 + j]);
            }
            c
        }
    }

    /// Row-major weights the chain kernels read a vector of values (or one) at a time, widened
    /// to f32 exactly.
    pub(super) trait Rows {
        /// Values `k..k + V::N` of row `r` (`cols` per row) as one vector.
        unsafe fn load<V: Lane>(&self, r: usize, cols: usize, k: usize) -> V;
        /// Value `k` of row `r` as f32.
        unsafe fn get(&self, r: usize, cols: usize, k: usize) -> f32;
        /// Asks for the cache line holding value `k` of row `r` (the kernels read a vector's
        /// worth of rows side by side, more streams than the hardware prefetcher follows).
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
        unsafe fn load<V: Lane>(&self, r: usize, cols: usize, k: usize) -> V {
            V::load(self.0.as_ptr().add(r * cols + k))
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
        unsafe fn load<V: Lane>(&self, r: usize, cols: usize, k: usize) -> V {
            V::load_bf16(self.0.as_ptr().add(r * cols + k))
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
        unsafe fn load<V: Lane>(&self, r: usize, cols: usize, k: usize) -> V {
            V::load_f16(self.0.as_ptr().add(r * cols + k))
        }
        #[inline(always)]
        unsafe fn get(&self, r: usize, cols: usize, k: usize) -> f32 {
            half::f16::from_bits(*self.0.get_unchecked(r * cols + k)).to_f32()
        }
    }

    /// [`token_panels`] on the instruction set `simd`.
    ///
    /// # Safety
    /// The CPU runs `simd`; `x` holds `tokens × cols` values, `out` `tokens × range.len()`
    /// zeros, and `range` lies within the weight's rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn token_panels_on<R: Rows>(
        simd: Simd,
        w: &R,
        cols: usize,
        x: &[f32],
        tokens: usize,
        panels: &[usize],
        range: Range<usize>,
        out: &mut [f32],
    ) {
        match simd {
            Simd::Avx512 => token_panels_avx512(w, cols, x, tokens, panels, range, out),
            Simd::Avx2 => token_panels_avx2(w, cols, x, tokens, panels, range, out),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    unsafe fn token_panels_avx512<R: Rows>(
        w: &R,
        cols: usize,
        x: &[f32],
        tokens: usize,
        panels: &[usize],
        range: Range<usize>,
        out: &mut [f32],
    ) {
        token_panels::<__m512, R>(w, cols, x, tokens, panels, range, out)
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn token_panels_avx2<R: Rows>(
        w: &R,
        cols: usize,
        x: &[f32],
        tokens: usize,
        panels: &[usize],
        range: Range<usize>,
        out: &mut [f32],
    ) {
        token_panels::<__m256, R>(w, cols, x, tokens, panels, range, out)
    }

    /// Per panel one FMA chain per output and token in `k` order, the panels added in order
    /// (OpenBLAS's GEMM driver for f32; one panel of the whole depth is MLX's `simd_gemm` for
    /// 16-bit weights). `V::N` outputs run side by side: an `N × N` block of weights transposed
    /// in registers gives, for each `k`, the outputs' weights as one vector, which then meets up
    /// to `V::TOKEN_BLOCK` tokens (one broadcast value each) before the next block is read, so
    /// the weights are read and transposed once per that many tokens. Outputs past the last
    /// whole group, and depths past the last whole block, are done one value at a time in the
    /// same order. `out` (`tokens × range.len()`) must start at zero: each panel's sums are
    /// added to it.
    #[inline(always)]
    unsafe fn token_panels<V: Lane, R: Rows>(
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
            let n = (tokens - t0).min(V::TOKEN_BLOCK);
            let at = TokenBlock {
                x: &x[t0 * cols..(t0 + n) * cols],
                out: &mut out[t0 * range.len()..(t0 + n) * range.len()],
            };
            match n {
                1 => token_block::<V, R, 1>(w, cols, at, panels, range.clone()),
                2 => token_block::<V, R, 2>(w, cols, at, panels, range.clone()),
                3 => token_block::<V, R, 3>(w, cols, at, panels, range.clone()),
                4 => token_block::<V, R, 4>(w, cols, at, panels, range.clone()),
                5 => token_block::<V, R, 5>(w, cols, at, panels, range.clone()),
                6 => token_block::<V, R, 6>(w, cols, at, panels, range.clone()),
                7 => token_block::<V, R, 7>(w, cols, at, panels, range.clone()),
                _ => token_block::<V, R, 8>(w, cols, at, panels, range.clone()),
            }
            t0 += n;
        }
    }

    /// Up to eight tokens (`x`, `N × cols`) and their outputs (`N × range.len()`).
    struct TokenBlock<'a> {
        x: &'a [f32],
        out: &'a mut [f32],
    }

    /// [`token_panels`] for exactly `N` tokens.
    #[inline(always)]
    unsafe fn token_block<V: Lane, R: Rows, const N: usize>(
        w: &R,
        cols: usize,
        at: TokenBlock<'_>,
        panels: &[usize],
        range: Range<usize>,
    ) {
        let lanes = V::N;
        let len = range.len();
        let (x, out) = (at.x.as_ptr(), at.out.as_mut_ptr());
        let mut r = range.start;
        while r + lanes <= range.end {
            let o = r - range.start;
            let mut k0 = 0;
            for &depth in panels {
                let mut acc = [V::zero(); N];
                let mut k = k0;
                while k + lanes <= k0 + depth {
                    if r + 2 * lanes <= range.end {
                        for g in 0..lanes {
                            w.prefetch(r + lanes + g, cols, k);
                        }
                    }
                    let rows: [V; LANES] = std::array::from_fn(|g| {
                        if g < lanes {
                            w.load::<V>(r + g, cols, k)
                        } else {
                            V::zero()
                        }
                    });
                    for (j, c) in V::transpose(rows).iter().enumerate().take(lanes) {
                        for (t, a) in acc.iter_mut().enumerate() {
                            let xv = V::splat(*x.add(t * cols + k + j));
                            *a = V::fmadd(*c, xv, *a);
                        }
                    }
                    k += lanes;
                }
                while k < k0 + depth {
                    let col: [f32; LANES] = std::array::from_fn(|g| {
                        if g < lanes {
                            w.get(r + g, cols, k)
                        } else {
                            0.0
                        }
                    });
                    let c = V::load(col.as_ptr());
                    for (t, a) in acc.iter_mut().enumerate() {
                        *a = V::fmadd(c, V::splat(*x.add(t * cols + k)), *a);
                    }
                    k += 1;
                }
                for (t, a) in acc.iter().enumerate() {
                    let dst = out.add(t * len + o);
                    V::store(dst, V::add(V::load(dst), *a));
                }
                k0 += depth;
            }
            r += lanes;
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

    /// [`packed_rows`] on the instruction set `simd`.
    ///
    /// # Safety
    /// As for [`token_panels_on`] (`out` need not start at zero).
    pub(super) unsafe fn packed_rows_on<R: Rows>(
        simd: Simd,
        w: &R,
        cols: usize,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) {
        match simd {
            Simd::Avx512 => packed_rows_avx512(w, cols, x, tokens, range, out),
            Simd::Avx2 => packed_rows_avx2(w, cols, x, tokens, range, out),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    unsafe fn packed_rows_avx512<R: Rows>(
        w: &R,
        cols: usize,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) {
        packed_rows::<__m512, R>(w, cols, x, tokens, range, out)
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn packed_rows_avx2<R: Rows>(
        w: &R,
        cols: usize,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) {
        packed_rows::<__m256, R>(w, cols, x, tokens, range, out)
    }

    /// One f32 chain per output and token over the whole depth in `k` order (MLX's 16-bit
    /// order) for many tokens: each group of `V::N` rows is widened and transposed once into a
    /// `cols × N` buffer (one vector per `k`, in the second-level cache), which every token then
    /// reads `V::PACKED_TOKENS` at a time. Rows past the last whole group are done one value at
    /// a time in the same order. Writes every output of `out` (`tokens × range.len()`).
    #[inline(always)]
    unsafe fn packed_rows<V: Lane, R: Rows>(
        w: &R,
        cols: usize,
        x: &[f32],
        tokens: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) {
        let lanes = V::N;
        let len = range.len();
        let mut packed = vec![0.0f32; cols * lanes];
        let mut r = range.start;
        while r + lanes <= range.end {
            pack_rows::<V, R>(w, cols, r, &mut packed);
            let mut t0 = 0;
            while t0 < tokens {
                let n = (tokens - t0).min(V::PACKED_TOKENS);
                let block = PackedBlock {
                    packed: &packed,
                    cols,
                    x: &x[t0 * cols..(t0 + n) * cols],
                    out: &mut out[t0 * len..(t0 + n) * len],
                    len,
                    at: r - range.start,
                };
                by_tokens!(n, packed_block::<V>(block));
                t0 += n;
            }
            r += lanes;
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

    /// Rows `r..r + V::N` widened to f32 and transposed into `packed` (`cols × N`: the rows'
    /// value `k` side by side at `N k`).
    #[inline(always)]
    unsafe fn pack_rows<V: Lane, R: Rows>(w: &R, cols: usize, r: usize, packed: &mut [f32]) {
        let lanes = V::N;
        let dst = packed.as_mut_ptr();
        let mut k = 0;
        while k + lanes <= cols {
            let rows: [V; LANES] = std::array::from_fn(|g| {
                if g < lanes {
                    w.load::<V>(r + g, cols, k)
                } else {
                    V::zero()
                }
            });
            for (j, c) in V::transpose(rows).iter().enumerate().take(lanes) {
                V::store(dst.add((k + j) * lanes), *c);
            }
            k += lanes;
        }
        for k in k..cols {
            for g in 0..lanes {
                *dst.add(k * lanes + g) = w.get(r + g, cols, k);
            }
        }
    }

    /// Up to fourteen tokens (`x`, `N × cols`) past one packed group of rows; their outputs go
    /// to columns `at..at + V::N` of `out` (`N` rows of `len`).
    struct PackedBlock<'a> {
        packed: &'a [f32],
        cols: usize,
        x: &'a [f32],
        out: &'a mut [f32],
        len: usize,
        at: usize,
    }

    /// [`packed_rows`] for exactly `N` tokens.
    #[inline(always)]
    unsafe fn packed_block<V: Lane, const N: usize>(b: PackedBlock<'_>) {
        let (p, x, cols) = (b.packed.as_ptr(), b.x.as_ptr(), b.cols);
        let mut acc = [V::zero(); N];
        for k in 0..cols {
            let wv = V::load(p.add(k * V::N));
            for (t, a) in acc.iter_mut().enumerate() {
                *a = V::fmadd(wv, V::splat(*x.add(t * cols + k)), *a);
            }
        }
        for (t, a) in acc.iter().enumerate() {
            V::store(b.out.as_mut_ptr().add(t * b.len + b.at), *a);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
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
        // One thread rounds the halved remainder up to the kernel's unroll instead.
        let one = Halving::SingleThread { unroll: 8 };
        assert_eq!(driver_panels(1026, 320, one), vec![320, 320, 200, 186]);
        assert_eq!(
            driver_panels(1026, 320, Halving::Threaded),
            vec![320, 320, 193, 193]
        );
        assert_eq!(driver_panels(700, 320, one), vec![320, 192, 188]);
        assert_eq!(driver_panels(300, 320, one), vec![300]);
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

    /// The instruction sets this CPU runs the kernels on (none on x86 without AVX2/FMA/F16C
    /// and on other architectures).
    fn sets() -> Vec<Simd> {
        [Simd::Avx512, Simd::Avx2]
            .into_iter()
            .filter(|s| s.runs_here())
            .collect()
    }

    /// [`matmul`]'s product of `tokens` tokens on every set this CPU runs that takes `order`
    /// (the lane order is AVX-512's only: AVX2 must refuse it). Where no set runs, the call
    /// must be refused rather than run instructions the CPU lacks.
    #[allow(clippy::too_many_arguments)]
    fn products(
        w: Weights<'_>,
        rows: usize,
        cols: usize,
        x: &[f32],
        tokens: usize,
        order: &Order,
        threads: usize,
    ) -> Vec<(Simd, Vec<f32>)> {
        if sets().is_empty() {
            let err = matmul(w, rows, cols, x, tokens, order, threads).unwrap_err();
            assert!(err.contains("AVX2"), "{order:?}: {err}");
        }
        let mut out = Vec::new();
        for set in sets() {
            let y = matmul_on(Some(set), w, rows, cols, x, tokens, order, threads);
            if *order == Order::Lanes && set == Simd::Avx2 {
                assert!(y.is_err(), "AVX2 must refuse the lane order");
                continue;
            }
            out.push((set, y.unwrap()));
        }
        out
    }

    /// The tests must run the host path wherever the CPU can, not only check that it refuses.
    #[test]
    fn x86_cpus_with_avx2_fma_and_f16c_run_the_host_products() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            assert!(Simd::Avx2.runs_here());
            assert!(available());
            assert!(sets().contains(&Simd::Avx2));
        }
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
                    for (_, y) in products(Weights::F32(&w), rows, cols, &x, 1, &ord, threads) {
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
                for (set, y) in products(weights, rows, cols, &x, 1, &Order::Sequential, 2) {
                    for (r, v) in y.iter().enumerate() {
                        let mut want = 0.0f32;
                        for c in 0..cols {
                            want += w[r * cols + c] * x[c];
                        }
                        assert_eq!(v.to_bits(), want.to_bits(), "{set:?} {name} row {r}");
                    }
                }
            }
        }
        let f = [0.0f32; 4];
        assert!(matvec(Weights::F32(&f), 2, 2, &f[..2], &Order::Sequential, 1).is_err());
    }

    /// bfloat16 values of either sign in [0.25, 4) from a seeded xorshift: exact in f32, and a
    /// product of two of them is too, but their sums round.
    fn rounding_values(seed: u32) -> impl FnMut() -> f32 {
        let mut seed = seed;
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            // Sign bit, one of four exponents, seven mantissa bits.
            let sign = (seed & 1) << 31;
            let exponent = (125 + (seed >> 1) % 4) << 23;
            let mantissa = ((seed >> 8) & 0x7f) << 16;
            f32::from_bits(sign | exponent | mantissa)
        }
    }

    /// The scalar reference of the panel order: per panel one fused multiply-add chain from
    /// zero over `row · x`, the panels' sums added in order to a total from zero.
    pub(in crate::engine::kernels) fn panel_chains(
        row: &[f32],
        x: &[f32],
        panels: &[usize],
    ) -> f32 {
        let (mut total, mut k0) = (0.0f32, 0);
        for depth in panels {
            let mut acc = 0.0f32;
            for k in k0..k0 + depth {
                acc = row[k].mul_add(x[k], acc);
            }
            total += acc;
            k0 += depth;
        }
        total
    }

    /// The panel order with sums that round: for every set this CPU runs, 1 to 16 tokens, rows
    /// that fill whole vectors and rows past them, every output of every token equals a scalar
    /// re-computation (per panel a fused multiply-add chain from zero, panels added in order),
    /// bit for bit.
    #[test]
    fn f32_panels_equal_a_scalar_chain_on_every_set() {
        let mut next = rounding_values(0x9e37_79b9);
        let (rows, cols) = (45, 700);
        let w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
        let order = Order::Panels(panels(cols, 320));
        let Order::Panels(cuts) = &order else {
            unreachable!()
        };
        for tokens in [1, 3, 4, 5, 8, 9, 16] {
            let x: Vec<f32> = (0..tokens * cols).map(|_| next()).collect();
            for (set, y) in products(Weights::F32(&w), rows, cols, &x, tokens, &order, 2) {
                for t in 0..tokens {
                    for r in 0..rows {
                        let row = &w[r * cols..(r + 1) * cols];
                        let total = panel_chains(row, &x[t * cols..(t + 1) * cols], cuts);
                        let got = y[t * rows + r];
                        assert_eq!(got.to_bits(), total.to_bits(), "{set:?} x{tokens} {t} {r}");
                    }
                }
            }
        }
    }

    /// Prompt-sized 16-bit products (the packed kernel, any token count): every output of
    /// every token equals a scalar left-to-right f32 sum of exact products, bit for bit, with
    /// values whose sums round (unlike [`case`]'s); f32 orders refuse them.
    #[test]
    fn long_sixteen_bit_products_sum_left_to_right_for_every_token() {
        let mut next = rounding_values(0x2545_f491);
        let (rows, cols) = (37, 100);
        let w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
        let bf: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let wide: Vec<f32> = bf
            .iter()
            .map(|b| f32::from_bits(u32::from(*b) << 16))
            .collect();
        for tokens in [17, 35, 100] {
            let x: Vec<f32> = (0..tokens * cols).map(|_| next()).collect();
            let sequential = &Order::Sequential;
            for (set, y) in products(Weights::Bf16(&bf), rows, cols, &x, tokens, sequential, 2) {
                for t in 0..tokens {
                    for r in 0..rows {
                        let mut want = 0.0f32;
                        for c in 0..cols {
                            want += wide[r * cols + c] * x[t * cols + c];
                        }
                        let got = y[t * rows + r];
                        assert_eq!(got.to_bits(), want.to_bits(), "{set:?} x{tokens} {t} {r}");
                    }
                }
            }
            let f32_order = Order::Panels(vec![cols]);
            assert!(matmul(Weights::F32(&w), rows, cols, &x, tokens, &f32_order, 1).is_err());
        }
    }
}
