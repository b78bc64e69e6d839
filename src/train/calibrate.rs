//! Confidence calibration (dspark-spec.md §4.1) and per-position pruning thresholds, fitted on
//! unpruned rounds: each round records the confidence logits of its γ drafted positions and
//! how many of them the target accepted.
//!
//! - **Sequential temperature scaling**: for k = 0..γ-1 in order, the temperature `T_k` of
//!   `c'_k = sigmoid(logit_k / T_k)` is the grid point minimising the ECE (20 equal-width bins)
//!   of the cumulative product `Π_{i≤k} c'_i` against the realised prefix-accept indicator,
//!   with `T_<k` fixed.
//! - **Thresholds**: at position k (reached rounds only), the smallest τ over the observed
//!   calibrated confidences with Laplace-smoothed `P(accepted | c'_k ≥ τ) = (a+1)/(n+2)` at
//!   least the target rate; fewer than `min_samples` reached rounds → 0 (never prune), no τ
//!   reaching the target → 1.0; position 0 → 0.
//! - **Report** ([`position_stats`]): per position, as DeepSpec's `confidence_head.py` measures
//!   it, the ECE and AUROC of the survival product against the prefix-accept indicator.
//!
//! Rounds come from the speculative trace ([`rounds_from_trace`]): the drafter's per-round
//! note already carries every position's confidence, so calibration needs no second path.

use crate::engine::error::{EngineError, Result};
use crate::spec::dspark::checkpoint::{self, DsparkConfig};
use crate::spec::trace::RoundTrace;
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

/// ECE bins, as DeepSpec's `confidence_head.py` measures.
pub const ECE_BINS: usize = 20;

