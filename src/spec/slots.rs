//! Drafting per slot of the batched engine: one drafter per sequence, proposing from the
//! tokens that sequence has so far (and, for DSpark and the Gemma 4 assistant, the target's
//! tapped outputs of its positions; for the assistant also its keys and values at the donor
//! layers: the batch hands each row its own); the engine verifies every slot's block in one
//! batched forward and says per slot how many drafts it kept (`engine::batch_verify`). Each
//! slot keeps its own acceptance counters, reported with its request.

use super::factory::SpecOptions;
use super::metrics::SpecMetrics;
use super::policy::{DraftLengthPolicy, RowOutlook, StepCost};
use super::source::{DraftSource, TargetView};
use crate::engine::batch::{BatchGenerator, BatchToken, DecodingRow};
use crate::engine::batch_verify::Verified;
use crate::engine::cache::{KvCache, RowKvView};
use crate::engine::error::{EngineError, Result};
use crate::engine::models::{Caches, LanguageModel};
use std::collections::HashMap;
use std::time::Instant;

/// One sequence's drafter, the tokens it has and its counters.
struct SlotDraft {
    source: Box<dyn DraftSource>,
    /// Prompt and every token handed out so far (the last one is the next block's anchor).
    sequence: Vec<u32>,
    /// Most tokens drafted per step for it (its request's `num_draft_tokens`).
    limit: usize,
    /// The group of its latest proposal ([`DraftSource::proposal_group`]).
    group: Option<usize>,
    metrics: SpecMetrics,
}

impl SlotDraft {
    /// Most tokens it may draft after `row`'s pending token (if any): its limit, within the
    /// row's room.
    fn room_for_drafts(&self, row: &DecodingRow) -> usize {
        let pending = usize::from(row.next_pending);
        self.limit.min(row.room.saturating_sub(1 + pending))
    }

    /// `row` as the policy sees it with `proposed` drafts on offer, kept with the drafter's
    /// own chances `keep` (see [`RowOutlook::keep`]).
    fn outlook(&self, row: &DecodingRow, proposed: usize, keep: Vec<f64>) -> RowOutlook {
        RowOutlook {
            proposed,
            guessed: row.next_pending && row.next.is_none(),
            accepted: self.metrics.accepted_tokens,
            drafted: self.metrics.drafted_tokens,
            keep,
        }
    }
}

/// The drafters of a batch's slots, and the policy that sizes each step's blocks.
pub struct SlotDrafters {
    opts: SpecOptions,
    policy: DraftLengthPolicy,
    slots: HashMap<usize, SlotDraft>,
    /// What each slot's drafter is forked from ([`DraftSource::fork`]).
    template: Box<dyn DraftSource>,
    /// Drafters of slots that left, for the next slots (each `begin` starts one afresh), so
    /// a drafter is forked once per concurrent slot rather than per request.
    idle: Vec<Box<dyn DraftSource>>,
    /// The rows and block width of the latest proposal, until its step's time is taken in.
    last_step: Option<(usize, usize)>,
    /// When the step under way (see [`SlotDrafters::step`]) started, and the generator's
    /// decoding forwards and prompt rounds then.
    step_started: Option<(Instant, (usize, usize))>,
}

/// The target as a slot's drafter sees it: the model, and the row's own keys and values at
/// the layers its drafter reads (none for most drafters).
fn view<'a>(model: &'a mut dyn LanguageModel, caches: &'a Caches) -> TargetView<'a> {
    TargetView { model, caches }
}

/// Row `row`'s lent keys and values as the caches of a single sequence whose anchor is at
/// `anchor` (the positions from it on cut); empty when the batch lends none.
pub fn row_caches(row: &DecodingRow, anchor: usize) -> Caches {
    row.kv
        .iter()
        .map(|kv| -> Box<dyn KvCache> {
            Box::new(RowKvView::new(kv.clone(), row.cached as i32).truncated(anchor as i32))
        })
        .collect()
}

impl SlotDrafters {
    /// A drafter forked from `template` (the drafter `opts` opens) for each slot, sized by
    /// `policy`.
    pub fn new(
        opts: &SpecOptions,
        policy: DraftLengthPolicy,
        template: Box<dyn DraftSource>,
    ) -> Self {
        Self {
            opts: opts.clone(),
            policy,
            slots: HashMap::new(),
            template,
            idle: Vec::new(),
            last_step: None,
            step_started: None,
        }
    }

    /// The target layers whose outputs the batch must hand to each row
    /// ([`BatchGenerator::tapping`]); empty for drafters that read tokens only.
    pub fn tap_layers(&self) -> Vec<usize> {
        self.template.tap_layers()
    }

