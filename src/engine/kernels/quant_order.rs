//! Products through MLX's affine-quantized 4-/8-bit layers (f32 or bf16 scales and biases) summed in
//! exactly the order MLX's CPU `quantized_matmul` sums them, so that L1 decoding of such a model
//! keeps MLX's bits without MLX's kernel (`--host-matvec on`).
//!
//! Why: MLX's CPU kernel for a transposed quantized weight (`_qmm_t`) is one scalar loop per
//! output on one thread (SmolLM2 4-bit decodes at ~6 tokens/s on it, 2 % of the roofline).
//!
//! The order (MLX 0.32's `_qmm_t` for `float`, whose SIMD variant needs vectors of at least 8
//! lanes, which MLX's x86 CPU build does not have): per output and token one f32 sum from zero
//! over the depth in order, each term `x · (scale · q + bias)` with the group's scale and bias and
//! every operation rounded on its own (no fused multiply-add). Each output is summed alone, so
//! the number of tokens and the split over threads change no bit. With bf16 scales MLX computes in
//! bf16: every operation, the running sum included, is rounded to bf16 as MLX rounds it. [`super::dense`]-style checks
//! against MLX's own `quantized_matmul` guard the claim at run time ([`super::qdense`]).

use super::elementwise::bf16_mlx;
use super::pair;

/// Rows a chunk of the product holds (the vector kernel's group of sixteen, times four).
const CHUNK_ROWS: usize = 64;
/// Tokens the vector kernel runs past one pass over a group of rows.
const TOKEN_BLOCK: usize = 8;
/// How far ahead of the words being read each row's words are fetched.
const PREFETCH_WORDS: usize = 64;

/// An affine-quantized `rows × cols` weight as MLX stores it: `packed` holds `cols · bits / 32`
/// words per row, value `k` of a row at bits `k · bits ..` of the row read as one little-endian
/// bit string (MLX's packs of 3, 5 or 3 bytes for 3-, 5- and 6-bit values are that string too),
/// `scales` and `biases` one value per row and group of `group` inputs, laid out by
/// [`blocked`].
#[derive(Debug, Clone, Copy)]
pub struct QuantWeights<'a> {
    /// Packed values, row-major.
    pub packed: &'a [u32],
    /// Per row and group ([`blocked`] layout).
    pub scales: &'a [f32],
    /// Per row and group ([`blocked`] layout).
    pub biases: &'a [f32],
    /// Outputs.
    pub rows: usize,
    /// Inputs.
    pub cols: usize,
    /// 2, 3, 4, 5, 6 or 8 (MLX's widths).
    pub bits: usize,
    /// Inputs per scale and bias (32, 64 or 128).
    pub group: usize,
    /// bfloat16 layers (scales, biases and inputs bf16, given widened): MLX then rounds every
    /// operation's result to bfloat16, the running sum included.
    pub bf16: bool,
}

impl QuantWeights<'_> {
    fn words_per_row(&self) -> usize {
        self.cols * self.bits / 32
    }

    fn groups(&self) -> usize {
        self.cols / self.group
    }

    /// Whether the buffers and sizes describe a weight this module reads.
    fn check(&self) -> Result<(), String> {
        let ok = matches!(self.bits, 2 | 3 | 4 | 5 | 6 | 8)
            && matches!(self.group, 32 | 64 | 128)
            && self.cols > 0
            && self.cols.is_multiple_of(self.group)
            && self.packed.len() == self.rows * self.words_per_row()
            && self.scales.len() == self.rows * self.groups()
            && self.biases.len() == self.rows * self.groups();
        if ok {
            Ok(())
        } else {
            Err(format!(
                "a {}x{} weight of {} bits in groups of {} does not match its buffers ({} words, {} scales, {} biases)",
                self.rows,
                self.cols,
                self.bits,
                self.group,
                self.packed.len(),
                self.scales.len(),
                self.biases.len()
            ))
        }
    }

    /// Where row `r`'s scale and bias of group `g` sit.
    fn group_at(&self, r: usize, g: usize) -> usize {
        blocked_index(self.rows, self.groups(), r, g)
    }

    /// Row `r` dequantized in f32 (`scale · q + bias`): an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        for (k, o) in out.iter_mut().enumerate().take(self.cols) {
            let g = self.group_at(r, k / self.group);
            *o = self.scales[g] * self.q(r, k) + self.biases[g];
        }
    }

    /// Value `k` of row `r`, unscaled.
    fn q(&self, r: usize, k: usize) -> f32 {
        let at = r * self.words_per_row() + k * self.bits / 32;
        let shift = (k * self.bits) % 32;
        let mut v = self.packed[at] >> shift;
        if shift + self.bits > 32 {
            v |= self.packed[at + 1] << (32 - shift);
        }
        (v & ((1 << self.bits) - 1)) as f32
    }
}

