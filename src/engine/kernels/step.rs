//! A whole forward step of a llama-style decoder on the host (`--perf-kernel on`, tier L3):
//! pre-norm grouped-query attention and a SwiGLU MLP, every projection 4/8-bit quantized,
//! f32 activations, for blocks of up to [`MAX_M`] tokens (a decode step or a speculative
//! verify block).
//!
//! Why a whole step: a decode token of a small model is ~200 mat-vecs of a few hundred
//! microseconds each; handing each one to the host kernel separately costs an MLX
//! evaluation and a graph round trip per projection, which is where the per-layer host path
//! lost most of its time. Here the only MLX work left per step is reading the past
//! keys/values in place and appending the new ones (done by the caller).

use super::affine::{Prepared, QMatrix, MAX_M};
use super::dispatch::{matvecs, selection, MatVec, Selection};
use super::host::HostQuant;
use super::vecops::{attend_head, rms_norm, silu_mul, HeadShape, HostRope, KvRows};
use crate::engine::error::{EngineError, Result};
use rayon::prelude::*;

/// One pre-norm layer: `h += o(attn(rope(q, k), v))` over `input_norm(h)`, then
/// `h += down(silu(gate(x)) * up(x))` over `x = post_norm(h)`.
#[derive(Debug, Clone)]
pub struct HostLayer {
    /// `input_layernorm` weight.
    pub input_norm: Vec<f32>,
    /// `post_attention_layernorm` weight.
    pub post_norm: Vec<f32>,
    /// `[q, k, v, o]` projections.
    pub attn: [HostQuant; 4],
    /// `[gate, up, down]` projections.
    pub mlp: [HostQuant; 3],
}

/// The decoder the host step runs.
#[derive(Debug, Clone)]
pub struct HostDecoder {
    /// The layers, in order.
    pub layers: Vec<HostLayer>,
    /// The quantized embedding table (also the LM head when `head` is `None`).
    pub embed: HostQuant,
    /// An untied LM head.
    pub head: Option<HostQuant>,
    /// The final norm's weight.
    pub final_norm: Vec<f32>,
    /// Every RMSNorm's epsilon.
    pub eps: f32,
    /// Attention heads and scale.
    pub heads: HeadShape,
    /// The rotary embedding every layer applies.
    pub rope: HostRope,
}

/// One layer's cached keys and values before the step, read in place from the cache buffers
/// (`[kv_heads, capacity, head_dim]`, first `len` positions valid; empty slices when `len` is 0).
#[derive(Debug, Clone, Copy)]
pub struct PastKv<'a> {
    /// Key buffer.
    pub keys: &'a [f32],
    /// Value buffer.
    pub values: &'a [f32],
    /// Positions each buffer has room for.
    pub capacity: usize,
    /// Valid positions (the cache offset).
    pub len: usize,
}

/// What a step is asked for.
#[derive(Debug, Clone, Copy)]
pub struct StepPlan<'a> {
    /// How many layers run (all of them, or fewer for an early-exit drafter).
    pub layers: usize,
    /// Layers whose outputs (the residual stream after them) to hand back, in this order.
    pub taps: &'a [usize],
    /// Whether to compute the final norm and LM head (a prefill chunk whose logits nobody
    /// reads skips the largest mat-vec of the step).
    pub logits: bool,
}

/// What a step computes.
#[derive(Debug)]
pub struct StepOut {
    /// Logits, `m × vocab`, by token (empty when the step was asked for none).
    pub logits: Vec<f32>,
    /// The residual stream after the last layer run (before the final norm), `m × hidden`.
    pub hidden: Vec<f32>,
    /// The requested taps, `m × hidden` each, in the order asked.
    pub taps: Vec<Vec<f32>>,
    /// Per layer, the block's new keys as `[kv_heads, m, head_dim]` (the cache layout).
    pub keys: Vec<Vec<f32>>,
    /// Per layer, the block's new values, same layout.
    pub values: Vec<Vec<f32>>,
}

/// Context × heads × head width below which attention stays on one thread.
const ATTENTION_PARALLEL_MIN: usize = 1 << 15;

fn runtime(e: String) -> EngineError {
    EngineError::Runtime(format!("host decode step: {e}"))
}

/// `x` (`m × cols`) prepared once per bit width among `mats`.
struct Inputs {
    four: Option<Prepared>,
    eight: Option<Prepared>,
}

