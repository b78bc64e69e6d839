//! The grouped-query attention block shared by llama-family models (llama, qwen2, qwen3, ...):
//! q/k/v projections, optional per-head q/k RMSNorm (qwen3, gemma3), RoPE at the cache offset, cache
//! update, and SDPA exactly as mlx-lm's `base.scaled_dot_product_attention` calls it; plus the
//! variants other families need (gemma2's soft-capped manual attention, qwen3_next's output gate).

use super::activations::{softcap_graph, CompiledOp};
use super::rope::Rope;
use crate::engine::cache::{causal_mask, AttentionMask, KvCache};
use crate::engine::cache_attention::attend;
use crate::engine::error::Result;
use crate::engine::kernels::{HeadShape, HostForm, HostProj};
use crate::engine::nn::{host_projs, weak_scalar, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::error::Exception;
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::{ops, Array};
use std::cell::RefCell;
use std::rc::Rc;

/// `mx.fast.scaled_dot_product_attention(q, k, v, scale, mask)`.
pub fn sdpa(q: &Array, k: &Array, v: &Array, scale: f32, mask: &AttentionMask) -> Result<Array> {
    let mask = match mask {
        AttentionMask::None => None,
        AttentionMask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        AttentionMask::Array(a) => Some(ScaledDotProductAttentionMask::Array(a)),
    };
    Ok(fast::scaled_dot_product_attention(
        q, k, v, scale, mask, None,
    )?)
}

/// `head_dim ** -0.5` folded in f64 like Python, then rounded to f32.
pub fn inv_sqrt_scale(head_dim: i32) -> f32 {
    (head_dim as f64).powf(-0.5) as f32
}

/// Shapes and options of one attention block.
#[derive(Debug, Clone)]
pub struct AttentionShape {
    /// Model width.
    pub hidden: i32,
    /// Query heads.
    pub n_heads: i32,
    /// Key/value heads.
    pub n_kv_heads: i32,
    /// Per-head width.
    pub head_dim: i32,
    /// Bias on q/k/v.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k with this eps (qwen3).
    pub qk_norm_eps: Option<f64>,
    /// Softmax scale.
    pub scale: f32,
}

/// gemma2's attention: `q * scale`, `q @ k.T`, `tanh(s / cap) * cap`, `where(mask, s, min)`,
/// precise softmax, `@ v`, with the query heads grouped per key/value head (`gemma2.py:83-104`).
pub fn softcap_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    cap: f64,
    mask: &AttentionMask,
) -> Result<Array> {
    let (b, n_heads, l, hd) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let n_kv = k.shape()[1];
    let repeats = n_heads / n_kv;
    let q = q.multiply(weak_scalar(scale as f64, q)?)?;
    let (q, k, v) = if repeats > 1 {
        (
            q.reshape(&[b, n_kv, repeats, l, hd])?,
            k.expand_dims(2)?,
            v.expand_dims(2)?,
        )
    } else {
        (q, k.clone(), v.clone())
    };
    let scores = softcap_graph(&ops::matmul(&q, k.swap_axes(-1, -2)?)?, cap)?;
    let mask = match mask {
        AttentionMask::None => None,
        AttentionMask::Array(m) => Some(m.clone()),
        AttentionMask::Causal => {
            let s = k.shape()[k.ndim() - 2];
            Some(causal_mask(l, s - l, None)?)
        }
    };
    // A batch's mask `[B, 1, L, S]` gets an axis for the grouped heads `[B, kv, rep, L, S]`
    // (mlx-lm's gemma2 leaves it out and cannot batch grouped heads; the values are the same).
    let mask = match mask {
        Some(m) if repeats > 1 && m.ndim() == 4 => Some(m.expand_dims(2)?),
        m => m,
    };
    let scores = match mask {
        Some(m) => {
            let min = scores.dtype().finfo_min().unwrap_or(f32::MIN as f64);
            let fill = Array::from_f32(min as f32).as_dtype(scores.dtype())?;
            ops::select(&m, &scores, &fill)?
        }
        None => scores,
    };
    let out = ops::matmul(ops::softmax_axis(&scores, -1, true)?, &v)?;
    if repeats > 1 {
        return Ok(out.reshape(&[b, n_heads, l, hd])?);
    }
    Ok(out)
}

