//! `mlxb parity`: runs the oracle of the tier the forks keep — mlx-lm for L1, mlx-optiq's
//! `optiq eval` path for L2 (a per-layer KV allocation) — and mlxb greedily on the same prompt
//! ids and compares token ids and full-vocabulary logprobs of every step, bit for bit.

use super::common::resolve_model;
use super::common::{ModelArgs, PromptArgs};
use super::flags::{open_session, ForkArgs};
use crate::engine::error::EngineError;
use crate::engine::forks::{KvQuant, Tier};
use crate::engine::generate::{Flow, GenerateConfig, Generator};
use crate::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
use crate::oracle::compare::compare;
use crate::oracle::{mlx_lm, optiq};
use clap::Args;

/// Flags of `mlxb parity`.
#[derive(Debug, Args)]
pub struct ParityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Greedy steps to compare.
    #[arg(long, short = 'm', default_value_t = 32)]
    pub max_tokens: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Forks to run mlxb with; the combination must keep L1 (mlx-lm, run with the same
    /// --kv-bits/--kv-group-size/--quantized-kv-start) or L2 (mlx-optiq with the same per-layer
    /// KV allocation).
    #[command(flatten)]
    pub forks: ForkArgs,
}

/// Entry point of `mlxb parity`.
pub fn run(args: ParityArgs) -> anyhow::Result<()> {
    let dir = resolve_model(args.model.model.as_deref())?;
    let resolution = args.forks.resolve()?;
    let leaving: Vec<String> = resolution
        .values
        .iter()
        .filter(|r| r.keeps > Tier::L2)
        .map(|r| format!("--{} {}", r.fork.name, r.value))
        .collect();
    if !leaving.is_empty() {
        return Err(EngineError::Input(format!(
            "parity has oracles for L1 (mlx-lm) and L2 (mlx-optiq), but {} leave L2; drop them",
            leaving.join(", ")
        ))
        .into());
    }
    let (mut session, forks) = open_session(&dir, &args.forks)?;
    let ids = args.prompt.ids(&session.tokenizer)?;
    let plan = session.model.plan.clone();
    let model = std::fs::canonicalize(&dir)?;
    let (oracle, trace) = if plan.per_layer_kv() {
        let trace = optiq::trace(
            &model,
            &plan.kv_bits,
            &ids,
            args.max_tokens,
            args.model.prefill_step_size,
        )?;
        (optiq::ORACLE, trace)
    } else {
        let request = serde_json::json!({
            "model": model,
            "prompt_ids": ids,
            "max_tokens": args.max_tokens,
            "prefill_step_size": args.model.prefill_step_size,
            "kv_bits": match forks.kv_quant {
                KvQuant::Bits(b) => Some(b),
                _ => None,
            },
            "kv_group_size": forks.kv_group_size,
            "quantized_kv_start": forks.quantized_kv_start,
        });
        (mlx_lm::ORACLE, mlx_lm::trace(&request)?)
    };

    let mut sampler = Sampler::new(&SamplerConfig::default())?;
    let mut processors = LogitsProcessors::new(&ProcessorConfig::default())?;
    let cfg = GenerateConfig {
        max_tokens: args.max_tokens,
        prefill_step_size: args.model.prefill_step_size,
    };
    let mut ours = Vec::new();
    Generator::new(session.model.model.as_mut(), &mut sampler, &mut processors)
        .with_startup(session.startup.clone())
        .with_plan(&plan)
        .run(&ids, &cfg, |s| {
            ours.push((s.token, s.logprobs.clone()));
            Ok(Flow::Continue)
        })?;
    let mut report = compare(&ours, &trace.ids, trace.logprobs.as_ref())?;
    report.oracle = oracle.to_owned();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("| model | oracle | prompt tokens | steps (mlxb/oracle) | first divergence | max abs diff | identical |");
        println!("|---|---|---|---|---|---|---|");
        println!(
            "| {} | {oracle} | {} | {}/{} | {} | {:e} | {} |",
            dir.display(),
            ids.len(),
            report.mlxb_steps,
            report.oracle_steps,
            report
                .first_divergence
                .map_or("none".to_owned(), |i| i.to_string()),
            report.max_abs_diff,
            if report.identical { "yes" } else { "NO" }
        );
    }
    if !report.identical {
        return Err(EngineError::Parity(format!(
            "mlxb diverges from {oracle} at step {}",
            report
                .first_divergence
                .unwrap_or(report.mlxb_steps.min(report.oracle_steps))
        ))
        .into());
    }
    Ok(())
}
