//! An f32 single-token product `y = x · Wᵀ` summed in exactly the order OpenBLAS's SkylakeX
//! kernels sum it, so that L1 decode gets MLX's bits without MLX's BLAS call.
//!
//! Why: on the CPU backend MLX hands every f32 `x @ W.T` to `cblas_sgemm`. For one token
//! OpenBLAS either re-packs the whole weight matrix on every call (its GEMM driver, ~37 % of an
//! f32 decode step in `sgemm_incopy`) or runs its small-matrix kernel on one thread. Reading the
//! weights in place on both cores is faster, and summing in OpenBLAS's order keeps every bit.
//!
//! MLX calls row-major `sgemm(NoTrans, Trans)`, which OpenBLAS runs as column-major `TN` with
//! `M` = outputs, `N` = tokens, `K` = inputs. The two orders (OpenBLAS 0.3.21, `SKYLAKEX`):
//! - **Lanes** (the small-matrix `TN` kernel, taken when `M·N·K ≤ 10⁶`, `M·N ≤ 1200` and
//!   `K ≥ 32`): sixteen lanes, lane `l` a fused multiply-add chain over `k ≡ l (mod 16)` (a
//!   short last chunk is masked to zeros), then the lanes added pairwise: outputs in the whole
//!   groups of four at the front in the kernel's 4×4-transpose order
//!   `((l0+l1)+(l2+l3))` per 128-bit quarter, quarters `(q0+q1)+(q2+q3)`; the rest in
//!   `_mm512_reduce_add_ps`'s halving order (`l + 8`, `+ 4`, `+ 2`, `+ 1`).
//! - **Panels** (the packed GEMM driver, every other product): `K` cut into panels of at most
//!   [`PANEL`] (a remainder below twice that is halved, rounding up), each panel a fused
//!   multiply-add chain from zero in `k` order, the panels added to the output in order.
//!
//! Nothing here assumes the running BLAS really is that one: [`super::dense`] compares each
//! weight shape with MLX's own product before using it, so another BLAS, CPU or version costs
//! speed, never bits.

use rayon::prelude::*;
use std::ops::Range;

/// OpenBLAS's single-precision panel depth on SkylakeX (`SGEMM_DEFAULT_Q`).
pub const PANEL: usize = 448;
/// Largest `M·N·K` OpenBLAS hands its small-matrix kernel.
const SMALL_MAX_MNK: f64 = 1e6;
/// Largest `M·N` (outputs × tokens) the small-matrix `TN` kernel takes.
const SMALL_MAX_OUTPUTS: usize = 1200;
/// Smallest depth the small-matrix `TN` kernel takes.
const SMALL_MIN_DEPTH: usize = 32;
/// Lanes of the small-matrix kernel's accumulators (one AVX-512 register).
const LANES: usize = 16;
/// Weights below which one thread does the whole product (a fork/join costs more).
const PARALLEL_MIN_WEIGHTS: usize = 1 << 16;

/// How OpenBLAS sums a single-token product.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Order {
    /// The small-matrix kernel: sixteen strided lanes, then a lane reduction.
    Lanes,
    /// The GEMM driver: sequential panels of these depths.
    Panels(Vec<usize>),
}

/// The order OpenBLAS uses for one token through a `rows × cols` weight.
pub fn order(rows: usize, cols: usize) -> Order {
    let mnk = rows as f64 * cols as f64;
    if mnk <= SMALL_MAX_MNK && rows <= SMALL_MAX_OUTPUTS && cols >= SMALL_MIN_DEPTH {
        Order::Lanes
    } else {
        Order::Panels(panels(cols))
    }
}

/// The GEMM driver's cut of `depth` into panels.
pub fn panels(depth: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = depth;
    while left > 0 {
        let p = if left >= 2 * PANEL {
            PANEL
        } else if left > PANEL {
            left.div_ceil(2)
        } else {
            left
        };
        out.push(p);
        left -= p;
    }
    out
}

/// Whether this CPU runs the kernels (both are written for AVX-512 with FMA, the CPUs whose
/// OpenBLAS kernels they mirror).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `y = x · Wᵀ` for one token: `w` is `rows × cols` row-major, `x` has `cols` values. Rows are
/// split over up to `threads` threads; the split never changes a bit (each output is summed
/// alone). Errors when the CPU lacks the kernels or the lengths disagree.
pub fn matvec(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    order: &Order,
    threads: usize,
) -> Result<Vec<f32>, String> {
    if !available() {
        return Err("this CPU has no AVX-512 and FMA for the f32 host product".into());
    }
    if cols == 0 || w.len() != rows * cols || x.len() != cols {
        return Err(format!(
            "shape mismatch: {rows}x{cols} weight of {} values, input of {}",
            w.len(),
            x.len()
        ));
    }
    let mut y = vec![0.0f32; rows];
    let threads = if rows * cols < PARALLEL_MIN_WEIGHTS {
        1
    } else {
        threads.max(1)
    };
    // Chunks of whole 16-row groups keep every thread on the kernels' vector paths.
    let per = (rows.div_ceil(threads).div_ceil(LANES) * LANES).max(LANES);
    y.par_chunks_mut(per).enumerate().for_each(|(i, out)| {
        let start = i * per;
        rows_into(w, rows, cols, x, order, start..start + out.len(), out);
    });
    Ok(y)
}