/// Where the per-head q/k RMSNorm sits and which weight form it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QkNormStyle {
    /// qwen3: `nn.RMSNorm` on `[B, L, H, D]`, before the head transpose.
    #[default]
    Plain,
    /// gemma3: `rms_norm(x, 1.0 + w)` on `[B, H, L, D]`, after the head transpose.
    GemmaAfterTranspose,
}

/// Per-family departures from the llama block that do not change its shape.
#[derive(Debug, Clone, Copy, Default)]
pub struct AttentionVariant {
    /// Where the q/k norms sit.
    pub norm_style: QkNormStyle,
    /// gemma2: manual attention with the scores soft-capped at this value ([`softcap_attention`]).
    pub softcap: Option<f64>,
    /// qwen3_next / qwen3_5: `q_proj` also yields a per-head gate (twice the width, split per
    /// head) and the output is `o_proj(out * sigmoid(gate))`.
    pub output_gate: bool,
}

/// The weights and per-head math of one attention block: everything except the cache.
#[derive(Clone)]
struct Heads {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    variant: AttentionVariant,
    shape: AttentionShape,
    rope: Rope,
}

/// Where RoPE starts: the cache offset as an int (as mlx-lm passes it) or as an array (inside a
/// compiled step, so one compiled function serves every position).
#[derive(Clone, Copy)]
enum Position<'a> {
    Int(i32),
    Array(&'a Array),
}

/// q, k, v (`[B, H, L, D]`) and qwen3_next's output gate.
type Projected = (Array, Array, Array, Option<Array>);

impl Heads {
    fn heads(&self, x: &Array, n: i32, norm: &Option<RmsNorm>) -> Result<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let x = if x.ndim() == 4 {
            x.clone()
        } else {
            x.reshape(&[b, l, n, -1])?
        };
        Ok(match (norm, self.variant.norm_style) {
            (Some(norm), QkNormStyle::Plain) => norm.forward(&x)?.transpose_axes(&[0, 2, 1, 3])?,
            (Some(norm), QkNormStyle::GemmaAfterTranspose) => {
                norm.forward_one_plus(&x.transpose_axes(&[0, 2, 1, 3])?)?
            }
            (None, _) => x.transpose_axes(&[0, 2, 1, 3])?,
        })
    }

    /// Width of `q_proj`'s output (twice the heads' width with an output gate).
    fn q_width(&self) -> i32 {
        let qd = self.shape.n_heads * self.shape.head_dim;
        if self.variant.output_gate {
            2 * qd
        } else {
            qd
        }
    }

    /// Projections, q/k norms and RoPE; `fused` is the concatenated q/k/v projection.
    fn project(&self, x: &Array, pos: Position<'_>, fused: Option<&Linear>) -> Result<Projected> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let (q, k, v) = match fused {
            Some(f) => {
                let kvd = self.shape.n_kv_heads * self.shape.head_dim;
                let qw = self.q_width();
                let mut parts = f.forward(x)?.split_at_indices(&[qw, qw + kvd], -1)?;
                let v = parts.pop();
                let k = parts.pop();
                let q = parts.pop();
                match (q, k, v) {
                    (Some(q), Some(k), Some(v)) => (q, k, v),
                    _ => {
                        return Err(crate::engine::error::EngineError::Runtime(
                            "fused q/k/v projection did not split in three".into(),
                        ))
                    }
                }
            }
            None => (
                self.q_proj.forward(x)?,
                self.k_proj.forward(x)?,
                self.v_proj.forward(x)?,
            ),
        };
        let (q, gate) = if self.variant.output_gate {
            let mut parts = q
                .reshape(&[b, l, self.shape.n_heads, -1])?
                .split_equal(2, -1)?;
            let gate = parts.pop().map(|g| g.reshape(&[b, l, -1])).transpose()?;
            (parts.swap_remove(0), gate)
        } else {
            (q, None)
        };
        let q = self.heads(&q, self.shape.n_heads, &self.q_norm)?;
        let k = self.heads(&k, self.shape.n_kv_heads, &self.k_norm)?;
        let v = self.heads(&v, self.shape.n_kv_heads, &None)?;
        let (q, k) = match pos {
            Position::Int(o) => (self.rope.apply(&q, o)?, self.rope.apply(&k, o)?),
            Position::Array(o) => (
                self.rope.apply_dynamic(&q, o)?,
                self.rope.apply_dynamic(&k, o)?,
            ),
        };
        Ok((q, k, v, gate))
    }

    /// Heads back to `[B, L, H * D]`, the output gate, `o_proj`.
    fn output(&self, out: &Array, gate: Option<&Array>) -> Result<Array> {
        let (b, l) = (out.shape()[0], out.shape()[2]);
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        match gate {
            Some(g) => self.o_proj.forward(&out.multiply(ops::sigmoid(g)?)?),
            None => self.o_proj.forward(&out),
        }
    }
}

