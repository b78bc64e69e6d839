//! f32 element-wise work of a decoder layer on the host, computing exactly what MLX's CPU
//! backend computes (`--host-elementwise on`, L1): the SwiGLU (`silu(gate) * up`), RMSNorm and
//! the residual add.
//!
//! MLX's CPU kernels on x86 are one lane wide (`simd/base_simd.h` has no x86 vectors), so its
//! `sigmoid` runs a scalar polynomial `exp` with a libm `fmaf` call per coefficient: ~20 ns a
//! value, a quarter of a SmolLM2 prompt's time. The same operations in 16 (AVX-512) or 8 (AVX2) lanes give the same
//! bits, because each one is a correctly rounded IEEE operation (multiply, add, divide, fused
//! multiply-add, float→int truncation) or exact (`floor`, bit shifts, selects); the order and
//! the constants follow `mlx/backend/cpu/simd/math.h` (`exp`) and `unary_ops.h` (`Sigmoid`) of
//! the MLX build mlxb links. RMSNorm is MLX's CPU fallback graph (`fast::rms_norm` has no CPU
//! kernel): squares summed one after another in f32 (its contiguous reduction, one lane), times
//! the f32 `1 / n`, plus `eps`, `1 / sqrt(·)`, then `(x · r) · w`. In a decode step these keep
//! the layer's data on the host between the host products, so MLX is waited on once per layer
//! (for attention) instead of three times. The MLX-facing side
//! ([`crate::engine::models::activations`], [`crate::engine::nn`]) still compares each with
//! MLX's own kernel once per process before using it.

use super::mlx_order::Simd;

/// `1 / ln 2` as MLX writes it (`x * 1.442695f`; the same f32 as `std`'s `LOG2_E`, but the
/// literal is MLX's).
#[allow(clippy::approx_constant)]
const LOG2_E: f32 = 1.442695;

/// The polynomial for `2^f` on `f ∈ [-0.5, 0.5]`, highest power first (MLX's `exp`).
const EXP2_POLY: [f32; 7] = [
    1.535_336_2e-4,
    1.339_887_4e-3,
    9.618_437e-3,
    5.550_332_5e-2,
    2.402_264_8e-1,
    6.931_472e-1,
    1.0,
];

/// MLX CPU's `exp` (`simd::exp<float, 1>`), one value.
pub fn exp_mlx(x: f32) -> f32 {
    let t = x * LOG2_E;
    // `floor(x + 0.5)` with `0.5` a double literal: the sum is formed exactly in f64.
    let ipart = (f64::from(t) + 0.5).floor() as f32;
    let fpart = t - ipart;
    let mut p = EXP2_POLY[0];
    for c in &EXP2_POLY[1..] {
        p = p.mul_add(fpart, *c);
    }
    // `(int(ipart) + 127) << 23`, wrapping as the C++ does on x86 for the inputs that the
    // selects below replace anyway (infinite or NaN `ipart`).
    let epart = (ipart as i32).wrapping_add(127).wrapping_shl(23);
    let mut result = f32::from_bits(epart as u32) * p;
    if x.is_nan() {
        result = x;
    }
    if x > 88.0 {
        result = f32::INFINITY;
    }
    if x < -88.0 {
        result = 0.0;
    }
    result
}

/// [`exp_mlx`] of every value of `x`, in place (eight at a time on the vector paths: the
/// `floor(t + 0.5)` in f64 lanes, as the scalar form forms it).
pub fn exp_mlx_slice(x: &mut [f32]) {
    exp_mlx_slice_on(vector_path(), x)
}

/// [`exp_mlx_slice`] on the instruction set `simd` (`None`: one value at a time), which the CPU
/// must run.
fn exp_mlx_slice_on(simd: Option<Simd>, x: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd.filter(|s| s.runs_here()) {
        done = x.len() / 8 * 8;
        // SAFETY: the CPU runs `simd` (checked); `done` is within `x`.
        unsafe {
            match simd {
                Simd::Avx512 => x86::exp_slice(&mut x[..done]),
                Simd::Avx2 => x86::exp_slice_avx2(&mut x[..done]),
            }
        }
    }
    for v in &mut x[done..] {
        *v = exp_mlx(*v);
    }
}

