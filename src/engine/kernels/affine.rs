//! The affine-quantized mat-vec over MLX's packed layout, `y = x · Wᵀ` with f32 accumulation,
//! for 4-bit weights (and 8-bit ones, which GGUF Q8_0 embeddings/LM heads import as), in three
//! implementations of one algorithm: AVX-512, AVX2+FMA and portable scalar.
//!
//! Layout (MLX `quantize(w, group_size, bits)`): row `r` of `W` (`cols` inputs) is
//! `cols * bits / 32` little-endian `u32` words, element `(32 / bits) j + i` in bits
//! `bits i..bits (i + 1)` of word `j`; `scales`/`biases` hold one f32 per `group` elements,
//! and `w = scale * q + bias`.
//!
//! Every path walks a row in 32-element chunks (16 bytes at 4 bits, 32 at 8). At 4 bits byte
//! `k` of a chunk holds element `2k` in its low nibble and `2k + 1` in its high one, so the
//! input is permuted once per call into [`Prepared`] (per chunk: the 16 even elements, then
//! the 16 odd ones) and each chunk becomes two contiguous 16-lane products without shuffles;
//! at 8 bits the order is already natural. Weights are dequantized once per chunk
//! (`fma(q, scale, bias)`) and reused for every input row (M ≤ [`MAX_M`]).

use super::vnni::{Int8Input, SPAN};
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use x86::{rows_avx2, rows_avx512};

/// Most input rows one call takes (single-token decode is 1; a speculative verify block ≤ 8).
pub const MAX_M: usize = 8;

/// Elements per packed chunk (four `u32` words).
const CHUNK: usize = 32;

/// Bit widths the kernels take.
pub const BITS: [usize; 2] = [4, 8];

/// An affine-quantized matrix in MLX's packed layout, borrowed from host memory.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    bits: usize,
    packed: &'a [u32],
    scales: &'a [f32],
    biases: &'a [f32],
    rows: usize,
    cols: usize,
    group: usize,
}

impl<'a> QMatrix<'a> {
    /// Checks the bit width (4 or 8), the slice lengths against `rows × cols` and the group
    /// size (32, 64 or 128), so the kernels can index without bounds checks.
    pub fn new(
        bits: usize,
        packed: &'a [u32],
        scales: &'a [f32],
        biases: &'a [f32],
        rows: usize,
        cols: usize,
        group: usize,
    ) -> Result<Self, String> {
        if !BITS.contains(&bits) {
            return Err(format!("{bits}-bit weights have no host kernel (4 or 8)"));
        }
        if ![32, 64, 128].contains(&group) {
            return Err(format!(
                "group size {group} is not 32, 64 or 128 (MLX affine quantization)"
            ));
        }
        if cols == 0 || !cols.is_multiple_of(group) {
            return Err(format!(
                "{cols} input columns are not a positive multiple of the group size {group}"
            ));
        }
        let groups = rows * cols / group;
        let words = rows * cols * bits / 32;
        if packed.len() != words || scales.len() != groups || biases.len() != groups {
            return Err(format!(
                "a {rows}x{cols} {bits}-bit matrix needs {words} packed words and {groups} scales/biases, got {}, {} and {}",
                packed.len(),
                scales.len(),
                biases.len()
            ));
        }
        Ok(Self {
            bits,
            packed,
            scales,
            biases,
            rows,
            cols,
            group,
        })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bits per weight.
    pub fn bits(&self) -> usize {
        self.bits
    }

    /// Elements per scale/bias group.
    pub fn group(&self) -> usize {
        self.group
    }

    /// The packed codes, `rows × cols · bits / 32` words.
    pub fn packed(&self) -> &'a [u32] {
        self.packed
    }

    /// Per-group scales, `rows × cols / group`.
    pub fn scales(&self) -> &'a [f32] {
        self.scales
    }

    /// Per-group biases, `rows × cols / group`.
    pub fn biases(&self) -> &'a [f32] {
        self.biases
    }

    /// Row `r` dequantized (`scale * q + bias`) into `out` (`cols` values): an embedding lookup
    /// from a quantized table. Errors when `r` or `out` is out of shape.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), String> {
        row_fits(r, self.rows, self.cols, out.len())?;
        let per_word = 32 / self.bits;
        let mask = (1u32 << self.bits) - 1;
        let words = &self.packed[r * self.cols / per_word..(r + 1) * self.cols / per_word];
        let gpr = self.cols / self.group;
        let (scales, biases) = (
            &self.scales[r * gpr..(r + 1) * gpr],
            &self.biases[r * gpr..(r + 1) * gpr],
        );
        for (c, o) in out.iter_mut().enumerate() {
            let q = (words[c / per_word] >> (self.bits * (c % per_word))) & mask;
            let g = c / self.group;
            *o = q as f32 * scales[g] + biases[g];
        }
        Ok(())
    }
}