    /// The target layers whose keys and values the batch must lend each row
    /// ([`BatchGenerator::lending_kv`]); empty for drafters that read none.
    pub fn kv_layers(&self) -> Vec<usize> {
        self.template.kv_layers()
    }

    /// The block width the policy chose for the step under way (1: no drafts); `None` when
    /// that step asked for no proposal (no row was decoding).
    pub fn step_width(&self) -> Option<usize> {
        self.last_step.map(|(_, width)| width)
    }

    /// Starts drafting for sequence `uid` with prompt `prompt`, sampled at `temp`, at most
    /// `limit` tokens per step (0: it decodes one token per step, counted as no drafts).
    pub fn join(
        &mut self,
        uid: usize,
        prompt: &[u32],
        (temp, limit): (f64, usize),
        model: &mut dyn LanguageModel,
    ) -> Result<()> {
        let mut source = match self.idle.pop() {
            Some(s) => s,
            None => self.template.fork()?.ok_or_else(|| {
                EngineError::Runtime(format!(
                    "the {} drafter cannot draft for one sequence of a batch",
                    self.template.name()
                ))
            })?,
        };
        source.configure_sampling(temp, self.opts.verify);
        source.begin(view(model, &Vec::new()), prompt)?;
        let metrics = SpecMetrics {
            drafter: source.name().to_owned(),
            ..SpecMetrics::default()
        };
        self.slots.insert(
            uid,
            SlotDraft {
                source,
                sequence: prompt.to_vec(),
                limit,
                group: None,
                metrics,
            },
        );
        Ok(())
    }

    /// Takes a token the batch handed out to its sequence.
    fn take(&mut self, token: &BatchToken) {
        if let Some(slot) = self.slots.get_mut(&token.uid) {
            slot.sequence.push(token.token);
        }
    }

    /// Each decoding row's proposal to follow its last handed-out token (a row whose next token
    /// is pending gets one token more: that token when it has been read, else a guess of it),
    /// cut to the block width the policy picks for the whole step; rows without a drafter,
    /// room or proposal get none. The engine's [`crate::engine::batch::Proposer`].
    pub fn drafts(
        &mut self,
        rows: &[DecodingRow],
        model: &mut dyn LanguageModel,
    ) -> Result<HashMap<usize, Vec<u32>>> {
        for row in rows {
            if let Some(slot) = self.slots.get_mut(&row.uid) {
                for t in &row.tapped {
                    slot.source
                        .observe_taps(t.first_position, t.layers.clone())?;
                }
            }
        }
        // Drafting costs time of its own (a DSpark block is a forward of the drafter): when no
        // width would pay even if every row offered its whole limit, the step stays plain
        // without drafting.
        if self.policy.width(&self.best_case(rows)) == 1 {
            self.last_step = Some((rows.len(), 1));
            return Ok(HashMap::new());
        }
        let mut drafts = HashMap::with_capacity(rows.len());
        let mut outlook = Vec::with_capacity(rows.len());
        for row in rows {
            let pending = usize::from(row.next_pending);
            let Some(slot) = self.slots.get_mut(&row.uid) else {
                outlook.push(RowOutlook::plain());
                continue;
            };
            let n = slot.room_for_drafts(row);
            let mut proposed = Vec::new();
            let mut keep = Vec::new();
            if n > 0 {
                let started = Instant::now();
                if let Some(next) = row.next {
                    slot.sequence.push(next);
                    let caches = row_caches(row, slot.sequence.len() - 1);
                    let draft = slot
                        .source
                        .draft(view(&mut *model, &caches), &slot.sequence, n);
                    slot.sequence.pop();
                    proposed = std::iter::once(next).chain(draft?.tokens).collect();
                } else if pending > 0 && !row.kv.is_empty() {
                    // A drafter that attends the row's keys cannot guess its unread token (a
                    // sliding window no longer holds the oldest position it would attend):
                    // placeholders of its whole limit say it wants to draft, and the step
                    // asks again once the pending tokens are read.
                    let last = slot.sequence.last().copied().unwrap_or_default();
                    proposed = vec![last; n + pending];
                } else {
                    let caches = row_caches(row, slot.sequence.len() - 1);
                    let draft = slot.source.draft(
                        view(&mut *model, &caches),
                        &slot.sequence,
                        n + pending,
                    )?;
                    proposed = draft.tokens;
                }
                slot.metrics.draft_seconds += started.elapsed().as_secs_f64();
                proposed.truncate(n + pending);
                // The drafter's confidences follow what it drafted: a guess of an unread
                // pending token first, then the drafts (a read one is not drafted). A drafter
                // without any has its proposal's group's acceptance instead.
                keep = slot
                    .source
                    .round_note()
                    .map(|note| note.confidence)
                    .unwrap_or_default();
                slot.group = slot.source.proposal_group();
                if let (true, Some(group)) = (keep.is_empty(), slot.group) {
                    let drafted = proposed.len() - usize::from(row.next.is_some());
                    keep = self.policy.group_chances(group, drafted);
                }
            }
            outlook.push(slot.outlook(row, proposed.len().saturating_sub(pending), keep));
            if proposed.len() > pending {
                drafts.insert(row.uid, (proposed, pending));
            }
        }
        let width = self.policy.width(&outlook);
        self.last_step = Some((rows.len(), width));
        let drafts = drafts
            .into_iter()
            .filter(|_| width > 1)
            .map(|(uid, (mut d, pending))| {
                d.truncate(width - 1 + pending);
                (uid, d)
            })
            .collect();
        Ok(drafts)
    }

