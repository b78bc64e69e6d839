//! Attention over one layer's cache, with the implementation the forks select:
//! MLX's fused SDPA (mlx-lm's default), the op-by-op reference attention (`--fused-sdpa off`),
//! mlx-lm's quantized attention over a [`QuantizedCache`](crate::engine::cache::QuantizedCache) (`--kv-quant`), the L3
//! experiment `--perf-kernel on` (quantized attention in f32 with an online softmax), and
//! bfloat16 attention on the host under `--host-matvec on` (MLX's bits, checked).

use super::cache::{causal_mask, AttentionMask, KvCache, QuantizedKv};
use super::error::{EngineError, Result};
use super::kernels::{self, attention::AttentionShape};
use super::models::attention::{sdpa, softcap_attention};
use super::nn::weak_scalar;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::{ops, Array, Dtype};

/// How attention layers compute over a cache; the generator sets it on every cache from the
/// forks (`KvCache::set_plan`). The default is mlx-lm's computation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttentionPlan {
    /// `--fused-sdpa off`: the op-by-op reference attention instead of MLX's fused op.
    pub reference_sdpa: bool,
    /// `--compiled-decode on`: single-token steps run the cache-independent parts of the
    /// attention block as compiled MLX functions.
    pub compiled_decode: bool,
    /// `--fused-decode on`: single-token steps project q, k and v with one fused matmul.
    pub fused_qkv: bool,
    /// `--perf-kernel on`: quantized-KV attention in f32 with an online softmax.
    pub online_f32: bool,
    /// `--host-matvec on`: bfloat16 attention over a full-precision cache runs on the host
    /// ([`crate::engine::kernels::attention`]) once it matched MLX's SDPA in this process.
    pub host_bf16: bool,
}

/// Keys per chunk of the online-softmax kernel (the cache's growth step).
const ONLINE_CHUNK: i32 = 256;

/// Stores `k`/`v` in `cache` and attends `q` over everything it holds, the way the cache's
/// kind and plan say; `softcap` is gemma2's soft-capped manual attention.
pub fn attend(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    softcap: Option<f64>,
    mask: &AttentionMask,
    cache: &mut dyn KvCache,
) -> Result<Array> {
    let plan = cache.plan();
    if let Some(qc) = cache.as_quantized_mut() {
        if softcap.is_some() {
            return Err(EngineError::Input(
                "soft-capped attention (gemma2) has no quantized form, in mlx-lm as here; use --kv-quant off".into(),
            ));
        }
        let (group_size, bits) = (qc.group_size(), qc.bits());
        let (keys, values) = qc.update_and_fetch_quantized(k, v)?;
        let kv = QuantizedView {
            keys: &keys,
            values: &values,
            group_size,
            bits,
        };
        return if plan.online_f32 {
            kv.online_f32_sdpa(q, scale, mask)
        } else {
            kv.sdpa(q, scale, mask)
        };
    }
    let (k, v) = cache.update_and_fetch(k, v)?;
    if softcap.is_none() && plan.host_bf16 {
        if let Some(out) = host_attention(q, &k, &v, scale, mask)? {
            return Ok(out);
        }
    }
    match softcap {
        Some(cap) => softcap_attention(q, &k, &v, scale, cap, mask),
        None if plan.reference_sdpa => reference_sdpa(q, &k, &v, scale, mask),
        None => sdpa(q, &k, &v, scale, mask),
    }
}

