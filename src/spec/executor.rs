//! The verify/accept/rollback round, run by the engine's generation loop when a drafter is
//! attached. Each round: the drafter proposes up to K tokens after the anchor; the target
//! verifies `[anchor, d1..dm]` in one forward; rows are accepted in order by the verify
//! policy; every emitted token comes from the target's own distribution; caches roll back
//! exactly to the kept positions; the drafter is told what was committed.

use super::rollback::{rewind, Checkpoint, Rewind};
use super::source::{Draft, TargetView, VerifyMode};
use super::verify::{reject_step, target_distribution, Decision};
use crate::engine::error::{EngineError, Result};
use crate::engine::generate::{Flow, GenerateConfig, GenerationStats, Generator, Step};
use crate::spec::metrics::SpecMetrics;
use crate::spec::trace::RoundTrace;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::transforms::eval;
use mlx_rs::{memory, ops, Array};
use std::time::Instant;

fn ids(tokens: &[u32]) -> Array {
    let v: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Array::from_slice(&v, &[v.len() as i32])
}

/// Emits tokens to the consumer and counts them.
struct Emitter<'f, F: FnMut(&Step) -> Result<Flow>> {
    on_token: &'f mut F,
    emitted: usize,
    stopped: bool,
    last: Option<u32>,
}

impl<F: FnMut(&Step) -> Result<Flow>> Emitter<'_, F> {
    fn emit(&mut self, token: u32, logprobs: Array) -> Result<()> {
        let flow = (self.on_token)(&Step {
            index: self.emitted,
            token,
            logprobs,
        })?;
        self.emitted += 1;
        self.last = Some(token);
        self.stopped |= flow == Flow::Stop;
        Ok(())
    }
}

