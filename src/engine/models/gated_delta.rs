//! The gated delta-net linear-attention layer of qwen3_5 / qwen3_next (mlx-lm's `GatedDeltaNet`
//! in `qwen3_5.py` with `gated_delta.py`): projections, a causal depthwise conv over a rolling
//! `conv_state`, L2-normalized q/k, the gated delta recurrence over an f32 `ssm_state`, and a
//! gated RMSNorm. Both states live in the layer's [`ArraysCache`] (slots 0 and 1).
//!
//! The recurrence runs mlx-lm's ops path (`gated_delta_ops`: one compiled
//! `_gated_delta_step_ops` per token), which is what mlx-lm runs off Metal. On a Metal GPU
//! mlx-lm switches to its custom kernels (`gated_delta_kernel`) for key head dims that are
//! multiples of 32; that path plugs in at [`Recurrence::run`].

use super::activations::{precise_swiglu, silu, CompiledOp};
use crate::engine::cache::ArraysCache;
use crate::engine::error::{EngineError, Result};
use crate::engine::nn::{weak_scalar, Linear};
use crate::engine::weights::WeightStore;
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{fast, ops, Array, Dtype};

/// Sizes of one gated delta-net layer (config.json's `linear_*` fields).
#[derive(Debug, Clone, Copy)]
pub struct DeltaShape {
    /// Model width.
    pub hidden: i32,
    /// Value heads (`linear_num_value_heads`).
    pub v_heads: i32,
    /// Key heads (`linear_num_key_heads`).
    pub k_heads: i32,
    /// Key head width (`linear_key_head_dim`).
    pub k_dim: i32,
    /// Value head width (`linear_value_head_dim`).
    pub v_dim: i32,
    /// Depthwise conv kernel size (`linear_conv_kernel_dim`).
    pub conv_kernel: i32,
    /// Epsilon of the gated RMSNorm (`rms_norm_eps`).
    pub eps: f64,
}

impl DeltaShape {
    fn key_dim(&self) -> i32 {
        self.k_heads * self.k_dim
    }
    fn value_dim(&self) -> i32 {
        self.v_heads * self.v_dim
    }
    fn conv_dim(&self) -> i32 {
        2 * self.key_dim() + self.value_dim()
    }
}

/// `compute_g(A_log, a, dt_bias) = exp(-exp(f32(A_log)) * softplus(a + dt_bias))`.
fn compute_g_graph(x: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
    let (a_log, a, dt_bias) = (&x[0], &x[1], &x[2]);
    let s = a.add(dt_bias)?;
    // nn.softplus: `logaddexp(x, 0)` with a weak 0.
    let softplus = ops::logaddexp(&s, Array::from_int(0).as_dtype(s.dtype())?)?;
    let decay = ops::exp(a_log.as_dtype(Dtype::Float32)?)?.negative()?;
    Ok(vec![ops::exp(decay.multiply(&softplus)?)?])
}

/// `_gated_delta_step_ops` (no mask): one token of the recurrence.
/// `q, k` `[B, H, Dk]`, `v` `[B, H, Dv]`, `g, beta` `[B, H]`, `state` `[B, H, Dv, Dk]`.
fn delta_step_graph(x: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
    let (q, k, v, g, beta, state) = (&x[0], &x[1], &x[2], &x[3], &x[4], &x[5]);
    let state = state.multiply(g.expand_dims_axes(&[-2, -1])?)?;
    let k_row = k.expand_dims(-2)?;
    let kv_mem = state.multiply(&k_row)?.sum_axis(-1, false)?;
    let delta = v.subtract(&kv_mem)?.multiply(beta.expand_dims(-1)?)?;
    let state = state.add(k_row.multiply(delta.expand_dims(-1)?)?)?;
    let y = state.multiply(q.expand_dims(-2)?)?.sum_axis(-1, false)?;
    Ok(vec![y.as_dtype(q.dtype())?, state])
}

/// `_gated_delta_step_ops` with a mask `[B]`: rows whose token is padding keep their state.
fn masked_step_graph(x: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
    let mut out = delta_step_graph(&x[..6])?;
    let keep = x[6].expand_dims_axes(&[1, 2, 3])?;
    out[1] = ops::select(&keep, &out[1], &x[5])?;
    Ok(out)
}

/// The compiled pieces of the recurrence, shared by all linear-attention layers of a model.
pub struct Recurrence {
    compute_g: CompiledOp,
    step: CompiledOp,
    masked_step: CompiledOp,
}