/// One unpruned drafting round.
#[derive(Debug, Clone, PartialEq)]
pub struct Round {
    /// Confidence logits of the drafted positions (before the sigmoid).
    pub logits: Vec<f64>,
    /// Accepted drafted tokens (a prefix of `logits`' positions).
    pub accepted: usize,
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Expected calibration error over `bins` equal-width bins.
pub fn ece(probs: &[f64], labels: &[bool], bins: usize) -> f64 {
    if probs.is_empty() {
        return 0.0;
    }
    let mut sum = vec![(0.0f64, 0.0f64, 0usize); bins];
    for (&p, &y) in probs.iter().zip(labels) {
        let b = ((p * bins as f64) as usize).min(bins - 1);
        sum[b].0 += p;
        sum[b].1 += y as u8 as f64;
        sum[b].2 += 1;
    }
    sum.iter()
        .filter(|s| s.2 > 0)
        .map(|&(p, y, _)| (p - y).abs() / probs.len() as f64)
        .sum()
}

/// Area under the ROC curve (Mann-Whitney rank statistic, ties counted half); `None` with
/// one class only. O(n log n), so a long calibration run stays cheap.
pub fn auroc(scores: &[f64], labels: &[bool]) -> Option<f64> {
    let pos = labels.iter().filter(|&&y| y).count();
    let neg = labels.len() - pos;
    if pos == 0 || neg == 0 {
        return None;
    }
    let mut pts: Vec<(f64, bool)> = scores.iter().copied().zip(labels.iter().copied()).collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    // For each run of equal scores: positives in it beat every negative below it, and tie
    // with the run's negatives (half a win each).
    let (mut wins, mut neg_below, mut i) = (0.0f64, 0usize, 0usize);
    while i < pts.len() {
        let (mut p_run, mut n_run) = (0usize, 0usize);
        let s = pts[i].0;
        while i < pts.len() && pts[i].0 == s {
            if pts[i].1 {
                p_run += 1;
            } else {
                n_run += 1;
            }
            i += 1;
        }
        wins += p_run as f64 * (neg_below as f64 + 0.5 * n_run as f64);
        neg_below += n_run;
    }
    Some(wins / (pos * neg) as f64)
}

/// Calibrated per-position confidences of a round.
pub fn calibrated(round: &Round, temps: &[f64]) -> Vec<f64> {
    round
        .logits
        .iter()
        .enumerate()
        .map(|(k, &l)| sigmoid(l / temps.get(k).copied().unwrap_or(1.0)))
        .collect()
}

/// Cumulative survival `Π_{i≤k} c_i` at position `k` and the prefix-accept label, per round.
pub fn survival_at(rounds: &[Round], temps: &[f64], k: usize) -> (Vec<f64>, Vec<bool>) {
    rounds
        .iter()
        .filter(|r| r.logits.len() > k)
        .map(|r| {
            let c = calibrated(r, temps);
            (c[..=k].iter().product::<f64>(), r.accepted > k)
        })
        .unzip()
}

/// The temperature grid: 0.05 .. 20, log-spaced (81 points, 1.0 included).
fn grid() -> Vec<f64> {
    (0..=80)
        .map(|i| 10f64.powf(-1.3 + 2.6 * i as f64 / 80.0))
        .chain([1.0])
        .collect()
}

/// Sequential temperature scaling over `gamma` positions.
pub fn fit_temperatures(rounds: &[Round], gamma: usize) -> Vec<f64> {
    let mut temps = vec![1.0; gamma];
    for k in 0..gamma {
        let mut best = (f64::INFINITY, 1.0f64);
        for t in grid() {
            temps[k] = t;
            let (p, y) = survival_at(rounds, &temps, k);
            let e = ece(&p, &y, ECE_BINS);
            // Ties go to the temperature closest to 1.
            if e < best.0 - 1e-12
                || ((e - best.0).abs() <= 1e-12 && t.ln().abs() < best.1.ln().abs())
            {
                best = (e, t);
            }
        }
        temps[k] = best.1;
    }
    temps
}

/// Per-position thresholds on calibrated confidences (see the module docs).
pub fn fit_thresholds(
    rounds: &[Round],
    temps: &[f64],
    gamma: usize,
    target: f64,
    min_samples: usize,
) -> Vec<f64> {
    let mut out = vec![0.0; gamma];
    for (k, slot) in out.iter_mut().enumerate().skip(1) {
        // Rounds that reached position k: every earlier position accepted.
        let mut pts: Vec<(f64, bool)> = rounds
            .iter()
            .filter(|r| r.logits.len() > k && r.accepted >= k)
            .map(|r| (calibrated(r, temps)[k], r.accepted > k))
            .collect();
        if pts.len() < min_samples {
            continue;
        }
        pts.sort_by(|a, b| b.0.total_cmp(&a.0));
        // Walk down from the most confident: after each distinct value, the set c >= tau.
        let (mut acc, mut n) = (0usize, 0usize);
        let mut best: Option<f64> = None;
        let mut i = 0;
        while i < pts.len() {
            let tau = pts[i].0;
            while i < pts.len() && pts[i].0 == tau {
                acc += pts[i].1 as usize;
                n += 1;
                i += 1;
            }
            if (acc as f64 + 1.0) / (n as f64 + 2.0) >= target {
                best = Some(tau);
            }
        }
        *slot = best.unwrap_or(1.0);
    }
    out
}

/// The config of the checkpoint at `dir` if a calibration can be written into it (an
/// mlxb-format drafter with a confidence head), so a long calibration run fails up front.
pub fn check_patchable(dir: &Path) -> Result<DsparkConfig> {
    let (dir, config) = checkpoint::patchable(dir, "a calibration")?;
    if !config.confidence_head {
        return Err(EngineError::file(
            &dir,
            "the drafter has no confidence head, so there is nothing to calibrate",
        ));
    }
    Ok(config)
}

/// Writes thresholds and temperatures into the checkpoint's `dspark.json` atomically (temp
/// file + rename; the tensors and every other field are untouched). Only mlxb-format
/// checkpoints with a confidence head can be patched.
pub fn patch_config(dir: &Path, thresholds: Vec<f64>, temps: Vec<f64>) -> Result<DsparkConfig> {
    let config = check_patchable(dir)?;
    let dir = checkpoint::checkpoint_dir(dir);
    if thresholds.len() != config.block_size || temps.len() != config.block_size {
        return Err(EngineError::Input(format!(
            "the calibration has {} positions; the drafter's block has {}",
            thresholds.len(),
            config.block_size
        )));
    }
    // Patch the file's own JSON so fields this version does not know survive as they are.
    let file = dir.join(checkpoint::DSPARK_CONFIG_FILE);
    let text = std::fs::read_to_string(&file)
        .map_err(|e| EngineError::file(&file, format!("cannot read it ({e})")))?;
    let mut raw: Value = serde_json::from_str(&text)
        .map_err(|e| EngineError::file(&file, format!("is not valid JSON ({e})")))?;
    let obj = raw
        .as_object_mut()
        .ok_or_else(|| EngineError::file(&file, "is not a JSON object"))?;
    obj.insert("thresholds".into(), serde_json::json!(thresholds));
    obj.insert("sts_temperatures".into(), serde_json::json!(temps));
    let patched: DsparkConfig = serde_json::from_value(raw.clone())
        .map_err(|e| EngineError::file(&file, format!("cannot be patched ({e})")))?;
    patched.validate(&file)?;
    let out = serde_json::to_string_pretty(&raw)
        .map_err(|e| EngineError::Runtime(format!("cannot serialize the drafter config ({e})")))?;
    crate::engine::fsutil::write_atomic(&file, (out + "\n").as_bytes())?;
    Ok(DsparkConfig {
        thresholds: Some(thresholds),
        sts_temperatures: Some(temps),
        ..config
    })
}

/// `logit` such that `sigmoid(logit / t) = c` (confidences that rounded to 0 or 1 in f64 map
/// to the largest finite logits).
fn logit_of(c: f64, t: f64) -> f64 {
    let c = c.clamp(1e-300, 1.0 - f64::EPSILON / 2.0);
    t * (c.ln() - (-c).ln_1p())
}

/// The rounds of a speculative trace as calibration data: the verified positions' confidence
/// logits (recovered from the traced confidences and the temperatures `temps` that were in
/// force) and the accepted count. Rounds without confidences (other drafters, plain decode
/// steps) are skipped; a round that ended the generation on an accepted token keeps only the
/// positions the target judged.
pub fn rounds_from_trace(trace: &[RoundTrace], temps: &[f64]) -> Vec<Round> {
    trace
        .iter()
        .filter_map(|r| {
            let conf = r.block_confidence.as_ref()?;
            let (judged, accepted) = match r.next {
                None => (r.accepted, r.accepted),
                // The stop token was the draft itself: accepted, and the last one judged.
                Some(t) if r.proposed.get(r.accepted) == Some(&t) => {
                    (r.accepted + 1, r.accepted + 1)
                }
                Some(_) => (r.proposed.len(), r.accepted),
            };
            let n = judged.min(r.proposed.len()).min(conf.len());
            (n > 0).then(|| Round {
                logits: conf[..n]
                    .iter()
                    .enumerate()
                    .map(|(k, &c)| logit_of(c, temps.get(k).copied().unwrap_or(1.0)))
                    .collect(),
                accepted: accepted.min(n),
            })
        })
        .collect()
}

/// Calibration quality at one draft position.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PositionStats {
    /// Draft position (0 = the first drafted token).
    pub position: usize,
    /// Rounds that proposed this position.
    pub proposed: usize,
    /// Rounds that reached it (every earlier position accepted).
    pub reached: usize,
    /// Share of reached rounds that accepted it (`None` when none reached it).
    pub accept_rate: Option<f64>,
    /// ECE of the survival product with temperatures `before`.
    pub ece_before: f64,
    /// ECE of the survival product with temperatures `after`.
    pub ece_after: f64,
    /// AUROC of the survival product with `before` (`None` with one class only).
    pub auroc_before: Option<f64>,
    /// AUROC of the survival product with `after`.
    pub auroc_after: Option<f64>,
}

