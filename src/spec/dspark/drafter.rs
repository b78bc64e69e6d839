//! The `dspark` drafter behind the speculative seam. Each round:
//!
//! 1. the target's tapped layer outputs for rows it has committed since the last round (the
//!    seam hands over every forward's rows, rejected verify rows included; only rows below the
//!    committed length are kept) become context features and are appended to the drafter's
//!    KV caches;
//! 2. one backbone pass over `[anchor, MASK x (γ-1)]`, base logits in one LM-head call;
//! 3. sequential sampling of the γ tokens and their confidences.
//!
//!    Greedy rounds of a drafter with a host form run steps 1-3 on the host kernels
//!    ([`super::host_block`]); other rounds build steps 1-2 as MLX graphs and sample on the
//!    host after one read (greedy) or on the device (sampled);
//! 4. draft-length pruning by [`PruneMode`] against the thresholds (calibrated per-position
//!    table, or one global `--dspark-min-conf` / `MLXB_DSPARK_MINCONF`): `keep-first` (the
//!    default) cuts at the first position k >= 1 whose confidence is below its threshold, so
//!    position 0 always survives; `deepspec` applies the same rule from position 0 (a
//!    zero-length proposal is a plain decode step); `survival` cuts where the cumulative
//!    product of confidences falls below the threshold. No thresholds = fixed γ. Pruning only
//!    shortens the proposal (a prefix of the unpruned block, never a second pass), so it
//!    changes how many tokens are verified, never what is emitted.

use super::checkpoint::{self, DsparkConfig, TargetFacts};
use super::host_block::HostBlock;
use super::host_sampler::host_f32;
use super::module::DsparkModule;
use crate::engine::error::{EngineError, Result};
use crate::engine::forks::Forks;
use crate::engine::models::{Caches, LanguageModel};
use crate::engine::weights::WeightStore;
use crate::spec::source::{Draft, DraftSource, TargetView, VerifyMode};
use crate::spec::trace::RoundNote;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array, Dtype};
use std::path::{Path, PathBuf};

/// The environment variable giving a global confidence threshold.
pub const MIN_CONF_ENV: &str = "MLXB_DSPARK_MINCONF";

/// `MLXB_DSPARK_MINCONF` as a threshold, if set.
pub fn min_conf_from_env() -> Result<Option<f64>> {
    let Ok(raw) = std::env::var(MIN_CONF_ENV) else {
        return Ok(None);
    };
    match raw.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(Some(v)),
        _ => Err(EngineError::Input(format!(
            "{MIN_CONF_ENV}={raw:?} is not a confidence between 0 and 1; fix or unset it"
        ))),
    }
}

/// How a block's draft length is pruned by its confidences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PruneMode {
    /// Cut at the first position k >= 1 whose own confidence is below the threshold; position
    /// 0 always survives (mlxb's design).
    #[default]
    KeepFirst,
    /// DeepSpec's released rule: cut at the first position k >= 0 whose own confidence is below
    /// the threshold; a zero-length proposal is a plain decode step.
    #[serde(rename = "deepspec")]
    DeepSpec,
    /// The paper's survival rule: keep position k while `c_0 * ... * c_k` is at least the
    /// threshold (a zero-length proposal is possible).
    Survival,
}

impl PruneMode {
    /// The flag spelling (`keep-first`, `deepspec`, `survival`).
    pub fn as_str(self) -> &'static str {
        match self {
            PruneMode::KeepFirst => "keep-first",
            PruneMode::DeepSpec => "deepspec",
            PruneMode::Survival => "survival",
        }
    }
}

/// What the drafter proposed in its latest round, before and after pruning (for tests,
/// calibration and metrics).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRecord {
    /// Absolute position of the anchor.
    pub anchor_position: usize,
    /// All γ sampled tokens (the unpruned block).
    pub tokens: Vec<u32>,
    /// Per-position confidence `c_k` in (0, 1) after calibration (empty without a head).
    pub confidence: Vec<f64>,
    /// How many tokens survived pruning (0..=γ; at least 1 under [`PruneMode::KeepFirst`]).
    pub kept: usize,
}

/// A block's drafted tokens, their calibrated confidences and, when sampling, the proposal
/// distributions.
type Drafted = (Vec<u32>, Vec<f64>, Option<Array>);

