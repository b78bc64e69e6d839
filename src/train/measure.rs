//! Measuring a drafter honestly (`mlxb measure`): every prompt runs vanilla and speculative
//! in the same process, interleaved (the order alternates per prompt so warm-up and cache
//! effects fall on both sides), through the one text-generation loop. The report has vLLM's
//! acceptance metrics, wall-clock decode speed of both runs and their ratio, and for DSpark
//! drafters the calibration of the confidence head per position. At temperature 0 the
//! speculative ids must equal the vanilla ids, prompt by prompt: a free losslessness check.

use super::calibrate::{position_stats, rounds_from_trace, PositionStats, Round};
use crate::engine::error::{EngineError, Result};
use crate::engine::generate::Speculator;
use crate::engine::generate::{Flow, GenerationStats};
use crate::engine::session::Session;
use crate::engine::text::{generate_text, TextParams};
use crate::spec::executor::Speculation;
use crate::spec::metrics::SpecMetrics;
use crate::spec::source::VerifyMode;
use crate::spec::trace::RoundTrace;
use serde::Serialize;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// What one generation produced.
pub struct Run {
    /// Generated ids (EOS included when it ended the generation).
    pub token_ids: Vec<u32>,
    /// Timings.
    pub stats: GenerationStats,
    /// Acceptance counters (speculative runs only).
    pub spec: Option<SpecMetrics>,
    /// Every verify round, as `--spec-trace` writes them (speculative runs only).
    pub rounds: Vec<RoundTrace>,
}

/// Generates from `prompt` with `params`, speculatively when `spec` is given (its counters are
/// this run's afterwards), recording the rounds in memory (after the run, so tracing costs the
/// timed loop nothing extra).
pub fn generate(
    session: &mut Session,
    prompt: &[u32],
    params: &TextParams,
    mut spec: Option<&mut Speculation<'_>>,
) -> Result<Run> {
    let rounds: Rc<RefCell<Vec<RoundTrace>>> = Rc::default();
    if let Some(s) = spec.as_deref_mut() {
        s.metrics = SpecMetrics::default();
        s.set_trace(Some(Box::new(rounds.clone())));
    }
    let speculator = spec.as_deref_mut().map(|s| -> &mut dyn Speculator { s });
    let out = generate_text(session, prompt, params, speculator, None, |_| {
        Ok(Flow::Continue)
    })?;
    let metrics = spec.map(|s| {
        s.set_trace(None);
        std::mem::take(&mut s.metrics)
    });
    let rounds = rounds.take();
    Ok(Run {
        token_ids: out.token_ids,
        stats: out.stats,
        spec: metrics,
        rounds,
    })
}

/// Wall-clock decode speed over many generations.
#[derive(Debug, Clone, Copy, Default)]
struct Speed {
    tokens: usize,
    time: Duration,
}

impl Speed {
    fn add(&mut self, s: &GenerationStats) {
        self.tokens += s.generation_tokens;
        self.time += s.generation_time;
    }
    fn tps(&self) -> f64 {
        self.tokens as f64 / self.time.as_secs_f64().max(1e-9)
    }
}