/// MLX CPU's `logsumexp` of one f32 row as MLX computes it on x86 Linux (`logsumexp.cpp` on
/// one-lane SIMD): the row's maximum, the [`exp_mlx`] of every `x - max` added one after the
/// other in row order, then `log(sum) + max`, or the maximum itself when it is infinite. The
/// exps run in vector lanes a chunk at a time, each chunk's feeding the one chain of sums while
/// the next is computed. `None` for a row holding a NaN, whose maximum MLX may pick otherwise.
pub fn logsumexp_mlx(x: &[f32]) -> Option<f32> {
    // The maximum's value does not depend on the order it is looked for in (its sign at zero
    // would, but `x - max` and `log(sum) + max` come out alike for either zero).
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if x.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut chunk = [0.0f32; LSE_CHUNK];
    let mut sum = 0.0f32;
    for part in x.chunks(LSE_CHUNK) {
        let exps = &mut chunk[..part.len()];
        for (e, v) in exps.iter_mut().zip(part) {
            *e = v - max;
        }
        exp_mlx_slice(exps);
        sum = exps.iter().fold(sum, |sum, e| sum + e);
    }
    Some(if max.is_infinite() {
        max
    } else {
        sum.ln() + max
    })
}

/// Values per chunk of [`logsumexp_mlx`]'s exps (small enough to stay in the L1 cache).
const LSE_CHUNK: usize = 256;

/// MLX CPU's `sigmoid`: `y = 1 / (1 + exp(|x|))`, then `y` for negative `x`, `1 - y` otherwise.
pub fn sigmoid_mlx(x: f32) -> f32 {
    let y = 1.0 / (1.0 + exp_mlx(x.abs()));
    if x < 0.0 {
        y
    } else {
        1.0 - y
    }
}

/// `out[i] = (gate[i] * sigmoid(gate[i])) * up[i]`, mlx-lm's `swiglu` (`nn.silu(gate) * x`)
/// as MLX's CPU backend evaluates it. All three slices must have the same length.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "swiglu: gate, up and out differ in length"
    );
    swiglu_on(vector_path(), gate, up, out)
}

/// [`swiglu`] on the instruction set `simd` (`None`: one value at a time); the lengths are
/// equal.
fn swiglu_on(simd: Option<Simd>, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd.filter(|s| s.runs_here()) {
        // SAFETY: the CPU runs `simd` (checked); the lengths are equal (the caller's).
        unsafe {
            match simd {
                Simd::Avx512 => x86::swiglu(gate, up, out),
                Simd::Avx2 => x86::swiglu_avx2(gate, up, out),
            }
        }
        return;
    }
    swiglu_scalar(gate, up, out);
}

/// The one-value-at-a-time form of [`swiglu`] (CPUs without AVX2, and the tail of a row).
pub fn swiglu_scalar(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = (g * sigmoid_mlx(g)) * u;
    }
}

/// An f32 rounded to bfloat16 the way MLX's `bfloat16_t` constructor rounds it: to nearest,
/// ties to even, every NaN to the one quiet NaN `0x7FC0` (not `half`'s rounding, which keeps a
/// NaN's sign and payload).
pub fn bf16_mlx(v: f32) -> half::bf16 {
    if v.is_nan() {
        return half::bf16::from_bits(0x7FC0);
    }
    let bits = v.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
    half::bf16::from_bits((rounded >> 16) as u16)
}

/// MLX's bfloat16 SwiGLU (`silu(gate) * up` with every intermediate a bfloat16) from a table of
/// its `silu` over all 65,536 bfloat16 values (`silu_table[g.to_bits()]`, built by MLX's own
/// kernel): the last multiply is one f32 product (exact: two 8-bit significands) rounded by
/// [`bf16_mlx`].
pub fn swiglu_bf16(
    gate: &[half::bf16],
    up: &[half::bf16],
    silu_table: &[half::bf16],
    out: &mut [half::bf16],
) {
    assert!(
        gate.len() == up.len() && up.len() == out.len() && silu_table.len() == 1 << 16,
        "swiglu_bf16: gate, up and out differ in length, or the table is not one per value"
    );
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = bf16_mlx(silu_table[usize::from(g.to_bits())].to_f32() * u.to_f32());
    }
}

