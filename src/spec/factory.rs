//! Opening drafters: the one place that turns drafter options into a [`DraftSource`], choosing
//! the drafter by the kind of artifact it is given when the kind is `auto` (a DSpark checkpoint
//! drafts as DSpark, a Gemma 4 assistant as the assistant, any other model as a two-model
//! drafter).

use super::dspark::drafter::{DsparkSource, PruneMode};
use super::lookup_first::LookupFirst;
use super::lookup_table::LookupTable;
use super::source::{DraftSource, VerifyMode};
use crate::engine::error::{EngineError, Result};
use crate::engine::forks::Forks;
use crate::engine::models::LanguageModel;
use crate::engine::session::Session;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The file a DSpark drafter's directory may hold its target's lookup table in
/// ([`LookupTable`]); its lookup (`lookup_first`) then consults it.
pub const LOOKUP_TABLE_FILE: &str = "lookup.safetensors";

/// Which lookup table the n-gram lookups consult.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TableChoice {
    /// The drafter's own: [`LOOKUP_TABLE_FILE`] in a DSpark drafter's directory, where its
    /// lookup has one; none otherwise.
    #[default]
    Own,
    /// This file.
    File(PathBuf),
    /// None.
    Off,
}

/// Which drafter to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftKind {
    /// Chosen from what is given: a drafter directory by its artifact kind (see
    /// [`concrete_kind`]), else `--draft-layers` means `self`.
    #[default]
    Auto,
    /// A separate, smaller model sharing the target's tokenizer (a DSpark checkpoint or a Gemma 4
    /// assistant given here drafts as what it is).
    Model,
    /// Prompt lookup: continue the latest earlier occurrence of the current n-gram.
    Ngram,
    /// Early exit: the target's own first K layers plus its final norm and LM head.
    SelfLayers,
    /// A DSpark (or DFlash) block drafter conditioned on the target's hidden states.
    Dspark,
    /// Gemma 4's KV-borrowing MTP assistant (`gemma4_assistant`) for a gemma4_text target.
    Assistant,
}

impl DraftKind {
    /// The flag spelling (`--draft-kind NAME`).
    pub fn name(self) -> &'static str {
        match self {
            DraftKind::Auto => "auto",
            DraftKind::Model => "model",
            DraftKind::Ngram => "ngram",
            DraftKind::SelfLayers => "self",
            DraftKind::Dspark => "dspark",
            DraftKind::Assistant => "assistant",
        }
    }
}

/// Everything needed to open a drafter, per-kind options included.
#[derive(Debug, Clone)]
pub struct SpecOptions {
    /// The drafter kind.
    pub kind: DraftKind,
    /// Draft model directory (for `model`), DSpark checkpoint directory (for `dspark`) or
    /// assistant checkpoint (for `assistant`).
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
    /// DSpark: how each block's draft length is pruned by its confidences.
    pub dspark_prune: PruneMode,
    /// Shortest n-gram a model drafter's rounds are first looked up with ([`LookupFirst`]);
    /// 0 = the model drafter drafts every round; `None` = the drafter's own choice (a DSpark
    /// checkpoint's `lookup_first`), else none.
    pub lookup_first: Option<usize>,
    /// The most tokens a model drafter's lookup proposes; `None` = the drafter's own choice (a
    /// DSpark checkpoint's `lookup_tokens`), else the round's draft length.
    pub lookup_tokens: Option<usize>,
    /// The lookup table the `ngram` drafter and a model drafter's lookup consult.
    pub lookup_table: TableChoice,
}

/// What a drafter directory holds: a Gemma 4 assistant, a DSpark checkpoint, or (anything else)
/// a model for the two-model drafter.
fn kind_of_dir(dir: &Path) -> DraftKind {
    if super::assistant::config::is_artifact(dir) {
        DraftKind::Assistant
    } else if super::dspark::checkpoint::is_artifact(dir) {
        DraftKind::Dspark
    } else {
        DraftKind::Model
    }
}

