//! `mlxb measure --n-parallel N`: a drafter that drafts per slot, measured in the batched
//! engine against the same batch decoding without drafts. The prompts run in groups of N; each
//! group is decoded twice in one batched generator each, with every sequence drafting for
//! itself and without drafts, the order alternating per group (so warm-up and drift fall on
//! both sides). Speed is aggregate decoding speed: tokens handed out after a group's first
//! ones (its prompts prefilled) over the time to its last. At temperature 0 every prompt's ids
//! from the drafting batch must equal its ids from the plain batch: a losslessness check at
//! the same batch shape.

use super::measure::MeasureReport;
use crate::engine::batch::{BatchGenerator, BatchSettings, BatchToken, SequenceRequest};
use crate::engine::error::{EngineError, Result};
use crate::engine::models::LoadedModel;
use crate::engine::sample::{Sampler, SamplerConfig};
use crate::spec::factory::SpecOptions;
use crate::spec::metrics::SpecMetrics;
use crate::spec::policy::{DraftLengthPolicy, DraftPolicy};
use crate::spec::slots::SlotDrafters;
use crate::spec::source::DraftSource;
use std::time::{Duration, Instant};

/// How a batched measurement runs.
pub struct BatchedMeasure<'a> {
    /// The drafter every sequence drafts with (one that drafts per slot).
    pub opts: &'a SpecOptions,
    /// That drafter, opened: each group's slots draft with drafters forked from it.
    pub drafter: &'a dyn DraftSource,
    /// How each step's block width is chosen.
    pub policy: DraftPolicy,
    /// Sequences decoded at once.
    pub n_parallel: usize,
    /// Token budget per prompt.
    pub max_tokens: usize,
    /// Prompt tokens per prefill forward.
    pub prefill_step_size: usize,
    /// Tokens that end a sequence.
    pub stop_tokens: Vec<u32>,
}

/// One group decoded once.
#[derive(Default)]
struct GroupRun {
    /// Each prompt's generated ids, in prompt order.
    ids: Vec<Vec<u32>>,
    /// Tokens handed out after the group's first ones, and the time they took.
    tokens: usize,
    time: Duration,
    /// Decoding forwards in that time.
    forwards: usize,
    /// The drafting run's per-sequence counters, summed.
    spec: SpecMetrics,
    /// The drafting run's steps by block width (index W - 1).
    widths: Vec<usize>,
}