/// What single-token steps reuse across calls under `--compiled-decode` / `--fused-decode`:
/// the fused q/k/v weight and the compiled functions, each built on first use.
#[derive(Default)]
struct StepRuntime {
    fused: Option<Linear>,
    pre: Option<(bool, CompiledOp)>,
    post: Option<CompiledOp>,
}

fn to_exception(e: crate::engine::error::EngineError) -> Exception {
    Exception::custom(e.to_string())
}

impl StepRuntime {
    fn fused(&mut self, m: &Heads) -> Result<Linear> {
        if let Some(f) = &self.fused {
            return Ok(f.clone());
        }
        let f = Linear::concat_out(&[&m.q_proj, &m.k_proj, &m.v_proj])?;
        self.fused = Some(f.clone());
        Ok(f)
    }

    /// `(x, offset) -> (q, k, v[, gate])`, compiled for fixed shapes (one trace at L = 1).
    fn pre(&mut self, m: &Heads, fused: Option<Linear>) -> &mut CompiledOp {
        let want = fused.is_some();
        if self.pre.as_ref().map(|(f, _)| *f) != Some(want) {
            let m = Rc::new(m.clone());
            let graph = move |a: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
                let (q, k, v, gate) = m
                    .project(&a[0], Position::Array(&a[1]), fused.as_ref())
                    .map_err(to_exception)?;
                Ok([q, k, v].into_iter().chain(gate).collect())
            };
            self.pre = Some((want, CompiledOp::new(graph, false, true)));
        }
        match &mut self.pre {
            Some((_, op)) => op,
            None => unreachable!("set above"),
        }
    }

    /// `(out[, gate]) -> o_proj(...)`, compiled for fixed shapes.
    fn post(&mut self, m: &Heads) -> &mut CompiledOp {
        self.post.get_or_insert_with(|| {
            let m = Rc::new(m.clone());
            let graph = move |a: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
                Ok(vec![m.output(&a[0], a.get(1)).map_err(to_exception)?])
            };
            CompiledOp::new(graph, false, true)
        })
    }
}

/// An attention block's pieces for the host decode step.
pub struct HostAttention {
    /// `[q, k, v, o]` projections.
    pub proj: [HostProj; 4],
    /// Heads and scale.
    pub heads: HeadShape,
    /// The rotary embedding.
    pub rope: Rope,
    /// Per-head `[q_norm, k_norm]` weights (Qwen3's block), fast form only.
    pub qk_norm: Option<[Vec<f32>; 2]>,
}

/// A loaded grouped-query attention block.
pub struct GqaAttention {
    m: Heads,
    step: RefCell<StepRuntime>,
}

impl GqaAttention {
    /// Loads `{prefix}.{q,k,v,o}_proj` (+ `q_norm`/`k_norm`, applied the qwen3 way).
    pub fn load(
        w: &mut WeightStore,
        prefix: &str,
        shape: AttentionShape,
        rope: Rope,
    ) -> Result<Self> {
        Self::load_styled(w, prefix, shape, rope, QkNormStyle::Plain)
    }

    /// Like [`GqaAttention::load`], with the q/k norms applied in `norm_style`.
    pub fn load_styled(
        w: &mut WeightStore,
        prefix: &str,
        shape: AttentionShape,
        rope: Rope,
        norm_style: QkNormStyle,
    ) -> Result<Self> {
        let variant = AttentionVariant {
            norm_style,
            ..Default::default()
        };
        Self::load_variant(w, prefix, shape, rope, variant)
    }

