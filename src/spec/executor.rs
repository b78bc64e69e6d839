//! The verify/accept/rollback round: [`Speculation`] is the engine's
//! [`Speculator`], so the generation loop hands decoding over to it after the first token. Each round: the drafter proposes up to K tokens after the anchor; the target
//! verifies `[anchor, d1..dm]` in one forward; rows are accepted in order by the verify
//! policy; every emitted token comes from the target's own distribution; caches roll back
//! exactly to the kept positions; the drafter is told what was committed.

use super::draft_gate::DraftGate;
use super::factory::SpecOptions;
use super::policy::DraftPolicy;
use super::source::{Draft, DraftSource, TargetView, VerifyMode};
use super::verify::{reject_step, target_distribution, Decision};
use crate::engine::error::{EngineError, Result};
use crate::engine::generate::{Flow, GenerateConfig, GenerationStats, Generator, Speculator, Step};
use crate::engine::logprobs::{host_argmax, logits_row};
use crate::engine::rollback::Rewind;
use crate::spec::metrics::SpecMetrics;
use crate::spec::trace::{RoundTrace, TraceSink};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::transforms::eval;
use mlx_rs::{memory, ops, Array};
use std::time::Instant;

fn ids(tokens: &[u32]) -> Array {
    let v: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Array::from_slice(&v, &[v.len() as i32])
}

/// A drafter attached to one generation, with its round size, verification rule, acceptance
/// counters and optional trace.
pub struct Speculation<'a> {
    /// The drafter.
    pub source: Box<dyn DraftSource + 'a>,
    /// Tokens drafted per round (a drafter's own block size replaces it when decoding starts).
    pub num_draft_tokens: usize,
    /// Verification rule.
    pub verify: VerifyMode,
    /// Acceptance counters, filled as rounds run.
    pub metrics: SpecMetrics,
    /// Whether each round drafts (every round unless [`Self::with_draft_policy`] says
    /// otherwise); what it learnt may be handed to the next generation's speculation.
    pub gate: DraftGate,
    /// Where rounds are traced (`--spec-trace`), and the rounds traced so far.
    trace: Option<(Box<dyn TraceSink + 'a>, usize)>,
}

impl<'a> Speculation<'a> {
    /// Attaches `source`, drafting `num_draft_tokens` per round verified by `verify`.
    pub fn new(
        source: Box<dyn DraftSource + 'a>,
        num_draft_tokens: usize,
        verify: VerifyMode,
    ) -> Self {
        Self {
            source,
            num_draft_tokens,
            verify,
            metrics: SpecMetrics::default(),
            gate: DraftGate::new(DraftPolicy::All),
            trace: None,
        }
    }

    /// Drafts by `policy`: [`DraftPolicy::Cost`] drafts only while drafting rounds hand out
    /// more tokens per second than plain ones ([`DraftGate`]); never changes what is emitted.
    pub fn with_draft_policy(mut self, policy: DraftPolicy) -> Self {
        self.gate = DraftGate::new(policy);
        self
    }

    /// Attaches `source` with the round size and verification rule of `opts`.
    pub fn with_options(source: Box<dyn DraftSource + 'a>, opts: &SpecOptions) -> Self {
        Self::new(source, opts.num_draft_tokens, opts.verify)
    }

    /// Records every round to `sink`; never changes what is generated.
    pub fn with_trace(mut self, sink: Box<dyn TraceSink + 'a>) -> Self {
        self.set_trace(Some(sink));
        self
    }

    /// Records the rounds of the generations that follow to `sink` (none: stop recording),
    /// numbering them from 0.
    pub fn set_trace(&mut self, sink: Option<Box<dyn TraceSink + 'a>>) {
        self.trace = sink.map(|s| (s, 0));
    }
}

/// Emits tokens to the consumer and counts them.
struct Emitter<'f> {
    on_token: &'f mut dyn FnMut(&Step) -> Result<Flow>,
    emitted: usize,
    stopped: bool,
    last: Option<u32>,
}

impl Emitter<'_> {
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

impl Speculator for Speculation<'_> {
    fn tap_layers(&self) -> Vec<usize> {
        self.source.tap_layers()
    }

    fn observe_taps(&mut self, first_position: usize, taps: Vec<Array>) -> Result<()> {
        self.source.observe_taps(first_position, taps)
    }

    /// Decodes in verify rounds after the first token.
    fn decode(
        &mut self,
        mut gen: Generator<'_>,
        prompt: &[u32],
        first: u32,
        first_logprobs: Array,
        cfg: &GenerateConfig,
        mut stats: GenerationStats,
        on_token: &mut dyn FnMut(&Step) -> Result<Flow>,
    ) -> Result<GenerationStats> {
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
        self.metrics.drafter = self.source.name().to_owned();
        if let Some(block) = self.source.block_size() {
            self.num_draft_tokens = block;
        }
        self.source
            .configure_sampling(gen.sampler().temp(), self.verify);
        self.source.begin(view(&mut gen), prompt)?;
        while !out.stopped && out.emitted < cfg.max_tokens {
            let before = out.emitted;
            self.round(&mut gen, &mut seq, cfg.max_tokens - out.emitted, &mut out)?;
            if before / 256 != out.emitted / 256 {
                memory::clear_cache()?;
            }
        }
        stats.generation_tokens = out.emitted;
        stats.generation_time = started.elapsed();
        stats.peak_memory = memory::peak_memory()?;
        Ok(stats)
    }
}

/// The generation's target as a drafter sees it.
fn view<'g>(gen: &'g mut Generator<'_>) -> TargetView<'g> {
    let (model, caches) = gen.target();
    TargetView { model, caches }
}