impl Recurrence {
    /// Compiles `compute_g` (shapeless) and the per-token step (shape-specialized), as mlx-lm's
    /// decorators do.
    pub fn new(compiled: bool) -> Self {
        Self {
            compute_g: CompiledOp::new(compute_g_graph, true, compiled),
            step: CompiledOp::new(delta_step_graph, false, compiled),
            masked_step: CompiledOp::new(masked_step_graph, false, compiled),
        }
    }

    /// `gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask)`: returns `y`
    /// `[B, T, Hv, Dv]` and the new state; `mask` `[B, T]` marks a batch's real tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        q: &Array,
        k: &Array,
        v: &Array,
        a: &Array,
        b: &Array,
        a_log: &Array,
        dt_bias: &Array,
        state: Option<&Array>,
        mask: Option<&Array>,
    ) -> Result<(Array, Array)> {
        let beta = ops::sigmoid(b)?;
        let g = self
            .compute_g
            .call1(&[a_log.clone(), a.clone(), dt_bias.clone()])?;
        let state = match state {
            Some(s) => s.clone(),
            None => {
                let (bsz, hk_dim) = (q.shape()[0], q.shape()[3]);
                let (hv, dv) = (v.shape()[2], v.shape()[3]);
                ops::zeros_dtype(&[bsz, hv, dv, hk_dim], Dtype::Float32)?
            }
        };
        // Seam: a Metal build would dispatch to mlx-lm's `gated_delta_kernel` here when on the
        // GPU with `Dk % 32 == 0`; everywhere else mlx-lm runs the ops path below.
        self.ops_path(q, k, v, &g, &beta, state, mask)
    }

    /// `gated_delta_ops`: the key heads repeated up to the value heads, then one compiled step
    /// per token.
    #[allow(clippy::too_many_arguments)]
    fn ops_path(
        &mut self,
        q: &Array,
        k: &Array,
        v: &Array,
        g: &Array,
        beta: &Array,
        mut state: Array,
        mask: Option<&Array>,
    ) -> Result<(Array, Array)> {
        let (t, hk) = (q.shape()[1], q.shape()[2]);
        let repeat = v.shape()[2] / hk;
        let (q, k) = if repeat > 1 {
            (
                Array::repeat_axis::<f32>(q.clone(), repeat, -2)?,
                Array::repeat_axis::<f32>(k.clone(), repeat, -2)?,
            )
        } else {
            (q.clone(), k.clone())
        };
        let mut ys = Vec::with_capacity(t as usize);
        for i in 0..t {
            let at = |a: &Array| a.index((.., i));
            let mut args = vec![at(&q), at(&k), at(v), at(g), at(beta), state];
            let step = match mask {
                Some(m) => {
                    args.push(at(m));
                    &mut self.masked_step
                }
                None => &mut self.step,
            };
            let mut out = step.call(&args)?;
            let (Some(new_state), Some(y)) = (out.pop(), out.pop()) else {
                return Err(EngineError::Runtime(
                    "gated delta step returned too few arrays".into(),
                ));
            };
            state = new_state;
            ys.push(y);
        }
        Ok((ops::stack(&ys, 1)?, state))
    }
}

/// The compiled element-wise functions a gated delta-net layer uses (one set per model).
pub struct DeltaOps {
    recurrence: Recurrence,
    silu: CompiledOp,
    precise_swiglu: CompiledOp,
}

impl DeltaOps {
    /// Compiles everything once.
    pub fn new(compiled: bool) -> Self {
        Self {
            recurrence: Recurrence::new(compiled),
            silu: silu(compiled),
            precise_swiglu: precise_swiglu(compiled),
        }
    }
}

/// One loaded gated delta-net layer.
pub struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    conv_weight: Array,
    dt_bias: Array,
    a_log: Array,
    norm_weight: Array,
    out_proj: Linear,
    shape: DeltaShape,
}

impl GatedDeltaNet {
    /// Loads `{prefix}.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,conv1d,dt_bias,A_log,norm,out_proj}`.
    pub fn load(w: &mut WeightStore, prefix: &str, s: DeltaShape) -> Result<Self> {
        let (d, vd) = (s.hidden, s.value_dim());
        let p = |n: &str| format!("{prefix}.{n}");
        Ok(Self {
            in_proj_qkv: Linear::load(w, &p("in_proj_qkv"), d, s.conv_dim(), false)?,
            in_proj_z: Linear::load(w, &p("in_proj_z"), d, vd, false)?,
            in_proj_b: Linear::load(w, &p("in_proj_b"), d, s.v_heads, false)?,
            in_proj_a: Linear::load(w, &p("in_proj_a"), d, s.v_heads, false)?,
            conv_weight: w.take(&p("conv1d.weight"), &[s.conv_dim(), s.conv_kernel, 1])?,
            dt_bias: w.take(&p("dt_bias"), &[s.v_heads])?,
            a_log: w.take(&p("A_log"), &[s.v_heads])?,
            norm_weight: w.take(&p("norm.weight"), &[s.v_dim])?,
            out_proj: Linear::load(w, &p("out_proj"), vd, d, false)?,
            shape: s,
        })
    }