/// The drafter `opts` opens: `auto` and `model` resolved by what their directory holds.
pub fn concrete_kind(opts: &SpecOptions) -> Result<DraftKind> {
    Ok(match (opts.kind, opts.draft_model.as_deref()) {
        (DraftKind::Auto | DraftKind::Model, Some(dir)) => kind_of_dir(dir),
        (DraftKind::Auto, None) if opts.draft_layers.is_some() => DraftKind::SelfLayers,
        (DraftKind::Auto, None) => {
            return Err(EngineError::Input(
                "--draft-kind auto needs a drafter: --drafter DIR, --draft-model DIR or \
                 --draft-layers K"
                    .into(),
            ))
        }
        (kind, _) => kind,
    })
}

/// Tokens per round when `--num-draft-tokens` is `given` (or not): a Gemma 4 assistant's own
/// `num_assistant_tokens` where it has one, else 3.
pub fn draft_tokens(kind: DraftKind, draft_model: Option<&Path>, given: Option<usize>) -> usize {
    match draft_model {
        Some(dir)
            if kind == DraftKind::Assistant
                || (matches!(kind, DraftKind::Auto | DraftKind::Model)
                    && kind_of_dir(dir) == DraftKind::Assistant) =>
        {
            super::assistant::config::draft_tokens(given, dir)
        }
        _ => given.unwrap_or(3),
    }
}

impl SpecOptions {
    /// Checks option combinations before anything is loaded.
    pub fn validate(&self) -> Result<()> {
        if self.num_draft_tokens == 0 {
            return Err(EngineError::Input(
                "--num-draft-tokens must be at least 1".into(),
            ));
        }
        if self.lookup_tokens == Some(0) {
            return Err(EngineError::Input(
                "--lookup-tokens must be at least 1 (--lookup-first 0 turns the lookup off)".into(),
            ));
        }
        if let Some(c) = self.dspark_min_conf.filter(|c| !(0.0..=1.0).contains(c)) {
            return Err(EngineError::Input(format!(
                "--dspark-min-conf {c:?} is out of range; give a confidence between 0 and 1"
            )));
        }
        match concrete_kind(self)? {
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
            DraftKind::SelfLayers if self.draft_layers.is_none() => Err(EngineError::Input(
                "--draft-kind self needs --draft-layers K (layers of the target to run)".into(),
            )),
            DraftKind::Ngram if self.ngram_min == 0 || self.ngram_min > self.ngram_max => {
                Err(EngineError::Input(format!(
                    "--ngram-min {} / --ngram-max {}: need 1 <= min <= max",
                    self.ngram_min, self.ngram_max
                )))
            }
            DraftKind::Ngram if self.lookup_first.is_some_and(|n| n > 0) => Err(EngineError::Input(
                "--lookup-first puts a lookup before a model drafter, and --draft-kind ngram is \
                 one already; drop --lookup-first or set --ngram-min"
                    .into(),
            )),
            _ => Ok(()),
        }
    }
}

/// Opens the drafter `opts` describes for a target opened as `session`.
pub fn open_source(
    opts: &SpecOptions,
    session: &Session,
    forks: Forks,
    prefill_step: usize,
) -> Result<Box<dyn DraftSource>> {
    let (source, own) = open_model_source(opts, session, forks, prefill_step)?;
    let vocab = session.model.model.vocab_size();
    let lookup = opts.lookup_first.or(own.first).unwrap_or(0);
    if lookup == 0
        && matches!(opts.lookup_table, TableChoice::File(_))
        && concrete_kind(opts)? != DraftKind::Ngram
    {
        return Err(EngineError::Input(format!(
            "--lookup-table is consulted by the ngram drafter and by a lookup in front of a model \
             drafter, and --draft-kind {} has neither; add --lookup-first N or drop --lookup-table",
            concrete_kind(opts)?.name()
        )));
    }
    if lookup == 0 && opts.lookup_tokens.is_some() {
        return Err(EngineError::Input(
            "--lookup-tokens sets how far a lookup in front of a model drafter proposes, and \
             this drafter has none; add --lookup-first N or drop --lookup-tokens"
                .into(),
        ));
    }
    Ok(match lookup {
        0 => source,
        min => Box::new(
            LookupFirst::new(
                source,
                min,
                min.max(opts.ngram_max),
                lookup_table(opts, vocab)?,
            )
            .with_max_tokens(opts.lookup_tokens.or(own.tokens)),
        ),
    })
}

