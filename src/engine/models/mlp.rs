//! The gated feed-forward block (`down(act(gate(x)) * up(x))`) shared by llama-family models.

use super::activations::{CompiledOp, SwiGlu};
use crate::engine::error::Result;
use crate::engine::kernels::{HostForm, HostProj};
use crate::engine::nn::{host_projs, Linear};
use crate::engine::weights::WeightStore;
use mlx_rs::Array;

/// `gate_proj`, `up_proj`, `down_proj`.
pub struct GatedMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl GatedMlp {
    /// Loads `{prefix}.{gate,up,down}_proj`.
    pub fn load(
        w: &mut WeightStore,
        prefix: &str,
        hidden: i32,
        inter: i32,
        bias: bool,
    ) -> Result<Self> {
        Ok(Self {
            gate_proj: Linear::load(w, &format!("{prefix}.gate_proj"), hidden, inter, bias)?,
            up_proj: Linear::load(w, &format!("{prefix}.up_proj"), hidden, inter, bias)?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), inter, hidden, bias)?,
        })
    }

    /// `[gate, up, down]` pinned for a host decode step of `form`, when it takes all three.
    pub fn host_parts(&self, form: HostForm) -> Result<Option<[HostProj; 3]>> {
        host_projs([&self.gate_proj, &self.up_proj, &self.down_proj], form)
    }

    /// `down(swiglu(gate(x), up(x)))`.
    pub fn forward_swiglu(&self, x: &Array, act: &mut SwiGlu) -> Result<Array> {
        let h = act.apply(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?;
        self.down_proj.forward(&h)
    }

    /// `down(op(gate(x), up(x)))` for a compiled gated activation taking `[gate, up]`.
    pub fn forward_op(&self, x: &Array, op: &mut CompiledOp) -> Result<Array> {
        let h = op.call1(&[self.gate_proj.forward(x)?, self.up_proj.forward(x)?])?;
        self.down_proj.forward(&h)
    }

    /// `down(f(gate(x), up(x)))` for another gated activation (e.g. gemma's geglu).
    pub fn forward_with(
        &self,
        x: &Array,
        f: impl FnOnce(&Array, &Array) -> Result<Array>,
    ) -> Result<Array> {
        let h = f(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?;
        self.down_proj.forward(&h)
    }
}