/// MLX CPU's `fast::rms_norm` of each `w.len()`-wide row of `x` into `out` (same lengths as
/// `x`): see the module docs for the order.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    assert!(
        dim > 0 && x.len().is_multiple_of(dim) && out.len() == x.len(),
        "rms_norm: rows do not match the weight"
    );
    // MLX's `mean` multiplies by `1 / n` made in f64 and cast to the array's f32.
    let inv_n = (1.0 / dim as f64) as f32;
    let sums = square_sums(x.len() / dim, dim, |i| x[i]);
    for ((row, o), sum) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)).zip(sums) {
        let r = 1.0 / (sum * inv_n + eps).sqrt();
        for ((o, v), wv) in o.iter_mut().zip(row).zip(w) {
            *o = (v * r) * wv;
        }
    }
}

/// `Σ v²` of each of `rows` rows of `dim` values (`value(i)`, row-major), each row summed from
/// zero in order, every square rounded before its add (MLX's order for one row). Eight rows'
/// chains run side by side: a prompt's rows no longer wait on one add's latency each.
fn square_sums(rows: usize, dim: usize, value: impl Fn(usize) -> f32) -> Vec<f32> {
    const WAYS: usize = 8;
    let mut sums = vec![0.0f32; rows];
    let mut r0 = 0;
    while r0 + WAYS <= rows {
        let mut acc = [0.0f32; WAYS];
        for k in 0..dim {
            for (j, a) in acc.iter_mut().enumerate() {
                let v = value((r0 + j) * dim + k);
                *a += v * v;
            }
        }
        sums[r0..r0 + WAYS].copy_from_slice(&acc);
        r0 += WAYS;
    }
    for (r, sum) in sums.iter_mut().enumerate().skip(r0) {
        for k in 0..dim {
            let v = value(r * dim + k);
            *sum += v * v;
        }
    }
    sums
}

/// `out = a + b`, element by element (MLX's add of two same-shape f32 arrays).
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x + y;
    }
}

/// [`rms_norm`] for bfloat16 rows and weight, as MLX's fallback graph runs it for that dtype:
/// the row widened to f32, normalised in f32 exactly as [`rms_norm`] does, rounded to bfloat16,
/// then multiplied by the weight in bfloat16 (one exact f32 product, rounded).
pub fn rms_norm_bf16(x: &[half::bf16], w: &[half::bf16], eps: f32, out: &mut [half::bf16]) {
    let dim = w.len();
    assert!(
        dim > 0 && x.len().is_multiple_of(dim) && out.len() == x.len(),
        "rms_norm_bf16: rows do not match the weight"
    );
    let inv_n = (1.0 / dim as f64) as f32;
    let sums = square_sums(x.len() / dim, dim, |i| x[i].to_f32());
    for ((row, o), sum) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)).zip(sums) {
        let r = 1.0 / (sum * inv_n + eps).sqrt();
        for ((o, v), wv) in o.iter_mut().zip(row).zip(w) {
            *o = bf16_mlx(bf16_mlx(v.to_f32() * r).to_f32() * wv.to_f32());
        }
    }
}

/// Rounds each value to bfloat16 (MLX's rounding), kept widened to f32.
pub fn round_bf16(x: &mut [f32]) {
    for v in x {
        *v = bf16_mlx(*v).to_f32();
    }
}

/// Bfloat16 values held widened to f32, narrowed back (exact for such values).
pub fn narrow_bf16(x: &[f32]) -> Vec<half::bf16> {
    x.iter().map(|v| bf16_mlx(*v)).collect()
}

/// The bits of 16-bit floats (`half::bf16`, `half::f16`), as the product kernels read them.
///
/// # Safety
/// `T` must be a `repr(transparent)` wrapper of `u16`.
pub unsafe fn bits_of<T>(s: &[T]) -> &[u16] {
    std::slice::from_raw_parts(s.as_ptr().cast(), s.len())
}