/// The host's bfloat16 attention for a batch-1 call without a mask array (none, or causal);
/// `None` leaves it to MLX: other dtypes or masks, no host kernels here, or a head layout
/// whose host result differed from MLX's SDPA in this process.
pub fn host_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &AttentionMask,
) -> Result<Option<Array>> {
    let causal = match mask {
        AttentionMask::None => false,
        AttentionMask::Causal => true,
        AttentionMask::Array(_) => return Ok(None),
    };
    if !kernels::host_allowed()
        || !kernels::mlx_order::available()
        || [q, k, v]
            .iter()
            .any(|a| a.dtype() != Dtype::Bfloat16 || a.ndim() != 4)
        || q.shape()[0] != 1
        || k.shape() != v.shape()
        || k.shape()[0] != 1
        || k.shape()[3] != q.shape()[3]
    {
        return Ok(None);
    }
    let shape = AttentionShape {
        heads: q.shape()[1] as usize,
        kv_heads: k.shape()[1] as usize,
        queries: q.shape()[2] as usize,
        keys: k.shape()[2] as usize,
        dim: q.shape()[3] as usize,
    };
    if shape.kv_heads == 0
        || !shape.heads.is_multiple_of(shape.kv_heads)
        || shape.queries > shape.keys
    {
        return Ok(None);
    }
    if !host_attention_matches_mlx(shape, scale)? {
        return Ok(None);
    }
    host_attention_unchecked(q, k, v, scale, causal, shape).map(Some)
}

/// [`host_attention`] without the layout checks and the comparison with MLX.
fn host_attention_unchecked(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    causal: bool,
    shape: AttentionShape,
) -> Result<Array> {
    // The scaled queries exactly as MLX's fallback forms them (one bfloat16 multiply).
    let qs = q.multiply(weak_scalar(scale as f64, q)?)?.contiguous()?;
    mlx_rs::transforms::eval([&qs, k, v])?;
    fn read(a: &Array) -> Result<&[half::bf16]> {
        a.try_as_slice::<half::bf16>().map_err(|e| {
            EngineError::Runtime(format!("host attention cannot read its input ({e})"))
        })
    }
    let qh = read(&qs)?;
    // The cache's keys and values are read where they are (a view with room for more keys);
    // a layout such a view cannot have is copied first.
    let (kc, vc);
    let (k, v) = match (cache_rows(k, shape), cache_rows(v, shape)) {
        (Some(kr), Some(vr)) if kr.1 == vr.1 => (kr, vr),
        _ => {
            (kc, vc) = (k.contiguous()?, v.contiguous()?);
            mlx_rs::transforms::eval([&kc, &vc])?;
            let stride = shape.keys * shape.dim;
            ((read(&kc)?, stride), (read(&vc)?, stride))
        }
    };
    let mut out = vec![half::bf16::ZERO; qh.len()];
    kernels::attention::attend_bf16(qh, (k.0, v.0, k.1), shape, causal, &mut out)
        .map_err(|e| EngineError::Runtime(format!("host attention: {e}")))?;
    Ok(Array::from_slice(&out, q.shape()))
}

/// An evaluated bfloat16 `[1, heads, keys, dim]` array's values as one slice from its first
/// head's first row to its last head's last row, with the distance between heads, when each
/// head's rows are contiguous (a cache view with room for more keys is); `None` otherwise.
fn cache_rows(a: &Array, shape: AttentionShape) -> Option<(&[half::bf16], usize)> {
    use mlx_rs::ArrayElement;
    let (keys, dim) = (shape.keys, shape.dim);
    let (st, dims) = (a.strides(), a.shape());
    if a.dtype() != Dtype::Bfloat16 || dims.len() != 4 || st.len() != 4 || keys == 0 || dim == 0 {
        return None;
    }
    let heads = dims[1] as usize;
    let rows_contiguous = (st[3] == 1 || dim == 1) && (st[2] == dim || keys == 1);
    if dims[0] != 1 || heads == 0 || !rows_contiguous || (heads > 1 && st[1] < keys * dim) {
        return None;
    }
    let stride = if heads > 1 { st[1] } else { keys * dim };
    let data = half::bf16::array_data(a);
    if data.is_null() {
        return None;
    }
    // SAFETY: `a` is evaluated and alive for the returned borrow; its buffer holds every head's
    // `keys × dim` rows `stride` apart (checked from its strides), so the range from the first
    // value to the last head's last row lies within it.
    Some((
        unsafe { std::slice::from_raw_parts(data, (heads - 1) * stride + keys * dim) },
        stride,
    ))
}

