//! The small per-token operations of a host decode step (RMSNorm, RoPE, grouped-query
//! attention over a cache, SwiGLU), on f32 host memory. They carry a few thousand flops per
//! token each, against millions in the mat-vecs, so they are plain loops the compiler
//! vectorizes; what matters is that none of them allocates per call or round-trips to MLX.

/// `Σ a_i b_i` with eight running sums (a shape the compiler vectorizes; a single running
/// float sum cannot be reordered, so it would stay scalar).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes::<8>(a, b)
}

/// `Σ a_i b_i` over `N` running sums, then the sums in order and the tail: the order is fixed by
/// `N` alone, whatever the CPU's vector width. More sums are more independent vector chains
/// (four with AVX2 at `N = 32`), so the adds' latency does not bound a long product.
#[inline(always)]
pub fn dot_lanes<const N: usize>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; N];
    let (ac, bc) = (a.chunks_exact(N), b.chunks_exact(N));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..N {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Outputs `rows` of `x · Wᵀ` (`x`: `m × cols`, `w` row-major) into `out` (`rows.len() × m`, by
/// output feature), each output `dot(weight row, token)`.
#[inline(always)]
pub fn rows_by_dot<E>(
    w: &[E],
    cols: usize,
    x: &[f32],
    m: usize,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    dot: impl Fn(&[E], &[f32]) -> f32,
) {
    let start = rows.start;
    for r in rows {
        let wr = &w[r * cols..(r + 1) * cols];
        for (t, xt) in x.chunks_exact(cols).enumerate().take(m) {
            out[(r - start) * m + t] = dot(wr, xt);
        }
    }
}

/// `out = x / sqrt(mean(x²) + eps) * w` for each row of `x` (rows of `w.len()` values).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss = dot(xr, xr);
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, xv), wv) in or.iter_mut().zip(xr).zip(w) {
            *o = xv * inv * wv;
        }
    }
}

/// `a = silu(a) * b` in place (`silu(g) = g / (1 + e^-g)`).
pub fn silu_mul(a: &mut [f32], b: &[f32]) {
    for (g, u) in a.iter_mut().zip(b) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// A rotary embedding on the host: `mx.fast.rope` with per-pair inverse frequencies.
#[derive(Debug, Clone)]
pub struct HostRope {
    /// Leading dimensions of each head that rotate (the rest pass through).
    pub dims: usize,
    /// Pairs are adjacent (`2i, 2i+1`) rather than split halves (`i, i + dims/2`).
    pub traditional: bool,
    /// Position multiplier (linear scaling).
    pub scale: f32,
    /// `dims / 2` inverse frequencies.
    pub inv_freq: Vec<f32>,
}

impl HostRope {
    /// The inverse frequencies `base^(-2i/dims)` of a plain rope.
    pub fn from_base(dims: usize, traditional: bool, base: f32, scale: f32) -> Self {
        let half = dims / 2;
        let inv_freq = (0..half)
            .map(|i| (-(i as f32 / half as f32) * base.log2()).exp2())
            .collect();
        Self {
            dims,
            traditional,
            scale,
            inv_freq,
        }
    }

    /// A rope given its frequencies (`mx.fast.rope(freqs=...)`): inverse frequencies `1/f`.
    pub fn from_freqs(dims: usize, traditional: bool, freqs: &[f32]) -> Self {
        Self {
            dims,
            traditional,
            scale: 1.0,
            inv_freq: freqs.iter().map(|f| 1.0 / f).collect(),
        }
    }

    /// Rotates every head (`head_dim` values each) of `x` for position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.dims / 2;
        let p = pos as f32 * self.scale;
        for head in x.chunks_exact_mut(head_dim) {
            for (i, f) in self.inv_freq.iter().enumerate() {
                let (s, c) = (p * f).sin_cos();
                let (a, b) = if self.traditional {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x1, x2) = (head[a], head[b]);
                head[a] = x1 * c - x2 * s;
                head[b] = x1 * s + x2 * c;
            }
        }
    }
}

/// One layer's keys or values as attention reads them: the cache's buffer
/// (`[kv_heads, capacity, head_dim]`, first `len` positions valid) followed by the block's new
/// positions (`[kv_heads, new, head_dim]`).
#[derive(Debug, Clone, Copy)]
pub struct KvRows<'a> {
    /// The cache buffer (empty when `len` is 0).
    pub past: &'a [f32],
    /// Positions the buffer has room for.
    pub capacity: usize,
    /// Valid past positions.
    pub len: usize,
    /// The new positions of this block.
    pub new: &'a [f32],
    /// How many new positions `new` holds.
    pub new_len: usize,
}

impl KvRows<'_> {
    /// Position `p`'s vector for key/value head `h`.
    fn at(&self, h: usize, p: usize, head_dim: usize) -> &[f32] {
        if p < self.len {
            &self.past[(h * self.capacity + p) * head_dim..][..head_dim]
        } else {
            &self.new[(h * self.new_len + p - self.len) * head_dim..][..head_dim]
        }
    }
}