    /// Like [`GqaAttention::load`], for a family-specific [`AttentionVariant`].
    pub fn load_variant(
        w: &mut WeightStore,
        prefix: &str,
        shape: AttentionShape,
        rope: Rope,
        variant: AttentionVariant,
    ) -> Result<Self> {
        let s = &shape;
        let (qd, kvd) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
        let q_out = if variant.output_gate { 2 * qd } else { qd };
        let norm = |w: &mut WeightStore, name: &str| -> Result<Option<RmsNorm>> {
            s.qk_norm_eps
                .map(|eps| RmsNorm::load(w, &format!("{prefix}.{name}"), s.head_dim, eps))
                .transpose()
        };
        let m = Heads {
            q_proj: Linear::load(w, &format!("{prefix}.q_proj"), s.hidden, q_out, s.qkv_bias)?,
            k_proj: Linear::load(w, &format!("{prefix}.k_proj"), s.hidden, kvd, s.qkv_bias)?,
            v_proj: Linear::load(w, &format!("{prefix}.v_proj"), s.hidden, kvd, s.qkv_bias)?,
            o_proj: Linear::load(w, &format!("{prefix}.o_proj"), qd, s.hidden, s.o_bias)?,
            q_norm: norm(w, "q_norm")?,
            k_norm: norm(w, "k_norm")?,
            variant,
            shape,
            rope,
        };
        Ok(Self {
            m,
            step: RefCell::new(StepRuntime::default()),
        })
    }

    /// The block for a host decode step of `form`: `None` unless it is the plain llama block (no
    /// soft-cap or output gate, projections that step takes), or Qwen3's with f32 q/k norms in
    /// the fast form.
    pub fn host_parts(&self, form: HostForm) -> Result<Option<HostAttention>> {
        let m = &self.m;
        if m.variant.softcap.is_some() || m.variant.output_gate {
            return Ok(None);
        }
        let qk_norm = match (&m.q_norm, &m.k_norm) {
            (None, None) => None,
            (Some(q), Some(k)) if form == HostForm::Fast => {
                match (q.host_weight(form)?, k.host_weight(form)?) {
                    (Some((q, _)), Some((k, _))) => Some([q, k]),
                    _ => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        let Some(proj) = host_projs([&m.q_proj, &m.k_proj, &m.v_proj, &m.o_proj], form)? else {
            return Ok(None);
        };
        let s = &m.shape;
        Ok(Some(HostAttention {
            proj,
            heads: HeadShape {
                n_heads: s.n_heads as usize,
                n_kv_heads: s.n_kv_heads as usize,
                head_dim: s.head_dim as usize,
                scale: s.scale,
            },
            rope: m.rope.clone(),
            qk_norm,
        }))
    }

    /// Attention over `x` ([B, L, D]) with the layer's cache and mask. Single-token steps
    /// follow the cache's [`crate::engine::cache_attention::AttentionPlan`] (compiled / fused q/k/v).
    pub fn forward(
        &self,
        x: &Array,
        mask: &AttentionMask,
        cache: &mut dyn KvCache,
    ) -> Result<Array> {
        let plan = cache.plan();
        let m = &self.m;
        let (scale, softcap) = (m.shape.scale, m.variant.softcap);
        if let Some(offsets) = cache.rope_offsets() {
            // Rows at different positions: mlx-lm's batched path, `rope(x, offset=cache.offset)`
            // with the per-row offsets, never the compiled or fused single-row steps.
            let (q, k, v, gate) = m.project(x, Position::Array(&offsets), None)?;
            let out = attend(&q, &k, &v, scale, softcap, mask, cache)?;
            return m.output(&out, gate.as_ref());
        }
        if x.shape()[1] != 1 || !(plan.compiled_decode || plan.fused_qkv) {
            let (q, k, v, gate) = m.project(x, Position::Int(cache.offset()), None)?;
            let out = attend(&q, &k, &v, scale, softcap, mask, cache)?;
            return m.output(&out, gate.as_ref());
        }
        let mut rt = self.step.borrow_mut();
        let fused = if plan.fused_qkv {
            Some(rt.fused(m)?)
        } else {
            None
        };
        if !plan.compiled_decode {
            let (q, k, v, gate) = m.project(x, Position::Int(cache.offset()), fused.as_ref())?;
            let out = attend(&q, &k, &v, scale, softcap, mask, cache)?;
            return m.output(&out, gate.as_ref());
        }
        let offset = Array::from_int(cache.offset());
        let mut qkv = rt.pre(m, fused).call(&[x.clone(), offset])?.into_iter();
        let (Some(q), Some(k), Some(v)) = (qkv.next(), qkv.next(), qkv.next()) else {
            return Err(crate::engine::error::EngineError::Runtime(
                "compiled attention step returned too few arrays".into(),
            ));
        };
        let out = attend(&q, &k, &v, scale, softcap, mask, cache)?;
        let args: Vec<Array> = std::iter::once(out).chain(qkv.next()).collect();
        rt.post(m).call1(&args)
    }
}
