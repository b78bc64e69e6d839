//! Lookup first: before a model drafter drafts a round, the sequence's last n-gram is looked up
//! in the prompt and the output so far ([`NgramSource`]); where it occurs earlier, what
//! followed it is proposed instead and the model drafter skips the round. Copies (code that
//! repeats a signature, answers that quote the question) are then drafted for free and as long
//! as they run, and the model drafter drafts the rest. dflash-mlx does the same before its
//! DFlash drafter (its CopySpec, a 6-gram lookup).
//!
//! The model drafter still sees every target forward (its tapped rows, its commits), so a round
//! it skips costs it nothing later but the context rows it takes in at its next round. What the
//! target emits never depends on who proposed.

use super::lookup_table::LookupTable;
use super::ngram::NgramSource;
use super::source::{Draft, DraftSource, RoundNote, TargetView, VerifyMode};
use crate::engine::error::Result;
use mlx_rs::Array;
use std::sync::Arc;

/// A model drafter behind a prompt lookup.
pub struct LookupFirst {
    lookup: NgramSource,
    inner: Box<dyn DraftSource>,
    /// Most tokens a lookup proposes (`None`: the round's draft length).
    max_tokens: Option<usize>,
    /// Whether the latest proposal came from the lookup.
    looked_up: bool,
}

impl LookupFirst {
    /// `inner` behind a lookup of the last `min..=max` tokens (longest first), and of
    /// `table` where it holds a longer n-gram ([`NgramSource::with_table`]).
    pub fn new(
        inner: Box<dyn DraftSource>,
        min: usize,
        max: usize,
        table: Option<Arc<LookupTable>>,
    ) -> Self {
        Self {
            lookup: NgramSource::new(min, max).with_table(table),
            inner,
            max_tokens: None,
            looked_up: false,
        }
    }

    /// The same, its lookups proposing at most `max_tokens` tokens (a model drafter's block
    /// may be longer than a copy is likely to run on).
    pub fn with_max_tokens(self, max_tokens: Option<usize>) -> Self {
        Self { max_tokens, ..self }
    }
}

/// `lookup+NAME` for the drafter kinds that can sit behind a lookup.
fn composed_name(inner: &'static str) -> &'static str {
    match inner {
        "dspark" => "lookup+dspark",
        "model" => "lookup+model",
        "self" => "lookup+self",
        "assistant" => "lookup+assistant",
        other => other,
    }
}

impl DraftSource for LookupFirst {
    fn name(&self) -> &'static str {
        composed_name(self.inner.name())
    }

    fn tap_layers(&self) -> Vec<usize> {
        self.inner.tap_layers()
    }

    fn observe_taps(&mut self, first_position: usize, taps: Vec<Array>) -> Result<()> {
        self.inner.observe_taps(first_position, taps)
    }

    fn begin(&mut self, target: TargetView<'_>, prompt: &[u32]) -> Result<()> {
        self.looked_up = false;
        self.inner.begin(target, prompt)
    }

    fn draft(&mut self, target: TargetView<'_>, sequence: &[u32], n: usize) -> Result<Draft> {
        let copied = self.lookup.draft(
            TargetView {
                model: &mut *target.model,
                caches: target.caches,
            },
            sequence,
            self.max_tokens.map_or(n, |m| m.min(n)),
        )?;
        self.looked_up = !copied.tokens.is_empty();
        if self.looked_up {
            return Ok(copied);
        }
        self.inner.draft(target, sequence, n)
    }

    fn commit(&mut self, target: TargetView<'_>, committed: usize) -> Result<()> {
        self.inner.commit(target, committed)
    }

    fn block_size(&self) -> Option<usize> {
        self.inner.block_size()
    }

    fn configure_sampling(&mut self, temp: f64, verify: VerifyMode) {
        self.inner.configure_sampling(temp, verify)
    }

    fn round_note(&self) -> Option<RoundNote> {
        // A looked-up round carries no confidences; the model drafter's note is of an earlier
        // round.
        if self.looked_up {
            None
        } else {
            self.inner.round_note()
        }
    }

    fn proposal_group(&self) -> Option<usize> {
        // A batch's policy learns a looked-up round's acceptance by the n-gram it matched; the
        // model drafter's rounds keep what it says of them.
        if self.looked_up {
            self.lookup.proposal_group()
        } else {
            self.inner.proposal_group()
        }
    }

    fn fork(&self) -> Result<Option<Box<dyn DraftSource>>> {
        Ok(self.inner.fork()?.map(|inner| {
            Box::new(Self {
                lookup: self.lookup.clone(),
                inner,
                max_tokens: self.max_tokens,
                looked_up: false,
            }) as Box<dyn DraftSource>
        }))
    }

    fn kv_layers(&self) -> Vec<usize> {
        self.inner.kv_layers()
    }
}
