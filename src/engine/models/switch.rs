//! Mixture-of-experts layers: mlx-lm's `switch_layers.py` (`SwitchLinear` over `gather_mm`,
//! `QuantizedSwitchLinear` over `gather_qmm`, `SwitchGLU` with its sort-by-expert path for 64+
//! routed pairs) and the softmax top-k router of qwen3_moe / qwen3_next.

use super::activations::CompiledOp;
use super::mlp::GatedMlp;
use crate::engine::error::Result;
use crate::engine::nn::{load_stacked_weight, Linear, LinearWeight};
use crate::engine::weights::WeightStore;
use mlx_rs::ops::indexing::{take_along_axis, Ellipsis, IndexOp};
use mlx_rs::{ops, Array};

/// mlx-lm sorts tokens by expert once `indices.size >= 64` (it selects the sorted kernels).
const SORT_THRESHOLD: i32 = 64;

/// `SwitchLinear` / `QuantizedSwitchLinear` (no bias: none of the ported families use one).
pub struct SwitchLinear {
    weight: LinearWeight,
}

impl SwitchLinear {
    /// Loads `{path}.weight` (`[E, out, in]`, + `.scales`/`.biases` when quantized).
    pub fn load(
        w: &mut WeightStore,
        path: &str,
        experts: i32,
        in_dim: i32,
        out_dim: i32,
    ) -> Result<Self> {
        Ok(Self {
            weight: load_stacked_weight(w, path, &[experts], out_dim, in_dim)?,
        })
    }

    /// `gather_mm(x, W.swapaxes(-1, -2), rhs_indices=idx)` or its quantized `gather_qmm`.
    pub fn forward(&self, x: &Array, idx: &Array, sorted: bool) -> Result<Array> {
        Ok(match &self.weight {
            LinearWeight::Dense(wt) => ops::gather_mm(x, wt.swap_axes(-1, -2)?, None, idx, sorted)?,
            LinearWeight::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => ops::gather_qmm(
                x,
                weight,
                scales,
                biases,
                None,
                idx,
                true,
                spec.group_size,
                spec.bits,
                sorted,
            )?,
        })
    }
}

/// `SwitchGLU`: per-token experts `down(act(gate(x), up(x)))` for the routed `indices`.
pub struct SwitchGlu {
    gate_proj: SwitchLinear,
    up_proj: SwitchLinear,
    down_proj: SwitchLinear,
}

impl SwitchGlu {
    /// Loads `{prefix}.{gate,up,down}_proj`.
    pub fn load(
        w: &mut WeightStore,
        prefix: &str,
        experts: i32,
        hidden: i32,
        inter: i32,
    ) -> Result<Self> {
        Ok(Self {
            gate_proj: SwitchLinear::load(
                w,
                &format!("{prefix}.gate_proj"),
                experts,
                hidden,
                inter,
            )?,
            up_proj: SwitchLinear::load(w, &format!("{prefix}.up_proj"), experts, hidden, inter)?,
            down_proj: SwitchLinear::load(
                w,
                &format!("{prefix}.down_proj"),
                experts,
                inter,
                hidden,
            )?,
        })
    }

    /// `x` `[B, L, D]`, `indices` `[B, L, k]` → `[B, L, k, D]`. `act` is called with
    /// `[gate, up]` (mlx-lm's `swiglu(gate, x)` / `geglu(gate, x)`).
    pub fn forward(&self, x: &Array, indices: &Array, act: &mut CompiledOp) -> Result<Array> {
        let x = x.expand_dims_axes(&[-2, -3])?;
        let do_sort = indices.size() as i32 >= SORT_THRESHOLD;
        let (x, idx, inv_order) = if do_sort {
            let (x, idx, inv) = gather_sort(&x, indices)?;
            (x, idx, Some(inv))
        } else {
            (x, indices.clone(), None)
        };
        let up = self.up_proj.forward(&x, &idx, do_sort)?;
        let gate = self.gate_proj.forward(&x, &idx, do_sort)?;
        let h = act.call1(&[gate, up])?;
        let mut y = self.down_proj.forward(&h, &idx, do_sort)?;
        if let Some(inv) = inv_order {
            y = ops::unflatten(y.take_axis(&inv, 0)?, 0, indices.shape())?;
        }
        Ok(y.squeeze_axes(&[-2])?)
    }
}