/// Per-row, per-group values (`rows × groups`, row-major, as MLX stores scales and biases)
/// reordered so that each whole group of sixteen rows holds its sixteen values of a group side
/// by side (one vector load in the kernel instead of a gather over sixteen rows); rows past the
/// last whole group of sixteen stay row-major at the end. A range of rows that starts on a
/// multiple of sixteen is a contiguous run of the result, laid out the same way.
pub fn blocked(plain: &[f32], rows: usize, groups: usize) -> Vec<f32> {
    let mut out = vec![0.0; plain.len()];
    for r in 0..rows {
        for g in 0..groups {
            out[blocked_index(rows, groups, r, g)] = plain[r * groups + g];
        }
    }
    out
}

fn blocked_index(rows: usize, groups: usize, r: usize, g: usize) -> usize {
    if r < rows / 16 * 16 {
        ((r / 16) * groups + g) * 16 + r % 16
    } else {
        r * groups + g
    }
}

/// Words that hold a whole number of `bits`-bit values, and how many: one word for 2, 4 and 8
/// bits; three words (16 values) for 6 bits; `bits` words (32 values) for 3 and 5 bits.
const fn unit(bits: usize) -> (usize, usize) {
    let common = gcd(bits, 32);
    (bits / common, 32 / common)
}

const fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// MLX's sum for output `r` of one token `x` (the reference order; also the path for rows past
/// the last group of sixteen and for CPUs without AVX-512).
pub fn output_scalar(w: &QuantWeights<'_>, r: usize, x: &[f32]) -> f32 {
    let mut sum = 0.0f32;
    for (k, xk) in x.iter().enumerate().take(w.cols) {
        let g = w.group_at(r, k / w.group);
        let (scale, bias) = (w.scales[g], w.biases[g]);
        if w.bf16 {
            let round = |v: f32| bf16_mlx(v).to_f32();
            let value = round(round(scale * w.q(r, k)) + bias);
            sum = round(sum + round(xk * value));
        } else {
            sum += xk * (scale * w.q(r, k) + bias);
        }
    }
    sum
}

/// The kernel a product runs on: every path sums each output in the same order (the lanes hold
/// different rows), so they differ only in speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Sixteen rows per vector (AVX-512F/BW with FMA and F16C, as the other host kernels).
    Avx512,
    /// Eight rows per vector, twice per group of sixteen (AVX2).
    Avx2,
    /// One output at a time.
    Scalar,
}

