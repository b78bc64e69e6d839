//! Greedy sequential sampling of a DSpark block on the host.
//!
//! Why: the sequential and confidence heads run γ dependent steps, each a dozen tiny MLX ops
//! (a row lookup, a few hundred-wide products, gates, an argmax): on a 2-core CPU that graph
//! costs 1.2-1.8 ms a round, a quarter of the draft, almost all of it per-op overhead. Here the
//! block's hidden states and base logits are read once and the γ steps are plain f32 loops
//! (SmolLM2's drafter: about 300,000 multiply-adds a step). Same equations as
//! [`super::module::DsparkModule::sample`] at temperature 0, summed in another order, so a
//! near-tie may draft another token; drafts never change what is emitted (the target
//! verifies), and the tests hold both paths to the same float64 reference.

use super::checkpoint::SeqHead;
use crate::engine::error::{EngineError, Result};
use crate::engine::kernels::ready_f32;
use crate::engine::kernels::vecops::dot;
use crate::engine::logprobs::first_greatest;
use mlx_rs::{Array, Dtype};

/// A dense layer's weight `[out, in]` and bias on the host.
struct HostLinear {
    weight: Vec<f32>,
    bias: Vec<f32>,
    inputs: usize,
}

impl HostLinear {
    fn new(weight: &Array, bias: Option<&Array>) -> Result<Option<Self>> {
        let Some(weight_values) = host_f32(weight)? else {
            return Ok(None);
        };
        let [outputs, inputs] = *weight.shape() else {
            return Ok(None);
        };
        let bias = match bias {
            Some(b) => match host_f32(b)? {
                Some(b) if b.len() == outputs as usize => b,
                _ => return Ok(None),
            },
            None => vec![0.0; outputs as usize],
        };
        Ok(Some(Self {
            weight: weight_values,
            bias,
            inputs: inputs as usize,
        }))
    }

    /// `W x + b` into `out`.
    fn forward(&self, x: &[f32], out: &mut [f32]) {
        for ((o, row), b) in out
            .iter_mut()
            .zip(self.weight.chunks_exact(self.inputs))
            .zip(&self.bias)
        {
            *o = dot(row, x) + b;
        }
    }
}

/// The values of an f32 array in row-major order; `None` for another dtype.
pub(super) fn host_f32(a: &Array) -> Result<Option<Vec<f32>>> {
    if a.dtype() != Dtype::Float32 {
        return Ok(None);
    }
    // A reshape makes a strided view contiguous, so the slice is in row-major order.
    let flat = a.reshape(&[-1])?;
    flat.eval()?;
    let values = flat
        .try_as_slice::<f32>()
        .map_err(|e| EngineError::Runtime(format!("cannot read a DSpark head's weights ({e})")))?;
    Ok(Some(values.to_vec()))
}

/// The values of an evaluated block array in place, or (a strided view) a row-major copy;
/// `None` for another dtype.
fn block_f32(a: &Array) -> Result<Option<std::borrow::Cow<'_, [f32]>>> {
    if let Some(values) = ready_f32(a) {
        return Ok(Some(std::borrow::Cow::Borrowed(values)));
    }
    Ok(host_f32(a)?.map(std::borrow::Cow::Owned))
}

/// The weights the γ steps read, as parts of [`super::module::DsparkModule`] hand them over.
pub struct HeadWeights<'a> {
    /// The sequential head's kind ([`SeqHead::None`]: base logits alone).
    pub kind: SeqHead,
    /// `W1` `[V, r]` (the previous token's embedding), with a sequential head.
    pub w1: Option<&'a Array>,
    /// `W2` over the draft ids `[Vd, r]`, with a sequential head.
    pub w2: Option<&'a Array>,
    /// The RNN's joint or the gated head's gate projection, weight and bias.
    pub proj: Option<(&'a Array, Option<&'a Array>)>,
    /// The confidence head's weight `[1, d (+ r)]` and bias.
    pub confidence: Option<(&'a Array, Option<&'a Array>)>,
    /// Whether the confidence head also reads `W1[x_{k-1}]`.
    pub confidence_with_markov: bool,
    /// The target id of each draft id (`None`: draft ids are target ids).
    pub target_ids: Option<&'a Array>,
}

