//! The AVX-512 VNNI path of the quantized mat-vec: the input is quantized to int8 per
//! 32-element block (`x ≈ d · q`, `d = max|x| / 127`, llama.cpp's Q8 activation scheme), and
//! `vpdpbusd` sums weight-code × input-code products exactly in int32, 4 per lane per
//! instruction. Per block only one float multiply-add is left:
//! `Σ w x ≈ scale · d · Σ q_w q_x + bias · Σ x` (the bias term uses the exact f32 sum of x).
//!
//! This is several times fewer instructions per weight than dequantizing to f32, at the cost
//! of the int8 rounding of the input (each input within `d / 2` of its exact value), which is
//! why it is a separate path (`MLXB_Q4_KERNEL=avx512vnni`) with its own error bound in tests.
//!
//! Spans of 64 input elements: at 4 bits a span is 32 packed bytes; byte `k` holds element
//! `2k` (low nibble) and `2k + 1` (high), so the int8 input stores each span's 32 even
//! elements, then its 32 odd ones, and the low and high nibble vectors multiply them without
//! shuffles; int32 lane `j` then covers elements `8j..8j + 8`, i.e. lanes 0-3 are the span's
//! first block and 4-7 its second. At 8 bits a span is 64 bytes in natural order and lanes 0-7
//! / 8-15 are its two blocks.

use super::affine::QMatrix;
use std::ops::Range;

/// Elements per int8 quantization block (the smallest MLX group size).
const BLOCK: usize = 32;

/// Elements per span (one 256-bit vector of 4-bit codes, one 512-bit vector of 8-bit codes).
pub(super) const SPAN: usize = 64;

/// `m` input rows quantized to int8 for the VNNI kernels.
#[derive(Debug, Clone)]
pub struct Int8Input {
    /// Codes, `m × cols`, each 64-element span de-interleaved (evens, odds) at 4 bits.
    codes: Vec<i8>,
    /// `d` per block, `m × cols / 32`.
    scales: Vec<f32>,
    /// Exact `Σ x` per block, `m × cols / 32`.
    sums: Vec<f32>,
    /// `d` spread over the int32 lanes of each span (`m × spans × LANES`): lanes of a span's
    /// first block then its second, so one multiply scales a whole span's lane sums.
    lanes: Vec<f32>,
    m: usize,
    cols: usize,
}

impl Int8Input {
    /// Quantizes `x` (`m × cols`, `cols` a multiple of `SPAN`) for `bits`-bit weights.
    pub fn new(x: &[f32], m: usize, cols: usize, bits: usize) -> Self {
        let blocks = cols / BLOCK;
        let mut codes = vec![0i8; m * cols];
        let mut scales = vec![0.0f32; m * blocks];
        let mut sums = vec![0.0f32; m * blocks];
        for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
            let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            scales[b] = d;
            sums[b] = xb.iter().sum();
            let base = b * BLOCK;
            for (i, v) in xb.iter().enumerate() {
                let q = (v * inv).round().clamp(-127.0, 127.0) as i8;
                let e = base + i;
                let at = if bits == 4 {
                    let span = e / SPAN * SPAN;
                    let k = e - span;
                    span + if k.is_multiple_of(2) {
                        k / 2
                    } else {
                        SPAN / 2 + k / 2
                    }
                } else {
                    e
                };
                codes[at] = q;
            }
        }
        let per = lanes_per_span(bits);
        let lanes = scales
            .chunks_exact(2)
            .flat_map(|d| {
                std::iter::repeat_n(d[0], per / 2).chain(std::iter::repeat_n(d[1], per / 2))
            })
            .collect();
        Self {
            codes,
            scales,
            sums,
            lanes,
            m,
            cols,
        }
    }

    /// Input rows.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The value input element `(row, col)` was rounded to (`d · q`), for error bounds.
    pub fn rounded(&self, row: usize, col: usize, bits: usize) -> f32 {
        let span = col / SPAN * SPAN;
        let k = col - span;
        let at = if bits == 4 {
            span + if k.is_multiple_of(2) {
                k / 2
            } else {
                SPAN / 2 + k / 2
            }
        } else {
            col
        };
        let blocks = self.cols / BLOCK;
        f32::from(self.codes[row * self.cols + at]) * self.scales[row * blocks + col / BLOCK]
    }
}

/// int32 lanes per span: a 256-bit vector at 4 bits, a 512-bit one at 8.
fn lanes_per_span(bits: usize) -> usize {
    if bits == 4 {
        8
    } else {
        16
    }
}

