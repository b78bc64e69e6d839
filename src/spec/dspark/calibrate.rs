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

use super::checkpoint::{self, DsparkConfig, Format};
use crate::engine::error::{EngineError, Result};
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

/// Area under the ROC curve (rank statistic, ties counted half); `None` with one class only.
pub fn auroc(scores: &[f64], labels: &[bool]) -> Option<f64> {
    let pos = labels.iter().filter(|&&y| y).count();
    let neg = labels.len() - pos;
    if pos == 0 || neg == 0 {
        return None;
    }
    let mut wins = 0.0;
    for (i, &s) in scores.iter().enumerate() {
        if !labels[i] {
            continue;
        }
        for (j, &t) in scores.iter().enumerate() {
            if labels[j] {
                continue;
            }
            wins += if s > t {
                1.0
            } else if s == t {
                0.5
            } else {
                0.0
            };
        }
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

/// Writes thresholds and temperatures into the checkpoint's `dspark.json` atomically (the
/// tensors are untouched). Only mlxb-format checkpoints can be patched.
pub fn patch_config(dir: &Path, thresholds: Vec<f64>, temps: Vec<f64>) -> Result<DsparkConfig> {
    let dir = checkpoint::checkpoint_dir(dir);
    let (mut config, format) = checkpoint::read_config(&dir)?;
    if format != Format::Mlxb {
        return Err(EngineError::file(
            &dir,
            "only mlxb-format drafters (dspark.json) can be patched with a calibration",
        ));
    }
    if !config.confidence_head {
        return Err(EngineError::file(
            &dir,
            "the drafter has no confidence head, so there is nothing to calibrate",
        ));
    }
    if thresholds.len() != config.block_size || temps.len() != config.block_size {
        return Err(EngineError::Input(format!(
            "the calibration has {} positions; the drafter's block has {}",
            thresholds.len(),
            config.block_size
        )));
    }
    config.thresholds = Some(thresholds);
    config.sts_temperatures = Some(temps);
    config.validate(&dir)?;
    checkpoint::write_config(&dir, &config)?;
    Ok(config)
}