/// The heads' weights on the host, made once per drafter.
pub struct HostSampler {
    kind: SeqHead,
    rank: usize,
    /// `W1` `[V, r]`.
    w1: Vec<f32>,
    /// `W2ᵀ` `[r, Vd]`: the bias is `r` vector multiply-adds over the draft ids.
    w2t: Vec<f32>,
    proj: Option<HostLinear>,
    confidence: Option<HostLinear>,
    confidence_with_markov: bool,
    target_ids: Option<Vec<u32>>,
}

/// What a greedy block drafted.
pub struct HostDraft {
    /// The γ drafted target ids.
    pub tokens: Vec<u32>,
    /// The confidence logit of each step (empty without a confidence head).
    pub confidence: Vec<f32>,
}

impl HostSampler {
    /// The host copy of `w`; `None` where a weight is not a dense f32 tensor of the expected
    /// shape (the caller then samples on MLX).
    pub fn new(w: HeadWeights<'_>) -> Result<Option<Self>> {
        let (mut w1, mut w2t, mut rank, mut proj) = (Vec::new(), Vec::new(), 0, None);
        if w.kind != SeqHead::None {
            let (Some(w1_array), Some(w2_array)) = (w.w1, w.w2) else {
                return Ok(None);
            };
            let (Some(table), Some(map)) = (host_f32(w1_array)?, host_f32(w2_array)?) else {
                return Ok(None);
            };
            let [draft_ids, r] = *w2_array.shape() else {
                return Ok(None);
            };
            let (draft_ids, r) = (draft_ids as usize, r as usize);
            if w1_array.shape().last() != Some(&(r as i32)) {
                return Ok(None);
            }
            w2t = vec![0.0; map.len()];
            for (i, row) in map.chunks_exact(r).enumerate() {
                for (j, v) in row.iter().enumerate() {
                    w2t[j * draft_ids + i] = *v;
                }
            }
            (w1, rank) = (table, r);
            proj = match w.proj {
                Some((weight, bias)) => match HostLinear::new(weight, bias)? {
                    Some(p) => Some(p),
                    None => return Ok(None),
                },
                None if w.kind == SeqHead::Markov => None,
                None => return Ok(None),
            };
        }
        let confidence = match w.confidence {
            Some((weight, bias)) => match HostLinear::new(weight, bias)? {
                Some(c) => Some(c),
                None => return Ok(None),
            },
            None => None,
        };
        let target_ids = match w.target_ids {
            Some(ids) => {
                let ids = ids.as_dtype(Dtype::Uint32)?;
                ids.eval()?;
                Some(
                    ids.try_as_slice::<u32>()
                        .map_err(|e| {
                            EngineError::Runtime(format!("cannot read the draft ids ({e})"))
                        })?
                        .to_vec(),
                )
            }
            None => None,
        };
        Ok(Some(Self {
            kind: w.kind,
            rank,
            w1,
            w2t,
            proj,
            confidence,
            confidence_with_markov: w.confidence_with_markov,
            target_ids,
        }))
    }

    /// Samples the block greedily from its post-norm hidden states `[γ, d]` and base logits
    /// `[γ, Vd]` (evaluated f32 arrays), starting after `anchor`.
    pub fn sample(&self, hidden: &Array, base_logits: &Array, anchor: u32) -> Result<HostDraft> {
        let (Some(hidden_values), Some(base)) = (block_f32(hidden)?, block_f32(base_logits)?)
        else {
            return Err(EngineError::Runtime(
                "the DSpark block's hidden states or base logits are not f32".into(),
            ));
        };
        let (&[gamma, d], &[_, draft_ids]) = (hidden.shape(), base_logits.shape()) else {
            return Err(EngineError::Runtime(
                "the DSpark block's hidden states or base logits are not matrices".into(),
            ));
        };
        let (gamma, d, draft_ids) = (gamma as usize, d as usize, draft_ids as usize);
        self.sample_rows(&hidden_values, &base, (gamma, d, draft_ids), anchor)
    }

