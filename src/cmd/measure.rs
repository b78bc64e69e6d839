//! `mlxb measure`: a drafter against vanilla mlxb on a prompt file, in one invocation
//! (see [`crate::train::measure`]): acceptance, speed, calibration, and at T=0 a losslessness
//! check.

use super::common::resolve_model;
use super::common::{ModelArgs, PromptFileArgs, SamplingArgs, SpecArgs};
use super::flags::{open_session, ForkArgs};
use crate::engine::error::EngineError;
use crate::spec::dspark::checkpoint;
use crate::spec::executor::Speculation;
use crate::spec::factory::{concrete_kind, open_source, DraftKind, SpecOptions};
use crate::spec::source::VerifyMode;
use crate::spec::trace::{JsonlTrace, TraceSink};
use crate::train::measure::measure;
use crate::train::prompts::PromptFile;
use clap::Args;
use std::path::PathBuf;

/// Flags of `mlxb measure`.
#[derive(Debug, Args)]
pub struct MeasureArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt file (JSONL: `prompt`, `messages` or `prompt_ids` per line).
    #[arg(long)]
    pub data: PathBuf,
    #[command(flatten)]
    pub prompt_file: PromptFileArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub forks: ForkArgs,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    pub json: bool,
    /// Write one JSON object per speculative round to FILE (JSONL, as `generate --spec-trace`,
    /// with each round's prompt index).
    #[arg(long, value_name = "FILE")]
    pub spec_trace: Option<PathBuf>,
}

/// The drafter options: a drafter is required; `--temp > 0` verifies by rejection sampling
/// unless `--spec-verify` says otherwise.
fn spec_options(args: &MeasureArgs) -> anyhow::Result<SpecOptions> {
    let mut opts = args.spec.options()?.ok_or_else(|| {
        EngineError::Input(
            "measure compares a drafter with vanilla decoding; give one (--drafter, --draft-kind ngram|self|model, --draft-model, --draft-layers)".into(),
        )
    })?;
    opts.verify =
        args.spec
            .spec_verify
            .map(VerifyMode::from)
            .unwrap_or(if args.sampling.temp > 0.0 {
                VerifyMode::Reject
            } else {
                VerifyMode::Match
            });
    opts.validate()?;
    Ok(opts)
}

/// The DSpark checkpoint's calibration temperatures (`Some(empty)` = uncalibrated), or `None`
/// when the drafter is not a DSpark drafter with a confidence head.
fn dspark_temperatures(opts: &SpecOptions) -> anyhow::Result<Option<Vec<f64>>> {
    let Some(path) = opts.draft_model.as_deref() else {
        return Ok(None);
    };
    if concrete_kind(opts)? != DraftKind::Dspark {
        return Ok(None);
    }
    let (config, _) = checkpoint::read_config(path)?;
    Ok(config
        .confidence_head
        .then(|| config.sts_temperatures.unwrap_or_default()))
}

/// Entry point of `mlxb measure`.
pub fn run(args: MeasureArgs) -> anyhow::Result<()> {
    // Every input is checked before the models load.
    let prompts = PromptFile::read(&args.data)?;
    let opts = spec_options(&args)?;
    let temps = dspark_temperatures(&opts)?;
    let mut trace = args
        .spec_trace
        .as_deref()
        .map(JsonlTrace::create)
        .transpose()?;
    let dir = resolve_model(args.model.model.as_deref())?;
    let (mut session, forks) = open_session(&dir, &args.forks)?;
    let ids = prompts
        .token_ids(&session, args.prompt_file.use_chat_template())
        .map_err(|e| args.prompt_file.explain(e))?;
    let mut source = open_source(&opts, &session, forks, args.model.prefill_step_size)?;
    let mut drafting = Speculation::with_options(Box::new(source.as_mut()), &opts);
    let params = args.sampling.text_params(&args.model);
    let bar = super::progress::bar("measuring", ids.len() as u64, "prompts");
    let report = measure(
        &mut session,
        &ids,
        &params,
        &mut drafting,
        temps.as_deref(),
        |i, run| {
            if let Some(t) = trace.as_mut() {
                t.set_prompt(i);
                for r in &run.rounds {
                    t.record(r)?;
                }
            }
            bar.inc(1);
            Ok(())
        },
    );
    bar.finish_and_clear();
    if let Some(t) = trace.as_mut() {
        t.flush()?;
    }
    let report = report?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", report.summary());
    }
    Ok(())
}