/// Per-position calibration of `rounds` under two temperature tables (empty = all 1).
pub fn position_stats(
    rounds: &[Round],
    before: &[f64],
    after: &[f64],
    gamma: usize,
) -> Vec<PositionStats> {
    (0..gamma)
        .map(|k| {
            let (pb, y) = survival_at(rounds, before, k);
            let (pa, _) = survival_at(rounds, after, k);
            let reached: Vec<bool> = rounds
                .iter()
                .filter(|r| r.logits.len() > k && r.accepted >= k)
                .map(|r| r.accepted > k)
                .collect();
            PositionStats {
                position: k,
                proposed: y.len(),
                reached: reached.len(),
                accept_rate: (!reached.is_empty())
                    .then(|| reached.iter().filter(|&&a| a).count() as f64 / reached.len() as f64),
                ece_before: ece(&pb, &y, ECE_BINS),
                ece_after: ece(&pa, &y, ECE_BINS),
                auroc_before: auroc(&pb, &y),
                auroc_after: auroc(&pa, &y),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition: P(score of a positive > score of a negative), ties half.
    fn auroc_pairs(s: &[f64], y: &[bool]) -> f64 {
        let (mut w, mut n) = (0.0, 0.0);
        for (i, &a) in s.iter().enumerate().filter(|(i, _)| y[*i]) {
            for (j, &b) in s.iter().enumerate().filter(|(j, _)| !y[*j]) {
                let _ = (i, j);
                w += if a > b {
                    1.0
                } else if a == b {
                    0.5
                } else {
                    0.0
                };
                n += 1.0;
            }
        }
        w / n
    }

    /// A small deterministic generator in [0, 1).
    fn lcg(state: &mut u64) -> f64 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*state >> 11) as f64 / (1u64 << 53) as f64
    }

    #[test]
    fn auroc_equals_the_pairwise_definition_with_ties() {
        let mut st = 7u64;
        let s: Vec<f64> = (0..300).map(|_| (lcg(&mut st) * 20.0).floor()).collect();
        let y: Vec<bool> = s.iter().map(|&v| lcg(&mut st) < v / 25.0).collect();
        let got = auroc(&s, &y).unwrap();
        assert!((got - auroc_pairs(&s, &y)).abs() < 1e-12, "{got}");
        assert_eq!(auroc(&[0.5, 0.5], &[true, false]), Some(0.5));
        assert_eq!(auroc(&[0.2, 0.1], &[true, false]), Some(1.0));
    }

    fn trace(conf: &[f64], proposed: &[u32], accepted: usize, next: Option<u32>) -> RoundTrace {
        RoundTrace {
            proposed: proposed.to_vec(),
            block_confidence: Some(conf.to_vec()),
            accepted,
            next,
            ..RoundTrace::default()
        }
    }

    #[test]
    fn trace_rounds_recover_logits_and_judged_positions() {
        let temps = [2.0, 0.5, 1.0];
        let logits = [1.5f64, -0.75, 3.0];
        let conf: Vec<f64> = logits
            .iter()
            .zip(temps)
            .map(|(l, t)| 1.0 / (1.0 + (-l / t).exp()))
            .collect();
        let rounds = rounds_from_trace(
            &[
                // Rejected at position 1: all three proposed positions were judged.
                trace(&conf, &[5, 6, 7], 1, Some(9)),
                // The executor cut the proposal to 2 tokens (end of the budget).
                trace(&conf, &[5, 6], 2, Some(8)),
                // Stopped on an accepted token: position 1 was never judged.
                trace(&conf, &[5, 6, 7], 1, None),
                // Stopped on the draft itself (greedy break before counting it).
                trace(&conf, &[5, 6, 7], 0, Some(5)),
                // A plain decode step and a drafter without confidences: skipped.
                trace(&conf, &[], 0, Some(4)),
                RoundTrace {
                    proposed: vec![1],
                    accepted: 1,
                    next: Some(2),
                    ..RoundTrace::default()
                },
            ],
            &temps,
        );
        let shape: Vec<(usize, usize)> = rounds
            .iter()
            .map(|r| (r.logits.len(), r.accepted))
            .collect();
        assert_eq!(shape, [(3, 1), (2, 2), (1, 1), (1, 1)]);
        for (got, want) in rounds[0].logits.iter().zip(logits) {
            assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        }
        // Saturated confidences stay finite.
        let r = rounds_from_trace(&[trace(&[1.0, 0.0], &[1, 2], 0, Some(3))], &[]);
        assert!(r[0].logits.iter().all(|l| l.is_finite()));
        assert!(r[0].logits[0] > 30.0 && r[0].logits[1] < -600.0);
    }

    #[test]
    fn traced_rounds_recover_known_temperature_and_threshold() {
        // Position 0 always accepted; position 1 accepted exactly when its true logit is
        // at least 1.0. The drafter ran with temperature 2 at position 1, so the traced
        // confidences are sigmoid(l / 2): the fit must undo that, and at a 0.999 target
        // rate the threshold is the smallest accepted sample, just above logit 1.0 whatever
        // temperature STS chose.
        let mut st = 11u64;
        let trace: Vec<RoundTrace> = (0..3000)
            .map(|_| {
                let l = lcg(&mut st) * 8.0 - 4.0;
                let accepted = if l >= 1.0 { 2 } else { 1 };
                let c = [0.999, 1.0 / (1.0 + (-l / 2.0).exp())];
                trace(&c, &[1, 2], accepted, Some(3))
            })
            .collect();
        let rounds = rounds_from_trace(&trace, &[1.0, 2.0]);
        let temps = fit_temperatures(&rounds, 2);
        let th = fit_thresholds(&rounds, &temps, 2, 0.999, 20);
        assert_eq!(th[0], 0.0);
        let raw = logit_of(th[1], temps[1]);
        assert!(
            (1.0..1.02).contains(&raw),
            "threshold at logit {raw} ({th:?}, {temps:?})"
        );
        let stats = position_stats(&rounds, &[], &temps, 2);
        assert_eq!((stats[1].proposed, stats[1].reached), (3000, 3000));
        assert!(stats[1].ece_after < stats[1].ece_before);
        assert_eq!(stats[1].auroc_after, Some(1.0));
        assert_eq!(stats[0].accept_rate, Some(1.0));
        assert_eq!(stats[0].auroc_before, None);
    }

    #[test]
    fn position_stats_by_hand() {
        let r = |logits: &[f64], accepted| Round {
            logits: logits.to_vec(),
            accepted,
        };
        // sigmoid(0) = 0.5 everywhere: survival 0.5 at position 0, 0.25 at position 1.
        let rounds = [r(&[0.0, 0.0], 2), r(&[0.0, 0.0], 0), r(&[0.0], 1)];
        let s = position_stats(&rounds, &[], &[], 3);
        assert_eq!((s[0].proposed, s[0].reached), (3, 3));
        assert_eq!(s[0].accept_rate, Some(2.0 / 3.0));
        // One bin: |0.5 - 2/3|.
        assert!((s[0].ece_before - (2.0f64 / 3.0 - 0.5)).abs() < 1e-12);
        // Position 1: rounds 0 and 1 proposed it, only round 0 reached it (and accepted).
        assert_eq!(
            (s[1].proposed, s[1].reached, s[1].accept_rate),
            (2, 1, Some(1.0))
        );
        assert!((s[1].ece_before - 0.25).abs() < 1e-12);
        assert_eq!(
            (s[2].proposed, s[2].reached, s[2].accept_rate),
            (0, 0, None)
        );
    }
}