impl Path {
    /// The path products take: the fastest this CPU runs, or the one `MLXB_QUANT_KERNEL`
    /// (`avx512`, `avx2`, `scalar`) names when this CPU runs it (to compare paths' speed).
    pub fn best() -> Path {
        static CHOSEN: std::sync::OnceLock<Path> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let fastest = Path::fastest();
            let Ok(asked) = std::env::var("MLXB_QUANT_KERNEL") else {
                return fastest;
            };
            let forced = match asked.as_str() {
                "avx512" => Path::Avx512,
                "avx2" => Path::Avx2,
                "scalar" => Path::Scalar,
                _ => {
                    eprintln!(
                        "mlxb: MLXB_QUANT_KERNEL={asked:?} is not a path (avx512, avx2 or scalar); using {fastest:?}"
                    );
                    return fastest;
                }
            };
            if !forced.runs_here() {
                eprintln!("mlxb: this CPU cannot run MLXB_QUANT_KERNEL={asked}; using {fastest:?}");
                return fastest;
            }
            forced
        })
    }

    fn fastest() -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            if super::mlx_order::Simd::Avx512.runs_here() {
                return Path::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Path::Avx2;
            }
        }
        Path::Scalar
    }

    /// Whether this CPU can run the path.
    pub fn runs_here(self) -> bool {
        match (self, Path::fastest()) {
            (Path::Scalar, _) | (_, Path::Avx512) => true,
            (Path::Avx2, fastest) => fastest == Path::Avx2,
            (Path::Avx512, _) => false,
        }
    }
}

/// `Y = X · Wᵀ` for `tokens` f32 tokens (`x` is `tokens × cols`, the result `tokens × rows`),
/// in MLX's order, on the fastest [`Path`]; `threads` ≥ 2 shares chunks of rows with the
/// [`pair`] helper.
pub fn qmatmul(
    w: &QuantWeights<'_>,
    x: &[f32],
    tokens: usize,
    threads: usize,
) -> Result<Vec<f32>, String> {
    qmatmul_on(Path::best(), w, x, tokens, threads)
}

/// [`qmatmul`] on a given path (refused when this CPU cannot run it).
pub fn qmatmul_on(
    path: Path,
    w: &QuantWeights<'_>,
    x: &[f32],
    tokens: usize,
    threads: usize,
) -> Result<Vec<f32>, String> {
    w.check()?;
    if !path.runs_here() {
        return Err(format!("this CPU cannot run the {path:?} path"));
    }
    if tokens == 0 || x.len() != tokens * w.cols {
        return Err(format!(
            "{} input values for {tokens} tokens of depth {}",
            x.len(),
            w.cols
        ));
    }
    let chunks = if threads < 2 {
        1
    } else {
        w.rows.div_ceil(CHUNK_ROWS)
    };
    let chunk_rows = w.rows.div_ceil(chunks.max(1)).div_ceil(16) * 16;
    let parts: Vec<std::sync::Mutex<Vec<f32>>> = (0..w.rows.div_ceil(chunk_rows.max(1)))
        .map(|_| std::sync::Mutex::new(Vec::new()))
        .collect();
    pair::share(parts.len(), &|i| {
        let start = i * chunk_rows;
        let end = (start + chunk_rows).min(w.rows);
        let mut out = vec![0.0f32; tokens * (end - start)];
        rows_into(path, w, x, tokens, start..end, &mut out);
        *super::lock(&parts[i]) = out;
    });
    let mut y = vec![0.0f32; tokens * w.rows];
    for (i, part) in parts.into_iter().enumerate() {
        let out = part.into_inner().unwrap_or_else(|p| p.into_inner());
        let start = i * chunk_rows;
        let len = out.len() / tokens;
        for (t, row) in out.chunks_exact(len.max(1)).enumerate().take(tokens) {
            y[t * w.rows + start..t * w.rows + start + len].copy_from_slice(row);
        }
    }
    Ok(y)
}

