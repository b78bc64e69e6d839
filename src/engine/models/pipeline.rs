//! Pipeline parallelism (mlx-lm's `models/pipeline.py` and the pipelined `Model.__call__`):
//! each rank runs a run of whole layers, the last rank the first layers and rank 0 the last;
//! the residual stream goes from rank to rank, and rank 0's final one is gathered to every
//! rank, so that all of them compute the same logits. The layers compute exactly what they
//! compute in one process, so the output keeps one process's bits.

use crate::engine::distributed::{all_gather, recv_like, send, Group};
use crate::engine::error::Result;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use std::sync::Arc;

/// This rank's place in the pipeline.
pub struct Stage {
    group: Arc<Group>,
}

impl Stage {
    /// The stage of this rank of `group`.
    pub fn new(group: Arc<Group>) -> Self {
        Self { group }
    }

    /// What this rank's first layer takes: the embedded ids `h` on the rank with the first
    /// layers, what the next rank sends everywhere else.
    pub fn receive(&self, h: Array) -> Result<Array> {
        let (rank, size) = (self.group.rank(), self.group.size());
        if rank + 1 < size {
            return recv_like(&h, rank + 1, &self.group);
        }
        Ok(h)
    }

    /// The last layer's output on every rank: this rank's output `h` goes on to rank - 1, and
    /// rank 0's (after the last layers) is gathered to all. Evaluated here: a caller that
    /// evaluates only the caches (a prefill chunk) would otherwise never send, and the rank
    /// before would wait for ever (mlx-lm ties the send into the last cache with `mx.depends`
    /// for the same reason).
    pub fn finish(&self, h: Array) -> Result<Array> {
        let rank = self.group.rank();
        let h = if rank == 0 {
            h
        } else {
            send(&h, rank - 1, &self.group)?
        };
        let batch = h.shape()[0];
        let out = all_gather(&h, &self.group)?.index(..batch);
        out.eval()?;
        Ok(out)
    }
}