/// Whether this CPU runs the VNNI kernels.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `Σ x` per weight group, `m × groups`: the input side of the bias term
/// `Σ_g bias_g · Σ_{x in g} x`, computed once per call.
fn group_sums(w: &QMatrix<'_>, x: &Int8Input) -> Vec<f32> {
    let bpg = w.group() / BLOCK;
    x.sums.chunks_exact(bpg).map(|s| s.iter().sum()).collect()
}

/// Rows `rows` of `y = x · Wᵀ` into `out` (`rows.len() × m`), for 4- or 8-bit `w`.
///
/// # Safety
/// [`available`] must hold; `x` must be prepared for `w`'s bit width with `w.cols()` columns
/// and at most 8 rows, and `out` must hold `rows.len() × x.m()` values (checked by the caller,
/// [`super::affine::rows_into`]).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn rows_into(
    w: &QMatrix<'_>,
    x: &Int8Input,
    rows: Range<usize>,
    out: &mut [f32],
) {
    macro_rules! by_m {
        ($f:ident, $s:ident) => {
            match x.m {
                1 => $f::<1>(w, x, &$s, rows, out),
                2 => $f::<2>(w, x, &$s, rows, out),
                3 => $f::<3>(w, x, &$s, rows, out),
                4 => $f::<4>(w, x, &$s, rows, out),
                5 => $f::<5>(w, x, &$s, rows, out),
                6 => $f::<6>(w, x, &$s, rows, out),
                7 => $f::<7>(w, x, &$s, rows, out),
                _ => $f::<8>(w, x, &$s, rows, out),
            }
        };
    }
    let sums = group_sums(w, x);
    if w.bits() == 4 {
        by_m!(rows_q4, sums)
    } else {
        by_m!(rows_q8, sums)
    }
}

/// `Σ a_i b_i` over `n` values, 16 lanes at a time (masked tail).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn dot512(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let k = (n - i).min(16);
        let mask: __mmask16 = if k == 16 { 0xFFFF } else { (1u16 << k) - 1 };
        acc = _mm512_fmadd_ps(
            _mm512_maskz_loadu_ps(mask, a.add(i)),
            _mm512_maskz_loadu_ps(mask, b.add(i)),
            acc,
        );
        i += 16;
    }
    _mm512_reduce_add_ps(acc)
}

#[cfg(target_arch = "x86_64")]
use super::mlx_order::x86::Lane;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// 4-bit rows: a span is one 256-bit load, split into low/high nibbles; lanes 0-3 hold the
/// span's first block, 4-7 its second.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma")]
unsafe fn rows_q4<const M: usize>(
    w: &QMatrix<'_>,
    x: &Int8Input,
    sums: &[f32],
    rows: Range<usize>,
    out: &mut [f32],
) {
    let cols = w.cols();
    let (gpr, bpg, spans) = (cols / w.group(), w.group() / BLOCK, cols / SPAN);
    let low = _mm256_set1_epi8(0x0F);
    // Lanes 4-7 take the span's second group's scale when groups are one block long (the
    // masked load reads only groups that exist).
    let (second, mask) = if bpg == 1 { (1, 0b11) } else { (0, 0b1) };
    let spread = _mm256_setr_epi32(0, 0, 0, 0, second, second, second, second);
    let packed = w.packed().as_ptr() as *const u8;
    let (codes, lanes) = (x.codes.as_ptr(), x.lanes.as_ptr());
    for (i, r) in rows.enumerate() {
        let p = packed.add(r * cols / 2);
        let srow = w.scales().as_ptr().add(r * gpr);
        let mut acc = [_mm256_setzero_ps(); M];
        for sp in 0..spans {
            let v = _mm256_loadu_si256(p.add(sp * 32) as *const __m256i);
            let lo = _mm256_and_si256(v, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
            let g0 = 2 * sp / bpg;
            let s = _mm256_permutevar8x32_ps(_mm256_maskz_loadu_ps(mask, srow.add(g0)), spread);
            for (mi, a) in acc.iter_mut().enumerate() {
                let xq = codes.add(mi * cols + sp * SPAN) as *const __m256i;
                let isum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256(xq));
                let isum = _mm256_dpbusd_epi32(isum, hi, _mm256_loadu_si256(xq.add(1)));
                let f = _mm256_mul_ps(s, _mm256_loadu_ps(lanes.add((mi * spans + sp) * 8)));
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), f, *a);
            }
        }
        let brow = w.biases().as_ptr().add(r * gpr);
        for (mi, a) in acc.iter().enumerate() {
            let bias = dot512(brow, sums.as_ptr().add(mi * gpr), gpr);
            *out.get_unchecked_mut(i * M + mi) = Lane::sum(*a) + bias;
        }
    }
}