/// Outputs `range` of every token into `out` (`tokens × range.len()`), on `path` (which must
/// run on this CPU).
pub(super) fn rows_into(
    path: Path,
    w: &QuantWeights<'_>,
    x: &[f32],
    tokens: usize,
    range: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let len = range.len();
    let mut r = range.start;
    #[cfg(not(target_arch = "x86_64"))]
    let _ = path;
    #[cfg(target_arch = "x86_64")]
    if path != Path::Scalar {
        while r + 16 <= range.end {
            let mut t0 = 0;
            while t0 < tokens {
                let n = (tokens - t0).min(TOKEN_BLOCK);
                let block = &x[t0 * w.cols..(t0 + n) * w.cols];
                let avx512 = path == Path::Avx512;
                // SAFETY: the path runs on this CPU (checked by `qmatmul_on`); `w` was checked
                // against its buffers (so its width is one of these) and `r + 16 <= rows`.
                let sums = unsafe {
                    match w.bits {
                        2 => x86::group16::<2>(avx512, w, r, block, n),
                        3 => x86::group16::<3>(avx512, w, r, block, n),
                        4 => x86::group16::<4>(avx512, w, r, block, n),
                        5 => x86::group16::<5>(avx512, w, r, block, n),
                        6 => x86::group16::<6>(avx512, w, r, block, n),
                        _ => x86::group16::<8>(avx512, w, r, block, n),
                    }
                };
                for (t, s) in sums.iter().enumerate().take(n) {
                    out[(t0 + t) * len + r - range.start..][..16].copy_from_slice(s);
                }
                t0 += n;
            }
            r += 16;
        }
    }
    for r in r..range.end {
        for t in 0..tokens {
            out[t * len + r - range.start] = output_scalar(w, r, &x[t * w.cols..(t + 1) * w.cols]);
        }
    }
}

