//! A greedy DSpark block on the host kernels: the context rows' keys and values, the block's
//! backbone pass and its draft head run on host memory ([`HostDecoder::step_rows`] for the
//! block), so a round builds no MLX graph.
//!
//! Why: as MLX graphs, a round's context features, block layer and head cost ~5 ms on a 2-core
//! CPU, a quarter of a SmolLM2 decode step, and almost none of it is the weights' bytes
//! (halving them changed nothing): it is per-operation overhead. Same equations as
//! [`super::module::DsparkModule::block`] (and `extend_context`), summed in another order, so
//! a near-tie may draft another token; the target verifies every draft, so the output never
//! changes.

use crate::engine::error::{EngineError, Result};
use crate::engine::kernels::vecops::rms_norm;
use crate::engine::kernels::StepPlan;
use crate::engine::kernels::{HostDecoder, HostProj, HostRope, KvBuffers, Numerics, PastKv};

/// The drafter's weights on the host and its context's keys and values.
pub struct HostBlock {
    /// The backbone layers, the final norm and the head over the draft ids (its embedding
    /// table is never read: the block enters as rows).
    decoder: HostDecoder,
    /// `fc`: the tapped rows to the drafter's width.
    fc: HostProj,
    /// `hidden_norm`'s weight.
    hidden_norm: Vec<f32>,
    rope: HostRope,
    /// The mask token's embedding (every block row after the anchor's).
    mask_row: Vec<f32>,
    /// Per layer, the context rows' keys and values in the step's cache layout
    /// (`[kv_heads, capacity, head_dim]`, the first `len` positions valid).
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    capacity: usize,
    len: usize,
}

/// A block's post-norm hidden states `[γ, d]` and base logits `[γ, Vd]`, row-major.
pub struct HostBlockOut {
    pub hidden: Vec<f32>,
    pub logits: Vec<f32>,
}

impl HostBlock {
    /// The host form of a drafter: `decoder` with the fast numerics, `fc` over the taps,
    /// `hidden_norm` and the mask token's embedding. `None` when the decoder is not in the fast
    /// numerics or the pieces' widths disagree.
    pub fn new(
        decoder: HostDecoder,
        fc: HostProj,
        hidden_norm: Vec<f32>,
        mask_row: Vec<f32>,
    ) -> Option<Self> {
        let Numerics::Fast(rope) = &decoder.numerics else {
            return None;
        };
        let d = hidden_norm.len();
        let widths_agree = fc.rows() == d
            && mask_row.len() == d
            && decoder.final_norm.len() == d
            && decoder.head.as_ref().is_some_and(|h| h.cols() == d);
        if !widths_agree {
            return None;
        }
        Some(Self {
            rope: rope.clone(),
            keys: vec![Vec::new(); decoder.layers.len()],
            values: vec![Vec::new(); decoder.layers.len()],
            decoder,
            fc,
            hidden_norm,
            mask_row,
            capacity: 0,
            len: 0,
        })
    }

    /// Drops every context row at or beyond `keep`.
    pub fn truncate(&mut self, keep: usize) {
        self.len = self.len.min(keep);
    }

    /// Appends `rows` tapped target rows (`taps`: `rows × fc.cols`, by row) as context at the
    /// next positions: `hidden_norm(fc(taps))`, then each layer's keys (k-norm, rotary
    /// embedding) and values.
    pub fn extend(&mut self, taps: &[f32], rows: usize) -> Result<()> {
        if rows == 0 || taps.len() != rows * self.fc.cols() {
            return Err(EngineError::Runtime(format!(
                "{} tapped values for {rows} context rows of {}",
                taps.len(),
                self.fc.cols()
            )));
        }
        let d = self.hidden_norm.len();
        let projected = self.fc.forward(taps, rows)?;
        let mut features = vec![0.0f32; rows * d];
        rms_norm(
            &projected,
            &self.hidden_norm,
            self.decoder.eps,
            &mut features,
        );
        self.reserve(self.len + rows);
        let heads = self.decoder.heads;
        let (hd, kvh) = (heads.head_dim, heads.n_kv_heads);
        for (i, layer) in self.decoder.layers.iter().enumerate() {
            let mut k = layer.attn[1].forward(&features, rows)?;
            let v = layer.attn[2].forward(&features, rows)?;
            if let Some([_, k_norm]) = &layer.qk_norm {
                let raw = k.clone();
                rms_norm(&raw, k_norm, self.decoder.eps, &mut k);
            }
            for (j, (kr, vr)) in k
                .chunks_exact_mut(kvh * hd)
                .zip(v.chunks_exact(kvh * hd))
                .enumerate()
            {
                let pos = self.len + j;
                self.rope.apply(kr, hd, pos);
                for h in 0..kvh {
                    let at = (h * self.capacity + pos) * hd;
                    self.keys[i][at..at + hd].copy_from_slice(&kr[h * hd..(h + 1) * hd]);
                    self.values[i][at..at + hd].copy_from_slice(&vr[h * hd..(h + 1) * hd]);
                }
            }
        }
        self.len += rows;
        Ok(())
    }

    /// Makes room for `needed` positions, keeping the valid ones where the layout puts them.
    fn reserve(&mut self, needed: usize) {
        if needed <= self.capacity {
            return;
        }
        let capacity = needed.max(2 * self.capacity).max(256);
        let heads = self.decoder.heads;
        let (hd, kvh) = (heads.head_dim, heads.n_kv_heads);
        for buffer in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let mut grown = vec![0.0f32; kvh * capacity * hd];
            for h in 0..kvh {
                let valid = self.len * hd;
                let (from, to) = (h * self.capacity * hd, h * capacity * hd);
                grown[to..to + valid].copy_from_slice(&buffer[from..from + valid]);
            }
            *buffer = grown;
        }
        self.capacity = capacity;
    }

    /// One backbone pass over the block `[anchor, MASK × (γ-1)]` at the next positions, every
    /// row seeing the whole context and the whole block; the block's own keys and values are
    /// not kept.
    pub fn block(&self, anchor_row: &[f32], gamma: usize) -> Result<HostBlockOut> {
        let d = self.hidden_norm.len();
        if anchor_row.len() != d || gamma == 0 {
            return Err(EngineError::Runtime(format!(
                "a DSpark block of {gamma} rows from an anchor row of {} values (width {d})",
                anchor_row.len()
            )));
        }
        let mut rows = Vec::with_capacity(gamma * d);
        rows.extend_from_slice(anchor_row);
        for _ in 1..gamma {
            rows.extend_from_slice(&self.mask_row);
        }
        let past: Vec<PastKv<'_>> = self
            .keys
            .iter()
            .zip(&self.values)
            .map(|(keys, values)| PastKv {
                buffers: KvBuffers::F32 { keys, values },
                capacity: self.capacity,
                len: self.len,
            })
            .collect();
        let plan = StepPlan {
            layers: self.decoder.layers.len(),
            taps: &[],
            logits: true,
            causal: false,
        };
        let out = self.decoder.step_rows(&rows, &past, plan)?;
        let mut hidden = vec![0.0f32; out.hidden.len()];
        rms_norm(
            &out.hidden,
            &self.decoder.final_norm,
            self.decoder.eps,
            &mut hidden,
        );
        Ok(HostBlockOut {
            hidden,
            logits: out.logits,
        })
    }
}
