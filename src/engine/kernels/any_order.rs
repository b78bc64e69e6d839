//! Products over f32 or bfloat16 weights with f32 inputs and sums, in whatever order is
//! fastest here: fused multiply-adds over the widest vector lanes the host kernels run (16 with
//! AVX-512, 8 with AVX2), two weight rows against a pass of tokens at once (each weight row is
//! read from memory once per block, each input chunk serves both rows).
//!
//! For products whose bits need match nothing: a DSpark drafter's block, whose proposals the
//! target verifies. Such a block streams its weights once a round and is bound by their bytes,
//! hence bfloat16 where the weights are bfloat16 values (a drafter stored in bfloat16, as the
//! shipped one is, whatever dtype it computes in).
//! Each output is summed in one order whatever the block or the share of rows, so a block's
//! bits equal its tokens' one by one (on one CPU; another vector width sums otherwise).

use super::mlx_order::Simd;
use std::ops::Range;

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
    rows_into_on(super::mlx_order::simd(), w, cols, x, m, rows, out)
}

/// [`rows_into`] on the vector set `simd` (one this CPU runs), or the plain sums for `None`.
fn rows_into_on(
    simd: Option<Simd>,
    w: AnyWeights<'_>,
    cols: usize,
    x: &[f32],
    m: usize,
    rows: Range<usize>,
    out: &mut [f32],
) {
    match w {
        AnyWeights::F32(w) => rows_into_of(simd, w, cols, x, m, rows, out),
        AnyWeights::Bf16(w) => rows_into_of(simd, w, cols, x, m, rows, out),
    }
}

/// A weight element the kernel reads.
trait Element: Copy {
    fn value(self) -> f32;
    /// `V::N` consecutive elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p..p + V::N` must be readable, on a CPU that runs `V`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load<V: Lane>(p: *const Self) -> V;
}

#[cfg(target_arch = "x86_64")]
use super::mlx_order::x86::Lane;

impl Element for f32 {
    fn value(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load<V: Lane>(p: *const Self) -> V {
        V::load(p)
    }
}

impl Element for u16 {
    fn value(self) -> f32 {
        f32::from_bits(u32::from(self) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load<V: Lane>(p: *const Self) -> V {
        V::load_bf16(p)
    }
}

fn rows_into_of<E: Element>(
    simd: Option<Simd>,
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
    {
        assert!(
            simd.is_none_or(Simd::runs_here),
            "{simd:?} does not run here"
        );
        // SAFETY: this CPU runs `simd` (asserted); the buffers hold what the product reads
        // and writes (asserted above).
        match simd {
            Some(Simd::Avx512) => return unsafe { x86::rows_avx512(w, cols, x, m, rows, out) },
            Some(Simd::Avx2) => return unsafe { x86::rows_avx2(w, cols, x, m, rows, out) },
            None => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd;
    // Without the host kernels: one plain sum per output.
    let dot = |w: &[E], x: &[f32]| w.iter().zip(x).map(|(w, x)| w.value() * x).sum();
    super::vecops::rows_by_dot(w, cols, x, m, rows, out, dot);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Element, Lane};
    use std::arch::x86_64::*;
    use std::ops::Range;

    #[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
    pub(super) unsafe fn rows_avx512<E: Element>(
        w: &[E],
        cols: usize,
        x: &[f32],
        m: usize,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        rows_into::<E, __m512>(w, cols, x, m, rows, out)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_avx2<E: Element>(
        w: &[E],
        cols: usize,
        x: &[f32],
        m: usize,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        rows_into::<E, __m256>(w, cols, x, m, rows, out)
    }

    /// Tokens one pass takes: two rows' chains for each, the two rows' weights and an input
    /// fit the vector registers (32 with AVX-512, 16 with AVX2).
    fn pass_tokens<V: Lane>() -> usize {
        if V::N == 16 {
            8
        } else {
            4
        }
    }

    /// Every pair of rows (and a last single one) against every pass of [`pass_tokens`]
    /// tokens: a pair's weights come from memory for the first pass, from the first-level
    /// cache after.
    #[inline(always)]
    unsafe fn rows_into<E: Element, V: Lane>(
        w: &[E],
        cols: usize,
        x: &[f32],
        m: usize,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        let start = rows.start;
        let mut r = rows.start;
        while r < rows.end {
            let pair = rows.end - r >= 2;
            let mut first = 0;
            while first < m {
                let n = (m - first).min(pass_tokens::<V>());
                let xs = &x[first * cols..(first + n) * cols];
                let at = (r - start) * m + first;
                macro_rules! pass {
                    ($t:literal) => {
                        if pair {
                            let sums = block::<E, V, 2, $t>(w, cols, xs, r);
                            out[at..at + $t].copy_from_slice(&sums[0]);
                            out[at + m..at + m + $t].copy_from_slice(&sums[1]);
                        } else {
                            let sums = block::<E, V, 1, $t>(w, cols, xs, r);
                            out[at..at + $t].copy_from_slice(&sums[0]);
                        }
                    };
                }
                seq_macro::seq!(T in 1..=7 {
                    match n {
                        #(T => pass!(T),)*
                        _ => pass!(8),
                    }
                });
                first += n;
            }
            r += 1 + usize::from(pair);
        }
    }

    /// The sums of weight rows `r..r + R` with each of the `T` tokens.
    // The register block is indexed by row and token together.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn block<E: Element, V: Lane, const R: usize, const T: usize>(
        w: &[E],
        cols: usize,
        x: &[f32],
        r: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[V::zero(); T]; R];
        let whole = cols / V::N * V::N;
        let wp = w.as_ptr().add(r * cols);
        let xp = x.as_ptr();
        let mut c = 0;
        while c < whole {
            let mut wv = [V::zero(); R];
            for (i, v) in wv.iter_mut().enumerate() {
                *v = E::load::<V>(wp.add(i * cols + c));
            }
            for t in 0..T {
                let xv = V::load(xp.add(t * cols + c));
                for i in 0..R {
                    acc[i][t] = V::fmadd(wv[i], xv, acc[i][t]);
                }
            }
            c += V::N;
        }
        let mut sums = [[0.0f32; T]; R];
        for i in 0..R {
            for t in 0..T {
                let mut s = acc[i][t].sum();
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

    /// On every vector set this CPU runs (AVX2 on an AVX-512 machine too) and on the plain
    /// sums: [`check_on`].
    fn check(w: AnyWeights<'_>, value: impl Fn(usize) -> f32, rows: usize, cols: usize) {
        let sets = [Some(Simd::Avx512), Some(Simd::Avx2)]
            .into_iter()
            .filter(|s| s.is_some_and(Simd::runs_here));
        for simd in sets.chain([None]) {
            check_on(simd, w, &value, rows, cols);
        }
    }

    /// Every output against a float64 sum, then the same bits one token at a time and with the
    /// rows shared out in two parts.
    fn check_on(
        simd: Option<Simd>,
        w: AnyWeights<'_>,
        value: impl Fn(usize) -> f32,
        rows: usize,
        cols: usize,
    ) {
        let rows_into = |w, cols, x: &[f32], m, range, out: &mut [f32]| {
            rows_into_on(simd, w, cols, x, m, range, out)
        };
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
                    "{simd:?}: row {r} token {t}: {got} vs {want}"
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
                    "{simd:?}: row {r} token {t}"
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