/// Whether the host attention gives MLX's SDPA bits for this head layout and scale, on two
/// fixed random calls (a decode step; a causal block of queries past a cached prefix);
/// decided once per process.
fn host_attention_matches_mlx(shape: AttentionShape, scale: f32) -> Result<bool> {
    type Verdicts = std::sync::Mutex<std::collections::HashMap<(usize, usize, usize, u32), bool>>;
    static VERDICTS: std::sync::OnceLock<Verdicts> = std::sync::OnceLock::new();
    let key = (shape.heads, shape.kv_heads, shape.dim, scale.to_bits());
    let verdicts = VERDICTS.get_or_init(Default::default);
    if let Some(v) = kernels::lock(verdicts).get(&key) {
        return Ok(*v);
    }
    let mut same = true;
    for (i, (queries, keys, causal)) in [(1, 37, false), (7, 40, true)].into_iter().enumerate() {
        let probe = AttentionShape {
            queries,
            keys,
            ..shape
        };
        let random = |seed: u64, heads: usize, len: usize| -> Result<Array> {
            let key = mlx_rs::random::key(seed)?;
            let dims = [1, heads as i32, len as i32, shape.dim as i32];
            Ok(mlx_rs::random::normal::<f32>(&dims[..], 0.0, 1.0, &key)?
                .as_dtype(Dtype::Bfloat16)?)
        };
        let seed = 0x7f4a_7c15 + 3 * i as u64;
        let q = random(seed, shape.heads, queries)?;
        let k = random(seed + 1, shape.kv_heads, keys)?;
        let v = random(seed + 2, shape.kv_heads, keys)?;
        let mask = if causal {
            AttentionMask::Causal
        } else {
            AttentionMask::None
        };
        let ours = host_attention_unchecked(&q, &k, &v, scale, causal, probe)?;
        let theirs = sdpa(&q, &k, &v, scale, &mask)?;
        same &= kernels::check_bits(&ours)? == kernels::check_bits(&theirs)?;
    }
    kernels::lock(verdicts).insert(key, same);
    Ok(same)
}

