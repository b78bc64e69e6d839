//! The `assistant` drafter behind the speculative seam. Each round, with the anchor token `t`
//! at position `p` (the target's caches hold positions `0..p`):
//!
//! 1. the target's post-final-norm hidden state at row `p - 1` (the last layer is tapped on
//!    every target forward; the final norm is applied here) and `E(t)·√B` from the target's
//!    embedding;
//! 2. each donor layer's keys/values read from the target's caches (read-only; full layers all
//!    `p` positions, sliding layers the last `sliding_window`);
//! 3. γ chained steps at the same position `p` over the same frozen prefix, each feeding its
//!    argmax and its post-projected hidden to the next; one evaluation at the end.
//!
//! The drafter writes nothing to the target; verification, acceptance and rollback are the
//! shared executor's. In a batch each slot has its own fork (the network shared), reading its
//! own row's keys and values, which the batch lends per row.

use super::config::{self, TargetLayout};
use super::module::{AssistantModule, DonorKv};
use crate::engine::error::{EngineError, Result};
use crate::engine::forks::Forks;
use crate::engine::models::Caches;
use crate::engine::weights::{QuantConfig, WeightStore};
use crate::spec::source::{Draft, DraftSource, TargetView};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::transforms::eval;
use mlx_rs::Array;
use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;

/// The `assistant` drafter.
pub struct AssistantSource {
    /// Shared by the forks of one server's slots, which draft in turn.
    module: Rc<RefCell<AssistantModule>>,
    /// The target layer whose output (before the final norm) is the hidden state.
    last_layer: usize,
    /// Tapped last-layer rows not yet used: (first position, `[1, L, B]`).
    pending: Vec<(usize, Array)>,
}

fn ids(tokens: &[u32]) -> Array {
    let v: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Array::from_slice(&v, &[1, v.len() as i32])
}

impl AssistantSource {
    /// Loads the assistant checkpoint at `path` for the gemma4_text target in `target_dir`,
    /// refusing with one sentence a checkpoint that does not fit it.
    pub fn open(path: &Path, target_dir: &Path, forks: Forks) -> Result<Self> {
        let dir = config::checkpoint_dir(path);
        let target = TargetLayout::read(target_dir)?;
        let checked = config::check(&dir, &target)?;
        let config_path = dir.join("config.json");
        let quant = QuantConfig::from_config(&config_path, &config::read_json(&config_path)?)?;
        let mut weights = WeightStore::load(&dir, quant)?;
        let module = AssistantModule::build(
            &checked,
            &mut weights,
            &config_path,
            forks.compiled_activations,
        )?;
        weights.finish()?;
        Ok(Self::new(
            module,
            target.args.num_hidden_layers.max(1) as usize - 1,
        ))
    }

    /// Wraps a built module for a target whose last layer is `last_layer`.
    pub fn new(module: AssistantModule, last_layer: usize) -> Self {
        Self {
            module: Rc::new(RefCell::new(module)),
            last_layer,
            pending: Vec::new(),
        }
    }

    /// The tapped row at `position` as `[1, 1, B]`.
    fn row(&self, position: usize) -> Result<Array> {
        self.pending
            .iter()
            .rev()
            .find(|(first, rows)| *first <= position && position < first + rows.shape()[1] as usize)
            .map(|(first, rows)| {
                let i = (position - first) as i32;
                rows.index((.., i..i + 1, ..))
            })
            .ok_or_else(|| {
                EngineError::Runtime(format!(
                    "the assistant drafter has no target hidden state for position {position}; the target must be run with the drafter's tap layer"
                ))
            })
    }

    /// The donor keys/values each drafter layer type sees for an anchor at `position`.
    fn donors(&self, caches: &Caches, position: usize) -> Result<Vec<DonorKv>> {
        let module = self.module.borrow();
        let window = module.sliding_window().max(1) as usize;
        module
            .donor_slots()
            .iter()
            .map(|&(full, index)| {
                let cache = caches.get(index).ok_or_else(|| {
                    EngineError::Runtime(format!("the target has no cache for donor layer {index}"))
                })?;
                if cache.offset() as usize != position {
                    return Err(EngineError::Runtime(format!(
                        "donor layer {index} holds {} positions, the anchor is at {position}",
                        cache.offset()
                    )));
                }
                let (keys, values) = cache.peek_kv()?.ok_or_else(|| {
                    EngineError::Input(format!(
                        "the assistant drafter cannot read donor layer {index}'s keys/values from this kind of cache (a quantized KV cache?); run without --kv-quant"
                    ))
                })?;
                let held = keys.shape()[2] as usize;
                let want = if full { position } else { window.min(position) };
                if held < want {
                    return Err(EngineError::Runtime(format!(
                        "donor layer {index} keeps {held} positions but the assistant needs the last {want}"
                    )));
                }
                let from = (held - want) as i32;
                Ok(DonorKv {
                    keys: keys.index((.., .., from.., ..)),
                    values: values.index((.., .., from.., ..)),
                })
            })
            .collect()
    }