    /// [`Self::sample`] over host rows: `hidden` `[γ, d]` and `base` `[γ, Vd]`, row-major, with
    /// `shape` = (γ, d, Vd).
    pub fn sample_rows(
        &self,
        hidden_values: &[f32],
        base: &[f32],
        shape: (usize, usize, usize),
        anchor: u32,
    ) -> Result<HostDraft> {
        let (gamma, d, draft_ids) = shape;
        if hidden_values.len() != gamma * d || base.len() != gamma * draft_ids {
            return Err(EngineError::Runtime(format!(
                "a DSpark block of {} hidden and {} logit values for {gamma} rows of {d} and {draft_ids}",
                hidden_values.len(),
                base.len()
            )));
        }
        let r = self.rank;
        let mut prev = anchor;
        let mut state = vec![0.0f32; r];
        let mut inner = vec![0.0f32; r];
        let mut parts = vec![0.0f32; 3 * r];
        let mut joint_in = Vec::with_capacity(2 * r + d);
        let mut conf_in = Vec::with_capacity(d + r);
        let mut z = vec![0.0f32; draft_ids];
        let mut bias = vec![0.0f32; draft_ids];
        let mut draft = HostDraft {
            tokens: Vec::with_capacity(gamma),
            confidence: Vec::with_capacity(gamma),
        };
        for k in 0..gamma {
            let h = &hidden_values[k * d..(k + 1) * d];
            z.copy_from_slice(&base[k * draft_ids..(k + 1) * draft_ids]);
            let e = if self.kind == SeqHead::None {
                &[][..]
            } else {
                let at = prev as usize * r;
                let e = self.w1.get(at..at + r).ok_or_else(|| {
                    EngineError::Runtime(format!("token {prev} is outside the DSpark head's table"))
                })?;
                self.inner(h, e, &mut state, &mut inner, &mut parts, &mut joint_in);
                // z = U + W2 · inner, W2 read by its columns.
                bias.fill(0.0);
                for (column, &x) in self.w2t.chunks_exact(draft_ids).zip(&inner) {
                    for (b, w) in bias.iter_mut().zip(column) {
                        *b += x * w;
                    }
                }
                for (zv, b) in z.iter_mut().zip(&bias) {
                    *zv += b;
                }
                e
            };
            if let Some(c) = &self.confidence {
                conf_in.clear();
                conf_in.extend_from_slice(h);
                if self.confidence_with_markov {
                    conf_in.extend_from_slice(e);
                }
                let mut logit = [0.0f32];
                c.forward(&conf_in, &mut logit);
                draft.confidence.push(logit[0]);
            }
            let best = first_greatest(z.iter().copied());
            let token = match &self.target_ids {
                Some(ids) => ids[best],
                None => best as u32,
            };
            draft.tokens.push(token);
            prev = token;
        }
        Ok(draft)
    }

    /// The sequential head's input to `W2` for one step (`state` carries the RNN's `s`).
    fn inner(
        &self,
        h: &[f32],
        e: &[f32],
        state: &mut [f32],
        inner: &mut [f32],
        parts: &mut [f32],
        joint_in: &mut Vec<f32>,
    ) {
        let r = self.rank;
        match (self.kind, &self.proj) {
            (SeqHead::Rnn, Some(joint)) => {
                joint_in.clear();
                joint_in.extend_from_slice(state);
                joint_in.extend_from_slice(e);
                joint_in.extend_from_slice(h);
                joint.forward(joint_in, parts);
                for j in 0..r {
                    let gate = sigmoid(parts[j]);
                    let cand = parts[r + j].tanh();
                    state[j] = gate * state[j] + (1.0 - gate) * cand;
                    inner[j] = parts[2 * r + j].tanh();
                }
            }
            (SeqHead::Gated, Some(gate)) => {
                joint_in.clear();
                joint_in.extend_from_slice(h);
                joint_in.extend_from_slice(e);
                gate.forward(joint_in, &mut parts[..r]);
                for j in 0..r {
                    inner[j] = sigmoid(parts[j]) * e[j];
                }
            }
            _ => inner.copy_from_slice(e),
        }
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}
