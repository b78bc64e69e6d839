//! Products over f32 or bfloat16 weights with f32 inputs and sums, in whatever order is
//! fastest here:
//! fused multiply-adds over 16-wide AVX-512 lanes, two weight rows against every token of a
//! block at once (each weight row is read once per block, each input chunk serves both rows).
//!
//! For products whose bits need match nothing: a DSpark drafter's block, whose proposals the
//! target verifies. Such a block streams its weights once a round and is bound by their bytes,
//! hence bfloat16 where the weights are bfloat16 values (a drafter stored in bfloat16, as the
//! shipped one is, whatever dtype it computes in).
//! Each output is summed in one order whatever the block or the share of rows, so a block's
//! bits equal its tokens' one by one.

use std::ops::Range;

/// The most tokens one pass takes; more run in passes of this many.
const MAX_TOKENS: usize = 8;

/// A weight matrix's values, row-major.
#[derive(Debug, Clone, Copy)]
pub enum AnyWeights<'a> {
    F32(&'a [f32]),
    /// bfloat16 bits.
    Bf16(&'a [u16]),
}

/// Outputs `rows` of `x · Wᵀ` (`x`: `m × cols`, `w`: `? × cols`) into `out` (`rows.len() × m`,
/// by output feature).
pub fn rows_into(
    w: AnyWeights<'_>,
    cols: usize,
    x: &[f32],
    m: usize,
    rows: Range<usize>,
    out: &mut [f32],
) {
    match w {
        AnyWeights::F32(w) => rows_into_of(w, cols, x, m, rows, out),
        AnyWeights::Bf16(w) => rows_into_of(w, cols, x, m, rows, out),
    }
}

/// A weight element the kernel reads.
trait Element: Copy {
    fn value(self) -> f32;
    /// Sixteen consecutive elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p..p + 16` must be readable, on a CPU with AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Element for f32 {
    fn value(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

impl Element for u16 {
    fn value(self) -> f32 {
        f32::from_bits(u32::from(self) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let bits = _mm256_loadu_si256(p.cast());
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
    }
}

fn rows_into_of<E: Element>(
    w: &[E],
    cols: usize,
    x: &[f32],
    m: usize,
    rows: Range<usize>,
    out: &mut [f32],
) {
    assert!(
        rows.end * cols <= w.len() && m * cols <= x.len() && rows.len() * m <= out.len(),
        "a product past its buffers"
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let mut first = 0;
        while first < m {
            let n = (m - first).min(MAX_TOKENS);
            let xs = &x[first * cols..(first + n) * cols];
            seq_macro::seq!(T in 1..=8 {
                match n {
                    #(T => {
                        // SAFETY: the CPU has AVX-512F (checked just above); the buffers hold
                        // what the product reads and writes (asserted above).
                        unsafe { avx512::rows_into::<E, T>(w, cols, xs, rows.clone(), out, m, first) }
                    })*
                    _ => unreachable!("passes take 1..=8 tokens"),
                }
            });
            first += n;
        }
        return;
    }
    // Without AVX-512: one plain sum per output.
    let dot = |w: &[E], x: &[f32]| w.iter().zip(x).map(|(w, x)| w.value() * x).sum();
    super::vecops::rows_by_dot(w, cols, x, m, rows, out, dot);
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::Element;
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Rows `rows` against `T` tokens `x` (`T × cols`), written as tokens `first..first + T` of
    /// `out` (`rows.len() × m`).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows_into<E: Element, const T: usize>(
        w: &[E],
        cols: usize,
        x: &[f32],
        rows: Range<usize>,
        out: &mut [f32],
        m: usize,
        first: usize,
    ) {
        let start = rows.start;
        let mut r = rows.start;
        while r < rows.end {
            let pair = rows.end - r >= 2;
            let sums = if pair {
                block::<E, 2, T>(w, cols, x, r)
            } else {
                let one = block::<E, 1, T>(w, cols, x, r);
                [one[0], [0.0; T]]
            };
            for (i, row_sums) in sums.iter().enumerate().take(1 + usize::from(pair)) {
                let at = (r + i - start) * m + first;
                out[at..at + T].copy_from_slice(row_sums);
            }
            r += 1 + usize::from(pair);
        }
    }

    /// The sums of weight rows `r..r + R` with each of the `T` tokens.
    // The register block is indexed by row and token together.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<E: Element, const R: usize, const T: usize>(
        w: &[E],
        cols: usize,
        x: &[f32],
        r: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let whole = cols / 16 * 16;
        let wp = w.as_ptr().add(r * cols);
        let xp = x.as_ptr();
        let mut c = 0;
        while c < whole {
            let mut wv = [_mm512_setzero_ps(); R];
            for (i, v) in wv.iter_mut().enumerate() {
                *v = E::load16(wp.add(i * cols + c));
            }
            for t in 0..T {
                let xv = _mm512_loadu_ps(xp.add(t * cols + c));
                for i in 0..R {
                    acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
                }
            }
            c += 16;
        }
        let mut sums = [[0.0f32; T]; R];
        for i in 0..R {
            for t in 0..T {
                let mut s = _mm512_reduce_add_ps(acc[i][t]);
                for k in whole..cols {
                    s += (*wp.add(i * cols + k)).value() * *xp.add(t * cols + k);
                }
                sums[i][t] = s;
            }
        }
        sums
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every output against a float64 sum, then the same bits one token at a time and with the
    /// rows shared out in two parts.
    fn check(w: AnyWeights<'_>, value: impl Fn(usize) -> f32, rows: usize, cols: usize) {
        let m = 11;
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 32.0)
            .collect();
        let mut block = vec![0.0f32; rows * m];
        rows_into(w, cols, &x, m, 0..rows, &mut block);
        for r in 0..rows {
            for t in 0..m {
                let want: f64 = (0..cols)
                    .map(|k| f64::from(value(r * cols + k)) * f64::from(x[t * cols + k]))
                    .sum();
                let got = f64::from(block[r * m + t]);
                assert!(
                    (got - want).abs() < 1e-3,
                    "row {r} token {t}: {got} vs {want}"
                );
            }
        }
        for t in 0..m {
            let mut one = vec![0.0f32; rows];
            let xt = &x[t * cols..(t + 1) * cols];
            rows_into(w, cols, xt, 1, 0..5, &mut one[..5]);
            rows_into(w, cols, xt, 1, 5..rows, &mut one[5..]);
            for r in 0..rows {
                assert_eq!(
                    one[r].to_bits(),
                    block[r * m + t].to_bits(),
                    "row {r} token {t}"
                );
            }
        }
    }

    #[test]
    fn products_match_a_float64_sum_and_a_block_equals_its_tokens() {
        // 83 columns: five whole 16-lane chunks and a tail; 37 rows: pairs and a last one.
        let (rows, cols) = (37, 83);
        let f32s: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0 + 1e-4 * (i % 7) as f32)
            .collect();
        check(AnyWeights::F32(&f32s), |i| f32s[i], rows, cols);
        let bf16s: Vec<u16> = f32s
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        check(AnyWeights::Bf16(&bf16s), |i| bf16s[i].value(), rows, cols);
    }
}