/// The result of `mlxb measure` (its `--json` object).
#[derive(Debug, Clone, Serialize)]
pub struct MeasureReport {
    /// Drafter name (`dspark`, `ngram`, `self`, `model`, ...).
    pub drafter: String,
    /// Prompts measured.
    pub prompts: usize,
    /// Sequences decoded at once (1: one stream at a time, where a round is one drafter
    /// proposal and its verify forward; more: a batch, where a round is one batched decoding
    /// forward for all its rows and speeds are aggregate).
    pub n_parallel: usize,
    /// Sampling temperature (0 = greedy).
    pub temp: f64,
    /// Verification rule (`match` or `reject`).
    pub verify: String,
    /// Whether speculative ids were checked equal to vanilla ids (greedy runs).
    pub lossless_checked: bool,
    /// Tokens the speculative runs generated.
    pub generated_tokens: usize,
    /// Tokens the vanilla runs generated.
    pub generated_tokens_vanilla: usize,
    /// Verify rounds with at least one drafted token.
    pub drafts: usize,
    /// Tokens proposed.
    pub drafted_tokens: usize,
    /// Proposed tokens accepted.
    pub accepted_tokens: usize,
    /// accepted / drafted.
    pub acceptance_rate: f64,
    /// 1 + accepted / drafts (vLLM's definition, bonus token included).
    pub mean_acceptance_length: f64,
    /// Accepted at position i / drafts.
    pub per_position_acceptance: Vec<f64>,
    /// Target forwards spent on verification.
    pub target_forwards: usize,
    /// Rounds whose rollback replayed a snapshot.
    pub replays: usize,
    /// Vanilla decode speed (generated tokens / generation time, summed over prompts).
    pub tokens_per_sec_vanilla: f64,
    /// Speculative decode speed, measured the same way.
    pub tokens_per_sec_spec: f64,
    /// tokens_per_sec_spec / tokens_per_sec_vanilla.
    pub speedup: f64,
    /// Milliseconds per round the drafter spent proposing and taking in committed tokens.
    pub draft_ms_per_round: f64,
    /// Milliseconds per round of the target's verify forward and acceptance.
    pub verify_ms_per_round: f64,
    /// Milliseconds per round of cache rollback.
    pub rollback_ms_per_round: f64,
    /// Milliseconds of one vanilla decode step (vanilla generation time / tokens).
    pub vanilla_step_ms: f64,
    /// Batched runs: decoding steps by the block width the policy chose (index W - 1; width
    /// 1 is a plain step), as `mlxb:spec_decode_block_width_total` counts them in `serve`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_widths: Option<Vec<usize>>,
    /// DSpark: ECE per position of the survival product with the checkpoint's temperatures.
    pub ece: Option<Vec<f64>>,
    /// DSpark: the same without temperatures (raw sigmoid confidences).
    pub ece_before: Option<Vec<f64>>,
    /// DSpark: AUROC per position with the checkpoint's temperatures.
    pub auroc: Option<Vec<Option<f64>>>,
    /// DSpark: AUROC per position without temperatures.
    pub auroc_before: Option<Vec<Option<f64>>>,
    /// DSpark: the full per-position calibration table.
    pub calibration: Option<Vec<PositionStats>>,
}