/// Whether row `r` of a `rows × cols` matrix fits an output of `len` values (a row lookup's check).
pub(super) fn row_fits(r: usize, rows: usize, cols: usize, len: usize) -> Result<(), String> {
    if r >= rows || len != cols {
        return Err(format!(
            "row {r} of a {rows}x{cols} matrix does not fit an output of {len}"
        ));
    }
    Ok(())
}

/// `m` input rows of `cols` values, permuted per 32-element chunk to match the element order
/// of `bits`-bit chunks.
pub struct Prepared {
    xp: Vec<f32>,
    int8: Option<Int8Input>,
    m: usize,
    cols: usize,
    bits: usize,
}

impl Prepared {
    /// Permutes `x` (`m × cols`, row-major; `cols` a multiple of 32, `m` in 1..=[`MAX_M`]) for
    /// `bits`-bit weights.
    pub fn new(x: &[f32], m: usize, cols: usize, bits: usize) -> Result<Self, String> {
        if m == 0 || m > MAX_M || !cols.is_multiple_of(CHUNK) || x.len() != m * cols {
            return Err(format!(
                "input of {} values is not {m} rows (1..={MAX_M}) of {cols} columns (a multiple of {CHUNK})",
                x.len()
            ));
        }
        if bits != 4 {
            return Ok(Self {
                xp: x.to_vec(),
                int8: None,
                m,
                cols,
                bits,
            });
        }
        let mut xp = vec![0.0f32; x.len()];
        for (src, dst) in x.chunks_exact(CHUNK).zip(xp.chunks_exact_mut(CHUNK)) {
            for k in 0..CHUNK / 2 {
                dst[k] = src[2 * k];
                dst[CHUNK / 2 + k] = src[2 * k + 1];
            }
        }
        Ok(Self {
            xp,
            int8: None,
            m,
            cols,
            bits,
        })
    }

    /// [`Prepared::new`], plus the int8 form `path` reads when it is the VNNI path and
    /// `cols` is a whole number of its spans (otherwise that path computes in f32 like
    /// [`KernelPath::Avx512`]).
    pub fn for_path(
        x: &[f32],
        m: usize,
        cols: usize,
        bits: usize,
        path: KernelPath,
    ) -> Result<Self, String> {
        let mut p = Self::new(x, m, cols, bits)?;
        if path == KernelPath::Avx512Vnni && cols.is_multiple_of(SPAN) {
            p.int8 = Some(Int8Input::new(x, m, cols, bits));
        }
        Ok(p)
    }

    /// The int8 form, when prepared for the VNNI path.
    pub fn int8(&self) -> Option<&Int8Input> {
        self.int8.as_ref()
    }

    /// Input rows.
    pub fn m(&self) -> usize {
        self.m
    }
}

/// Which implementation computes the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// AVX-512 VNNI over int8-rounded inputs ([`super::vnni`]): fewest instructions per
    /// weight, at the cost of rounding the input to 8 bits per 32-element block.
    Avx512Vnni,
    /// 16-lane AVX-512F.
    Avx512,
    /// 8-lane AVX2 with FMA.
    Avx2,
    /// Portable scalar code (any CPU; also the reference the SIMD paths are tested against).
    Scalar,
}

impl KernelPath {
    /// Every path, fastest first.
    pub const ALL: [KernelPath; 4] = [
        KernelPath::Avx512Vnni,
        KernelPath::Avx512,
        KernelPath::Avx2,
        KernelPath::Scalar,
    ];

    /// The name used by `MLXB_Q4_KERNEL`.
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Avx512Vnni => "avx512vnni",
            KernelPath::Avx512 => "avx512",
            KernelPath::Avx2 => "avx2",
            KernelPath::Scalar => "scalar",
        }
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            KernelPath::Scalar => true,
            KernelPath::Avx512Vnni => super::vnni::available(),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// Computes rows `rows` of `y = x · Wᵀ` into `out` (`rows.len() × m`, row-major by output
