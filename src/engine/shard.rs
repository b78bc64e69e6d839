//! A rank's share of a checkpoint when a job splits the model over several ranks
//! ([`super::distributed`]): under tensor parallelism a slice of each split layer, as mlx's
//! `shard_linear` slices it; under pipeline parallelism whole layers, as mlx-lm's
//! `model.pipeline` assigns them. The loader reads only the share (see [`RankShare::load`]).

use super::distributed::Group;
use super::error::{EngineError, Result};
use super::loader::{self, Narrowed, TensorEntry};
use mlx_rs::Array;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// How a linear layer's weights are split over the ranks of a tensor-parallel job, as mlx's
/// `shard_linear` splits them (rank r holds the r-th of N equal, contiguous slices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// "all-to-sharded": each rank holds a slice of the outputs (weight rows and bias).
    Outputs,
    /// "sharded-to-all": each rank holds a slice of the inputs (weight columns); the partial
    /// outputs are summed over the ranks, then the whole bias is added.
    Inputs,
}

/// A tensor-parallel split: (module-path suffix, kind) per split layer; the rest is whole on
/// every rank.
pub type ShardPlan = [(&'static str, Sharding)];

/// What a rank holds.
#[derive(Debug, Clone)]
pub enum Share {
    /// A slice of every layer the plan splits.
    Tensor(&'static ShardPlan),
    /// Whole decoder layers `model.layers.{i}` for i in this range (and everything outside
    /// the layers).
    Pipeline(Range<usize>),
}

/// One rank's share of a checkpoint.
pub struct RankShare {
    group: Arc<Group>,
    share: Share,
    /// Tensors the loader already read as this rank's part.
    read_in_part: HashSet<String>,
}

impl RankShare {
    /// The share `share` of the rank of `group` this process is.
    pub fn new(group: Arc<Group>, share: Share) -> Self {
        Self {
            group,
            share,
            read_in_part: HashSet::new(),
        }
    }

    /// Reads this rank's share of one safetensors file.
    pub fn load(&mut self, file: &Path) -> Result<HashMap<String, Array>> {
        let parts = std::cell::RefCell::new(Vec::new());
        let narrow = |t: &TensorEntry| {
            let n = self.narrowed(t);
            if matches!(n, Some(Narrowed::Part(_) | Narrowed::Strided)) {
                parts.borrow_mut().push(t.name.clone());
            }
            n
        };
        let cut = |name: &str, a: Array| self.cut(name, a);
        let tensors = loader::load_narrowed(file, &narrow, &cut)?;
        self.read_in_part.extend(parts.into_inner());
        Ok(tensors)
    }

    /// Number of ranks each layer is split over (1 under pipeline parallelism).
    pub fn tensor_ranks(&self) -> usize {
        match self.share {
            Share::Tensor(_) => self.group.size(),
            Share::Pipeline(_) => 1,
        }
    }

    /// The layers this rank runs under pipeline parallelism, and its group.
    pub fn pipeline(&self) -> Option<(Range<usize>, Arc<Group>)> {
        match &self.share {
            Share::Pipeline(layers) => Some((layers.clone(), self.group.clone())),
            Share::Tensor(_) => None,
        }
    }

    /// The group whose ranks' outputs of the layer at `module` must be summed (an
    /// input-split layer), if any.
    pub fn all_sum_group(&self, module: &str) -> Option<Arc<Group>> {
        (self.sharding_of(module)? == Sharding::Inputs).then(|| self.group.clone())
    }

    /// This rank's slice of tensor `name` (`a` itself where its module is not split or the
    /// loader read only the slice), copied out, so that `a`'s buffer can go.
    pub fn cut(&self, name: &str, a: Array) -> Result<Array> {
        if self.read_in_part.contains(name) {
            return Ok(a);
        }
        let Some((module, leaf)) = name.rsplit_once('.') else {
            return Ok(a);
        };
        let Some(axis) = self
            .sharding_of(module)
            .and_then(|k| split_axis(k, leaf, a.ndim()))
        else {
            return Ok(a);
        };
        let (n, len) = (self.group.size() as i32, a.shape()[axis]);
        if len % n != 0 {
            return Err(EngineError::Input(format!(
                "tensor `{name}` has {len} entries along axis {axis}, which do not split evenly \
                 over {n} ranks; run this model on a number of ranks that divides it"
            )));
        }
        let mut parts = a.split_equal(n, axis as i32)?;
        Ok(parts.swap_remove(self.group.rank()).contiguous()?)
    }

    /// What the loader reads of tensor `t`: under pipeline parallelism nothing of another
    /// rank's layers; under tensor parallelism only this rank's part where that is one
    /// contiguous range (every axis before the split one has size 1) and divides evenly, the
    /// whole tensor to [`RankShare::cut`] at once where the part is strided; `None` (whole, as
    /// usual) otherwise.
    fn narrowed(&self, t: &TensorEntry) -> Option<Narrowed> {
        if let Share::Pipeline(layers) = &self.share {
            return layer_of(&t.name)
                .filter(|i| !layers.contains(i))
                .map(|_| Narrowed::Skip);
        }
        let (module, leaf) = t.name.rsplit_once('.')?;
        let axis = split_axis(self.sharding_of(module)?, leaf, t.shape.len())?;
        let n = self.group.size() as u64;
        let len = t.shape[axis];
        if !len.is_multiple_of(n) {
            return None;
        }
        if t.shape[..axis].iter().any(|&d| d != 1) || !(t.end - t.start).is_multiple_of(n) {
            return Some(Narrowed::Strided);
        }
        let part = (t.end - t.start) / n;
        let mut entry = t.clone();
        entry.start = t.start + part * self.group.rank() as u64;
        entry.end = entry.start + part;
        entry.shape[axis] = len / n;
        Some(Narrowed::Part(entry))
    }

    fn sharding_of(&self, module: &str) -> Option<Sharding> {
        let Share::Tensor(plan) = self.share else {
            return None;
        };
        plan.iter()
            .find(|(suffix, _)| module.ends_with(suffix))
            .map(|&(_, kind)| kind)
    }
}

/// The axis a tensor (`leaf`: `weight`, `bias`, `scales`, `biases`) of a layer split `kind` is
/// split along, as mlx's `shard_linear` splits it; `None` where it stays whole (the bias of an
/// input-split layer).
fn split_axis(kind: Sharding, leaf: &str, ndim: usize) -> Option<usize> {
    let last = ndim.checked_sub(1)?;
    match (kind, leaf) {
        (Sharding::Outputs, "bias") => Some(last),
        (Sharding::Outputs, _) => Some(last.saturating_sub(1)),
        (Sharding::Inputs, "bias") => None,
        (Sharding::Inputs, _) => Some(last),
    }
}

/// The decoder layer a tensor belongs to (`model.layers.{i}.…`).
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    rest.split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::layer_of;

    #[test]
    fn layer_of_reads_the_layer_index() {
        assert_eq!(layer_of("model.layers.12.mlp.up_proj.weight"), Some(12));
        assert_eq!(layer_of("model.embed_tokens.weight"), None);
        assert_eq!(layer_of("model.layers.x.mlp"), None);
    }
}