    /// Runs the layer over `x` `[B, S, D]`, reading and replacing the cache's two state slots;
    /// `mask` `[B, S]` (a batch's real tokens) keeps pad tokens out of both states.
    pub fn forward(
        &self,
        x: &Array,
        cache: &mut ArraysCache,
        mask: Option<&Array>,
        fns: &mut DeltaOps,
    ) -> Result<Array> {
        let s = &self.shape;
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let mut qkv = self.in_proj_qkv.forward(x)?;
        if let Some(m) = mask {
            let zero = Array::from_int(0).as_dtype(qkv.dtype())?;
            qkv = ops::select(&m.expand_dims(-1)?, &qkv, &zero)?;
        }
        let z = self
            .in_proj_z
            .forward(x)?
            .reshape(&[b, l, s.v_heads, s.v_dim])?;
        let beta_in = self.in_proj_b.forward(x)?;
        let a = self.in_proj_a.forward(x)?;

        let conv_state = match cache.get(0) {
            Some(c) => c.clone(),
            None => ops::zeros_dtype(&[b, s.conv_kernel - 1, s.conv_dim()], x.dtype())?,
        };
        let conv_input = ops::concatenate(&[conv_state, qkv], 1)?;
        let n_keep = s.conv_kernel - 1;
        let conv_state = match cache.lengths() {
            // Each row's last `n_keep` inputs before its padding.
            Some(lengths) => {
                let ends: Vec<i32> = lengths.iter().map(|&n| n.clamp(0, l)).collect();
                let ends = Array::from_slice(&ends, &[b, 1]);
                let positions = ends
                    .add(ops::arange::<_, i32>(0, n_keep, 1)?)?
                    .expand_dims(-1)?;
                mlx_rs::ops::indexing::take_along_axis(&conv_input, &positions, 1)?
            }
            None => {
                let total = conv_input.shape()[1];
                conv_input
                    .index((.., (total - n_keep).., ..))
                    .contiguous()?
            }
        };
        cache.set(0, conv_state)?;
        let conv = ops::conv1d(&conv_input, &self.conv_weight, 1, 0, 1, s.conv_dim())?;
        let conv_out = fns.silu.call1(&[conv])?;

        let parts = conv_out.split_at_indices(&[s.key_dim(), 2 * s.key_dim()], -1)?;
        let heads = [
            (s.k_heads, s.k_dim),
            (s.k_heads, s.k_dim),
            (s.v_heads, s.v_dim),
        ];
        let mut qkv = parts
            .iter()
            .zip(heads)
            .map(|(t, (h, dh))| t.reshape(&[b, l, h, dh]))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let (Some(v), Some(k), Some(q)) = (qkv.pop(), qkv.pop(), qkv.pop()) else {
            return Err(EngineError::Runtime("conv output split failed".into()));
        };
        let (q, k) = normalize_qk(&q, &k, s.k_dim)?;

        let (out, state) = fns.recurrence.run(
            &q,
            &k,
            &v,
            &a,
            &beta_in,
            &self.a_log,
            &self.dt_bias,
            cache.get(1),
            mask,
        )?;
        cache.set(1, state)?;
        cache.advance(l);

        // Qwen3NextRMSNormGated: precise_swiglu(out, z, rms_norm(out, w, eps)).
        let normed = fast::rms_norm(&out, Some(&self.norm_weight), s.eps as f32)?;
        let out = fns.precise_swiglu.call1(&[out, z, normed])?;
        self.out_proj.forward(&out.reshape(&[b, l, -1])?)
    }
}

/// `normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)`: L2-normalize q and k (as an RMSNorm with
/// the eps rescaled) and fold the `Dk**-0.5` readout scale into q.
fn normalize_qk(q: &Array, k: &Array, k_dim: i32) -> Result<(Array, Array)> {
    let inv = (k_dim as f64).powf(-0.5);
    let inv2 = inv.powf(2.0);
    let eps = (1e-6 * inv2) as f32;
    let qn = fast::rms_norm(q, None, eps)?;
    let kn = fast::rms_norm(k, None, eps)?;
    Ok((
        weak_scalar(inv2, &qn)?.multiply(&qn)?,
        weak_scalar(inv, &kn)?.multiply(&kn)?,
    ))
}