impl Speculation<'_> {
    /// One round emitting between 1 and `remaining` tokens.
    fn round(
        &mut self,
        gen: &mut Generator<'_>,
        seq: &mut Vec<u32>,
        remaining: usize,
        out: &mut Emitter<'_>,
    ) -> Result<()> {
        // A block must not straddle the switch to quantized KV caches (see `max_draft`).
        let room = self
            .num_draft_tokens
            .min(remaining.saturating_sub(1))
            .min(gen.max_block().unwrap_or(usize::MAX));
        let k = if room > 0 && self.gate.drafts() {
            room
        } else {
            0
        };
        let anchor = *seq
            .last()
            .ok_or_else(|| EngineError::Runtime("empty sequence".into()))?;
        let emitted_before = out.emitted;
        let drafting = Instant::now();
        let mut draft = if k > 0 {
            self.source.draft(view(gen), seq, k)?
        } else {
            Draft::default()
        };
        draft.tokens.truncate(k);
        let m = draft.tokens.len();
        self.metrics.draft_seconds += drafting.elapsed().as_secs_f64();
        let verifying = Instant::now();

        let base = gen.positions();
        let checkpoint = gen.checkpoint();
        let mut input = vec![anchor];
        input.extend_from_slice(&draft.tokens);
        let (logits, first, taps) = gen.forward_tapped(&ids(&input), self.source.tap_layers())?;
        if !taps.is_empty() {
            self.source.observe_taps(first, taps)?;
        }

        let accepted = match self.verify {
            VerifyMode::Match if gen.sampler().is_greedy() && !gen.has_processors() => {
                accept_greedy(gen, &logits, &draft.tokens, out)?
            }
            VerifyMode::Match => accept_matching(gen, &logits, &input, out)?,
            VerifyMode::Reject => accept_rejecting(gen, &logits, &input, &draft, out)?,
        };
        seq.extend_from_slice(&draft.tokens[..accepted]);
        self.metrics.verify_seconds += verifying.elapsed().as_secs_f64();

        let rolling_back = Instant::now();
        let keep = base + accepted + 1;
        let how = gen.rewind(checkpoint, keep, &input[..accepted + 1])?;
        self.metrics.rollback_seconds += rolling_back.elapsed().as_secs_f64();
        self.metrics.record(m, accepted);
        if how == Rewind::Replayed {
            self.metrics.replays += 1;
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
                self.source.round_note()
            } else {
                None
            };
            sink.record(&trace.with_note(note))?;
            *rounds += 1;
        }
        let committing = Instant::now();
        self.source.commit(view(gen), keep)?;
        self.metrics.draft_seconds += committing.elapsed().as_secs_f64();
        if room > 0 {
            let seconds = drafting.elapsed().as_secs_f64();
            self.gate
                .observe(k > 0, out.emitted - emitted_before, seconds);
        }
        // The token after the accepted drafts (correction or bonus) is the next anchor.
        if let Some(next) = out.last {
            seq.push(next);
        }
        Ok(())
    }
}

/// Greedy with no logits processors: all rows' argmaxes in one evaluation.
fn accept_greedy(
    gen: &mut Generator<'_>,
    logits: &Array,
    drafts: &[u32],
    out: &mut Emitter<'_>,
) -> Result<usize> {
    let mut lps = Vec::with_capacity(drafts.len() + 1);
    for i in 0..=drafts.len() {
        lps.push(gen.logprobs_row(logits_row(logits, i), &Array::from_slice::<i32>(&[], &[0]))?);
    }
    // Rows the host computed are picked there; otherwise all in one MLX evaluation.
    let picks = match lps.iter().map(host_argmax).collect::<Option<Vec<u32>>>() {
        Some(picks) => picks,
        None => {
            let picks = lps
                .iter()
                .map(|lp| argmax_axis(lp, -1, false))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let picks = ops::concatenate(&picks, 0)?;
            eval([&picks])?;
            picks.as_slice::<u32>().to_vec()
        }
    };
    let rows = lps
        .iter()
        .map(|lp| lp.squeeze_axes(&[0]))
        .collect::<std::result::Result<Vec<_>, _>>()?;
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
fn accept_matching(
    gen: &mut Generator<'_>,
    logits: &Array,
    input: &[u32],
    out: &mut Emitter<'_>,
) -> Result<usize> {
    let mut accepted = 0;
    for i in 0..input.len() {
        let lp = gen.logprobs_row(logits_row(logits, i), &ids(&input[i..=i]))?;
        let t = gen.sampler().sample(&lp)?.try_item_cast::<u32>()?;
        out.emit(t, lp.squeeze_axes(&[0])?)?;
        if out.stopped || i + 1 == input.len() || t != input[i + 1] {
            break;
        }
        accepted += 1;
    }
    Ok(accepted)
}

/// Rejection sampling with the drafter's probabilities (one-hot when deterministic).
fn accept_rejecting(
    gen: &mut Generator<'_>,
    logits: &Array,
    input: &[u32],
    draft: &Draft,
    out: &mut Emitter<'_>,
) -> Result<usize> {
    let temp = gen.sampler().temp();
    let mut accepted = 0;
    for i in 0..input.len() {
        let lp = gen.logprobs_row(logits_row(logits, i), &ids(&input[i..=i]))?;
        if i + 1 == input.len() {
            let t = gen.sampler().sample(&lp)?.try_item_cast::<u32>()?;
            out.emit(t, lp.squeeze_axes(&[0])?)?;
            break;
        }
        let p = target_distribution(gen.sampler(), &lp, temp)?;
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