impl BatchedMeasure<'_> {
    fn generator(&self, model: &LoadedModel, rows: usize) -> Result<BatchGenerator> {
        BatchGenerator::new(
            model.model.as_ref(),
            &model.plan,
            Sampler::new(&SamplerConfig::default())?,
            self.stop_tokens.clone(),
            BatchSettings {
                completion_batch_size: rows,
                prefill_batch_size: rows,
                prefill_step_size: self.prefill_step_size.max(1),
            },
        )
    }

    /// Decodes `group` in one generator; with `drafting`, every sequence drafts for itself
    /// (the policy comes back with the step costs it learnt).
    fn run_group(
        &self,
        model: &mut LoadedModel,
        group: &[Vec<u32>],
        drafting: Option<&mut DraftLengthPolicy>,
    ) -> Result<GroupRun> {
        let mut gen = self.generator(model, group.len())?;
        let mut drafters = match drafting {
            Some(policy) => {
                let template = self.drafter.fork()?.ok_or_else(|| {
                    EngineError::Input(
                        "this drafter cannot draft per sequence in a batch; measure it with --n-parallel 1".into(),
                    )
                })?;
                let d = SlotDrafters::new(self.opts, policy.clone(), template);
                gen = gen
                    .speculative(model.model.as_ref())?
                    .tapping(d.tap_layers())
                    .lending_kv(d.kv_layers());
                Some((d, policy))
            }
            None => None,
        };
        let requests = group
            .iter()
            .map(|p| SequenceRequest::new(p.clone(), self.max_tokens))
            .collect();
        let uids = gen.insert(requests)?;
        if let Some((d, _)) = drafters.as_mut() {
            for (&uid, prompt) in uids.iter().zip(group) {
                d.join(
                    uid,
                    prompt,
                    (0.0, self.opts.num_draft_tokens),
                    model.model.as_mut(),
                )?;
            }
        }
        let mut run = GroupRun {
            ids: vec![Vec::new(); group.len()],
            ..GroupRun::default()
        };
        let mut started: Option<(Instant, usize)> = None;
        loop {
            let tokens: Vec<BatchToken> = match drafters.as_mut() {
                Some((d, _)) => {
                    let tokens = d.step(&mut gen, model.model.as_mut())?;
                    if let Some(w) = d.step_width() {
                        count_width(&mut run.widths, w);
                    }
                    tokens
                }
                None => gen.next_tokens(model.model.as_mut())?,
            };
            if tokens.is_empty() {
                break;
            }
            match started {
                None => started = Some((Instant::now(), gen.decode_forwards())),
                Some(_) => run.tokens += tokens.len(),
            }
            for t in tokens {
                let Some(i) = uids.iter().position(|&u| u == t.uid) else {
                    continue;
                };
                run.ids[i].push(t.token);
                if t.finish.is_some() {
                    if let Some((d, _)) = drafters.as_mut() {
                        if let Some(m) = d.leave(t.uid) {
                            run.spec.add(&m);
                        }
                    }
                }
            }
        }
        if let Some((t, forwards)) = started {
            run.time = t.elapsed();
            run.forwards = gen.decode_forwards() - forwards;
        }
        if let Some((d, policy)) = drafters {
            *policy = d.into_policy();
        }
        Ok(run)
    }

    /// Measures on every prompt (see the module docs); `after_group` sees the prompts done.
    pub fn run(
        &self,
        model: &mut LoadedModel,
        prompts: &[Vec<u32>],
        mut after_group: impl FnMut(usize) -> Result<()>,
    ) -> Result<MeasureReport> {
        let rows = self.n_parallel.clamp(1, prompts.len().max(1));
        let probe = self
            .generator(model, rows)?
            .speculative(model.model.as_ref())?;
        let mut policy = DraftLengthPolicy::for_batch(
            self.policy,
            &probe,
            model.model.as_mut(),
            rows,
            self.opts.num_draft_tokens + 1,
        )?;
        drop(probe);
        let (mut vanilla, mut spec) = (GroupRun::default(), GroupRun::default());
        let mut done = 0;
        for (g, group) in prompts.chunks(rows).enumerate() {
            let (v, s) = if g % 2 == 0 {
                let v = self.run_group(model, group, None)?;
                (v, self.run_group(model, group, Some(&mut policy))?)
            } else {
                let s = self.run_group(model, group, Some(&mut policy))?;
                (self.run_group(model, group, None)?, s)
            };
            for (k, (a, b)) in s.ids.iter().zip(&v.ids).enumerate() {
                if let Some(at) = super::measure::first_difference(a, b) {
                    return Err(EngineError::Parity(format!(
                        "prompt {}: the drafting batch's ids differ from the plain batch's at generated token {at} ({:?} vs {:?}); greedy speculative decoding must be lossless",
                        done + k,
                        a.get(at),
                        b.get(at)
                    )));
                }
            }
            for (total, run) in [(&mut vanilla, v), (&mut spec, s)] {
                total.tokens += run.tokens;
                total.time += run.time;
                total.forwards += run.forwards;
                total.spec.add(&run.spec);
                if total.widths.len() < run.widths.len() {
                    total.widths.resize(run.widths.len(), 0);
                }
                for (t, n) in total.widths.iter_mut().zip(&run.widths) {
                    *t += n;
                }
                total.ids.extend(run.ids);
            }
            done += group.len();
            after_group(done)?;
        }
        Ok(report(self, prompts.len(), &vanilla, &spec))
    }
}

/// Counts one step of block width `width` in `widths` (index W - 1).
fn count_width(widths: &mut Vec<usize>, width: usize) {
    if widths.len() < width {
        widths.resize(width, 0);
    }
    widths[width - 1] += 1;
}

/// The report of a batched measurement: acceptance from the sequences' own counters; a round
/// is one batched decoding forward (draft and verify times per forward, all rows together).
fn report(
    m: &BatchedMeasure<'_>,
    prompts: usize,
    vanilla: &GroupRun,
    spec: &GroupRun,
) -> MeasureReport {
    let tps = |r: &GroupRun| r.tokens as f64 / r.time.as_secs_f64().max(1e-9);
    let mut totals = spec.spec.clone();
    totals.target_forwards = spec.forwards;
    let draft = totals.draft_seconds;
    let verify = (spec.time.as_secs_f64() - draft).max(0.0);
    let mut r = MeasureReport::new(&totals, prompts, 0.0, "match");
    r.n_parallel = m.n_parallel;
    r.lossless_checked = true;
    r.generated_tokens = spec.ids.iter().map(Vec::len).sum();
    r.generated_tokens_vanilla = vanilla.ids.iter().map(Vec::len).sum();
    r.tokens_per_sec_vanilla = tps(vanilla);
    r.tokens_per_sec_spec = tps(spec);
    r.speedup = r.tokens_per_sec_spec / r.tokens_per_sec_vanilla.max(1e-12);
    r.draft_ms_per_round = totals.ms_per_round(draft);
    r.verify_ms_per_round = totals.ms_per_round(verify);
    r.block_widths = Some(spec.widths.clone());
    r.vanilla_step_ms = vanilla.time.as_secs_f64() * 1e3 / vanilla.forwards.max(1) as f64;
    r
}