/// Shapes of a grouped-query attention.
#[derive(Debug, Clone, Copy)]
pub struct HeadShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (each serves `n_heads / n_kv_heads` consecutive query heads).
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Softmax scale.
    pub scale: f32,
}

impl HeadShape {
    /// The key/value head query head `h` reads.
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.n_heads / self.n_kv_heads)
    }
}

/// Causal attention of query head `h` (`q`: `head_dim` values) of the block's token `j` over
/// every past position and the block's first `j + 1` new ones, into `out` (`head_dim`).
/// `scores` is scratch of at least `len + j + 1` values.
#[allow(clippy::too_many_arguments)]
pub fn attend_head(
    s: HeadShape,
    h: usize,
    q: &[f32],
    keys: KvRows<'_>,
    values: KvRows<'_>,
    j: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = s.head_dim;
    let kvh = s.kv_head(h);
    let scores = &mut scores[..keys.len + j + 1];
    let mut max = f32::NEG_INFINITY;
    for (p, sc) in scores.iter_mut().enumerate() {
        *sc = dot(q, keys.at(kvh, p, hd)) * s.scale;
        max = max.max(*sc);
    }
    let mut sum = 0.0f32;
    for sc in scores.iter_mut() {
        *sc = (*sc - max).exp();
        sum += *sc;
    }
    out.fill(0.0);
    for (p, sc) in scores.iter().enumerate() {
        let w = sc / sum;
        for (o, v) in out.iter_mut().zip(values.at(kvh, p, hd)) {
            *o += w * v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_the_formula() {
        let x = [1.0f32, -2.0, 3.0, 0.5, 0.0, 4.0];
        let w = [0.5f32, 1.0, 2.0];
        let mut out = [0.0f32; 6];
        rms_norm(&x, &w, 1e-5, &mut out);
        for r in 0..2 {
            let row = &x[3 * r..3 * r + 3];
            let ms = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / 3.0;
            for c in 0..3 {
                let want = f64::from(row[c]) / (ms + 1e-5).sqrt() * f64::from(w[c]);
                assert!((f64::from(out[3 * r + c]) - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_by_position_times_frequency() {
        let rope = HostRope::from_base(4, false, 10000.0, 1.0);
        assert!((rope.inv_freq[1] - 0.01).abs() < 1e-7);
        let mut x = [1.0f32, 0.0, 0.0, 1.0];
        rope.apply(&mut x, 4, 3);
        // Pair (0, 2) rotates by 3 rad; pair (1, 3) by 0.03 rad.
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[2] - 3f32.sin()).abs() < 1e-6);
        assert!((x[1] + 0.03f32.sin()).abs() < 1e-6 && (x[3] - 0.03f32.cos()).abs() < 1e-6);
        let trad = HostRope::from_freqs(2, true, &[0.5]);
        let mut y = [1.0f32, 0.0];
        trad.apply(&mut y, 2, 1);
        assert!((y[0] - 2f32.cos()).abs() < 1e-6 && (y[1] - 2f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn attention_is_a_softmax_weighted_sum_over_past_and_new_positions() {
        // 2 query heads share 1 kv head of width 2; 1 past position, 2 new ones.
        let s = HeadShape {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 2,
            scale: 0.5,
        };
        let past_k = [1.0f32, 0.0, 9.0, 9.0]; // capacity 2, only the first is valid
        let past_v = [1.0f32, 2.0, 9.0, 9.0];
        let new_k = [0.0f32, 1.0, 1.0, 1.0];
        let new_v = [3.0f32, 4.0, 5.0, 6.0];
        let rows = |past, new| KvRows {
            past,
            capacity: 2,
            len: 1,
            new,
            new_len: 2,
        };
        let q = [2.0f32, 0.0, 0.0, 2.0];
        let mut scores = [0.0f32; 3];
        let mut out = [0.0f32; 4];
        // Token j = 0 sees the past position and the first new one only.
        for (h, (qh, oh)) in q.chunks(2).zip(out.chunks_mut(2)).enumerate() {
            let (k, v) = (rows(&past_k, &new_k), rows(&past_v, &new_v));
            attend_head(s, h, qh, k, v, 0, &mut scores, oh);
        }
        for (h, qh) in q.chunks(2).enumerate() {
            let logits = [qh[0] * 0.5, qh[1] * 0.5];
            let (e0, e1) = (logits[0].exp(), logits[1].exp());
            let want = [
                (e0 * 1.0 + e1 * 3.0) / (e0 + e1),
                (e0 * 2.0 + e1 * 4.0) / (e0 + e1),
            ];
            assert!((out[2 * h] - want[0]).abs() < 1e-6 && (out[2 * h + 1] - want[1]).abs() < 1e-6);
        }
    }

    #[test]
    fn dot_sums_every_product() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..19).map(|i| (i % 3) as f32).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_eq!(dot(&a, &b), want);
    }

    #[test]
    fn silu_mul_gates() {
        let mut a = [0.0f32, 2.0];
        silu_mul(&mut a, &[5.0, 3.0]);
        assert_eq!(a[0], 0.0);
        assert!((a[1] - 2.0 / (1.0 + (-2.0f32).exp()) * 3.0).abs() < 1e-6);
    }
}