/// The `dspark` drafter.
pub struct DsparkSource {
    module: DsparkModule,
    caches: Caches,
    /// Context rows whose keys/values are in `caches` (positions `0..context`).
    context: usize,
    /// Tapped rows not yet consumed: (first position, `[1, L, m*d]`).
    pending: Vec<(usize, Array)>,
    /// Threshold per draft position (empty = never prune).
    thresholds: Vec<f64>,
    /// STS temperatures per position (empty = none).
    temperatures: Vec<f64>,
    temp: f64,
    prune: PruneMode,
    last: Option<BlockRecord>,
    passes: usize,
    /// Where it was loaded from, so a batch's slots can load drafters of their own.
    origin: Option<Origin>,
    /// The drafter on the host kernels for greedy rounds: `None` until a greedy sequence first
    /// asks, `Some(None)` where the drafter has no host form.
    host: Option<Option<HostBlock>>,
    /// Whether greedy rounds may take the host form.
    host_allowed: bool,
    /// Whether this sequence's context lives in `host` (else in `caches`).
    on_host: bool,
}

/// What [`DsparkSource::open`] loaded a drafter with.
#[derive(Debug, Clone)]
struct Origin {
    path: PathBuf,
    min_conf: Option<f64>,
    forks: Forks,
    /// The target's dtype, which the drafter computes in.
    dtype: Dtype,
}

impl DsparkSource {
    /// Loads the checkpoint at `path`, checks it against `target` and builds the drafter.
    /// `min_conf` (the global threshold) overrides the checkpoint's calibrated table.
    pub fn open(
        path: &Path,
        target: &dyn LanguageModel,
        min_conf: Option<f64>,
        forks: Forks,
    ) -> Result<Self> {
        let origin = Origin {
            path: path.to_owned(),
            min_conf,
            forks,
            dtype: target.embed(&Array::from_slice(&[0i32], &[1, 1]))?.dtype(),
        };
        Self::load(origin, Some(&TargetFacts::of(target)?))
    }

    /// Loads the checkpoint `origin` names, checked against `facts` when given.
    fn load(origin: Origin, facts: Option<&TargetFacts>) -> Result<Self> {
        let mut ckpt = checkpoint::load(&origin.path)?;
        if let Some(facts) = facts {
            ckpt.config.check_target(facts, &ckpt.dir)?;
        }
        let forks = origin.forks;
        cast_floats(&mut ckpt.weights, origin.dtype)?;
        // The drafter's products take the host kernels on the same terms as the target's.
        ckpt.weights.set_host_kernel(forks.host_q4());
        ckpt.weights.set_host_matvec(forks.host_dense());
        let module =
            DsparkModule::build(&ckpt.config, &mut ckpt.weights, forks.compiled_activations)?;
        ckpt.weights.finish()?;
        let mut source = Self::new(module, origin.min_conf);
        source.origin = Some(origin);
        Ok(source)
    }

    /// Wraps a built module (thresholds from `min_conf`, else from its config).
    pub fn new(module: DsparkModule, min_conf: Option<f64>) -> Self {
        let c = module.config();
        let thresholds = thresholds(c, min_conf);
        let temperatures = c.sts_temperatures.clone().unwrap_or_default();
        let caches = module.new_caches();
        Self {
            module,
            caches,
            context: 0,
            pending: Vec::new(),
            thresholds,
            temperatures,
            temp: 0.0,
            prune: PruneMode::default(),
            last: None,
            passes: 0,
            origin: None,
            host: None,
            host_allowed: true,
            on_host: false,
        }
    }

    /// Keeps greedy rounds on MLX (`false`), or lets them take the host kernels where the
    /// drafter has a host form (`true`, the default).
    pub fn with_host_block(mut self, allowed: bool) -> Self {
        self.host_allowed = allowed;
        self
    }

    /// Whether the current sequence drafts on the host kernels.
    pub fn drafts_on_host(&self) -> bool {
        self.on_host
    }

    /// The host form for greedy rounds, made at the first call; `None` where there is none
    /// (neither its block nor its heads on the host).
    fn host_block(&mut self, target: &dyn LanguageModel) -> Result<Option<&mut HostBlock>> {
        if self.host.is_none() {
            let block = match self.module.host_sampler()? {
                Some(_) => self.module.host_block(target)?,
                None => None,
            };
            self.host = Some(block);
        }
        Ok(self.host.as_mut().and_then(Option::as_mut))
    }

    /// Sets the pruning rule (default [`PruneMode::KeepFirst`]).
    pub fn with_prune(mut self, prune: PruneMode) -> Self {
        self.prune = prune;
        self
    }

    /// The pruning rule in force.
    pub fn prune(&self) -> PruneMode {
        self.prune
    }

    /// The drafter's config.
    pub fn config(&self) -> &DsparkConfig {
        self.module.config()
    }