/// The first generated position where two id lists differ (a length difference counts).
pub(super) fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// Measures `drafting` on every prompt against vanilla generation. `temps` are the DSpark
/// checkpoint's calibration temperatures (`Some(empty)` = uncalibrated DSpark; `None` = not
/// DSpark). `after_prompt` sees each prompt's index and speculative run (progress, traces).
pub fn measure(
    session: &mut Session,
    prompts: &[Vec<u32>],
    params: &TextParams,
    drafting: &mut Speculation<'_>,
    temps: Option<&[f64]>,
    mut after_prompt: impl FnMut(usize, &Run) -> Result<()>,
) -> Result<MeasureReport> {
    let greedy = params.sampler.temp == 0.0;
    let base_seed = params.seed.unwrap_or(0);
    let (mut vanilla, mut spec) = (Speed::default(), Speed::default());
    let mut total = SpecMetrics::default();
    let mut rounds: Vec<Round> = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let p = TextParams {
            seed: Some(base_seed.wrapping_add(i as u64)),
            ..params.clone()
        };
        let (v, s) = if i % 2 == 0 {
            let v = generate(session, prompt, &p, None)?;
            (v, generate(session, prompt, &p, Some(drafting))?)
        } else {
            let s = generate(session, prompt, &p, Some(drafting))?;
            (generate(session, prompt, &p, None)?, s)
        };
        if greedy {
            if let Some(at) = first_difference(&s.token_ids, &v.token_ids) {
                return Err(EngineError::Parity(format!(
                    "prompt {i}: the speculative ids differ from vanilla at generated token {at} ({:?} vs {:?}); greedy speculative decoding must be lossless",
                    s.token_ids.get(at),
                    v.token_ids.get(at)
                )));
            }
        }
        vanilla.add(&v.stats);
        spec.add(&s.stats);
        if let Some(m) = &s.spec {
            total.add(m);
        }
        if let Some(t) = temps {
            rounds.extend(rounds_from_trace(&s.rounds, t));
        }
        after_prompt(i, &s)?;
    }
    let calibration = temps.filter(|_| !rounds.is_empty()).map(|t| {
        let gamma = rounds.iter().map(|r| r.logits.len()).max().unwrap_or(0);
        position_stats(&rounds, &[], t, gamma)
    });
    let column = |f: fn(&PositionStats) -> f64| {
        calibration
            .as_ref()
            .map(|c| c.iter().map(f).collect::<Vec<_>>())
    };
    let column_opt = |f: fn(&PositionStats) -> Option<f64>| {
        calibration
            .as_ref()
            .map(|c| c.iter().map(f).collect::<Vec<_>>())
    };
    let verify = match drafting.verify {
        VerifyMode::Match => "match",
        VerifyMode::Reject => "reject",
    };
    let mut report = MeasureReport::new(&total, prompts.len(), params.sampler.temp, verify);
    report.lossless_checked = greedy;
    report.generated_tokens = spec.tokens;
    report.generated_tokens_vanilla = vanilla.tokens;
    report.tokens_per_sec_vanilla = vanilla.tps();
    report.tokens_per_sec_spec = spec.tps();
    report.speedup = spec.tps() / vanilla.tps().max(1e-12);
    report.draft_ms_per_round = total.ms_per_round(total.draft_seconds);
    report.verify_ms_per_round = total.ms_per_round(total.verify_seconds);
    report.rollback_ms_per_round = total.ms_per_round(total.rollback_seconds);
    report.vanilla_step_ms = 1e3 / vanilla.tps().max(1e-12);
    report.ece = column(|p| p.ece_after);
    report.ece_before = column(|p| p.ece_before);
    report.auroc = column_opt(|p| p.auroc_after);
    report.auroc_before = column_opt(|p| p.auroc_before);
    report.calibration = calibration;
    Ok(report)
}

impl MeasureReport {
    /// A report with the acceptance counters of `totals` over `prompts` prompts, one stream at
    /// a time, and every speed, time and calibration field still empty.
    pub fn new(totals: &SpecMetrics, prompts: usize, temp: f64, verify: &str) -> Self {
        Self {
            drafter: totals.drafter.clone(),
            prompts,
            n_parallel: 1,
            temp,
            verify: verify.into(),
            lossless_checked: false,
            generated_tokens: 0,
            generated_tokens_vanilla: 0,
            drafts: totals.drafts,
            drafted_tokens: totals.drafted_tokens,
            accepted_tokens: totals.accepted_tokens,
            acceptance_rate: totals.acceptance_rate(),
            mean_acceptance_length: totals.mean_acceptance_length(),
            per_position_acceptance: totals.per_position_rate(),
            target_forwards: totals.target_forwards,
            replays: totals.replays,
            tokens_per_sec_vanilla: 0.0,
            tokens_per_sec_spec: 0.0,
            speedup: 0.0,
            draft_ms_per_round: 0.0,
            verify_ms_per_round: 0.0,
            rollback_ms_per_round: 0.0,
            vanilla_step_ms: 0.0,
            block_widths: None,
            ece: None,
            ece_before: None,
            auroc: None,
            auroc_before: None,
            calibration: None,
        }
    }

