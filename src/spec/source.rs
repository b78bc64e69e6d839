//! The seam between drafters and the executor.

use crate::engine::error::{EngineError, Result};
use crate::engine::models::{Caches, LanguageModel};
use crate::spec::dspark::drafter::PruneMode;
use mlx_rs::Array;
use std::path::PathBuf;

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
    fn round_note(&self) -> Option<super::trace::RoundNote> {
        None
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
    fn round_note(&self) -> Option<super::trace::RoundNote> {
        (**self).round_note()
    }
}

/// Which drafter to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftKind {
    /// A separate, smaller model sharing the target's tokenizer.
    Model,
    /// Prompt lookup: continue the latest earlier occurrence of the current n-gram.
    Ngram,
    /// Early exit: the target's own first K layers plus its final norm and LM head.
    #[value(name = "self")]
    SelfLayers,
    /// A DSpark (or DFlash) block drafter conditioned on the target's hidden states.
    Dspark,
    /// Gemma 4's KV-borrowing MTP assistant (`gemma4_assistant`) for a gemma4_text target.
    Assistant,
}

/// How drafted tokens are verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum VerifyMode {
    /// Accept while the target's sampled token equals the draft (exact greedy at T=0;
    /// distribution-exact at any temperature).
    #[default]
    Match,
    /// Standard rejection sampling with the draft's probabilities and residual resampling.
    Reject,
}

/// Everything needed to open a drafter.
#[derive(Debug, Clone)]
pub struct SpecOptions {
    /// The drafter kind.
    pub kind: DraftKind,
    /// Draft model directory (for `model`), or DSpark checkpoint directory (for `dspark`).
    pub draft_model: Option<PathBuf>,
    /// Tokens drafted per round.
    pub num_draft_tokens: usize,
    /// Layers the `self` drafter runs.
    pub draft_layers: Option<usize>,
    /// Longest n-gram the `ngram` drafter matches.
    pub ngram_max: usize,
    /// Shortest n-gram the `ngram` drafter matches.
    pub ngram_min: usize,
    /// Verification rule.
    pub verify: VerifyMode,
    /// DSpark: one confidence threshold for every draft position past the first (overrides
    /// the checkpoint's calibrated table and `MLXB_DSPARK_MINCONF`).
    pub dspark_min_conf: Option<f64>,
}

impl SpecOptions {
    /// Checks option combinations before anything is loaded.
    pub fn validate(&self) -> Result<()> {
        if self.num_draft_tokens == 0 {
            return Err(EngineError::Input(
                "--num-draft-tokens must be at least 1".into(),
            ));
        }
        match self.kind {
            DraftKind::Model if self.draft_model.is_none() => Err(EngineError::Input(
                "--draft-kind model needs --draft-model DIR".into(),
            )),
            DraftKind::Dspark if self.draft_model.is_none() => Err(EngineError::Input(
                "--draft-kind dspark needs --drafter DIR (a DSpark checkpoint)".into(),
            )),
            DraftKind::Assistant if self.draft_model.is_none() => Err(EngineError::Input(
                "--draft-kind assistant needs --draft-model DIR (a gemma4_assistant checkpoint)"
                    .into(),
            )),
            _ if self
                .dspark_min_conf
                .is_some_and(|c| !(0.0..=1.0).contains(&c)) =>
            {
                Err(EngineError::Input(format!(
                    "--dspark-min-conf {:?} is out of range; give a confidence between 0 and 1",
                    self.dspark_min_conf.unwrap_or_default()
                )))
            }
            DraftKind::SelfLayers if self.draft_layers.is_none() => Err(EngineError::Input(
                "--draft-kind self needs --draft-layers K (layers of the target to run)".into(),
            )),
            DraftKind::Ngram if self.ngram_min == 0 || self.ngram_min > self.ngram_max => {
                Err(EngineError::Input(format!(
                    "--ngram-min {} / --ngram-max {}: need 1 <= min <= max",
                    self.ngram_min, self.ngram_max
                )))
            }
            _ => Ok(()),
        }
    }
}

/// Opens the drafter `opts` describes for a target opened as `session`.
pub fn open_source(
    opts: &SpecOptions,
    session: &crate::engine::session::Session,
    forks: crate::engine::flags::Forks,
    prefill_step: usize,
) -> Result<Box<dyn DraftSource>> {
    open_source_pruned(opts, PruneMode::default(), session, forks, prefill_step)
}

/// [`open_source`] with a DSpark pruning rule (`--dspark-prune`; other drafters ignore it).
pub fn open_source_pruned(
    opts: &SpecOptions,
    prune: PruneMode,
    session: &crate::engine::session::Session,
    forks: crate::engine::flags::Forks,
    prefill_step: usize,
) -> Result<Box<dyn DraftSource>> {
    opts.validate()?;
    Ok(match opts.kind {
        DraftKind::Ngram => Box::new(super::ngram::NgramSource::new(
            opts.ngram_min,
            opts.ngram_max,
        )),
        DraftKind::SelfLayers => Box::new(super::early_exit::EarlyExitSource::new(
            opts.draft_layers.unwrap_or(0),
        )),
        DraftKind::Dspark => open_dspark(opts, prune, session, forks)?,
        DraftKind::Assistant => open_assistant(opts, session, forks)?,
        DraftKind::Model
            if opts
                .draft_model
                .as_deref()
                .is_some_and(super::assistant::config::is_artifact) =>
        {
            open_assistant(opts, session, forks)?
        }
        DraftKind::Model
            if opts
                .draft_model
                .as_deref()
                .is_some_and(super::dspark::checkpoint::is_artifact) =>
        {
            open_dspark(opts, prune, session, forks)?
        }
        DraftKind::Model => {
            let dir = opts.draft_model.as_deref().ok_or_else(|| {
                EngineError::Input("--draft-kind model needs --draft-model DIR".into())
            })?;
            Box::new(super::two_model::TwoModelSource::open(
                dir,
                &session.tokenizer,
                session.model.model.vocab_size(),
                forks,
                prefill_step,
            )?)
        }
    })
}

/// Opens the DSpark drafter at `opts.draft_model` for the session's target.
fn open_dspark(
    opts: &SpecOptions,
    prune: PruneMode,
    session: &crate::engine::session::Session,
    forks: crate::engine::flags::Forks,
) -> Result<Box<dyn DraftSource>> {
    let dir = opts.draft_model.as_deref().ok_or_else(|| {
        EngineError::Input("--draft-kind dspark needs --drafter DIR (a DSpark checkpoint)".into())
    })?;
    let min_conf = match opts.dspark_min_conf {
        Some(c) => Some(c),
        None => super::dspark::drafter::min_conf_from_env()?,
    };
    Ok(Box::new(
        super::dspark::drafter::DsparkSource::open(
            dir,
            session.model.model.as_ref(),
            min_conf,
            forks,
        )?
        .with_prune(prune),
    ))
}

/// Opens the Gemma 4 assistant at `opts.draft_model` for the session's (gemma4_text) target.
fn open_assistant(
    opts: &SpecOptions,
    session: &crate::engine::session::Session,
    forks: crate::engine::flags::Forks,
) -> Result<Box<dyn DraftSource>> {
    let dir = opts.draft_model.as_deref().ok_or_else(|| {
        EngineError::Input(
            "--draft-kind assistant needs --draft-model DIR (a gemma4_assistant checkpoint)".into(),
        )
    })?;
    Ok(Box::new(super::assistant::drafter::AssistantSource::open(
        dir,
        &session.dir,
        forks,
    )?))
}