    /// Drafts `n` tokens after `sequence` (greedy), returning each step's lazy token id and
    /// logits `[1, 1, V]`.
    fn chain(
        &mut self,
        target: &TargetView<'_>,
        sequence: &[u32],
        n: usize,
    ) -> Result<Vec<(Array, Array)>> {
        let Some((&anchor, _)) = sequence.split_last() else {
            return Ok(Vec::new());
        };
        let p = sequence.len() - 1;
        if p == 0 || n == 0 {
            return Ok(Vec::new());
        }
        let mut hidden = target.model.final_norm(&self.row(p - 1)?)?;
        let donors = self.donors(target.caches, p)?;
        let mut embedding = target.model.embed(&ids(&[anchor]))?;
        let mut chain = Vec::with_capacity(n);
        for i in 0..n {
            let (logits, next) = self
                .module
                .borrow_mut()
                .step(&embedding, &hidden, p as i32, &donors)?;
            let tok = argmax_axis(logits.index((.., -1, ..)), -1, false)?;
            if i + 1 < n {
                embedding = target.model.embed(&tok.reshape(&[1, 1])?)?;
                hidden = next;
            }
            chain.push((tok, logits));
        }
        Ok(chain)
    }

    /// The tokens [`DraftSource::draft`] would propose and every step's logits `[n, V]`
    /// (for reference checks); reads the target like `draft` and changes nothing.
    pub fn draft_logits(
        &mut self,
        target: TargetView<'_>,
        sequence: &[u32],
        n: usize,
    ) -> Result<(Vec<u32>, Array)> {
        let chain = self.chain(&target, sequence, n)?;
        let logits: Vec<Array> = chain
            .iter()
            .map(|(_, l)| l.reshape(&[1, -1]))
            .collect::<std::result::Result<_, _>>()?;
        let logits = mlx_rs::ops::concatenate(&logits, 0)?;
        let tokens = read_tokens(&chain)?;
        Ok((tokens, logits))
    }
}

/// Evaluates the chained token ids and reads them.
fn read_tokens(chain: &[(Array, Array)]) -> Result<Vec<u32>> {
    let ids: Vec<&Array> = chain.iter().map(|(t, _)| t).collect();
    eval(ids.iter().copied())?;
    Ok(chain
        .iter()
        .map(|(t, _)| t.try_item_cast::<u32>())
        .collect::<std::result::Result<Vec<u32>, _>>()?)
}

impl DraftSource for AssistantSource {
    fn name(&self) -> &'static str {
        "assistant"
    }

    fn tap_layers(&self) -> Vec<usize> {
        vec![self.last_layer]
    }

    fn observe_taps(&mut self, first_position: usize, mut taps: Vec<Array>) -> Result<()> {
        if first_position == 0 {
            self.pending.clear();
        }
        if let Some(rows) = taps.pop() {
            self.pending.push((first_position, rows));
        }
        Ok(())
    }

    fn begin(&mut self, _target: TargetView<'_>, prompt: &[u32]) -> Result<()> {
        // This prompt's rows arrived with the prefill; anything else is stale.
        self.pending.retain(|(first, _)| *first < prompt.len());
        Ok(())
    }

    fn draft(&mut self, target: TargetView<'_>, sequence: &[u32], n: usize) -> Result<Draft> {
        let chain = self.chain(&target, sequence, n)?;
        if chain.is_empty() {
            return Ok(Draft::default());
        }
        let tokens = read_tokens(&chain)?;
        // Later anchors are further on: rows before this anchor's are no longer needed.
        let p = sequence.len() - 1;
        self.pending
            .retain(|(first, rows)| first + rows.shape()[1] as usize >= p);
        Ok(Draft {
            tokens,
            probs: None,
        })
    }

    fn fork(&self) -> Result<Option<Box<dyn DraftSource>>> {
        Ok(Some(Box::new(Self {
            module: Rc::clone(&self.module),
            last_layer: self.last_layer,
            pending: Vec::new(),
        })))
    }

    fn kv_layers(&self) -> Vec<usize> {
        let module = self.module.borrow();
        module
            .donor_slots()
            .iter()
            .map(|&(_, index)| index)
            .collect()
    }

    fn commit(&mut self, _target: TargetView<'_>, committed: usize) -> Result<()> {
        // Chunks starting at or beyond the committed length hold only rejected rows; a stale
        // row inside an older chunk is shadowed by the newer forward that recomputed it (the
        // lookup takes the newest chunk covering a position).
        self.pending.retain(|(first, _)| *first < committed);
        Ok(())
    }
}
