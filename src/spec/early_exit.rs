//! The `self` drafter (early exit): the target's own first K layers, then its final norm and
//! LM head. A real drafter for any target without training. Its caches start as copies of
//! the target's first K caches after the prompt (identical computations), so it costs no
//! extra prefill; a drafter for one slot of a batch, which is not handed the target's caches
//! of its sequence, fills caches of its own at its first draft.

use super::autoregressive::{CachedDrafter, ForwardFn};
use super::source::{Draft, DraftSource, TargetView};
use crate::engine::error::{EngineError, Result};
use crate::engine::models::ForwardOpts;

/// The `self` drafter.
pub struct EarlyExitSource {
    layers: usize,
    state: Option<CachedDrafter>,
}

impl EarlyExitSource {
    /// Drafts with the first `layers` layers of the target.
    pub fn new(layers: usize) -> Self {
        Self {
            layers,
            state: None,
        }
    }

    /// Runs `step` on the drafter's caches with the target's first `layers` layers (then its
    /// final norm and head) as the forward.
    fn with_state<T>(
        &mut self,
        target: TargetView<'_>,
        step: impl FnOnce(&mut CachedDrafter, &mut ForwardFn<'_>) -> Result<T>,
    ) -> Result<T> {
        let opts = ForwardOpts {
            exit_after: Some(self.layers),
            taps: Vec::new(),
        };
        let state = self
            .state
            .as_mut()
            .ok_or_else(|| EngineError::Runtime("self drafter used before begin".into()))?;
        let model = target.model;
        step(state, &mut |x, c| {
            Ok(model.forward_ext(x, c, &opts)?.logits)
        })
    }
}

impl DraftSource for EarlyExitSource {
    fn name(&self) -> &'static str {
        "self"
    }

    fn begin(&mut self, target: TargetView<'_>, prompt: &[u32]) -> Result<()> {
        let mut caches = target.model.make_caches();
        let total = caches.len();
        if self.layers == 0 || self.layers >= total {
            return Err(EngineError::Input(format!(
                "--draft-layers {} is out of range: the target has {total} layers (use 1..{})",
                self.layers,
                total - 1
            )));
        }
        caches.truncate(self.layers);
        if target.caches.is_empty() {
            // A batch's slot: the first draft feeds the whole prompt.
            self.state = Some(CachedDrafter::new(caches, Vec::new()));
            return Ok(());
        }
        for (own, theirs) in caches.iter_mut().zip(target.caches.iter()) {
            // A copy of the target's cache, of its kind (it may be quantized by now).
            match theirs.clone_box() {
                Some(c) => *own = c,
                None => own.restore(theirs.snapshot())?,
            }
        }
        self.state = Some(CachedDrafter::new(caches, prompt.to_vec()));
        Ok(())
    }

    fn draft(&mut self, target: TargetView<'_>, sequence: &[u32], n: usize) -> Result<Draft> {
        let tokens = self.with_state(target, |state, forward| state.draft(sequence, n, forward))?;
        Ok(Draft {
            tokens,
            probs: None,
        })
    }

    fn commit(&mut self, target: TargetView<'_>, committed: usize) -> Result<()> {
        self.with_state(target, |state, forward| state.commit(committed, forward))
    }

    fn fork(&self) -> Result<Option<Box<dyn DraftSource>>> {
        Ok(Some(Box::new(Self::new(self.layers))))
    }
}