/// The vector kernel, written once ([`group_kernel`]) over a few lane operations with the same
/// names for sixteen lanes ([`lanes16`], AVX-512F) and eight ([`lanes8`], AVX2). Every form sums
/// each output in the same order (the lanes hold different rows), so they differ only in speed.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{QuantWeights, PREFETCH_WORDS, TOKEN_BLOCK};

    /// Sixteen f32 lanes. The operations are plain functions inlined into the kernel, which
    /// carries the instruction set's `target_feature`.
    #[allow(clippy::missing_safety_doc)]
    pub(super) mod lanes16 {
        use std::arch::x86_64::*;
        pub type F = __m512;
        pub type I = __m512i;
        pub const N: usize = 16;
        #[inline(always)]
        pub unsafe fn gather(base: *const u32, index: I) -> I {
            _mm512_i32gather_epi32::<4>(index, base.cast())
        }
        #[inline(always)]
        pub unsafe fn shr(v: I, by: i32) -> I {
            _mm512_srlv_epi32(v, _mm512_set1_epi32(by))
        }
        #[inline(always)]
        pub unsafe fn shl(v: I, by: i32) -> I {
            _mm512_sllv_epi32(v, _mm512_set1_epi32(by))
        }
        #[inline(always)]
        pub unsafe fn or(a: I, b: I) -> I {
            _mm512_or_si512(a, b)
        }
        #[inline(always)]
        pub unsafe fn and(a: I, b: I) -> I {
            _mm512_and_si512(a, b)
        }
        #[inline(always)]
        pub unsafe fn splat_i(v: i32) -> I {
            _mm512_set1_epi32(v)
        }
        #[inline(always)]
        pub unsafe fn zero_i() -> I {
            _mm512_setzero_si512()
        }
        #[inline(always)]
        pub unsafe fn to_f32(v: I) -> F {
            _mm512_cvtepi32_ps(v)
        }
        #[inline(always)]
        pub unsafe fn splat(v: f32) -> F {
            _mm512_set1_ps(v)
        }
        #[inline(always)]
        pub unsafe fn zero() -> F {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        pub unsafe fn load(p: *const f32) -> F {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        pub unsafe fn store(p: *mut f32, v: F) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        pub unsafe fn mul(a: F, b: F) -> F {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        pub unsafe fn add(a: F, b: F) -> F {
            _mm512_add_ps(a, b)
        }
        /// Lane `l` holds `l · stride`.
        #[inline(always)]
        pub unsafe fn strided(stride: i32) -> I {
            _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(stride),
            )
        }
        /// Each lane rounded to bfloat16 (and widened back) as MLX's `bfloat16_t` rounds: to
        /// nearest, ties to even, every NaN to `0x7FC0`.
        #[inline(always)]
        pub unsafe fn round(v: F) -> F {
            let bits = _mm512_castps_si512(v);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let biased = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
            let rounded = _mm512_and_si512(biased, _mm512_set1_epi32(0xFFFF_0000_u32 as i32));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            let rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0_0000));
            _mm512_castsi512_ps(rounded)
        }
    }

    /// Eight f32 lanes, the same operations.
    #[allow(clippy::missing_safety_doc)]
    pub(super) mod lanes8 {
        use std::arch::x86_64::*;
        pub type F = __m256;
        pub type I = __m256i;
        pub const N: usize = 8;
        #[inline(always)]
        pub unsafe fn gather(base: *const u32, index: I) -> I {
            _mm256_i32gather_epi32::<4>(base.cast(), index)
        }
        #[inline(always)]
        pub unsafe fn shr(v: I, by: i32) -> I {
            _mm256_srlv_epi32(v, _mm256_set1_epi32(by))
        }
        #[inline(always)]
        pub unsafe fn shl(v: I, by: i32) -> I {
            _mm256_sllv_epi32(v, _mm256_set1_epi32(by))
        }
        #[inline(always)]
        pub unsafe fn or(a: I, b: I) -> I {
            _mm256_or_si256(a, b)
        }
        #[inline(always)]
        pub unsafe fn and(a: I, b: I) -> I {
            _mm256_and_si256(a, b)
        }
        #[inline(always)]
        pub unsafe fn splat_i(v: i32) -> I {
            _mm256_set1_epi32(v)
        }
        #[inline(always)]
        pub unsafe fn zero_i() -> I {
            _mm256_setzero_si256()
        }
        #[inline(always)]
        pub unsafe fn to_f32(v: I) -> F {
            _mm256_cvtepi32_ps(v)
        }
        #[inline(always)]
        pub unsafe fn splat(v: f32) -> F {
            _mm256_set1_ps(v)
        }
        #[inline(always)]
        pub unsafe fn zero() -> F {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        pub unsafe fn load(p: *const f32) -> F {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        pub unsafe fn store(p: *mut f32, v: F) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        pub unsafe fn mul(a: F, b: F) -> F {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        pub unsafe fn add(a: F, b: F) -> F {
            _mm256_add_ps(a, b)
        }
        /// Lane `l` holds `l · stride`.
        #[inline(always)]
        pub unsafe fn strided(stride: i32) -> I {
            _mm256_mullo_epi32(
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                _mm256_set1_epi32(stride),
            )
        }
        /// As [`super::lanes16::round`].
        #[inline(always)]
        pub unsafe fn round(v: F) -> F {
            let bits = _mm256_castps_si256(v);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
            let biased = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
            let rounded = _mm256_and_si256(biased, _mm256_set1_epi32(0xFFFF_0000_u32 as i32));
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
            let quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0_0000));
            _mm256_blendv_ps(_mm256_castsi256_ps(rounded), quiet, nan)
        }
    }

    /// Defines `$name::<BITS>(w, r, x, n)`: rows `r..r + N` for `n` (≤ [`TOKEN_BLOCK`]) tokens
    /// `x`, the rows side by side in the lanes of `$v`, each word of the rows gathered once (a
    /// unit of whole values at a time, so a value that straddles two words is joined from both),
    /// each dequantized value `scale · q + bias` formed once and met by every token. `BITS` is a
    /// constant so that each unit's shifts are known when it is compiled.
    macro_rules! group_kernel {
        ($name:ident, $feature:literal, $v:ident) => {
            #[target_feature(enable = $feature)]
            unsafe fn $name<const BITS: usize>(
                w: &QuantWeights<'_>,
                r: usize,
                x: &[f32],
                n: usize,
            ) -> [[f32; $v::N]; TOKEN_BLOCK] {
                let (wpr, groups) = (w.words_per_row(), w.groups());
                let word_index = $v::strided(wpr as i32);
                let mask = $v::splat_i((1 << BITS) - 1);
                let (unit_words, unit_values) = super::unit(BITS);
                let mut acc = [$v::zero(); TOKEN_BLOCK];
                let words = w.packed.as_ptr().add(r * wpr);
                for g in 0..groups {
                    let at = w.group_at(r, g);
                    let scale = $v::load(w.scales.as_ptr().add(at));
                    let bias = $v::load(w.biases.as_ptr().add(at));
                    let first = g * w.group / unit_values;
                    // The rows are more streams than the hardware prefetcher follows: fetch each
                    // row's words a few lines ahead, once per group. Past a row's end the address
                    // falls in the next row, and past the last row's in the next rows of the
                    // product: words read soon either way (a prefetch never faults).
                    let ahead = g * w.group * BITS / 32 + PREFETCH_WORDS;
                    for lane in 0..$v::N {
                        let line = words.wrapping_add(lane * wpr + ahead);
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                            line.cast(),
                        );
                    }
                    for unit in first..first + w.group / unit_values {
                        let mut v = [$v::zero_i(); 5];
                        for (i, vi) in v.iter_mut().enumerate().take(unit_words) {
                            *vi = $v::gather(words.add(unit * unit_words + i), word_index);
                        }
                        for e in 0..unit_values {
                            let (i, shift) = (e * BITS / 32, (e * BITS % 32) as i32);
                            let mut joined = $v::shr(v[i], shift);
                            if shift as usize + BITS > 32 {
                                joined = $v::or(joined, $v::shl(v[i + 1], 32 - shift));
                            }
                            let q = $v::to_f32($v::and(joined, mask));
                            let k = unit * unit_values + e;
                            if w.bf16 {
                                let scaled = $v::round($v::mul(scale, q));
                                let value = $v::round($v::add(scaled, bias));
                                for (t, a) in acc.iter_mut().enumerate().take(n) {
                                    let xv = $v::splat(*x.get_unchecked(t * w.cols + k));
                                    *a = $v::round($v::add(*a, $v::round($v::mul(xv, value))));
                                }
                            } else {
                                let value = $v::add($v::mul(scale, q), bias);
                                for (t, a) in acc.iter_mut().enumerate().take(n) {
                                    let xv = $v::splat(*x.get_unchecked(t * w.cols + k));
                                    *a = $v::add(*a, $v::mul(xv, value));
                                }
                            }
                        }
                    }
                }
                let mut out = [[0.0f32; $v::N]; TOKEN_BLOCK];
                for (o, a) in out.iter_mut().zip(&acc).take(n) {
                    $v::store(o.as_mut_ptr(), *a);
                }
                out
            }
        };
    }

    group_kernel!(rows16, "avx512f", lanes16);
    group_kernel!(rows8, "avx2", lanes8);

    /// Rows `r..r + 16` for `n` tokens: one AVX-512 pass, or two AVX2 passes of eight rows
    /// (whose scales and biases sit side by side in the [`super::blocked`] layout, eight and
    /// eight).
    ///
    /// # Safety
    /// The CPU runs the chosen instruction set; `w` was checked against its buffers and
    /// `r + 16 <= w.rows`.
    pub(super) unsafe fn group16<const BITS: usize>(
        avx512: bool,
        w: &QuantWeights<'_>,
        r: usize,
        x: &[f32],
        n: usize,
    ) -> [[f32; 16]; TOKEN_BLOCK] {
        if avx512 {
            return rows16::<BITS>(w, r, x, n);
        }
        let mut out = [[0.0f32; 16]; TOKEN_BLOCK];
        for half in 0..2 {
            let sums = rows8::<BITS>(w, r + 8 * half, x, n);
            for (o, s) in out.iter_mut().zip(&sums).take(n) {
                o[8 * half..8 * half + 8].copy_from_slice(s);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A weight with every quantized value and awkward f32 scales and biases.
    fn weight(
        rows: usize,
        cols: usize,
        bits: usize,
        group: usize,
    ) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
        let mut s = 0x9e37_79b9_u32;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        };
        let packed = (0..rows * cols * bits / 32).map(|_| next()).collect();
        let groups = rows * cols / group;
        let scales = (0..groups)
            .map(|_| (next() % 1000) as f32 / 7919.0 + 1e-3)
            .collect();
        let biases = (0..groups)
            .map(|_| -((next() % 1000) as f32) / 3571.0)
            .collect();
        (packed, scales, biases)
    }

    /// A window of rows that starts on a multiple of sixteen is the same run of the blocked
    /// layout as the blocked layout of the window alone (the host check multiplies such windows).
    #[test]
    fn blocked_windows_are_runs_of_the_whole() {
        let (rows, groups) = (53, 3);
        let plain: Vec<f32> = (0..rows * groups).map(|i| i as f32).collect();
        let whole = blocked(&plain, rows, groups);
        for start in [0, 16, 32, 48] {
            for end in (start + 1)..=rows {
                if end % 16 != 0 && end != rows {
                    continue;
                }
                let alone = blocked(&plain[start * groups..end * groups], end - start, groups);
                assert_eq!(
                    &whole[start * groups..end * groups],
                    &alone[..],
                    "{start}..{end}"
                );
            }
        }
        assert_eq!(
            whole[blocked_index(rows, groups, 17, 2)],
            plain[17 * groups + 2]
        );
    }

    /// Every path this CPU runs, on one thread and two, gives the scalar reference's bits for every
    /// output of every token, on rows that are and are not whole groups of sixteen.
    #[test]
    fn every_path_equals_the_scalar_order() {
        for (rows, cols, bits, group, bf16) in [
            (40, 128, 4, 64, false),
            (130, 256, 8, 32, false),
            (16, 384, 4, 128, false),
            (40, 128, 4, 64, true),
            (130, 256, 8, 32, true),
            (24, 64, 2, 32, false),
            (40, 96, 3, 32, false),
            (40, 160, 5, 32, false),
            (33, 192, 6, 64, false),
            (40, 160, 5, 32, true),
            (33, 192, 6, 64, true),
        ] {
            let (packed, scales, biases) = weight(rows, cols, bits, group);
            let round = |v: Vec<f32>| -> Vec<f32> {
                v.into_iter()
                    .map(|x| if bf16 { bf16_mlx(x).to_f32() } else { x })
                    .collect()
            };
            let (scales, biases) = (round(scales), round(biases));
            let w = QuantWeights {
                packed: &packed,
                scales: &scales,
                biases: &biases,
                rows,
                cols,
                bits,
                group,
                bf16,
            };
            for tokens in [1, 3, 9] {
                let x: Vec<f32> = round(
                    (0..tokens * cols)
                        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 33.0)
                        .collect(),
                );
                for (path, threads) in [Path::Avx512, Path::Avx2, Path::Scalar]
                    .into_iter()
                    .filter(|p| p.runs_here())
                    .flat_map(|p| [(p, 1), (p, 2)])
                {
                    let y = qmatmul_on(path, &w, &x, tokens, threads).unwrap();
                    for t in 0..tokens {
                        for r in 0..rows {
                            let want = output_scalar(&w, r, &x[t * cols..(t + 1) * cols]);
                            assert_eq!(
                                y[t * rows + r].to_bits(),
                                want.to_bits(),
                                "{rows}x{cols} {bits}-bit, x{tokens}, {path:?}, token {t} row {r}"
                            );
                        }
                    }
                }
            }
        }
        let f = [0u32; 4];
        let w = QuantWeights {
            packed: &f,
            scales: &[1.0],
            biases: &[0.0],
            rows: 1,
            cols: 32,
            bits: 7,
            group: 32,
            bf16: false,
        };
        assert!(qmatmul(&w, &[0.0; 32], 1, 1).is_err());
        assert!(qmatmul(&QuantWeights { bits: 3, ..w }, &[0.0; 32], 1, 1).is_err());
    }
}