    /// The latest round's block (unpruned tokens, confidences, surviving length).
    pub fn last_block(&self) -> Option<&BlockRecord> {
        self.last.as_ref()
    }

    /// Backbone passes run so far (exactly one per `draft` call that proposed tokens).
    pub fn passes(&self) -> usize {
        self.passes
    }

    /// Drops every context row at or beyond `keep`.
    fn truncate_context(&mut self, keep: usize) {
        if keep < self.context {
            match &mut self.host {
                Some(Some(host)) if self.on_host => host.truncate(keep),
                _ => {
                    for c in self.caches.iter_mut() {
                        c.trim((self.context - keep) as i32);
                    }
                }
            }
            self.context = keep;
        }
    }

    /// The tapped rows `context..end` from `pending`, in order, as `[1, L, m*d]`; rows at or
    /// past `end` stay pending (a batch may have run the anchor already: the next round reads
    /// its row).
    fn take_rows(&mut self, end: usize) -> Result<Option<Array>> {
        let mut parts = Vec::new();
        let mut next = self.context;
        let mut chunks = std::mem::take(&mut self.pending);
        chunks.sort_by_key(|(p, _)| *p);
        for (first, rows) in chunks {
            let len = rows.shape()[1] as usize;
            if first + len > end {
                let from = first.max(end);
                let tail = rows.index((.., (from - first) as i32.., ..));
                self.pending.push((from, tail));
            }
            if first + len <= next || first >= end {
                continue;
            }
            if first > next {
                break;
            }
            let to = (first + len).min(end);
            parts.push(rows.index((.., (next - first) as i32..(to - first) as i32, ..)));
            next = to;
        }
        if next < end {
            return Err(EngineError::Runtime(format!(
                "the DSpark drafter has no tapped target rows for positions {next}..{end}; the target must be run with the drafter's tap layers"
            )));
        }
        if parts.is_empty() {
            return Ok(None);
        }
        Ok(Some(ops::concatenate(&parts, 1)?))
    }

    /// A greedy block on the host form: `rows` (the tapped rows since the last round) join the
    /// context, then the block runs and its heads sample. Returns the drafted tokens and
    /// calibrated confidences (as [`Self::draft_on_mlx`]).
    fn draft_on_host(
        &mut self,
        target: &dyn LanguageModel,
        rows: Option<Array>,
        anchor: u32,
    ) -> Result<Drafted> {
        let gamma = self.config().block_size;
        let anchor_row = self.module.embedded_rows(target, &[anchor])?;
        let lost = || EngineError::Runtime("the DSpark drafter lost its host form".into());
        let host = self
            .host
            .as_mut()
            .and_then(Option::as_mut)
            .ok_or_else(lost)?;
        if let Some(rows) = rows {
            let count = rows.shape()[1] as usize;
            let taps = host_f32(&rows)?.ok_or_else(|| {
                EngineError::Runtime("the target's tapped rows are not f32".into())
            })?;
            host.extend(&taps, count)?;
        }
        let anchor_row = anchor_row
            .ok_or_else(|| EngineError::Runtime("the anchor's embedding is not f32".into()))?;
        let out = host.block(&anchor_row, gamma)?;
        let sampler = self.module.host_sampler()?.ok_or_else(lost)?;
        let d = anchor_row.len();
        let shape = (gamma, d, out.logits.len() / gamma);
        let drafted = sampler.sample_rows(&out.hidden, &out.logits, shape, anchor)?;
        Ok((drafted.tokens, self.calibrate(&drafted.confidence), None))
    }

    /// A block on MLX: `rows` (as for [`Self::draft_on_host`]) join the caches, then greedy
    /// blocks are sampled on the host after one read of the block; sampled ones (and heads
    /// that are not dense f32) on MLX, whose random draws the rejection rule reads. Returns the
    /// drafted tokens, calibrated confidences and, when sampling, the proposal distributions.
    fn draft_on_mlx(
        &mut self,
        target: &dyn LanguageModel,
        rows: Option<Array>,
        anchor: u32,
    ) -> Result<Drafted> {
        if let Some(rows) = rows {
            let features = self.module.context_features(&rows)?;
            self.module.extend_context(&features, &mut self.caches)?;
        }
        let out = self.module.block(target, anchor, &mut self.caches)?;
        if self.temp == 0.0 {
            eval([&out.hidden, &out.base_logits])?;
            if let Some(d) = self.module.sample_greedy_on_host(&out, anchor)? {
                return Ok((d.tokens, self.calibrate(&d.confidence), None));
            }
        }
        let sampled = self.module.sample(&out, anchor, self.temp)?;
        let conf = match &sampled.confidence {
            Some(c) => Some(c.as_dtype(Dtype::Float32)?),
            None => None,
        };
        let mut outputs = vec![&sampled.tokens];
        outputs.extend(conf.as_ref());
        eval(outputs)?;
        let tokens: Vec<u32> = sampled.tokens.as_slice::<u32>().to_vec();
        let confidence = match &conf {
            Some(c) => self.calibrate(c.as_slice::<f32>()),
            None => Vec::new(),
        };
        Ok((tokens, confidence, sampled.probs))
    }