impl Generator<'_> {
    /// Decodes in verify rounds after the first token (`first`, already sampled from the
    /// prompt exactly as the vanilla loop does).
    pub(crate) fn run_speculative<F: FnMut(&Step) -> Result<Flow>>(
        mut self,
        prompt: &[u32],
        first: u32,
        first_logprobs: Array,
        cfg: &GenerateConfig,
        mut stats: GenerationStats,
        on_token: &mut F,
    ) -> Result<(GenerationStats, Option<SpecMetrics>)> {
        let started = Instant::now();
        let mut out = Emitter {
            on_token,
            emitted: 0,
            stopped: false,
            last: None,
        };
        let mut seq = prompt.to_vec();
        if cfg.max_tokens > 0 {
            out.emit(first, first_logprobs)?;
            seq.push(first);
        }
        {
            let spec = self
                .spec
                .as_mut()
                .ok_or_else(|| EngineError::Runtime("no drafter attached".into()))?;
            spec.metrics.drafter = spec.source.name().to_owned();
            if let Some(block) = spec.source.block_size() {
                spec.num_draft_tokens = block;
            }
            spec.source.configure_sampling(spec.temp, spec.verify);
            spec.source.begin(
                TargetView {
                    model: &mut *self.model,
                    caches: &self.caches,
                },
                prompt,
            )?;
        }
        while !out.stopped && out.emitted < cfg.max_tokens {
            let before = out.emitted;
            self.round(&mut seq, cfg.max_tokens - out.emitted, &mut out)?;
            if before / 256 != out.emitted / 256 {
                memory::clear_cache()?;
            }
        }
        stats.generation_tokens = out.emitted;
        stats.generation_time = started.elapsed();
        stats.peak_memory = memory::peak_memory()?;
        Ok((stats, self.spec.take().map(|s| s.metrics)))
    }

    /// One round emitting between 1 and `remaining` tokens.
    fn round<F: FnMut(&Step) -> Result<Flow>>(
        &mut self,
        seq: &mut Vec<u32>,
        remaining: usize,
        out: &mut Emitter<'_, F>,
    ) -> Result<()> {
        let spec = self
            .spec
            .as_mut()
            .ok_or_else(|| EngineError::Runtime("no drafter attached".into()))?;
        // A block must not straddle the switch to quantized KV caches (see `max_draft`).
        let k = spec
            .num_draft_tokens
            .min(remaining.saturating_sub(1))
            .min(self.plan.max_draft(self.positions).unwrap_or(usize::MAX));
        let anchor = *seq
            .last()
            .ok_or_else(|| EngineError::Runtime("empty sequence".into()))?;
        let emitted_before = out.emitted;
        let mut draft = if k > 0 {
            spec.source.draft(
                TargetView {
                    model: &mut *self.model,
                    caches: &self.caches,
                },
                seq,
                k,
            )?
        } else {
            Draft::default()
        };
        draft.tokens.truncate(k);
        let m = draft.tokens.len();
        let (verify, temp) = (spec.verify, spec.temp);

        let base = self.positions;
        let checkpoint = Checkpoint::take(&self.caches, base);
        let mut input = vec![anchor];
        input.extend_from_slice(&draft.tokens);
        let logits = self.forward_tokens(&ids(&input))?;

        let accepted = match verify {
            VerifyMode::Match if self.sampler.is_greedy() && self.processors.is_empty() => {
                self.accept_greedy(&logits, &draft.tokens, out)?
            }
            VerifyMode::Match => self.accept_matching(&logits, &input, out)?,
            VerifyMode::Reject => self.accept_rejecting(&logits, &input, &draft, temp, out)?,
        };
        seq.extend_from_slice(&draft.tokens[..accepted]);

        let keep = base + accepted + 1;
        let model = &mut *self.model;
        let how = rewind(
            &mut self.caches,
            checkpoint,
            self.positions,
            keep,
            &input[..accepted + 1],
            |t, caches| model.forward(&ids(t).expand_dims(0)?, caches).map(|_| ()),
        )?;
        self.positions = keep;
        self.plan.quantize(&mut self.caches)?;
        let spec = self
            .spec
            .as_mut()
            .ok_or_else(|| EngineError::Runtime("no drafter attached".into()))?;
        spec.metrics.record(m, accepted);
        if how == Rewind::Replayed {
            spec.metrics.replays += 1;
        }
        if let Some((sink, rounds)) = self.trace.as_mut() {
            let emitted = out.emitted - emitted_before;
            let trace = RoundTrace {
                round: *rounds,
                anchor_pos: base,
                anchor,
                proposed: draft.tokens.clone(),
                accepted,
                next: out.last.filter(|_| emitted > accepted),
                ..RoundTrace::default()
            };
            // Without a draft call this round (k = 0) the drafter's note is stale.
            let note = if k > 0 {
                spec.source.round_note()
            } else {
                None
            };
            sink.record(&trace.with_note(note))?;
            *rounds += 1;
        }
        spec.source.commit(
            TargetView {
                model: &mut *self.model,
                caches: &self.caches,
            },
            keep,
        )?;
        // The token after the accepted drafts (correction or bonus) is the next anchor.
        if let Some(next) = out.last {
            seq.push(next);
        }
        Ok(())
    }

    /// Greedy with no logits processors: all rows' argmaxes in one evaluation.
    fn accept_greedy<F: FnMut(&Step) -> Result<Flow>>(
        &mut self,
        logits: &Array,
        drafts: &[u32],
        out: &mut Emitter<'_, F>,
    ) -> Result<usize> {
        let mut rows = Vec::with_capacity(drafts.len() + 1);
        let mut picks = Vec::with_capacity(drafts.len() + 1);
        for i in 0..=drafts.len() {
            let lp = self.logprobs_row(
                logits.index((.., i as i32, ..)),
                &Array::from_slice::<i32>(&[], &[0]),
            )?;
            picks.push(argmax_axis(&lp, -1, false)?);
            rows.push(lp.squeeze_axes(&[0])?);
        }
        let picks = ops::concatenate(&picks, 0)?;
        eval([&picks])?;
        let picks: Vec<u32> = picks.as_slice::<u32>().to_vec();
        let mut accepted = 0;
        for (i, (t, lp)) in picks.into_iter().zip(rows).enumerate() {
            out.emit(t, lp)?;
            if out.stopped || i == drafts.len() || t != drafts[i] {
                break;
            }
            accepted += 1;
        }
        Ok(accepted)
    }

    /// Token match with the full sampler and processors, row by row (each row's history
    /// includes the tokens fed before it, exactly as the vanilla loop builds it).
    fn accept_matching<F: FnMut(&Step) -> Result<Flow>>(
        &mut self,
        logits: &Array,
        input: &[u32],
        out: &mut Emitter<'_, F>,
    ) -> Result<usize> {
        let mut accepted = 0;
        for i in 0..input.len() {
            let lp = self.logprobs_row(logits.index((.., i as i32, ..)), &ids(&input[i..=i]))?;
            let t = self.sampler.sample(&lp)?.try_item_cast::<u32>()?;
            out.emit(t, lp.squeeze_axes(&[0])?)?;
            if out.stopped || i + 1 == input.len() || t != input[i + 1] {
                break;
            }
            accepted += 1;
        }
        Ok(accepted)
    }

    /// Rejection sampling with the drafter's probabilities (one-hot when deterministic).
    fn accept_rejecting<F: FnMut(&Step) -> Result<Flow>>(
        &mut self,
        logits: &Array,
        input: &[u32],
        draft: &Draft,
        temp: f64,
        out: &mut Emitter<'_, F>,
    ) -> Result<usize> {
        let mut accepted = 0;
        for i in 0..input.len() {
            let lp = self.logprobs_row(logits.index((.., i as i32, ..)), &ids(&input[i..=i]))?;
            if i + 1 == input.len() {
                let t = self.sampler.sample(&lp)?.try_item_cast::<u32>()?;
                out.emit(t, lp.squeeze_axes(&[0])?)?;
                break;
            }
            let p = target_distribution(self.sampler, &lp, temp)?;
            let q = draft.probs.as_ref().map(|q| q.index(i as i32));
            let d = input[i + 1];
            match reject_step(&p, q.as_ref(), d)? {
                Decision::Accept => {
                    out.emit(d, lp.squeeze_axes(&[0])?)?;
                    accepted += 1;
                    if out.stopped {
                        break;
                    }
                }
                Decision::Replace(t) => {
                    out.emit(t, lp.squeeze_axes(&[0])?)?;
                    break;
                }
            }
        }
        Ok(accepted)
    }
}
