//! The routed-expert branch of gemma4_text's MoE variant (mlx-lm's `Router` and `Experts` in
//! `models/gemma4_text.py`), which runs beside the dense MLP and is added to its output.

use super::activations::CompiledOp;
use super::gemma4_text::Args;
use super::switch::{mix_experts, top_k_indices, SwitchGlu};
use crate::engine::error::Result;
use crate::engine::nn::{weak_scalar, Linear, RmsNorm};
use crate::engine::weights::WeightStore;
use mlx_rs::ops::indexing::take_along_axis;
use mlx_rs::{fast, ops, Array};

/// The branch of one layer: the router, the experts and the norms around them.
pub struct MoeBranch {
    proj: Linear,
    scale: Array,
    per_expert_scale: Array,
    experts: SwitchGlu,
    top_k: i32,
    root_size: f64,
    eps: f32,
    pre_feedforward_layernorm_2: RmsNorm,
    post_feedforward_layernorm_1: RmsNorm,
    post_feedforward_layernorm_2: RmsNorm,
}

impl MoeBranch {
    /// Loads the branch of layer `prefix` (`model.layers.{i}`) when `a` enables the MoE block
    /// (and gives its sizes, as validation requires).
    pub fn load(w: &mut WeightStore, prefix: &str, a: &Args) -> Result<Option<Self>> {
        let (true, Some(e), Some(k), Some(mi)) = (
            a.enable_moe_block,
            a.num_experts,
            a.top_k_experts,
            a.moe_intermediate_size,
        ) else {
            return Ok(None);
        };
        let (d, eps) = (a.hidden_size, a.rms_norm_eps);
        let norm =
            |w: &mut WeightStore, name: &str| RmsNorm::load(w, &format!("{prefix}.{name}"), d, eps);
        Ok(Some(Self {
            proj: Linear::load(w, &format!("{prefix}.router.proj"), d, e, false)?,
            scale: w.take(&format!("{prefix}.router.scale"), &[d])?,
            per_expert_scale: w.take(&format!("{prefix}.router.per_expert_scale"), &[e])?,
            experts: SwitchGlu::load(w, &format!("{prefix}.experts.switch_glu"), e, d, mi)?,
            top_k: k,
            root_size: (d as f64).powf(-0.5),
            eps: eps as f32,
            pre_feedforward_layernorm_2: norm(w, "pre_feedforward_layernorm_2")?,
            post_feedforward_layernorm_1: norm(w, "post_feedforward_layernorm_1")?,
            post_feedforward_layernorm_2: norm(w, "post_feedforward_layernorm_2")?,
        }))
    }

    /// `Router`: `rms_norm(x, scale * hidden**-0.5)`, top-k of the projected scores, softmax
    /// over the chosen ones, times each chosen expert's scale.
    fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let w = self
            .scale
            .multiply(weak_scalar(self.root_size, &self.scale)?)?;
        let scores = self.proj.forward(&fast::rms_norm(x, Some(&w), self.eps)?)?;
        let idx = top_k_indices(&scores, self.top_k)?;
        let weights = ops::softmax_axis(&take_along_axis(&scores, &idx, -1)?, -1, false)?;
        let weights = weights.multiply(self.per_expert_scale.take_axis(&idx, 0)?)?;
        Ok((idx, weights))
    }

    /// The layer's feed-forward output: the dense MLP's output `dense` (normed) plus the
    /// experts' mix over `h`, the residual stream after attention.
    pub fn forward(&self, dense: &Array, h: &Array, geglu: &mut CompiledOp) -> Result<Array> {
        let h1 = self.post_feedforward_layernorm_1.forward(dense)?;
        let (idx, weights) = self.route(h)?;
        let h2 = self.pre_feedforward_layernorm_2.forward(h)?;
        let h2 = mix_experts(&self.experts.forward(&h2, &idx, geglu)?, &weights)?;
        Ok(h1.add(self.post_feedforward_layernorm_2.forward(&h2)?)?)
    }
}