/// Whether the L1 host step's attention of `dtype` (f32:
/// [`kernels::attention::attend_f32_query`]; bfloat16: [`kernels::attention::attend_bf16_query`])
/// gives MLX's SDPA bits for this head layout and scale and a block of `queries` queries (causal
/// past the first): key counts on both sides of OpenBLAS's switch from its small-matrix kernel to
/// panels and of its GEMM driver's cuts of the keys (on one thread and on two), the keys split
/// as the step splits them (the cache's rows, then the block's own); decided once per process.
pub fn exact_attention_matches_mlx(
    heads: kernels::HeadShape,
    queries: usize,
    dtype: Dtype,
) -> Result<bool> {
    type Key = (usize, usize, usize, u32, usize, bool);
    type Verdicts = std::sync::Mutex<std::collections::HashMap<Key, bool>>;
    static VERDICTS: std::sync::OnceLock<Verdicts> = std::sync::OnceLock::new();
    let kernels::HeadShape {
        n_heads,
        n_kv_heads,
        head_dim: dim,
        scale,
    } = heads;
    let bf16 = match dtype {
        Dtype::Float32 => false,
        Dtype::Bfloat16 => true,
        _ => return Ok(false),
    };
    let key = (n_heads, n_kv_heads, dim, scale.to_bits(), queries, bf16);
    let verdicts = VERDICTS.get_or_init(Default::default);
    if let Some(v) = kernels::lock(verdicts).get(&key) {
        return Ok(*v);
    }
    if n_kv_heads == 0
        || !n_heads.is_multiple_of(n_kv_heads)
        || !kernels::mlx_order::available()
        || queries == 0
    {
        return Ok(false);
    }
    let read = |a: &Array| -> Result<Vec<f32>> {
        let a = a.as_dtype(Dtype::Float32)?.contiguous()?;
        a.eval()?;
        a.try_as_slice::<f32>()
            .map(<[f32]>::to_vec)
            .map_err(|e| EngineError::Runtime(format!("cannot read an attention check ({e})")))
    };
    // 1,025 cached keys tell the driver's one-thread cut of the values from its two-thread one;
    // past 4,096 keys a single query's values run on two threads on the `Haswell` kernels (on
    // the AVX-512 sets they stay on one chain, as at 1,300).
    let haswell = kernels::mlx_order::F32Kernels::here() == kernels::mlx_order::F32Kernels::Haswell;
    let long = haswell.then_some(4500);
    let mut same = true;
    for (i, past) in [0usize, 1, 36, 300, 700, 1025, 1300]
        .into_iter()
        .chain(long)
        .enumerate()
    {
        let keys = past + queries;
        let order = kernels::attention::F32AttentionOrder::here(queries, keys, dim);
        if order.is_none() && !bf16 {
            continue;
        }
        let random = |seed: u64, h: usize, len: usize| -> Result<Array> {
            let dims = [1, h as i32, len as i32, dim as i32];
            Ok(Array::from_slice(&spread_values(h * len * dim, seed), &dims).as_dtype(dtype)?)
        };
        let seed = 0x51ed_270b + 3 * i as u64;
        let (q, k, v) = (
            random(seed, n_heads, queries)?,
            random(seed + 1, n_kv_heads, keys)?,
            random(seed + 2, n_kv_heads, keys)?,
        );
        // mlx-lm asks for the causal mask on blocks of more than one token.
        let mask = if queries > 1 {
            AttentionMask::Causal
        } else {
            AttentionMask::None
        };
        let theirs = read(&sdpa(&q, &k, &v, scale, &mask)?)?;
        let (qh, kh, vh) = (read(&q)?, read(&k)?, read(&v)?);
        let mut scores = Vec::new();
        let mut out = vec![0.0f32; dim];
        for (h, t) in (0..n_heads).flat_map(|h| (0..queries).map(move |t| (h, t))) {
            let g = heads.kv_head(h);
            let row = (h * queries + t) * dim;
            let head = |a, rows| kv_rows(a, g * keys, dim, rows);
            let (cached, block) = (0..past, past..keys);
            match &order {
                Some(order) if !bf16 => {
                    let scaled: Vec<f32> = qh[row..row + dim].iter().map(|x| scale * x).collect();
                    kernels::attention::attend_f32_query(
                        &scaled,
                        (head(&kh, cached.clone()), head(&vh, cached)),
                        (head(&kh, block.clone()), head(&vh, block)),
                        keys,
                        past + t + 1,
                        order,
                        &mut scores,
                        &mut out,
                    )
                }
                _ => {
                    let mut scaled = vec![0.0f32; dim];
                    kernels::attention::scale_bf16_query(&qh[row..row + dim], scale, &mut scaled);
                    let narrow = kernels::elementwise::narrow_bf16;
                    kernels::attention::attend_bf16_query(
                        &scaled,
                        (
                            &narrow(head(&kh, cached.clone())),
                            &narrow(head(&vh, cached)),
                        ),
                        (&narrow(head(&kh, block.clone())), &narrow(head(&vh, block))),
                        past + t + 1,
                        &mut scores,
                        &mut out,
                    )
                }
            }
            .map_err(EngineError::Runtime)?;
            same &= out
                .iter()
                .map(|x| x.to_bits())
                .eq(theirs[row..row + dim].iter().map(|x| x.to_bits()));
        }
    }
    kernels::lock(verdicts).insert(key, same);
    Ok(same)
}

/// `n` deterministic values spread evenly over (-2.6, 2.6), the width of activations a check
/// of attention needs (scores a few units apart, so every key carries weight), made on the host
/// because MLX's random normals cost more than the check itself.
fn spread_values(n: usize, seed: u64) -> Vec<f32> {
    kernels::elementwise::probe_bits(seed)
        .take(n)
        .map(|s| ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 2.6)
        .collect()
}

/// Rows `rows` of the `dim`-wide rows of `a` that start at row `first`.
fn kv_rows(a: &[f32], first: usize, dim: usize, rows: std::ops::Range<usize>) -> &[f32] {
    &a[(first + rows.start) * dim..(first + rows.end) * dim]
}