/// The lookup table `opts` choose, read from its file, for a target of `vocab` ids.
fn lookup_table(opts: &SpecOptions, vocab: i32) -> Result<Option<Arc<LookupTable>>> {
    let path = match &opts.lookup_table {
        TableChoice::Off => return Ok(None),
        TableChoice::File(path) => path.clone(),
        TableChoice::Own => match opts.draft_model.as_deref() {
            Some(dir) if concrete_kind(opts)? == DraftKind::Dspark => {
                let path = dir.join(LOOKUP_TABLE_FILE);
                if !path.is_file() {
                    return Ok(None);
                }
                path
            }
            _ => return Ok(None),
        },
    };
    let table = LookupTable::load(&path)?;
    if table
        .largest_id()
        .is_some_and(|id| id >= vocab.max(0) as u32)
    {
        return Err(EngineError::file(
            &path,
            format!(
                "holds token ids beyond the target's {vocab}: it was built for another model; \
                 build one from this model's sequences with `mlxb lookup-table`"
            ),
        ));
    }
    Ok(Some(Arc::new(table)))
}

/// The lookup a drafter's checkpoint asks for in front of it (a DSpark drafter's
/// `lookup_first` and `lookup_tokens`).
#[derive(Debug, Clone, Copy, Default)]
struct OwnLookup {
    first: Option<usize>,
    tokens: Option<usize>,
}

/// The drafter `opts` describes, without a lookup in front, and the lookup its checkpoint asks
/// for.
fn open_model_source(
    opts: &SpecOptions,
    session: &Session,
    forks: Forks,
    prefill_step: usize,
) -> Result<(Box<dyn DraftSource>, OwnLookup)> {
    opts.validate()?;
    let dir = || {
        opts.draft_model.as_deref().ok_or_else(|| {
            EngineError::Input("this drafter needs a directory (--drafter or --draft-model)".into())
        })
    };
    let source: Box<dyn DraftSource> = match concrete_kind(opts)? {
        DraftKind::Dspark => {
            let source = open_dspark(opts, dir()?, session.model.model.as_ref(), forks)?;
            let own = OwnLookup {
                first: source.config().lookup_first,
                tokens: source.config().lookup_tokens,
            };
            return Ok((Box::new(source), own));
        }
        DraftKind::Ngram => Box::new(
            super::ngram::NgramSource::new(opts.ngram_min, opts.ngram_max)
                .with_table(lookup_table(opts, session.model.model.vocab_size())?),
        ),
        DraftKind::SelfLayers => Box::new(super::early_exit::EarlyExitSource::new(
            opts.draft_layers.unwrap_or(0),
        )),
        DraftKind::Assistant => Box::new(super::assistant::drafter::AssistantSource::open(
            dir()?,
            &session.dir,
            forks,
        )?),
        DraftKind::Model | DraftKind::Auto => Box::new(super::two_model::TwoModelSource::open(
            dir()?,
            &session.tokenizer,
            session.model.model.vocab_size(),
            forks,
            prefill_step,
        )?),
    };
    Ok((source, OwnLookup::default()))
}

/// The DSpark drafter at `dir` for `target`, with the options' threshold and pruning rule.
fn open_dspark(
    opts: &SpecOptions,
    dir: &Path,
    target: &dyn LanguageModel,
    forks: Forks,
) -> Result<DsparkSource> {
    let min_conf = match opts.dspark_min_conf {
        Some(c) => Some(c),
        None => super::dspark::drafter::min_conf_from_env()?,
    };
    Ok(DsparkSource::open(dir, target, min_conf, forks)?.with_prune(opts.dspark_prune))
}