impl Inputs {
    fn new(
        sel: Selection,
        x: &[f32],
        m: usize,
        cols: usize,
        mats: &[&QMatrix<'_>],
    ) -> Result<Self> {
        let make = |bits: usize| -> Result<Option<Prepared>> {
            if mats.iter().any(|w| w.bits() == bits) {
                let p = Prepared::for_path(x, m, cols, bits, sel.path).map_err(runtime)?;
                Ok(Some(p))
            } else {
                Ok(None)
            }
        };
        Ok(Self {
            four: make(4)?,
            eight: make(8)?,
        })
    }

    fn for_matrix(&self, w: &QMatrix<'_>) -> Result<&Prepared> {
        let p = if w.bits() == 4 {
            &self.four
        } else {
            &self.eight
        };
        p.as_ref()
            .ok_or_else(|| runtime(format!("no input prepared for {} bits", w.bits())))
    }
}

/// `y = x · Wᵀ` for each `(W, out)` pair over one input `x`, with outputs by token
/// (`m × rows`), in one fork/join.
fn project(
    sel: Selection,
    x: &[f32],
    m: usize,
    pairs: &mut [(&QMatrix<'_>, &mut Vec<f32>)],
) -> Result<()> {
    let cols = pairs.first().map_or(0, |(w, _)| w.cols());
    let mats: Vec<&QMatrix<'_>> = pairs.iter().map(|(w, _)| *w).collect();
    let inputs = Inputs::new(sel, x, m, cols, &mats)?;
    let mut by_row: Vec<Vec<f32>> = pairs.iter().map(|(w, _)| vec![0.0; w.rows() * m]).collect();
    let jobs = pairs
        .iter()
        .zip(by_row.iter_mut())
        .map(|((w, _), out)| {
            Ok(MatVec {
                w: **w,
                x: inputs.for_matrix(w)?,
                out,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    matvecs(sel, jobs)?;
    for ((w, out), rows_major) in pairs.iter_mut().zip(by_row) {
        let rows = w.rows();
        out.resize(rows * m, 0.0);
        if m == 1 {
            out.copy_from_slice(&rows_major);
            continue;
        }
        for (r, vals) in rows_major.chunks_exact(m).enumerate() {
            for (j, v) in vals.iter().enumerate() {
                out[j * rows + r] = *v;
            }
        }
    }
    Ok(())
}

/// Token-major `[m, heads, head_dim]` to the cache's `[heads, m, head_dim]`.
fn to_cache_layout(x: &[f32], m: usize, heads: usize, hd: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for j in 0..m {
        for h in 0..heads {
            out[(h * m + j) * hd..][..hd].copy_from_slice(&x[(j * heads + h) * hd..][..hd]);
        }
    }
    out
}

impl HostDecoder {
    /// Output vocabulary (the LM head's rows).
    pub fn vocab(&self) -> usize {
        self.head.as_ref().unwrap_or(&self.embed).rows()
    }

    /// Runs the block `ids` (1..=[`MAX_M`] tokens at positions `past[_].len..`) through the
    /// first `plan.layers` layers (one `past` each), collecting `plan.taps`, then the final
    /// norm and LM head when `plan.logits` is set.
    pub fn step(&self, ids: &[u32], past: &[PastKv<'_>], plan: StepPlan<'_>) -> Result<StepOut> {
        let sel = selection()?;
        let m = ids.len();
        let run = plan.layers;
        if m == 0 || m > MAX_M || past.len() != run || run == 0 || run > self.layers.len() {
            return Err(runtime(format!(
                "{m} tokens (1..={MAX_M}) with {} caches for {run} of {} layers",
                past.len(),
                self.layers.len()
            )));
        }
        if plan.taps.iter().any(|&t| t >= run) {
            return Err(runtime(format!("a tap is outside the {run} layers run")));
        }
        // The MLX handles stay on this thread; the pool sees only borrowed host memory.
        let layers = self.layers[..run]
            .iter()
            .map(|l| {
                let [q, k, v, o] = &l.attn;
                let [g, u, d] = &l.mlp;
                Ok(LayerView {
                    input_norm: &l.input_norm,
                    post_norm: &l.post_norm,
                    attn: [q.matrix()?, k.matrix()?, v.matrix()?, o.matrix()?],
                    mlp: [g.matrix()?, u.matrix()?, d.matrix()?],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = self.embed.matrix()?;
        let view = View {
            layers,
            embed,
            head: match &self.head {
                Some(h) => h.matrix()?,
                None => embed,
            },
            final_norm: &self.final_norm,
            eps: self.eps,
            heads: self.heads,
            rope: &self.rope,
        };
        // Run on a pool thread so the step's many fork/joins stay inside the pool.
        let (out, ()) = rayon::join(|| view.step(sel, ids, past, plan), || ());
        out
    }
}

/// One layer's weights as host slices.
struct LayerView<'a> {
    input_norm: &'a [f32],
    post_norm: &'a [f32],
    attn: [QMatrix<'a>; 4],
    mlp: [QMatrix<'a>; 3],
}

/// A [`HostDecoder`] as borrowed host memory only (shareable with the thread pool).
struct View<'a> {
    layers: Vec<LayerView<'a>>,
    embed: QMatrix<'a>,
    head: QMatrix<'a>,
    final_norm: &'a [f32],
    eps: f32,
    heads: HeadShape,
    rope: &'a HostRope,
}

impl View<'_> {
    fn step(
        &self,
        sel: Selection,
        ids: &[u32],
        past: &[PastKv<'_>],
        plan: StepPlan<'_>,
    ) -> Result<StepOut> {
        let m = ids.len();
        let s = self.heads;
        let (hd, qd, kvd) = (
            s.head_dim,
            s.n_heads * s.head_dim,
            s.n_kv_heads * s.head_dim,
        );
        let embed = self.embed;
        let d = embed.cols();
        let mut h = vec![0.0f32; m * d];
        for (id, row) in ids.iter().zip(h.chunks_exact_mut(d)) {
            embed.dequantize_row(*id as usize, row).map_err(runtime)?;
        }
        let mut xn = vec![0.0f32; m * d];
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        let (mut o, mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut attn = vec![0.0f32; m * qd];
        let mut scores = Vec::new();
        let (mut new_keys, mut new_values) = (Vec::new(), Vec::new());
        let mut taps = vec![Vec::new(); plan.taps.len()];
        for (i, (layer, past)) in self.layers.iter().zip(past).enumerate() {
            let [wq, wk, wv, wo] = layer.attn;
            if wq.rows() != qd || wk.rows() != kvd || wv.rows() != kvd || wo.cols() != qd {
                return Err(runtime(
                    "attention projections disagree with the head shape".into(),
                ));
            }
            rms_norm(&h, layer.input_norm, self.eps, &mut xn);
            project(
                sel,
                &xn,
                m,
                &mut [(&wq, &mut q), (&wk, &mut k), (&wv, &mut v)],
            )?;
            for j in 0..m {
                self.rope
                    .apply(&mut q[j * qd..(j + 1) * qd], hd, past.len + j);
                self.rope
                    .apply(&mut k[j * kvd..(j + 1) * kvd], hd, past.len + j);
            }
            let (kc, vc) = (
                to_cache_layout(&k, m, s.n_kv_heads, hd),
                to_cache_layout(&v, m, s.n_kv_heads, hd),
            );
            let rows = |past_buf, new| KvRows {
                past: past_buf,
                capacity: past.capacity,
                len: past.len,
                new,
                new_len: m,
            };
            let (keys, values) = (rows(past.keys, &kc), rows(past.values, &vc));
            let positions = past.len + m;
            let head = |scores: &mut Vec<f32>, (i, out): (usize, &mut [f32])| {
                let (j, h) = (i / s.n_heads, i % s.n_heads);
                scores.resize(positions, 0.0);
                attend_head(s, h, &q[i * hd..(i + 1) * hd], keys, values, j, scores, out);
            };
            // Heads split over the pool once the context makes them worth a fork/join.
            if sel.threads > 1 && positions * s.n_heads * hd >= ATTENTION_PARALLEL_MIN {
                attn.par_chunks_mut(hd)
                    .enumerate()
                    .for_each_init(Vec::new, head);
            } else {
                attn.chunks_mut(hd)
                    .enumerate()
                    .for_each(|x| head(&mut scores, x));
            }
            new_keys.push(kc);
            new_values.push(vc);
            project(sel, &attn, m, &mut [(&wo, &mut o)])?;
            h.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            let [wg, wu, wd] = layer.mlp;
            rms_norm(&h, layer.post_norm, self.eps, &mut xn);
            project(sel, &xn, m, &mut [(&wg, &mut gate), (&wu, &mut up)])?;
            silu_mul(&mut gate, &up);
            project(sel, &gate, m, &mut [(&wd, &mut down)])?;
            h.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
            for (tap, _) in taps.iter_mut().zip(plan.taps).filter(|(_, &t)| t == i) {
                tap.clone_from(&h);
            }
        }
        let mut logits = Vec::new();
        if plan.logits {
            rms_norm(&h, self.final_norm, self.eps, &mut xn);
            project(sel, &xn, m, &mut [(&self.head, &mut logits)])?;
        }
        super::host::count_calls(7 * self.layers.len() + usize::from(plan.logits));
        Ok(StepOut {
            logits,
            hidden: h,
            taps,
            keys: new_keys,
            values: new_values,
        })
    }
}