/// feature) with `path`. Errors when `path` is not available on this CPU or shapes disagree.
pub fn rows_into(
    path: KernelPath,
    w: &QMatrix<'_>,
    x: &Prepared,
    rows: Range<usize>,
    out: &mut [f32],
) -> Result<(), String> {
    if !path.available() {
        return Err(format!("this CPU cannot run the {} kernel", path.name()));
    }
    if x.cols != w.cols || x.bits != w.bits || rows.end > w.rows || out.len() != rows.len() * x.m {
        return Err(format!(
            "shape mismatch: {}x{} {}-bit matrix, input of {} columns for {} bits, rows {rows:?}, output of {}",
            w.rows,
            w.cols,
            w.bits,
            x.cols,
            x.bits,
            out.len()
        ));
    }
    macro_rules! by_m {
        ($f:ident, $b:literal) => {
            match x.m {
                1 => $f::<$b, 1>(w, &x.xp, rows, out),
                2 => $f::<$b, 2>(w, &x.xp, rows, out),
                3 => $f::<$b, 3>(w, &x.xp, rows, out),
                4 => $f::<$b, 4>(w, &x.xp, rows, out),
                5 => $f::<$b, 5>(w, &x.xp, rows, out),
                6 => $f::<$b, 6>(w, &x.xp, rows, out),
                7 => $f::<$b, 7>(w, &x.xp, rows, out),
                _ => $f::<$b, 8>(w, &x.xp, rows, out),
            }
        };
        ($f:ident) => {
            if w.bits == 4 {
                by_m!($f, 4)
            } else {
                by_m!($f, 8)
            }
        };
    }
    match path {
        KernelPath::Scalar => by_m!(rows_scalar),
        // SAFETY: `available()` checked the CPU features above, and the shapes were checked
        // here and in `QMatrix::new`/`Prepared::new`, which is all the kernels index by.
        // SAFETY: as above; the int8 input was prepared for this matrix's width and columns.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512Vnni if x.int8.is_some() => unsafe {
            if let Some(int8) = &x.int8 {
                super::vnni::rows_into(w, int8, rows, out)
            }
        },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni if w.bits == 4 && x.m == 1 => unsafe {
            x86::rows_avx512_q4_m1(w, &x.xp, rows, out)
        },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe { by_m!(rows_avx512) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => unsafe { by_m!(rows_avx2) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("not available off x86_64"),
    }
    Ok(())
}

/// The quantized values of one packed chunk, in the order of a [`Prepared`] chunk.
fn decode_chunk<const B: usize>(chunk: &[u32], q: &mut [u8; CHUNK]) {
    let bytes = chunk.iter().flat_map(|v| v.to_le_bytes());
    if B == 4 {
        for (k, byte) in bytes.enumerate() {
            q[k] = byte & 0xF;
            q[CHUNK / 2 + k] = byte >> 4;
        }
    } else {
        for (k, byte) in bytes.enumerate() {
            q[k] = byte;
        }
    }
}

fn rows_scalar<const B: usize, const M: usize>(
    w: &QMatrix<'_>,
    xp: &[f32],
    rows: Range<usize>,
    out: &mut [f32],
) {
    let words = w.cols * B / 32;
    let gpr = w.cols / w.group;
    let mut q = [0u8; CHUNK];
    for (i, r) in rows.enumerate() {
        let packed = &w.packed[r * words..(r + 1) * words];
        let (scales, biases) = (&w.scales[r * gpr..], &w.biases[r * gpr..]);
        let mut acc = [0.0f32; M];
        for (c, chunk) in packed.chunks_exact(B).enumerate() {
            let g = c * CHUNK / w.group;
            decode_chunk::<B>(chunk, &mut q);
            // Plain multiply-adds: `mul_add` is a libm call on CPUs without FMA.
            let (sg, bg) = (scales[g], biases[g]);
            let wv = q.map(|qv| f32::from(qv) * sg + bg);
            for (mi, a) in acc.iter_mut().enumerate() {
                let x = &xp[mi * w.cols + c * CHUNK..][..CHUNK];
                *a += wv.iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
            }
        }
        out[i * M..(i + 1) * M].copy_from_slice(&acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::mlx_order::x86::Lane;
    use super::{QMatrix, CHUNK};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// How far ahead of the codes being read the kernels prefetch (bytes; the scales and
    /// biases the same number of groups ahead). A decode step streams each weight once, and
    /// with the hardware prefetchers alone the 4-bit kernel waited on its loads (measured in
    /// docs/performance.md, "Prefetched 4-bit kernel"; 512 bytes ahead was no better).
    const PREFETCH_BYTES: usize = 1024;

    /// Asks for the cache line `ahead` elements past `p` (never dereferenced, so it may lie
    /// past the end of the slice).
    #[inline(always)]
    unsafe fn prefetch<T>(p: *const T, ahead: usize) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead).cast());
    }

    /// Prefetches the scales and biases (`groups`, one f32 per group of `group_bytes` codes)
    /// as far ahead as [`PREFETCH_BYTES`] of codes reach, once per cache line of them (`g`,
    /// the group about to be read).
    #[inline(always)]
    unsafe fn prefetch_groups(g: usize, groups: [*const f32; 2], group_bytes: usize) {
        if g.is_multiple_of(F32_PER_LINE) {
            for q in groups {
                prefetch(q, g + PREFETCH_BYTES / group_bytes);
            }
        }
    }

    /// f32 values in a 64-byte cache line.
    const F32_PER_LINE: usize = 16;

    /// AVX-512: a chunk's dequantized weights as two 16-lane vectors (prepared positions 0..16
    /// and 16..32). At 4 bits `table` holds the group's 16 possible weights `fma(q, s, b)` and
    /// each nibble selects its lane (`vpermps` reads only the index's low 4 bits, so the low
    /// nibbles need no mask); at 8 bits the bytes are converted and dequantized directly.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn chunk512<const B: usize>(
        p: *const u8,
        table: __m512,
        s: __m512,
        b: __m512,
    ) -> [__m512; 2] {
        let bytes = |o: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(o) as *const __m128i));
        if B == 4 {
            let v = bytes(0);
            [
                _mm512_permutexvar_ps(v, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), table),
            ]
        } else {
            [bytes(0), bytes(16)].map(|q| _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, b))
        }
    }

    /// AVX-512 rows: weights dequantized 16 lanes at a time, two accumulators per input row.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `w` must be `B`-bit and `xp` (`M × cols`) and `out`
    /// (`rows.len() × M`) must have the sizes [`super::rows_into`] checks.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows_avx512<const B: usize, const M: usize>(
        w: &QMatrix<'_>,
        xp: &[f32],
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        let cols = w.cols;
        let (gpr, cpg) = (cols / w.group, w.group / CHUNK);
        let iota = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        for (i, r) in rows.enumerate() {
            let packed = w.packed.as_ptr().add(r * cols * B / 32) as *const u8;
            let (srow, brow) = (
                w.scales.as_ptr().add(r * gpr),
                w.biases.as_ptr().add(r * gpr),
            );
            let mut acc = [[_mm512_setzero_ps(); 2]; M];
            for g in 0..gpr {
                prefetch_groups(g, [srow, brow], w.group * B / 8);
                let s = _mm512_set1_ps(*srow.add(g));
                let b = _mm512_set1_ps(*brow.add(g));
                let table = _mm512_fmadd_ps(iota, s, b);
                for c in g * cpg..(g + 1) * cpg {
                    prefetch(packed, c * 4 * B + PREFETCH_BYTES);
                    let wq = chunk512::<B>(packed.add(c * 4 * B), table, s, b);
                    for (mi, a) in acc.iter_mut().enumerate() {
                        let x = xp.as_ptr().add(mi * cols + c * CHUNK);
                        a[0] = _mm512_fmadd_ps(wq[0], _mm512_loadu_ps(x), a[0]);
                        a[1] = _mm512_fmadd_ps(wq[1], _mm512_loadu_ps(x.add(16)), a[1]);
                    }
                }
            }
            for (mi, a) in acc.iter().enumerate() {
                *out.get_unchecked_mut(i * M + mi) =
                    _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
            }
        }
    }

    /// AVX-512, 4-bit, one input row: two output rows at a time, so each input load and each
    /// group's loop overhead serve both rows and four independent accumulator chains hide
    /// the FMA latency (the decode-step hot path).
    ///
    /// # Safety
    /// As for [`rows_avx512`] with `B = 4` and `M = 1`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows_avx512_q4_m1(
        w: &QMatrix<'_>,
        xp: &[f32],
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        let cols = w.cols;
        let (gpr, cpg) = (cols / w.group, w.group / CHUNK);
        let iota = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let row_bytes = cols / 2;
        let x = xp.as_ptr();
        let (start, n) = (rows.start, rows.len());
        let mut i = 0;
        while i + 2 <= n {
            let r = start + i;
            let p0 = (w.packed.as_ptr() as *const u8).add(r * row_bytes);
            let p1 = p0.add(row_bytes);
            let (s0, b0) = (
                w.scales.as_ptr().add(r * gpr),
                w.biases.as_ptr().add(r * gpr),
            );
            let (s1, b1) = (s0.add(gpr), b0.add(gpr));
            let mut a = [_mm512_setzero_ps(); 4];
            for g in 0..gpr {
                prefetch_groups(g, [s0, b0], w.group / 2);
                prefetch_groups(g, [s1, b1], w.group / 2);
                let t0 =
                    _mm512_fmadd_ps(iota, _mm512_set1_ps(*s0.add(g)), _mm512_set1_ps(*b0.add(g)));
                let t1 =
                    _mm512_fmadd_ps(iota, _mm512_set1_ps(*s1.add(g)), _mm512_set1_ps(*b1.add(g)));
                for c in g * cpg..(g + 1) * cpg {
                    prefetch(p0, c * 16 + PREFETCH_BYTES);
                    prefetch(p1, c * 16 + PREFETCH_BYTES);
                    let (xl, xh) = (
                        _mm512_loadu_ps(x.add(c * CHUNK)),
                        _mm512_loadu_ps(x.add(c * CHUNK + 16)),
                    );
                    let v0 =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(p0.add(c * 16) as *const __m128i));
                    let v1 =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(p1.add(c * 16) as *const __m128i));
                    a[0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v0, t0), xl, a[0]);
                    a[1] = _mm512_fmadd_ps(
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v0), t0),
                        xh,
                        a[1],
                    );
                    a[2] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v1, t1), xl, a[2]);
                    a[3] = _mm512_fmadd_ps(
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v1), t1),
                        xh,
                        a[3],
                    );
                }
            }
            *out.get_unchecked_mut(i) = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
            *out.get_unchecked_mut(i + 1) = _mm512_reduce_add_ps(_mm512_add_ps(a[2], a[3]));
            i += 2;
        }
        if i < n {
            rows_avx512::<4, 1>(w, xp, start + i..rows.end, &mut out[i..]);
        }
    }

    /// AVX2: a chunk's values as four 8-lane integer vectors (prepared positions 0..8, ...,
    /// 24..32).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn chunk256<const B: usize>(p: *const u8, low: __m256i) -> [__m256i; 4] {
        let half = |o: usize| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(o) as *const __m128i));
        if B == 4 {
            let (v0, v1) = (half(0), half(8));
            [
                _mm256_and_si256(v0, low),
                _mm256_and_si256(v1, low),
                _mm256_srli_epi32::<4>(v0),
                _mm256_srli_epi32::<4>(v1),
            ]
        } else {
            [half(0), half(8), half(16), half(24)]
        }
    }

    /// AVX2+FMA rows: weights dequantized 8 lanes at a time, four accumulators per input row.
    /// A row meets its input rows two at a time (eight accumulators, the dequantized chunk and
    /// the constants fill the sixteen registers; more would spill every multiply-add), the
    /// row's packed bytes read from memory for the first pair and from the cache after; each
    /// input row's sums are the same whichever pass it is in.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; sizes as for [`rows_avx512`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_avx2<const B: usize, const M: usize>(
        w: &QMatrix<'_>,
        xp: &[f32],
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        for (i, r) in rows.enumerate() {
            let mut first = 0;
            while first < M {
                let sums = out.as_mut_ptr().add(i * M + first);
                let x = xp.as_ptr().add(first * w.cols);
                if M - first >= 2 {
                    row_avx2::<B, 2>(w, r, x, sums);
                    first += 2;
                } else {
                    row_avx2::<B, 1>(w, r, x, sums);
                    first += 1;
                }
            }
        }
    }

    /// Row `r` against the `T` input rows at `xp` (`T × cols`), the sums written to
    /// `sums[..T]`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_avx2<const B: usize, const T: usize>(
        w: &QMatrix<'_>,
        r: usize,
        xp: *const f32,
        sums: *mut f32,
    ) {
        let cols = w.cols;
        let (gpr, cpg) = (cols / w.group, w.group / CHUNK);
        let low = _mm256_set1_epi32(0xF);
        let packed = w.packed.as_ptr().add(r * cols * B / 32) as *const u8;
        let (srow, brow) = (
            w.scales.as_ptr().add(r * gpr),
            w.biases.as_ptr().add(r * gpr),
        );
        let mut acc = [[_mm256_setzero_ps(); 4]; T];
        for g in 0..gpr {
            prefetch_groups(g, [srow, brow], w.group * B / 8);
            let s = _mm256_set1_ps(*srow.add(g));
            let b = _mm256_set1_ps(*brow.add(g));
            for c in g * cpg..(g + 1) * cpg {
                prefetch(packed, c * 4 * B + PREFETCH_BYTES);
                let q = chunk256::<B>(packed.add(c * 4 * B), low);
                let wq = q.map(|q| _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, b));
                for (t, a) in acc.iter_mut().enumerate() {
                    let x = xp.add(t * cols + c * CHUNK);
                    for (j, aj) in a.iter_mut().enumerate() {
                        *aj = _mm256_fmadd_ps(wq[j], _mm256_loadu_ps(x.add(8 * j)), *aj);
                    }
                }
            }
        }
        for (t, a) in acc.iter().enumerate() {
            let v = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            *sums.add(t) = Lane::sum(v);
        }
    }
}