/// 8-bit rows: a span is one 512-bit load of codes in natural order; lanes 0-7 hold the
/// span's first block, 8-15 its second.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma")]
unsafe fn rows_q8<const M: usize>(
    w: &QMatrix<'_>,
    x: &Int8Input,
    sums: &[f32],
    rows: Range<usize>,
    out: &mut [f32],
) {
    let cols = w.cols();
    let (gpr, bpg, spans) = (cols / w.group(), w.group() / BLOCK, cols / SPAN);
    let (second, mask) = if bpg == 1 { (1, 0b11) } else { (0, 0b1) };
    let spread = _mm512_setr_epi32(
        0, 0, 0, 0, 0, 0, 0, 0, second, second, second, second, second, second, second, second,
    );
    let packed = w.packed().as_ptr() as *const u8;
    let (codes, lanes) = (x.codes.as_ptr(), x.lanes.as_ptr());
    for (i, r) in rows.enumerate() {
        let p = packed.add(r * cols);
        let srow = w.scales().as_ptr().add(r * gpr);
        let mut acc = [_mm512_setzero_ps(); M];
        for sp in 0..spans {
            let v = _mm512_loadu_si512(p.add(sp * SPAN) as *const _);
            let g0 = 2 * sp / bpg;
            let s = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(mask, srow.add(g0)));
            for (mi, a) in acc.iter_mut().enumerate() {
                let xq = codes.add(mi * cols + sp * SPAN) as *const _;
                let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(xq));
                let f = _mm512_mul_ps(s, _mm512_loadu_ps(lanes.add((mi * spans + sp) * 16)));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), f, *a);
            }
        }
        let brow = w.biases().as_ptr().add(r * gpr);
        for (mi, a) in acc.iter().enumerate() {
            let bias = dot512(brow, sums.as_ptr().add(mi * gpr), gpr);
            *out.get_unchecked_mut(i * M + mi) = _mm512_reduce_add_ps(*a) + bias;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kernels::affine::{pack, rows_into, KernelPath, Prepared};

    /// With AVX-512 VNNI the path's rows equal a float64 product on its rounded input; without
    /// it the path refuses every call rather than run instructions the CPU lacks.
    #[test]
    fn vnni_rows_equal_the_dequantized_product_on_the_rounded_input() {
        for (bits, group, m) in [(4, 32, 1), (4, 64, 3), (4, 128, 8), (8, 32, 1), (8, 64, 2)] {
            let (rows, cols) = (11, 384);
            let q: Vec<u8> = (0..rows * cols)
                .map(|i| ((i * 37 + i / 7) % (1 << bits)) as u8)
                .collect();
            let packed = pack(&q, bits);
            let groups = rows * cols / group;
            let scales: Vec<f32> = (0..groups).map(|g| 0.02 + (g % 5) as f32 * 0.004).collect();
            let biases: Vec<f32> = (0..groups).map(|g| -0.1 + (g % 3) as f32 * 0.03).collect();
            let w = QMatrix::new(bits, &packed, &scales, &biases, rows, cols, group).unwrap();
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 13) % 29) as f32 * 0.07 - 1.0)
                .collect();
            let p = Prepared::for_path(&x, m, cols, bits, KernelPath::Avx512Vnni).unwrap();
            let rounded = p.int8().unwrap();
            let mut out = vec![0.0f32; rows * m];
            let ran = rows_into(KernelPath::Avx512Vnni, &w, &p, 0..rows, &mut out);
            if !available() {
                let err = ran.unwrap_err();
                assert!(err.contains("cannot run the avx512vnni kernel"), "{err}");
                continue;
            }
            ran.unwrap();
            for r in 0..rows {
                for mi in 0..m {
                    // s q x̂ + b x: the scale half on the rounded input, the bias half exact.
                    let want: f64 = (0..cols)
                        .map(|c| {
                            let g = r * cols / group + c / group;
                            let (s, b) = (f64::from(scales[g]), f64::from(biases[g]));
                            let xh = f64::from(rounded.rounded(mi, c, bits));
                            s * f64::from(q[r * cols + c]) * xh + b * f64::from(x[mi * cols + c])
                        })
                        .sum();
                    let got = f64::from(out[r * m + mi]);
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{bits}-bit g{group} m{m} row {r}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn rounding_stays_within_half_a_step_of_each_block() {
        let x: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        for bits in [4, 8] {
            let r = Int8Input::new(&x, 1, 128, bits);
            for (c, v) in x.iter().enumerate() {
                let block = &x[c / 32 * 32..c / 32 * 32 + 32];
                let step = block.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                assert!((v - r.rounded(0, c, bits)).abs() <= step / 2.0 + 1e-6);
            }
        }
    }
}