    /// Calibrated confidence `sigmoid(logit / T_k)` of each position.
    fn calibrate(&self, logits: &[f32]) -> Vec<f64> {
        logits
            .iter()
            .enumerate()
            .map(|(k, &l)| {
                let t = self.temperatures.get(k).copied().unwrap_or(1.0);
                1.0 / (1.0 + (-(l as f64) / t).exp())
            })
            .collect()
    }
}

/// Casts every floating tensor to `dtype`: the drafter computes in the target's dtype, so a
/// bf16 checkpoint drafting for a float32 target runs in float32 (as DeepSpec loads it).
fn cast_floats(w: &mut WeightStore, dtype: Dtype) -> Result<()> {
    for name in w.names() {
        let a = w.take_any(&name)?;
        let floating = matches!(a.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16);
        let a = if floating && a.dtype() != dtype {
            a.as_dtype(dtype)?
        } else {
            a
        };
        w.insert(&name, a);
    }
    Ok(())
}

/// Per-position thresholds: the global one at every position, else the checkpoint's table.
fn thresholds(c: &DsparkConfig, min_conf: Option<f64>) -> Vec<f64> {
    if c.confidence_head {
        if let Some(m) = min_conf {
            return vec![m; c.block_size];
        }
        if let Some(t) = &c.thresholds {
            return t.clone();
        }
    }
    Vec::new()
}

/// How many of `block` tokens survive `mode` (no thresholds or no confidences: all of them).
pub fn surviving_length(
    confidence: &[f64],
    thresholds: &[f64],
    block: usize,
    mode: PruneMode,
) -> usize {
    let first = match mode {
        PruneMode::KeepFirst => 1,
        PruneMode::DeepSpec | PruneMode::Survival => 0,
    };
    let mut survival = 1.0;
    (0..block)
        .find(|&k| match (confidence.get(k), thresholds.get(k)) {
            (Some(c), Some(t)) => {
                survival *= c;
                let score = if mode == PruneMode::Survival {
                    survival
                } else {
                    *c
                };
                k >= first && score < *t
            }
            _ => false,
        })
        .unwrap_or(block)
}