/// `_gather_sort`: orders the (token, expert) pairs by expert.
fn gather_sort(x: &Array, indices: &Array) -> Result<(Array, Array, Array)> {
    let m = indices.shape()[indices.ndim() - 1];
    let flat = indices.flatten(None, None)?;
    let order = ops::argsort_axis(&flat, -1)?;
    let inv_order = ops::argsort_axis(&order, -1)?;
    let rows = order.floor_divide(Array::from_int(m).as_dtype(order.dtype())?)?;
    let x = x.flatten(0, -3)?.take_axis(&rows, 0)?;
    Ok((x, flat.take_axis(&order, 0)?, inv_order))
}

/// `argpartition(scores, kth=-k)[..., -k:]`: the top-k expert ids per token (unordered).
pub fn top_k_indices(scores: &Array, k: i32) -> Result<Array> {
    let e = scores.shape()[scores.ndim() - 1];
    Ok(ops::argpartition_axis(scores, -k, -1)?.index((Ellipsis, (e - k)..)))
}

/// The qwen3_moe / qwen3_next router: `softmax(gate(x), precise)`, top-k, optionally
/// renormalized; returns `(indices, scores)`.
pub struct SoftmaxTopK {
    gate: Linear,
    top_k: i32,
    norm_topk_prob: bool,
}

impl SoftmaxTopK {
    /// Loads `{prefix}.gate` (`[experts, hidden]`).
    pub fn load(
        w: &mut WeightStore,
        prefix: &str,
        hidden: i32,
        experts: i32,
        top_k: i32,
        norm_topk_prob: bool,
    ) -> Result<Self> {
        Ok(Self {
            gate: Linear::load(w, &format!("{prefix}.gate"), hidden, experts, false)?,
            top_k,
            norm_topk_prob,
        })
    }

    /// Routes `x` `[B, L, D]`.
    pub fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let gates = ops::softmax_axis(&self.gate.forward(x)?, -1, true)?;
        let inds = top_k_indices(&gates, self.top_k)?;
        let mut scores = take_along_axis(&gates, &inds, -1)?;
        if self.norm_topk_prob {
            scores = scores.divide(scores.sum_axis(-1, true)?)?;
        }
        Ok((inds, scores))
    }
}

/// `(y * scores[..., None]).sum(-2)`: the routed experts' outputs mixed per token.
pub fn mix_experts(y: &Array, scores: &Array) -> Result<Array> {
    Ok(y.multiply(scores.expand_dims(-1)?)?.sum_axis(-2, false)?)
}

/// The always-on expert of qwen3_next-style blocks, scaled by `sigmoid(shared_expert_gate(x))`.
struct SharedExpert {
    mlp: GatedMlp,
    gate: Linear,
}

/// A sparse MoE block: softmax top-k router, `SwitchGLU` experts with SwiGLU, optionally a
/// gated shared expert (qwen3_next / qwen3_5) — mlx-lm's `Qwen3MoeSparseMoeBlock` and
/// `Qwen3NextSparseMoeBlock`.
pub struct SparseMoe {
    router: SoftmaxTopK,
    switch_mlp: SwitchGlu,
    shared: Option<SharedExpert>,
}

/// Sizes of a [`SparseMoe`] block.
#[derive(Debug, Clone, Copy)]
pub struct MoeShape {
    /// Model width.
    pub hidden: i32,
    /// Routed experts.
    pub experts: i32,
    /// Experts per token.
    pub top_k: i32,
    /// Width of each routed expert.
    pub expert_inter: i32,
    /// Renormalize the top-k scores to sum to 1.
    pub norm_topk_prob: bool,
    /// Width of the shared expert (qwen3_next style) when there is one.
    pub shared_inter: Option<i32>,
}