/// Packs codes `q` (values below `2^bits`, row-major) the way MLX does (unit tests' weights).
#[cfg(test)]
pub(crate) fn pack(q: &[u8], bits: usize) -> Vec<u32> {
    q.chunks_exact(32 / bits)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (i, &v)| w | (u32::from(v) << (bits * i)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_matches_a_plain_dequantized_dot_product() {
        for bits in BITS {
            check_against_f64(bits);
        }
    }

    fn check_against_f64(bits: usize) {
        let (rows, cols, group) = (7, 128, 64);
        let q: Vec<u8> = (0..rows * cols)
            .map(|i| ((i * 7 + i / 5) % (1 << bits)) as u8)
            .collect();
        let packed = pack(&q, bits);
        let groups = rows * cols / group;
        let scales: Vec<f32> = (0..groups).map(|g| 0.01 + g as f32 * 0.003).collect();
        let biases: Vec<f32> = (0..groups).map(|g| -0.05 + g as f32 * 0.001).collect();
        let w = QMatrix::new(bits, &packed, &scales, &biases, rows, cols, group).unwrap();
        for m in [1, 3, 8] {
            check_rows(bits, &w, (rows, cols, group), (&q, &scales, &biases), m);
        }
    }

    fn check_rows(
        bits: usize,
        w: &QMatrix<'_>,
        (rows, cols, group): (usize, usize, usize),
        (q, scales, biases): (&[u8], &[f32], &[f32]),
        m: usize,
    ) {
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i % 11) as f32 - 5.0) * 0.25)
            .collect();
        let prepared = Prepared::new(&x, m, cols, bits).unwrap();
        let mut want = vec![0.0f64; rows * m];
        for r in 0..rows {
            for mi in 0..m {
                want[r * m + mi] = (0..cols)
                    .map(|c| {
                        let g = r * cols / group + c / group;
                        let wv = f64::from(q[r * cols + c]) * f64::from(scales[g])
                            + f64::from(biases[g]);
                        wv * f64::from(x[mi * cols + c])
                    })
                    .sum();
            }
        }
        for path in KernelPath::ALL.into_iter().filter(|p| p.available()) {
            let mut out = vec![0.0f32; rows * m];
            rows_into(path, w, &prepared, 0..rows, &mut out).unwrap();
            for (got, want) in out.iter().zip(&want) {
                assert!(
                    (f64::from(*got) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{} {bits}-bit: {got} vs {want}",
                    path.name()
                );
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(QMatrix::new(4, &[0; 4], &[0.0], &[0.0], 1, 32, 32).is_ok());
        assert!(QMatrix::new(4, &[0; 4], &[0.0], &[0.0], 1, 32, 16).is_err());
        assert!(QMatrix::new(4, &[0; 4], &[0.0], &[0.0], 1, 32, 64).is_err());
        assert!(QMatrix::new(4, &[0; 3], &[0.0], &[0.0], 1, 32, 32).is_err());
        assert!(QMatrix::new(3, &[0; 3], &[0.0], &[0.0], 1, 32, 32).is_err());
        assert!(QMatrix::new(8, &[0; 4], &[0.0], &[0.0], 1, 32, 32).is_err());
        assert!(Prepared::new(&[0.0; 32], 2, 32, 4).is_err());
        assert!(Prepared::new(&[0.0; 9 * 32], 9, 32, 4).is_err());
    }
}