impl DraftSource for DsparkSource {
    fn name(&self) -> &'static str {
        "dspark"
    }

    fn tap_layers(&self) -> Vec<usize> {
        self.config()
            .target_layer_ids
            .iter()
            .map(|&t| t as usize)
            .collect()
    }

    fn observe_taps(&mut self, first_position: usize, taps: Vec<Array>) -> Result<()> {
        if first_position == 0 {
            // A new sequence (a fresh prompt): forget the previous one.
            self.truncate_context(0);
            self.pending.clear();
        }
        let rows = ops::concatenate(&taps, -1)?;
        self.pending.push((first_position, rows));
        Ok(())
    }

    fn begin(&mut self, target: TargetView<'_>, prompt: &[u32]) -> Result<()> {
        // This prompt's tapped rows arrived with the prefill, before `begin`; anything else
        // (context or rows of an earlier generation) is stale.
        self.truncate_context(0);
        self.pending.retain(|(first, _)| *first < prompt.len());
        self.last = None;
        // A sequence's context lives in one place: the host form's buffers for greedy rounds
        // where it has one, MLX's caches otherwise.
        self.on_host =
            self.temp == 0.0 && self.host_allowed && self.host_block(&*target.model)?.is_some();
        Ok(())
    }

    fn block_size(&self) -> Option<usize> {
        Some(self.config().block_size)
    }

    fn fork(&self) -> Result<Option<Box<dyn DraftSource>>> {
        // A drafter built from a module in memory has no checkpoint to load again.
        let Some(origin) = &self.origin else {
            return Ok(None);
        };
        let source = Self::load(origin.clone(), None)?
            .with_prune(self.prune)
            .with_host_block(self.host_allowed);
        Ok(Some(Box::new(source)))
    }

    fn configure_sampling(&mut self, temp: f64, verify: VerifyMode) {
        // Proposals are drawn at the target's temperature only where the rejection rule can use
        // their distribution; token matching wants the drafter's most likely token.
        self.temp = if verify == VerifyMode::Reject && temp >= 1e-5 {
            temp
        } else {
            0.0
        };
    }

    fn draft(&mut self, target: TargetView<'_>, sequence: &[u32], n: usize) -> Result<Draft> {
        let Some((&anchor, _)) = sequence.split_last() else {
            return Ok(Draft::default());
        };
        if n == 0 {
            return Ok(Draft::default());
        }
        let start = sequence.len() - 1;
        self.truncate_context(start);
        let rows = self.take_rows(start)?;
        let (tokens, confidence, probs) = if self.on_host {
            self.draft_on_host(&*target.model, rows, anchor)?
        } else {
            self.draft_on_mlx(&*target.model, rows, anchor)?
        };
        self.context = start;
        self.passes += 1;
        let kept = surviving_length(&confidence, &self.thresholds, tokens.len(), self.prune);
        let len = kept.min(n);
        let draft = Draft {
            tokens: tokens[..len].to_vec(),
            probs: probs.as_ref().map(|p| p.index(..len as i32)),
        };
        self.last = Some(BlockRecord {
            anchor_position: start,
            tokens,
            confidence,
            kept,
        });
        Ok(draft)
    }

    fn round_note(&self) -> Option<RoundNote> {
        let last = self.last.as_ref()?;
        if last.confidence.is_empty() {
            return None;
        }
        let len = last.kept.min(last.tokens.len());
        let uniform = self.thresholds.windows(2).all(|w| w[0] == w[1]);
        Some(RoundNote {
            confidence: last.confidence[..len.min(last.confidence.len())].to_vec(),
            block_confidence: last.confidence.clone(),
            threshold: match self.thresholds.first() {
                None => Some(0.0),
                Some(&t) if uniform => Some(t),
                Some(_) => None,
            },
            thresholds: (!uniform).then(|| self.thresholds.clone()),
            prune: Some(self.prune.as_str().to_owned()),
        })
    }

    fn commit(&mut self, _target: TargetView<'_>, committed: usize) -> Result<()> {
        self.truncate_context(committed);
        // Rows at or beyond the committed length came from rejected verify positions.
        self.pending.retain(|(first, _)| *first < committed);
        for (first, rows) in self.pending.iter_mut() {
            let len = rows.shape()[1] as usize;
            if *first + len > committed {
                *rows = rows.index((.., ..(committed - *first) as i32, ..));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{surviving_length, PruneMode};

    #[test]
    fn pruning_cuts_at_the_first_low_confidence_after_position_zero() {
        let keep = |c: &[f64], t: &[f64]| surviving_length(c, t, 4, PruneMode::KeepFirst);
        let thr = [0.9, 0.5, 0.5, 0.5];
        assert_eq!(keep(&[0.1, 0.6, 0.4, 0.9], &thr), 2);
        assert_eq!(keep(&[0.1, 0.2, 0.9, 0.9], &thr), 1);
        assert_eq!(keep(&[0.6, 0.6, 0.6, 0.6], &thr), 4);
        // No thresholds or no confidences: the whole block.
        assert_eq!(keep(&[0.1; 4], &[]), 4);
        assert_eq!(keep(&[], &thr), 4);
    }

    #[test]
    fn deepspec_prunes_position_zero_and_survival_multiplies() {
        let thr = [0.5; 4];
        let ds = |c: &[f64]| surviving_length(c, &thr, 4, PruneMode::DeepSpec);
        let sv = |c: &[f64]| surviving_length(c, &thr, 4, PruneMode::Survival);
        assert_eq!(ds(&[0.4, 0.9, 0.9, 0.9]), 0, "zero-length proposal");
        assert_eq!(ds(&[0.6, 0.6, 0.4, 0.9]), 2);
        assert_eq!(ds(&[0.6, 0.6, 0.6, 0.6]), 4);
        // 0.9, 0.72, 0.504, 0.4536: the product crosses 0.5 at position 3.
        assert_eq!(sv(&[0.9, 0.8, 0.7, 0.9]), 3);
        assert_eq!(sv(&[0.6, 0.6, 0.9, 0.9]), 1);
        assert_eq!(sv(&[0.4, 1.0, 1.0, 1.0]), 0);
        // Threshold 0 never prunes in any mode.
        for mode in [
            PruneMode::KeepFirst,
            PruneMode::DeepSpec,
            PruneMode::Survival,
        ] {
            assert_eq!(surviving_length(&[1e-9; 4], &[0.0; 4], 4, mode), 4);
        }
    }
}
