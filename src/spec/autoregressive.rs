//! State shared by drafters that run a model token by token with their own caches (a
//! separate draft model, or the target's first K layers): which tokens their caches hold,
//! feeding what is new, drafting a chain lazily (one evaluation per draft), and exact rewind.

use crate::engine::error::{EngineError, Result};
use crate::engine::models::Caches;
use crate::engine::rollback::{rewind, Checkpoint};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::transforms::eval;
use mlx_rs::Array;

/// A forward over `[1, L]` ids that updates the caches and returns logits `[1, L, V]`.
pub type ForwardFn<'a> = dyn FnMut(&Array, &mut Caches) -> Result<Array> + 'a;

/// Caches plus the token ids they hold.
pub struct CachedDrafter {
    /// One cache per layer the drafter runs.
    pub caches: Caches,
    fed: Vec<u32>,
    checkpoint: Option<Checkpoint>,
}

fn ids_array(ids: &[u32]) -> Array {
    let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Array::from_slice(&v, &[1, v.len() as i32])
}

impl CachedDrafter {
    /// Wraps fresh (or pre-filled) caches that hold `fed`.
    pub fn new(caches: Caches, fed: Vec<u32>) -> Self {
        Self {
            caches,
            fed,
            checkpoint: None,
        }
    }

    /// Feeds `tokens` in chunks of `step` (prefill), without drafting.
    pub fn prefill(
        &mut self,
        tokens: &[u32],
        step: usize,
        forward: &mut ForwardFn<'_>,
    ) -> Result<()> {
        for chunk in tokens.chunks(step.max(1)) {
            forward(&ids_array(chunk), &mut self.caches)?;
            let state: Vec<Array> = self.caches.iter().flat_map(|c| c.state()).collect();
            eval(&state)?;
            self.fed.extend_from_slice(chunk);
        }
        Ok(())
    }

    /// Feeds the part of `sequence` not yet in the caches, then drafts `n` tokens greedily,
    /// chaining the lazy argmax of each step into the next (one evaluation at the end).
    pub fn draft(
        &mut self,
        sequence: &[u32],
        n: usize,
        forward: &mut ForwardFn<'_>,
    ) -> Result<Vec<u32>> {
        let common = self
            .fed
            .iter()
            .zip(sequence)
            .take_while(|(a, b)| a == b)
            .count();
        // A draft continues from the logits after the sequence's last token, so that token is
        // fed again when the caches already hold it (a second draft from the same point, as
        // when a batch drafts from a guessed token and again once the guess proved right),
        // where the checkpoint allows the rewind.
        let last = sequence.len().saturating_sub(1);
        let rewind_to_last = common > last
            && self
                .checkpoint
                .as_ref()
                .is_some_and(|c| c.positions() <= last);
        let keep = if rewind_to_last { last } else { common };
        if keep < self.fed.len() {
            // The caller skipped a commit (or drafts again): a trim-or-replay to `keep`.
            self.commit(keep, forward)?;
        }
        let new = &sequence[self.fed.len()..];
        if new.is_empty() || n == 0 {
            return Ok(Vec::new());
        }
        self.checkpoint = Some(Checkpoint::take(&self.caches, self.fed.len()));
        let mut logits = forward(&ids_array(new), &mut self.caches)?;
        self.fed.extend_from_slice(new);
        let mut chain = Vec::with_capacity(n);
        for i in 0..n {
            let last = logits.index((.., -1, ..));
            let next = argmax_axis(&last, -1, false)?;
            chain.push(next.clone());
            if i + 1 < n {
                logits = forward(&next.reshape(&[1, 1])?, &mut self.caches)?;
            }
        }
        eval(&chain)?;
        let drafted: Vec<u32> = chain
            .iter()
            .map(|a| a.try_item_cast::<u32>())
            .collect::<std::result::Result<_, _>>()?;
        // The caches now also hold drafts 1..n-1.
        self.fed.extend_from_slice(&drafted[..n - 1]);
        Ok(drafted)
    }

    /// Keeps the first `committed` positions, rewinding exactly (trim or replay).
    pub fn commit(&mut self, committed: usize, forward: &mut ForwardFn<'_>) -> Result<()> {
        let current = self.fed.len();
        let keep = committed.min(current);
        if keep == current {
            self.checkpoint = None;
            return Ok(());
        }
        let Some(checkpoint) = self.checkpoint.take().filter(|c| c.positions() <= keep) else {
            return Err(EngineError::Runtime(format!(
                "drafter caches cannot be rewound from {current} to {keep} positions (no checkpoint)"
            )));
        };
        let from = checkpoint.positions().min(keep);
        let tokens = self.fed[from..keep].to_vec();
        rewind(
            &mut self.caches,
            checkpoint,
            current,
            keep,
            &tokens,
            |t, caches| forward(&ids_array(t), caches).map(|_| ()),
        )?;
        self.fed.truncate(keep);
        Ok(())
    }
}
