//! `mlxb measure`: a drafter against vanilla mlxb on a prompt file, in one invocation
//! (see [`crate::train::measure`]): acceptance, speed, calibration, and at T=0 a losslessness
//! check.

use super::common::resolve_model;
use super::common::{ModelArgs, PromptFileArgs, SamplingArgs, SpecArgs};
use super::flags::{open_session, ForkArgs};
use crate::engine::error::EngineError;
use crate::engine::sample::LogitsProcessors;
use crate::spec::dspark::checkpoint;
use crate::spec::executor::Speculation;
use crate::spec::factory::{concrete_kind, open_source, DraftKind, SpecOptions};
use crate::spec::policy::DraftPolicy;
use crate::spec::source::VerifyMode;
use crate::spec::trace::{JsonlTrace, TraceSink};
use crate::train::measure::{measure, MeasureReport};
use crate::train::measure_batch::BatchedMeasure;
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
    /// Decode N prompts at once in the batched engine, every sequence drafting for itself (as
    /// `serve --max-batch N` does), against the same batches without drafts: aggregate speeds,
    /// greedy ids checked equal to the plain batch's. 1 measures one stream at a time.
    #[arg(long = "n-parallel", value_name = "N", default_value_t = 1)]
    pub n_parallel: usize,
    /// How drafting is sized: with `--n-parallel` above 1, each batched step's verify blocks
    /// (as `serve --draft-policy`); for one stream, whether a round drafts (as
    /// `generate --draft-policy`: `cost` drafts while it hands out more tokens per second than
    /// plain steps, `all` every round) [default: cost; all with --spec-trace].
    // The bracket is clap's default-value convention in the help text, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long, value_enum)]
    pub draft_policy: Option<DraftPolicy>,
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

/// Why `--n-parallel N` cannot measure these settings, if it cannot (checked before any model
/// loads).
fn batch_refusal(args: &MeasureArgs) -> anyhow::Result<Option<String>> {
    if args.n_parallel == 0 {
        return Ok(Some("--n-parallel must be at least 1".into()));
    }
    if args.n_parallel == 1 {
        return Ok(None);
    }
    let params = args.sampling.text_params(&args.model);
    Ok(if params.sampler.temp != 0.0 {
        Some("measure --n-parallel compares greedy batches (--temp 0): sampled rows of a batch share one random stream, so the two batches could not be compared".into())
    } else if !LogitsProcessors::new(&params.processors)?.is_empty() {
        Some("measure --n-parallel decodes without logits processors (no repetition, presence or frequency penalty, logit bias)".into())
    } else if args.spec_trace.is_some() {
        Some(
            "--spec-trace records one stream's rounds; leave it out with --n-parallel above 1"
                .into(),
        )
    } else {
        None
    })
}

/// Entry point of `mlxb measure`.
pub fn run(args: MeasureArgs) -> anyhow::Result<()> {
    // Every input is checked before the models load.
    let prompts = PromptFile::read(&args.data)?;
    let opts = spec_options(&args)?;
    if let Some(why) = batch_refusal(&args)? {
        return Err(EngineError::Input(why).into());
    }
    let report = if args.n_parallel > 1 {
        measure_batched(&args, &prompts, &opts)?
    } else {
        measure_streams(&args, &prompts, &opts)?
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", report.summary());
    }
    Ok(())
}

/// One stream at a time (see [`measure`]).
fn measure_streams(
    args: &MeasureArgs,
    prompts: &PromptFile,
    opts: &SpecOptions,
) -> anyhow::Result<MeasureReport> {
    let temps = dspark_temperatures(opts)?;
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
    let mut source = open_source(opts, &session, forks, args.model.prefill_step_size)?;
    // Every block size either side runs does its one-time work (the host step's checks) now,
    // so neither side's speed carries it.
    let longest = source.block_size().unwrap_or(0).max(opts.num_draft_tokens) + 1;
    session.model.warm_up_blocks(longest)?;
    let mut drafting =
        Speculation::with_options(Box::new(source.as_mut()), opts).with_draft_policy(
            DraftPolicy::for_stream(args.draft_policy, args.spec_trace.is_some()),
        );
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
    Ok(report?)
}

/// `--n-parallel N` prompts at once (see [`BatchedMeasure`]).
fn measure_batched(
    args: &MeasureArgs,
    prompts: &PromptFile,
    opts: &SpecOptions,
) -> anyhow::Result<MeasureReport> {
    let dir = resolve_model(args.model.model.as_deref())?;
    let (mut session, forks) = open_session(&dir, &args.forks)?;
    let ids = prompts
        .token_ids(&session, args.prompt_file.use_chat_template())
        .map_err(|e| args.prompt_file.explain(e))?;
    let drafter = open_source(opts, &session, forks, args.model.prefill_step_size)?;
    let measure = BatchedMeasure {
        opts,
        drafter: drafter.as_ref(),
        policy: args.draft_policy.unwrap_or_default(),
        n_parallel: args.n_parallel,
        max_tokens: args.sampling.text_params(&args.model).generate.max_tokens,
        prefill_step_size: args.model.prefill_step_size,
        stop_tokens: session.tokenizer.eos_token_ids().iter().copied().collect(),
    };
    let bar = super::progress::bar("measuring", ids.len() as u64, "prompts");
    let report = measure.run(&mut session.model, &ids, |done| {
        bar.set_position(done as u64);
        Ok(())
    });
    bar.finish_and_clear();
    Ok(report?)
}