/// Outputs `range` of the product into `out` (checked by [`matvec`]).
fn rows_into(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    order: &Order,
    range: Range<usize>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `matvec` checked `available()` and every length.
    unsafe {
        match order {
            Order::Lanes => x86::lanes(w, rows, cols, x, range, out),
            Order::Panels(p) => x86::panels(w, cols, x, p, range, out),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, rows, cols, x, order, range, out);
        unreachable!("matvec refuses CPUs without the kernels");
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
            while c < full {
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

    /// The GEMM driver's order for outputs `range`: per panel one FMA chain per output, sixteen
    /// outputs side by side (a 16×16 block of weights transposed in registers gives, for each
    /// `k`, the sixteen outputs' weights as one vector), the panels added in order. Outputs
    /// past the last whole group of sixteen, and panel depths past the last whole block, are
    /// done one value at a time in the same order.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn panels(
        w: &[f32],
        cols: usize,
        x: &[f32],
        panels: &[usize],
        range: Range<usize>,
        out: &mut [f32],
    ) {
        let mut r = range.start;
        while r + LANES <= range.end {
            let base = w.as_ptr().add(r * cols);
            let mut total = _mm512_setzero_ps();
            let mut k0 = 0;
            for &depth in panels {
                let mut acc = _mm512_setzero_ps();
                let mut k = k0;
                while k + LANES <= k0 + depth {
                    let cols16 = transpose16(base.add(k), cols);
                    for (j, c) in cols16.iter().enumerate() {
                        acc = _mm512_fmadd_ps(*c, _mm512_set1_ps(*x.get_unchecked(k + j)), acc);
                    }
                    k += LANES;
                }
                while k < k0 + depth {
                    let mut col = [0.0f32; LANES];
                    for (g, v) in col.iter_mut().enumerate() {
                        *v = *base.add(g * cols + k);
                    }
                    let c = _mm512_loadu_ps(col.as_ptr());
                    acc = _mm512_fmadd_ps(c, _mm512_set1_ps(*x.get_unchecked(k)), acc);
                    k += 1;
                }
                total = _mm512_add_ps(total, acc);
                k0 += depth;
            }
            let at = r - range.start;
            _mm512_storeu_ps(out.as_mut_ptr().add(at), total);
            r += LANES;
        }
        while r < range.end {
            let row = w.as_ptr().add(r * cols);
            let mut total = 0.0f32;
            let mut k0 = 0;
            for &depth in panels {
                let mut acc = 0.0f32;
                for k in k0..k0 + depth {
                    acc = (*row.add(k)).mul_add(*x.get_unchecked(k), acc);
                }
                total += acc;
                k0 += depth;
            }
            out[r - range.start] = total;
            r += 1;
        }
    }

    /// Sixteen rows (`stride` apart) of sixteen values from `p`, returned as sixteen columns:
    /// element `g` of column `j` is row `g`'s value `j`.
    #[target_feature(enable = "avx512f")]
    unsafe fn transpose16(p: *const f32, stride: usize) -> [__m512; LANES] {
        let r: [__m512; LANES] = std::array::from_fn(|g| _mm512_loadu_ps(p.add(g * stride)));
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
        assert_eq!(panels(576), vec![288, 288]);
        assert_eq!(panels(1536), vec![448, 448, 320, 320]);
        assert_eq!(panels(1000), vec![448, 276, 276]);
        assert_eq!(panels(448), vec![448]);
        assert_eq!(panels(10), vec![10]);
        assert_eq!(panels(3000).iter().sum::<usize>(), 3000);
    }

    #[test]
    fn small_products_take_the_lane_order() {
        assert_eq!(order(576, 576), Order::Lanes);
        assert_eq!(order(192, 576), Order::Lanes);
        assert_eq!(order(1536, 576), Order::Panels(vec![288, 288]));
        assert_eq!(order(576, 16), Order::Panels(vec![16]));
        assert_eq!(order(1200, 833), Order::Lanes);
        assert_eq!(order(1200, 834), Order::Panels(vec![417, 417]));
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

    /// A plain float64 product, for a loose sanity bound (the bit-exact check against MLX
    /// lives with the MLX-facing code in `dense`).
    #[test]
    fn both_orders_are_close_to_a_float64_product() {
        if !available() {
            eprintln!("no AVX-512 here: the f32 host product is unused on this CPU");
            return;
        }
        for (rows, cols) in [(7, 40), (37, 100), (64, 576), (1500, 960)] {
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
                .collect();
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0)
                .collect();
            for ord in [Order::Lanes, Order::Panels(panels(cols))] {
                for threads in [1, 2, 3] {
                    let y = matvec(&w, rows, cols, &x, &ord, threads).unwrap();
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