    /// Each row as the policy would see it if its drafter offered its whole limit.
    fn best_case(&self, rows: &[DecodingRow]) -> Vec<RowOutlook> {
        rows.iter()
            .map(|row| match self.slots.get(&row.uid) {
                Some(slot) => slot.outlook(row, slot.room_for_drafts(row), Vec::new()),
                None => RowOutlook::plain(),
            })
            .collect()
    }

    /// One step of `gen` (a speculative batch) with every slot drafting for itself: the wall
    /// time of the previous step (to this one's start: handing out its tokens counts) goes to
    /// the policy, each slot takes the tokens handed out to it, and each drafter learns what
    /// the verify forwards kept.
    pub fn step(
        &mut self,
        gen: &mut BatchGenerator,
        model: &mut dyn LanguageModel,
    ) -> Result<Vec<BatchToken>> {
        let now = (gen.decode_forwards(), gen.prompt_rounds());
        if let Some((t, before)) = self.step_started {
            // A generator replaced since (a failed batch) starts counting again: no forwards.
            let forwards = now.0.saturating_sub(before.0);
            // A step that also prefilled says nothing of what decoding costs.
            if now.1 == before.1 {
                self.step_took(t.elapsed().as_secs_f64(), forwards);
            } else {
                self.last_step = None;
            }
        }
        self.step_started = Some((Instant::now(), now));
        let tokens = gen.next_tokens_drafted(model, &mut |rows, m| self.drafts(rows, m))?;
        for token in &tokens {
            self.take(token);
        }
        self.record(&gen.take_verified(), model)?;
        Ok(tokens)
    }

    /// Takes in the wall time of the step the latest proposal was made for (from its start to
    /// the next step's, over the `forwards` decoding forwards it ran), for the policy.
    fn step_took(&mut self, seconds: f64, forwards: usize) {
        if let (Some((rows, width)), true) = (self.last_step.take(), forwards > 0) {
            self.policy.observe(&StepCost {
                rows,
                width,
                seconds: seconds / forwards as f64,
            });
        }
    }

    /// Counts what the verify steps did for each slot and tells each drafter what is final.
    fn record(&mut self, verified: &[Verified], model: &mut dyn LanguageModel) -> Result<()> {
        let none = Vec::new();
        for v in verified {
            let Some(slot) = self.slots.get_mut(&v.uid) else {
                continue;
            };
            slot.metrics.record(v.proposed, v.accepted);
            self.policy.observe_acceptance(v.proposed, v.accepted);
            if let Some(group) = slot.group {
                self.policy.observe_group(group, v.proposed, v.accepted);
            }
            // The target's cache holds every handed-out token but the newest (the next anchor).
            let committed = slot.sequence.len().saturating_sub(1);
            slot.source.commit(view(&mut *model, &none), committed)?;
        }
        Ok(())
    }

    /// The policy, with the step costs it has taken in.
    pub fn into_policy(self) -> DraftLengthPolicy {
        self.policy
    }

    /// Ends a batch: every slot's drafter goes back to the idle ones, and the next batch's
    /// first step starts the step timing afresh.
    pub fn end_batch(&mut self) {
        self.idle
            .extend(self.slots.drain().map(|(_, slot)| slot.source));
        self.last_step = None;
        self.step_started = None;
    }

    /// Ends sequence `uid`'s drafting; its counters, when it had a drafter.
    pub fn leave(&mut self, uid: usize) -> Option<SpecMetrics> {
        let slot = self.slots.remove(&uid)?;
        self.idle.push(slot.source);
        Some(slot.metrics)
    }
}
