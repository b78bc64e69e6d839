//! The seam between drafters and the executor: what a drafter is ([`DraftSource`]), what it
//! proposes ([`Draft`]), what it may see of the target ([`TargetView`]) and how its proposals
//! are verified ([`VerifyMode`]). It depends on nothing else in `spec`: drafters and the
//! executor depend on it, and [`super::factory`] opens drafters.

use crate::engine::error::Result;
use crate::engine::models::{Caches, LanguageModel};
use mlx_rs::Array;

/// What a drafter proposes for the positions after the anchor.
#[derive(Debug, Clone, Default)]
pub struct Draft {
    /// Proposed token ids (1..=n of them; the length is authoritative).
    pub tokens: Vec<u32>,
    /// The drafter's distribution per proposed token `[len, V]`, for rejection sampling;
    /// `None` means the proposals were deterministic (one-hot q).
    pub probs: Option<Array>,
}

/// The target as a drafter may see it during a call: its model (for early-exit and
/// embedding reuse) and its live caches (read-only; the executor owns rollback).
pub struct TargetView<'a> {
    /// The target model.
    pub model: &'a mut dyn LanguageModel,
    /// The target's caches, one per layer.
    pub caches: &'a Caches,
}

/// A drafter attached to one generation.
pub trait DraftSource {
    /// Short name for metrics and errors (`model`, `ngram`, `self`, `dspark`).
    fn name(&self) -> &'static str;

    /// Target layers whose outputs the executor should capture during the target's prefill
    /// and every verify forward, and hand over through [`DraftSource::observe_taps`].
    fn tap_layers(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Receives the captured tap outputs of one target forward (ownership moves), with the
    /// absolute position of its first row.
    fn observe_taps(&mut self, _first_position: usize, _taps: Vec<Array>) -> Result<()> {
        Ok(())
    }

    /// Called once after the target has processed the whole prompt (its caches hold
    /// `prompt.len()` positions) and before the first draft. It starts the drafter afresh:
    /// nothing from an earlier generation may survive it (a server reuses one drafter).
    fn begin(&mut self, _target: TargetView<'_>, _prompt: &[u32]) -> Result<()> {
        Ok(())
    }

    /// Proposes up to `n` tokens to follow `sequence` (prompt + generated so far; its last
    /// token is the anchor, not yet in the target's cache).
    fn draft(&mut self, target: TargetView<'_>, sequence: &[u32], n: usize) -> Result<Draft>;

    /// Tells the drafter that the first `committed` positions of the sequence it last saw
    /// plus the accepted part of its draft are final; anything it computed beyond is stale.
    fn commit(&mut self, target: TargetView<'_>, committed: usize) -> Result<()>;

    /// The tokens per round this drafter was built for, overriding `--num-draft-tokens` (a
    /// DSpark checkpoint's trained block size); `None` = take the option.
    fn block_size(&self) -> Option<usize> {
        None
    }

    /// Tells the drafter how the target samples and verifies, once before [`Self::begin`]
    /// (a drafter may then sample its proposals at the same temperature and return `probs`).
    fn configure_sampling(&mut self, _temp: f64, _verify: VerifyMode) {}

    /// What this drafter adds to the trace of its latest [`Self::draft`] call (confidences,
    /// threshold, pruning mode); `None` = nothing beyond the tokens.
    fn round_note(&self) -> Option<RoundNote> {
        None
    }

    /// For a drafter without confidences of its own: a small number that groups its latest
    /// proposal with earlier ones likely kept as often (n-gram: the length of the suffix it
    /// matched), so a batch's draft-length policy can learn each group's acceptance. `None` =
    /// no such grouping.
    fn proposal_group(&self) -> Option<usize> {
        None
    }

    /// Another drafter like this one, with no sequence of its own yet, for another sequence of
    /// the same target: one per slot of a batch (sharing weights where the kind can). `None`
    /// for kinds that cannot draft for one row of a batch.
    fn fork(&self) -> Result<Option<Box<dyn DraftSource>>> {
        Ok(None)
    }

    /// Target layers whose keys and values [`Self::draft`] reads from [`TargetView::caches`]
    /// (the Gemma 4 assistant's donor layers): a batch then hands each row's own to its
    /// drafter. Empty for drafters that read none.
    fn kv_layers(&self) -> Vec<usize> {
        Vec::new()
    }
}

/// A borrowed drafter drafts like the drafter itself, so one drafter can serve many
/// generations in turn (each generation's [`DraftSource::begin`] starts it afresh).
/// Every trait method must be forwarded here, defaulted ones included.
impl<T: DraftSource + ?Sized> DraftSource for &mut T {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn tap_layers(&self) -> Vec<usize> {
        (**self).tap_layers()
    }
    fn observe_taps(&mut self, first_position: usize, taps: Vec<Array>) -> Result<()> {
        (**self).observe_taps(first_position, taps)
    }
    fn begin(&mut self, target: TargetView<'_>, prompt: &[u32]) -> Result<()> {
        (**self).begin(target, prompt)
    }
    fn draft(&mut self, target: TargetView<'_>, sequence: &[u32], n: usize) -> Result<Draft> {
        (**self).draft(target, sequence, n)
    }
    fn commit(&mut self, target: TargetView<'_>, committed: usize) -> Result<()> {
        (**self).commit(target, committed)
    }
    fn block_size(&self) -> Option<usize> {
        (**self).block_size()
    }
    fn configure_sampling(&mut self, temp: f64, verify: VerifyMode) {
        (**self).configure_sampling(temp, verify)
    }
    fn round_note(&self) -> Option<RoundNote> {
        (**self).round_note()
    }
    fn proposal_group(&self) -> Option<usize> {
        (**self).proposal_group()
    }
    fn fork(&self) -> Result<Option<Box<dyn DraftSource>>> {
        (**self).fork()
    }
    fn kv_layers(&self) -> Vec<usize> {
        (**self).kv_layers()
    }
}

/// How drafted tokens are verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VerifyMode {
    /// Accept while the target's sampled token equals the draft (exact greedy at T=0;
    /// distribution-exact at any temperature).
    #[default]
    Match,
    /// Standard rejection sampling with the draft's probabilities and residual resampling.
    Reject,
}

/// What a drafter adds to the trace of its latest round.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoundNote {
    /// Sigmoid confidence of each proposed position (after pruning; DSpark only).
    pub confidence: Vec<f64>,
    /// Confidence of every position of the unpruned block.
    pub block_confidence: Vec<f64>,
    /// The global threshold in force (`None` = a per-position table or no pruning).
    pub threshold: Option<f64>,
    /// Per-position thresholds in force, when they are not all one value.
    pub thresholds: Option<Vec<f64>>,
    /// The pruning rule (`keep-first`, `deepspec`, `survival`).
    pub prune: Option<String>,
}