/// `a + b` in bfloat16 as MLX adds it: the f32 sum rounded by [`bf16_mlx`].
pub fn add_bf16(a: &[half::bf16], b: &[half::bf16], out: &mut [half::bf16]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = bf16_mlx(x.to_f32() + y.to_f32());
    }
}

/// `n` deterministic values over every magnitude a layer's activations meet (2^-30 .. 2^8),
/// both signs: the input of the host paths' one-time checks against MLX.
pub fn probe_values(n: usize, seed: u64) -> Vec<f32> {
    probe_bits(seed)
        .take(n)
        .map(|s| {
            let mant = 1.0 + (s >> 41) as f32 / (1u64 << 23) as f32;
            let sign = if s & 1 == 0 { 1.0 } else { -1.0 };
            sign * mant * 2f32.powi(((s >> 8) % 39) as i32 - 30)
        })
        .collect()
}

/// The deterministic 64-bit stream (xorshift) the one-time checks draw their inputs from.
pub fn probe_bits(seed: u64) -> impl Iterator<Item = u64> {
    let mut s = seed | 1;
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    })
}

/// The instruction set [`swiglu`] and [`exp_mlx_slice`] run on here: the host products' set
/// ([`super::mlx_order::simd`], which `MLXB_DENSE_KERNEL=avx2` narrows); `None` runs the
/// scalar forms.
pub fn vector_path() -> Option<Simd> {
    super::mlx_order::simd()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{swiglu_scalar, EXP2_POLY, LOG2_E};
    use std::arch::x86_64::*;

    /// The rest of `exp_mlx` for eight values `v` once `t = v · log2(e)` and its rounded
    /// integer part `ipart` are formed: the polynomial, the exponent bits, the selects.
    #[inline(always)]
    unsafe fn exp8_finish(v: __m256, t: __m256, ipart: __m256) -> __m256 {
        let fpart = _mm256_sub_ps(t, ipart);
        let mut p = _mm256_set1_ps(EXP2_POLY[0]);
        for c in &EXP2_POLY[1..] {
            p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(*c));
        }
        let epart = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvttps_epi32(ipart),
            _mm256_set1_epi32(127),
        ));
        let mut r = _mm256_mul_ps(_mm256_castsi256_ps(epart), p);
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
        r = _mm256_blendv_ps(r, v, nan);
        let big = _mm256_cmp_ps::<_CMP_GT_OQ>(v, _mm256_set1_ps(88.0));
        r = _mm256_blendv_ps(r, _mm256_set1_ps(f32::INFINITY), big);
        let small = _mm256_cmp_ps::<_CMP_LT_OQ>(v, _mm256_set1_ps(-88.0));
        _mm256_blendv_ps(r, _mm256_setzero_ps(), small)
    }

    /// [`super::exp_mlx`] eight values at a time with AVX2 (`x.len()` a multiple of eight), for
    /// any sign: `floor(t + 0.5)` in two f64 vectors of four, exactly as the scalar form.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx,avx2,fma")]
    pub unsafe fn exp_slice_avx2(x: &mut [f32]) {
        let floor = |t: __m128| {
            let wide = _mm256_add_pd(_mm256_cvtps_pd(t), _mm256_set1_pd(0.5));
            _mm256_cvtpd_ps(_mm256_round_pd::<
                { _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC },
            >(wide))
        };
        for chunk in x.chunks_exact_mut(8) {
            let v = _mm256_loadu_ps(chunk.as_ptr());
            let t = _mm256_mul_ps(v, _mm256_set1_ps(LOG2_E));
            let lo = floor(_mm256_castps256_ps128(t));
            let hi = floor(_mm256_extractf128_ps::<1>(t));
            let ipart = _mm256_set_m128(hi, lo);
            _mm256_storeu_ps(chunk.as_mut_ptr(), exp8_finish(v, t, ipart));
        }
    }

    /// 8 lanes of `exp_mlx` for `x ≥ 0` or NaN (the sigmoid's `|x|`), as [`exp16`].
    #[inline(always)]
    unsafe fn exp8_nonnegative(x: __m256) -> __m256 {
        let t = _mm256_mul_ps(x, _mm256_set1_ps(LOG2_E));
        let fl = _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
        let frac = _mm256_sub_ps(t, fl);
        let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
        let ipart = _mm256_blendv_ps(fl, _mm256_add_ps(fl, _mm256_set1_ps(1.0)), up);
        exp8_finish(x, t, ipart)
    }

    /// [`super::swiglu`] 8 values at a time with AVX2; the last `len % 8` one at a time.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `gate`, `up` and `out` must have the same length.
    #[target_feature(enable = "avx,avx2,fma")]
    pub unsafe fn swiglu_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let one = _mm256_set1_ps(1.0);
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let full = gate.len() / 8 * 8;
        for i in (0..full).step_by(8) {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let y = _mm256_div_ps(
                one,
                _mm256_add_ps(one, exp8_nonnegative(_mm256_and_ps(g, magnitude))),
            );
            let negative = _mm256_cmp_ps::<_CMP_LT_OQ>(g, _mm256_setzero_ps());
            let sig = _mm256_blendv_ps(_mm256_sub_ps(one, y), y, negative);
            _mm256_storeu_ps(
                out.as_mut_ptr().add(i),
                _mm256_mul_ps(_mm256_mul_ps(g, sig), u),
            );
        }
        swiglu_scalar(&gate[full..], &up[full..], &mut out[full..]);
    }

    /// 16 lanes of `exp_mlx` for `x ≥ 0` or NaN (the sigmoid's `|x|`).
    #[target_feature(enable = "avx512f")]
    unsafe fn exp16(x: __m512) -> __m512 {
        let t = _mm512_mul_ps(x, _mm512_set1_ps(LOG2_E));
        // floor(t + 0.5) in exact arithmetic: floor(t), plus one when t's fraction (exact:
        // t - floor(t) loses nothing for the finite t here) is at least one half.
        let fl = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
        let frac = _mm512_sub_ps(t, fl);
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
        let ipart = _mm512_mask_add_ps(fl, up, fl, _mm512_set1_ps(1.0));
        let fpart = _mm512_sub_ps(t, ipart);
        let mut p = _mm512_set1_ps(EXP2_POLY[0]);
        for c in &EXP2_POLY[1..] {
            p = _mm512_fmadd_ps(p, fpart, _mm512_set1_ps(*c));
        }
        let epart = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvttps_epi32(ipart),
            _mm512_set1_epi32(127),
        ));
        let mut r = _mm512_mul_ps(_mm512_castsi512_ps(epart), p);
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        r = _mm512_mask_mov_ps(r, nan, x);
        let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(88.0));
        r = _mm512_mask_mov_ps(r, big, _mm512_set1_ps(f32::INFINITY));
        let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-88.0));
        _mm512_mask_mov_ps(r, small, _mm512_setzero_ps())
    }

    /// [`super::exp_mlx`] eight values at a time (`x.len()` a multiple of eight), for any
    /// sign: `floor(t + 0.5)` is formed in f64 lanes, exactly as the scalar form forms it.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f,avx,avx2,fma")]
    pub unsafe fn exp_slice(x: &mut [f32]) {
        for chunk in x.chunks_exact_mut(8) {
            let v = _mm256_loadu_ps(chunk.as_ptr());
            let t = _mm256_mul_ps(v, _mm256_set1_ps(LOG2_E));
            let wide = _mm512_add_pd(_mm512_cvtps_pd(t), _mm512_set1_pd(0.5));
            let ipart = _mm512_cvtpd_ps(_mm512_roundscale_pd::<
                { _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC },
            >(wide));
            _mm256_storeu_ps(chunk.as_mut_ptr(), exp8_finish(v, t, ipart));
        }
    }

    /// 16 lanes of `(g * sigmoid(g)) * u`.
    #[target_feature(enable = "avx512f")]
    unsafe fn swiglu16(g: __m512, u: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        let abs = _mm512_abs_ps(g);
        let y = _mm512_div_ps(one, _mm512_add_ps(one, exp16(abs)));
        let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(g, _mm512_setzero_ps());
        let sig = _mm512_mask_mov_ps(_mm512_sub_ps(one, y), negative, y);
        _mm512_mul_ps(_mm512_mul_ps(g, sig), u)
    }

    /// [`super::swiglu`] 16 values at a time; the last `len % 16` one at a time.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `gate`, `up` and `out` must have the same length.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let full = gate.len() / 16 * 16;
        for i in (0..full).step_by(16) {
            let g = _mm512_loadu_ps(gate.as_ptr().add(i));
            let u = _mm512_loadu_ps(up.as_ptr().add(i));
            _mm512_storeu_ps(out.as_mut_ptr().add(i), swiglu16(g, u));
        }
        swiglu_scalar(&gate[full..], &up[full..], &mut out[full..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit patterns spread over every exponent, both signs, and the special values.
    fn sweep() -> Vec<f32> {
        let mut v: Vec<f32> = (0..1u32 << 20)
            .map(|i| f32::from_bits(i.wrapping_mul(4099).wrapping_add(i >> 7)))
            .collect();
        v.extend([
            0.0,
            -0.0,
            88.0,
            -88.0,
            88.000_01,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        v.extend([
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            f32::MAX,
            f32::MIN,
            0.5,
            -0.5,
        ]);
        v
    }

    /// The vector paths this CPU runs (AVX-512 and AVX2 on an AVX-512 machine), and the
    /// dispatch's own choice (`None` where there is none: it must fall back to the scalar form
    /// and never run instructions the CPU lacks).
    fn paths() -> Vec<Option<Simd>> {
        let mut out = vec![vector_path()];
        out.extend(
            [Simd::Avx512, Simd::Avx2]
                .into_iter()
                .filter(|s| s.runs_here())
                .map(Some),
        );
        out
    }

    /// [`swiglu`] equals [`swiglu_scalar`] bit for bit over the sweep on every vector path.
    #[test]
    fn swiglu_equals_the_scalar_form_bit_for_bit() {
        let gate = sweep();
        let up: Vec<f32> = gate.iter().rev().map(|x| x * 0.75 + 0.1).collect();
        let mut scalar = vec![0.0; gate.len()];
        swiglu_scalar(&gate, &up, &mut scalar);
        for path in paths() {
            let mut vector = vec![0.0; gate.len()];
            swiglu_on(path, &gate, &up, &mut vector);
            for (i, (s, v)) in scalar.iter().zip(&vector).enumerate() {
                assert!(
                    s.to_bits() == v.to_bits() || (s.is_nan() && v.is_nan()),
                    "{path:?} gate {} up {}: scalar {s:e} vector {v:e}",
                    gate[i],
                    up[i]
                );
            }
        }
    }

    /// [`exp_mlx_slice`] equals [`exp_mlx`] bit for bit over the sweep (both signs: the
    /// softmax's `x - max` is never positive) and over the softmax's range in fine steps.
    #[test]
    fn exp_slice_equals_the_scalar_exp_bit_for_bit() {
        let mut xs = sweep();
        xs.extend((0..200_000).map(|i| -(i as f32) * 0.000_45));
        xs.extend((0..5000).map(|i| -88.5 + i as f32 * 1e-4));
        for path in paths() {
            let mut vector = xs.clone();
            exp_mlx_slice_on(path, &mut vector);
            for (x, v) in xs.iter().zip(&vector) {
                let s = exp_mlx(*x);
                assert!(
                    s.to_bits() == v.to_bits() || (s.is_nan() && v.is_nan()),
                    "{path:?} exp({x:e}): scalar {s:e} vector {v:e}"
                );
            }
        }
    }

    #[test]
    fn exp_is_close_to_the_true_exp_and_saturates_like_mlx() {
        for i in 0..2000 {
            let x = i as f32 * 0.044 - 44.0;
            let rel = (f64::from(exp_mlx(x)) / f64::from(x).exp() - 1.0).abs();
            assert!(rel < 1e-5, "exp({x}) off by {rel}");
        }
        assert_eq!(exp_mlx(88.5), f32::INFINITY);
        assert_eq!(exp_mlx(-88.5), 0.0);
        assert!(exp_mlx(f32::NAN).is_nan());
        assert_eq!(sigmoid_mlx(0.0), 0.5);
    }
}
