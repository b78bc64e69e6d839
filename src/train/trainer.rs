//! DSpark training (dspark-spec.md §2): one optimizer step over a batch of cached sequences and
//! the training run that saves drafter and state.
//!
//! The pieces live by job: [`super::example`] (examples, anchors, the seeded stream),
//! [`super::forward`] (parameters and the differentiable forward), [`super::loss`] (DeepSpec's
//! loss), [`super::optim`] (options, schedule, AdamW) and [`super::state`] (resumable state).
//!
//! **Determinism**: the sequence order and anchors of step `s` derive from `(seed, s)` alone,
//! and the optimizer state is saved exactly, so `--resume` reproduces an uninterrupted run bit
//! for bit.

use crate::engine::bits::same_bits;
use crate::engine::error::{EngineError, Result};
use crate::spec::dspark::checkpoint;
use mlx_rs::error::Exception;
use mlx_rs::{ops, Array, Dtype};
use std::collections::HashMap;
use std::path::PathBuf;

use super::draft_vocab::vocab_tensors;
use super::example::{anchor_batch, sample_anchors, AnchorBatch, Example, SplitMix};
use super::forward::{Frozen, Params};
use super::loss::total_loss;
use super::optim::{AdamW, TrainOptions};
use super::state::save_state;

/// What one step reported.
#[derive(Debug, Clone, Copy)]
pub struct StepReport {
    /// Step index (1-based, after the update).
    pub step: u64,
    /// Total loss before the update.
    pub loss: f32,
    /// Weighted CE, L1, BCE and KL (each over the global weight).
    pub terms: [f32; 4],
    /// Gradient norm before clipping.
    pub grad_norm: f32,
    /// Learning rate used.
    pub lr: f64,
}

/// The loss (and its terms) of `params` over `examples` with the anchors of step `t`, and the
/// gradients when `grad` is set.
pub fn step_loss(
    frozen: &Frozen<'_>,
    params: &Params,
    examples: &[&Example],
    opts: &TrainOptions,
    t: u64,
    grad: bool,
) -> Result<(f32, [f32; 4], Option<Vec<Array>>)> {
    let gamma = frozen.config.block_size;
    let mask_id = frozen.config.mask_token_id;
    let batches: Vec<(&Example, AnchorBatch)> = examples
        .iter()
        .enumerate()
        .map(|(j, ex)| {
            let mut rng = SplitMix::new(opts.seed, (t << 16) ^ j as u64);
            let anchors = sample_anchors(&ex.mask, opts.anchors, &mut rng);
            (*ex, anchor_batch(ex, &anchors, gamma, mask_id))
        })
        .filter(|(_, b)| !b.anchors.is_empty())
        .collect();
    if batches.is_empty() {
        return Err(EngineError::Input(
            "no training sequence in this step has two consecutive loss tokens".into(),
        ));
    }
    let f = |p: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
        let mut acc: Option<[Array; 5]> = None;
        for (ex, b) in &batches {
            let s = frozen.sums(p, ex, b)?;
            acc = Some(match acc {
                None => s,
                Some(a) => {
                    let mut out = s;
                    for (o, x) in out.iter_mut().zip(&a) {
                        *o = o.add(x)?;
                    }
                    out
                }
            });
        }
        let sums = acc.ok_or_else(|| Exception::custom("empty batch"))?;
        let total = total_loss(&sums, opts.loss_weights)?;
        let den = ops::maximum(&sums[4], Array::from_f32(1e-12))?;
        let mut vals = vec![total];
        for s in &sums[..4] {
            vals.push(s.divide(&den)?);
        }
        Ok(vals)
    };
    let (vals, grads) = if grad {
        let argnums: Vec<i32> = (0..params.values.len() as i32).collect();
        let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(f, argnums.as_slice());
        let (v, g) = vg(&params.values)?;
        (v, Some(g))
    } else {
        (f(&params.values)?, None)
    };
    mlx_rs::transforms::eval(vals.iter())?;
    Ok((
        vals[0].item_cast::<f32>(),
        [
            vals[1].item_cast::<f32>(),
            vals[2].item_cast::<f32>(),
            vals[3].item_cast::<f32>(),
            vals[4].item_cast::<f32>(),
        ],
        grads,
    ))
}

/// A training run: target, drafter config, parameters, optimizer and where it saves.
pub struct Trainer<'a> {
    /// Frozen parts.
    pub frozen: Frozen<'a>,
    /// Trainable parameters.
    pub params: Params,
    /// Optimizer state.
    pub opt: AdamW,
    /// Options.
    pub opts: TrainOptions,
    /// Output checkpoint directory.
    pub out: PathBuf,
    /// Dtype the drafter weights are written in.
    pub save_dtype: Dtype,
}

impl<'a> Trainer<'a> {
    /// One optimizer step over the examples of the current step.
    pub fn step(&mut self, examples: &[Example]) -> Result<StepReport> {
        let t = self.opt.step;
        let chosen: Vec<&Example> = self
            .opts
            .step_examples(t, examples.len())
            .into_iter()
            .map(|i| &examples[i])
            .collect();
        let (loss, terms, grads) =
            step_loss(&self.frozen, &self.params, &chosen, &self.opts, t, true)?;
        let grads = grads.ok_or_else(|| EngineError::Runtime("no gradients".into()))?;
        let lr = self.opts.lr_at(t);
        let grad_norm = self.opt.update(&mut self.params, &grads, &self.opts)?;
        Ok(StepReport {
            step: self.opt.step,
            loss,
            terms,
            grad_norm,
            lr,
        })
    }

    /// Writes the training state and then the drafter (`model.safetensors` + `dspark.json`),
    /// each atomically. State first: a run killed in between leaves either no `dspark.json`
    /// (a plain re-run starts over) or an older drafter next to a newer state (`--resume`
    /// continues from the state), never a checkpoint that neither can continue.
    pub fn save(&self) -> Result<()> {
        std::fs::create_dir_all(&self.out).map_err(|e| {
            EngineError::file(&self.out, format!("cannot create the directory ({e})"))
        })?;
        save_state(&self.out, &self.params, &self.opt, &self.opts)?;
        self.save_drafter()
    }

    /// Writes only the drafter from the current parameters.
    pub fn save_drafter(&self) -> Result<()> {
        checkpoint::save(&self.out, self.frozen.config, &self.drafter_tensors()?)
    }

    /// The drafter's tensors: the parameters in the save dtype, and the draft vocabulary's
    /// `d2t`/`t2d` when it trains on one.
    fn drafter_tensors(&self) -> Result<HashMap<String, Array>> {
        let mut tensors = self.params.to_tensors(self.save_dtype)?;
        if let Some(head) = self.frozen.draft_head() {
            tensors.extend(vocab_tensors(&head.ids, self.frozen.config.vocab_size)?);
        }
        Ok(tensors)
    }

    /// Whether `on_disk` (a drafter's tensors) is exactly the drafter the current parameters
    /// save as: same names, dtypes, shapes and bits. A run killed between [`Self::save`]'s two
    /// writes leaves an older drafter next to a newer state; `--resume` checks this to repair it.
    pub fn drafter_matches(&self, on_disk: &HashMap<String, Array>) -> Result<bool> {
        let current = self.drafter_tensors()?;
        if current.len() != on_disk.len() {
            return Ok(false);
        }
        for (name, a) in &current {
            let Some(b) = on_disk.get(name) else {
                return Ok(false);
            };
            if !same_bits(a, b)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