impl SparseMoe {
    /// Loads `{prefix}.gate`, `{prefix}.switch_mlp` (+ `shared_expert`, `shared_expert_gate`).
    pub fn load(w: &mut WeightStore, prefix: &str, s: MoeShape) -> Result<Self> {
        let shared = match s.shared_inter {
            Some(inter) => Some(SharedExpert {
                mlp: GatedMlp::load(
                    w,
                    &format!("{prefix}.shared_expert"),
                    s.hidden,
                    inter,
                    false,
                )?,
                gate: Linear::load(
                    w,
                    &format!("{prefix}.shared_expert_gate"),
                    s.hidden,
                    1,
                    false,
                )?,
            }),
            None => None,
        };
        Ok(Self {
            router: SoftmaxTopK::load(w, prefix, s.hidden, s.experts, s.top_k, s.norm_topk_prob)?,
            switch_mlp: SwitchGlu::load(
                w,
                &format!("{prefix}.switch_mlp"),
                s.experts,
                s.hidden,
                s.expert_inter,
            )?,
            shared,
        })
    }

    /// Routes and mixes `x` `[B, L, D]`; `swiglu` is the model's compiled SwiGLU.
    pub fn forward(&self, x: &Array, swiglu: &mut CompiledOp) -> Result<Array> {
        let (inds, scores) = self.router.route(x)?;
        let y = self.switch_mlp.forward(x, &inds, swiglu)?;
        let mixed = mix_experts(&y, &scores)?;
        match &self.shared {
            // qwen3_moe: `.astype(y.dtype)` after the sum.
            None => Ok(mixed.as_dtype(y.dtype())?),
            Some(se) => {
                let shared_y = se.mlp.forward_op(x, swiglu)?;
                let shared_y = ops::sigmoid(se.gate.forward(x)?)?.multiply(&shared_y)?;
                Ok(mixed.add(&shared_y)?)
            }
        }
    }
}

/// mlx-lm's `sanitize` for per-expert checkpoints: stacks `{prefix}.experts.{e}.{n}.weight`
/// into `{prefix}.switch_mlp.{n}.weight` (`[E, out, in]`) when the per-expert form is present.
pub fn stack_experts(w: &mut WeightStore, prefix: &str, experts: i32) -> Result<()> {
    if !w.contains(&format!("{prefix}.experts.0.up_proj.weight")) {
        return Ok(());
    }
    for n in ["up_proj", "down_proj", "gate_proj"] {
        let parts = (0..experts)
            .map(|e| w.take_any(&format!("{prefix}.experts.{e}.{n}.weight")))
            .collect::<Result<Vec<_>>>()?;
        w.insert(
            &format!("{prefix}.switch_mlp.{n}.weight"),
            ops::stack(&parts, 0)?,
        );
    }
    Ok(())
}

/// A layer's feed-forward: a dense SwiGLU MLP or a sparse MoE block.
pub enum FeedForward {
    /// `down(swiglu(gate(x), up(x)))`.
    Dense(Box<GatedMlp>),
    /// Routed experts.
    Moe(Box<SparseMoe>),
}

impl FeedForward {
    /// Applies the block with the model's compiled SwiGLU.
    pub fn forward(&self, x: &Array, swiglu: &mut CompiledOp) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward_op(x, swiglu),
            FeedForward::Moe(moe) => moe.forward(x, swiglu),
        }
    }
}

/// Checks the expert counts of an MoE config (`num_experts`, `num_experts_per_tok`).
pub fn check_experts(
    spec: &super::ModelSpec,
    experts: i32,
    top_k: i32,
    top_k_field: &str,
) -> Result<()> {
    if experts < 1 {
        return Err(spec.field_error(
            "num_experts",
            &format!("is {experts}; it must be at least 1"),
        ));
    }
    if top_k < 1 || top_k > experts {
        return Err(spec.field_error(
            top_k_field,
            &format!("is {top_k}; it must be between 1 and num_experts ({experts})"),
        ));
    }
    Ok(())
}