/// Query heads grouped per key/value head (`[B, Hkv, rep, L, D]`) when there is more than
/// one query head per key/value head; returns the grouped query and the repeat count.
fn group_heads(q: &Array, n_kv: i32) -> Result<(Array, i32)> {
    let (b, h, l, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let rep = h / n_kv;
    if rep > 1 {
        Ok((q.reshape(&[b, n_kv, rep, l, d])?, rep))
    } else {
        Ok((q.clone(), rep))
    }
}

/// Undoes [`group_heads`] on the attention output.
fn ungroup_heads(out: Array, rep: i32, q: &Array) -> Result<Array> {
    if rep > 1 {
        let s = q.shape();
        return Ok(out.reshape(&[s[0], s[1], s[2], -1])?);
    }
    Ok(out)
}

/// The boolean mask for scores `[.., qL, kL]` (`"causal"` becomes mlx-lm's index mask).
fn mask_array(mask: &AttentionMask, q_len: i32, k_len: i32) -> Result<Option<Array>> {
    Ok(match mask {
        AttentionMask::None => None,
        AttentionMask::Array(m) => Some(m.clone()),
        AttentionMask::Causal => Some(causal_mask(q_len, k_len - q_len, None)?),
    })
}

/// `where(mask, scores, finfo(dtype).min)` with the minimum as a weak Python scalar.
fn apply_mask(scores: Array, mask: Option<Array>) -> Result<Array> {
    match mask {
        None => Ok(scores),
        Some(m) if m.dtype() == Dtype::Bool => {
            let min = scores.dtype().finfo_min().unwrap_or(f32::MIN as f64);
            Ok(ops::select(&m, &scores, weak_scalar(min, &scores)?)?)
        }
        Some(m) => Ok(scores.add(&m)?),
    }
}

/// The op-by-op reference attention: `q * scale`, `q @ k.T` per key/value head group, the
/// mask via `where(mask, s, finfo.min)`, precise softmax, `@ v`. On the CPU backend MLX's
/// fused SDPA runs this very graph, so both give the same bits there.
pub fn reference_sdpa(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &AttentionMask,
) -> Result<Array> {
    let (gq, rep) = group_heads(&q.multiply(weak_scalar(scale as f64, q)?)?, k.shape()[1])?;
    let (k, v) = if rep > 1 {
        (k.expand_dims(2)?, v.expand_dims(2)?)
    } else {
        (k.clone(), v.clone())
    };
    let scores = ops::matmul(&gq, k.swap_axes(-1, -2)?)?;
    let (ql, kl) = (q.shape()[2], k.shape()[k.ndim() - 2]);
    let scores = apply_mask(scores, mask_array(mask, ql, kl)?)?;
    let out = ops::matmul(ops::softmax_axis(&scores, -1, true)?, &v)?;
    ungroup_heads(out, rep, q)
}

fn expand_kv(x: &QuantizedKv, rep: i32) -> Result<QuantizedKv> {
    if rep <= 1 {
        return Ok(x.clone());
    }
    Ok(QuantizedKv {
        data: x.data.expand_dims(-3)?,
        scales: x.scales.expand_dims(-3)?,
        biases: x.biases.expand_dims(-3)?,
    })
}

fn qmm(x: &Array, w: &QuantizedKv, transpose: bool, gs: i32, bits: i32) -> Result<Array> {
    Ok(ops::quantized_matmul(
        x, &w.data, &w.scales, &w.biases, transpose, gs, bits,
    )?)
}

/// A quantized cache's contents as attention reads them, with their quantization parameters.
pub struct QuantizedView<'a> {
    /// Quantized keys `[B, Hkv, S, ..]`.
    pub keys: &'a QuantizedKv,
    /// Quantized values.
    pub values: &'a QuantizedKv,
    /// Quantization group size.
    pub group_size: i32,
    /// Bits per value.
    pub bits: i32,
}