    /// The human-readable summary `mlxb measure` prints without `--json`.
    pub fn summary(&self) -> String {
        let per: Vec<String> = self
            .per_position_acceptance
            .iter()
            .map(|r| format!("{r:.3}"))
            .collect();
        let batched = self.n_parallel > 1;
        let (rows, equal) = match batched {
            true => (
                format!(", {} sequences at once", self.n_parallel),
                ", ids equal the plain batch",
            ),
            false => (String::new(), ", ids equal vanilla"),
        };
        let round =
            (self.draft_ms_per_round + self.verify_ms_per_round + self.rollback_ms_per_round)
                / self.vanilla_step_ms.max(1e-9);
        let mut out = format!(
            "drafter {} on {} prompts (temp {}, verify {}{}{})\n\
             generated: {} tokens speculative, {} vanilla\n\
             drafts {}, drafted {}, accepted {}, target forwards {}\n\
             acceptance rate {:.3}, mean acceptance length {:.3}\n\
             per-position acceptance: [{}]\n",
            self.drafter,
            self.prompts,
            self.temp,
            self.verify,
            rows,
            if self.lossless_checked { equal } else { "" },
            self.generated_tokens,
            self.generated_tokens_vanilla,
            self.drafts,
            self.drafted_tokens,
            self.accepted_tokens,
            self.target_forwards,
            self.acceptance_rate,
            self.mean_acceptance_length,
            per.join(", "),
        );
        if batched {
            out.push_str(&format!(
                "decode (aggregate): plain batch {:.2} tok/s, drafting batch {:.2} tok/s, speedup {:.3}x\n\
                 step: draft {:.2} ms + verify {:.2} ms = {:.2} plain batched steps of {:.2} ms",
                self.tokens_per_sec_vanilla,
                self.tokens_per_sec_spec,
                self.speedup,
                self.draft_ms_per_round,
                self.verify_ms_per_round,
                round,
                self.vanilla_step_ms,
            ));
        } else {
            out.push_str(&format!(
                "decode: vanilla {:.2} tok/s, speculative {:.2} tok/s, speedup {:.3}x\n\
                 round: draft {:.2} ms + verify {:.2} ms + rollback {:.2} ms = {:.2} vanilla steps of {:.2} ms",
                self.tokens_per_sec_vanilla,
                self.tokens_per_sec_spec,
                self.speedup,
                self.draft_ms_per_round,
                self.verify_ms_per_round,
                self.rollback_ms_per_round,
                round,
                self.vanilla_step_ms,
            ));
        }
        if let Some(c) = &self.calibration {
            out.push_str("\n\nconfidence calibration (survival product vs prefix accepted):\n");
            out.push_str(&stats_table(c, None));
        }
        out
    }
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.3}"))
}

/// A per-position calibration table; `fit` adds the fitted (threshold, temperature) columns.
pub fn stats_table(stats: &[PositionStats], fit: Option<(&[f64], &[f64])>) -> String {
    let mut out = String::from(
        "pos  proposed  reached  accept  ECE before  ECE after  AUROC before  AUROC after",
    );
    if fit.is_some() {
        out.push_str("  threshold  temperature");
    }
    for s in stats {
        out.push_str(&format!(
            "\n{:>3}  {:>8}  {:>7}  {:>6}  {:>10.4}  {:>9.4}  {:>12}  {:>11}",
            s.position,
            s.proposed,
            s.reached,
            fmt_opt(s.accept_rate),
            s.ece_before,
            s.ece_after,
            fmt_opt(s.auroc_before),
            fmt_opt(s.auroc_after),
        ));
        if let Some((th, temps)) = fit {
            out.push_str(&format!(
                "  {:>9}  {:>11}",
                fmt_opt(th.get(s.position).copied()),
                fmt_opt(temps.get(s.position).copied())
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_add_up_and_differences_are_found() {
        let mut a = SpecMetrics::default();
        a.record(3, 2);
        a.record(0, 0);
        a.draft_seconds = 0.25;
        let mut b = SpecMetrics::default();
        b.record(5, 5);
        b.draft_seconds = 0.5;
        b.verify_seconds = 0.3;
        let mut t = SpecMetrics::default();
        t.add(&a);
        t.add(&b);
        assert_eq!((t.draft_seconds, t.verify_seconds), (0.75, 0.3));
        assert_eq!(t.ms_per_round(t.draft_seconds), 250.0);
        assert_eq!(
            (
                t.drafts,
                t.drafted_tokens,
                t.accepted_tokens,
                t.target_forwards
            ),
            (2, 8, 7, 3)
        );
        assert_eq!(t.accepted_per_position, [2, 2, 1, 1, 1]);
        assert_eq!(t.mean_acceptance_length(), 1.0 + 7.0 / 2.0);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 5, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
    }
}
