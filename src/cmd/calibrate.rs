//! `mlxb calibrate`: runs a DSpark drafter unpruned over a prompt file (greedy), fits
//! sequential temperature scaling and per-position thresholds on the recorded rounds
//! (dspark-spec.md §4.1; the math is in [`crate::train::calibrate`]) and patches them
//! into the checkpoint's `dspark.json` atomically.

use super::common::resolve_model;
use super::common::{ModelArgs, PromptFileArgs};
use super::flags::{open_session, ForkArgs};
use crate::engine::error::EngineError;
use crate::engine::generate::GenerateConfig;
use crate::engine::sample::{ProcessorConfig, SamplerConfig};
use crate::engine::text::TextParams;
use crate::spec::dspark::drafter::DsparkSource;
use crate::spec::executor::Speculation;
use crate::spec::source::VerifyMode;
use crate::train::calibrate::{
    check_patchable, fit_temperatures, fit_thresholds, patch_config, position_stats,
    rounds_from_trace,
};
use crate::train::measure::{generate, stats_table};
use crate::train::prompts::PromptFile;
use clap::Args;
use std::path::PathBuf;

/// Flags of `mlxb calibrate`.
#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// DSpark checkpoint directory (mlxb format) to calibrate in place; `default` = the
    /// shipped drafter.
    #[arg(long, value_parser = crate::spec::dspark::shipped::parse_drafter_arg)]
    pub drafter: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt file (JSONL: `prompt`, `messages` or `prompt_ids` per line).
    #[arg(long)]
    pub data: PathBuf,
    #[command(flatten)]
    pub prompt_file: PromptFileArgs,
    /// Tokens generated per prompt at most.
    #[arg(long, short = 'm', default_value_t = 256)]
    pub max_tokens: usize,
    /// Smallest Laplace-smoothed acceptance rate a kept position must reach.
    #[arg(long, default_value_t = 0.5)]
    pub target_rate: f64,
    /// Positions reached in fewer rounds than this are never pruned (threshold 0).
    #[arg(long, default_value_t = 30)]
    pub min_samples: usize,
    #[command(flatten)]
    pub forks: ForkArgs,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Entry point of `mlxb calibrate`.
pub fn run(args: CalibrateArgs) -> anyhow::Result<()> {
    // Every input is checked before the long run.
    let prompts = PromptFile::read(&args.data)?;
    let config = check_patchable(&args.drafter)?;
    if !(args.target_rate > 0.0 && args.target_rate <= 1.0) {
        return Err(EngineError::Input(format!(
            "--target-rate {} is out of range; give an acceptance rate in (0, 1]",
            args.target_rate
        ))
        .into());
    }
    if args.max_tokens < 2 {
        return Err(EngineError::Input(
            "--max-tokens must be at least 2 (the first token comes before any draft)".into(),
        )
        .into());
    }
    let dir = resolve_model(args.model.model.as_deref())?;
    let (mut session, forks) = open_session(&dir, &args.forks)?;
    let ids = prompts
        .token_ids(&session, args.prompt_file.use_chat_template())
        .map_err(|e| args.prompt_file.explain(e))?;
    // Threshold 0 at every position: the whole block is proposed and verified.
    let mut source = DsparkSource::open(
        &args.drafter,
        session.model.model.as_ref(),
        Some(0.0),
        forks,
    )?;
    let gamma = config.block_size;
    let in_force = config.sts_temperatures.clone().unwrap_or_default();
    let mut drafting = Speculation::new(Box::new(&mut source), gamma, VerifyMode::Match);
    let params = TextParams {
        sampler: SamplerConfig::default(),
        processors: ProcessorConfig::default(),
        generate: GenerateConfig {
            max_tokens: args.max_tokens,
            prefill_step_size: args.model.prefill_step_size,
        },
        seed: None,
    };
    let bar = super::progress::bar("calibrating", ids.len() as u64, "prompts");
    let mut rounds = Vec::new();
    for prompt in &ids {
        let run = generate(&mut session, prompt, &params, Some(&mut drafting));
        bar.inc(1);
        rounds.extend(rounds_from_trace(&run?.rounds, &in_force));
    }
    bar.finish_and_clear();
    if rounds.is_empty() {
        return Err(EngineError::Input(
            "no drafting round was recorded; give more prompts or a larger --max-tokens".into(),
        )
        .into());
    }
    let temps = fit_temperatures(&rounds, gamma);
    let thresholds = fit_thresholds(&rounds, &temps, gamma, args.target_rate, args.min_samples);
    let stats = position_stats(&rounds, &[], &temps, gamma);
    patch_config(&args.drafter, thresholds.clone(), temps.clone())?;
    if args.json {
        let obj = serde_json::json!({
            "drafter": args.drafter,
            "model": dir,
            "prompts": ids.len(),
            "rounds": rounds.len(),
            "target_rate": args.target_rate,
            "min_samples": args.min_samples,
            "thresholds": thresholds,
            "temperatures": temps,
            "positions": stats,
        });
        println!("{obj}");
    } else {
        println!(
            "{} rounds from {} prompts; thresholds (target rate {}) and temperatures written to {}\n",
            rounds.len(),
            ids.len(),
            args.target_rate,
            args.drafter.display()
        );
        println!("{}", stats_table(&stats, Some((&thresholds, &temps))));
    }
    Ok(())
}