impl QuantizedView<'_> {
    fn kv_heads(&self) -> i32 {
        let d = &self.keys.data;
        d.shape()[d.ndim() - 3]
    }

    fn qmm(&self, x: &Array, w: &QuantizedKv, transpose: bool) -> Result<Array> {
        qmm(x, w, transpose, self.group_size, self.bits)
    }

    /// mlx-lm's `quantized_scaled_dot_product_attention` (base.py), op for op.
    pub fn sdpa(&self, q: &Array, scale: f32, mask: &AttentionMask) -> Result<Array> {
        let (gq, rep) = group_heads(&q.multiply(weak_scalar(scale as f64, q)?)?, self.kv_heads())?;
        let (keys, values) = (expand_kv(self.keys, rep)?, expand_kv(self.values, rep)?);
        let scores = self.qmm(&gq, &keys, true)?;
        let (ql, kl) = (
            scores.shape()[scores.ndim() - 2],
            scores.shape()[scores.ndim() - 1],
        );
        let scores = apply_mask(scores, mask_array(mask, ql, kl)?)?;
        let scores = ops::softmax_axis(&scores, -1, true)?;
        let out = self.qmm(&scores, &values, false)?;
        ungroup_heads(out, rep, q)
    }

    /// `--perf-kernel on`: quantized-KV attention computed in f32 (queries and the cache's
    /// scales/biases upcast; on CPU f32 quantized matmuls are several times faster than bf16
    /// ones) with an online softmax over chunks of `ONLINE_CHUNK` keys: each chunk keeps its
    /// max, exp-sum and weighted values, and the chunks are merged at the end. The output is
    /// cast back to the query dtype. Not bit-identical to mlx-lm (tier L3).
    pub fn online_f32_sdpa(&self, q: &Array, scale: f32, mask: &AttentionMask) -> Result<Array> {
        let f32 = |x: &QuantizedKv| -> Result<QuantizedKv> {
            Ok(QuantizedKv {
                data: x.data.clone(),
                scales: x.scales.as_dtype(Dtype::Float32)?,
                biases: x.biases.as_dtype(Dtype::Float32)?,
            })
        };
        let qf = q
            .as_dtype(Dtype::Float32)?
            .multiply(Array::from_f32(scale))?;
        let (gq, rep) = group_heads(&qf, self.kv_heads())?;
        let keys = expand_kv(&f32(self.keys)?, rep)?;
        let values = expand_kv(&f32(self.values)?, rep)?;
        let total = keys.data.shape()[keys.data.ndim() - 2];
        let mask = mask_array(mask, q.shape()[2], total)?;
        let floor = Array::from_f32(f32::MIN);
        let mut parts: Vec<(Array, Array, Array)> = Vec::new();
        let mut start = 0;
        while start < total {
            let end = (start + ONLINE_CHUNK).min(total);
            let s = self.qmm(&gq, &keys.range(start, end), true)?;
            let s = match &mask {
                Some(m) => {
                    let m = m.index((Ellipsis, start..end));
                    if m.dtype() == Dtype::Bool {
                        ops::select(&m, &s, &floor)?
                    } else {
                        s.add(m.as_dtype(Dtype::Float32)?)?
                    }
                }
                None => s,
            };
            let m = s.max_axis(-1, true)?;
            let p = s.subtract(&m)?.exp()?;
            let l = p.sum_axis(-1, true)?;
            let o = self.qmm(&p, &values.range(start, end), false)?;
            parts.push((m, l, o));
            start = end;
        }
        merge_chunks(parts, rep, q)
    }
}

/// Merges online-softmax chunks `(max, exp-sum, weighted values)` into the attention output.
fn merge_chunks(parts: Vec<(Array, Array, Array)>, rep: i32, q: &Array) -> Result<Array> {
    let Some((first, _, _)) = parts.first() else {
        return Err(EngineError::Runtime("attention over an empty cache".into()));
    };
    let mut global = first.clone();
    for (m, _, _) in &parts[1..] {
        global = ops::maximum(&global, m)?;
    }
    let mut num: Option<Array> = None;
    let mut den: Option<Array> = None;
    for (m, l, o) in parts {
        let w = m.subtract(&global)?.exp()?;
        let (o, l) = (o.multiply(&w)?, l.multiply(&w)?);
        num = Some(match num {
            Some(n) => n.add(&o)?,
            None => o,
        });
        den = Some(match den {
            Some(d) => d.add(&l)?,
            None => l,
        });
    }
    let (Some(num), Some(den)) = (num, den) else {
        return Err(EngineError::Runtime("attention over an empty cache".into()));
    };
    let out = num.divide(&den)?.as_dtype(q.dtype())?;
    ungroup_heads(out, rep, q)
}
