//! `mlxb parity`: runs the oracle of the tier the forks keep — mlx-lm for L1, mlx-optiq's
//! `optiq eval` path for L2 (a per-layer KV allocation) — and mlxb greedily on the same prompt
//! ids and compares token ids and full-vocabulary logprobs of every step, bit for bit.

use super::common::resolve_model;
use super::common::{ModelArgs, PromptArgs};
use super::flags::{open_session, ForkArgs};
use crate::engine::bits::same_bits;
use crate::engine::error::EngineError;
use crate::engine::forks::{KvQuant, Tier};
use crate::engine::generate::{Flow, GenerateConfig, Generator};
use crate::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
use crate::oracle::{mlx_lm, optiq};
use clap::Args;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

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

/// The comparison of one run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ParityReport {
    /// The oracle compared with (filled in by `run`).
    pub oracle: String,
    /// Steps the oracle produced.
    pub oracle_steps: usize,
    /// Steps mlxb produced.
    pub mlxb_steps: usize,
    /// First step whose token id or logprob bits differ.
    pub first_divergence: Option<usize>,
    /// Largest |mlxb - mlx-lm| over all compared logprobs (in f32).
    pub max_abs_diff: f32,
    /// Whether ids and logprobs are bit-identical at every step.
    pub identical: bool,
}

/// Compares mlxb's steps with the oracle's.
pub fn compare(
    ours: &[(u32, Array)],
    oracle_ids: &[i32],
    oracle_lp: Option<&Array>,
) -> anyhow::Result<ParityReport> {
    let mut first = None;
    let mut max_diff = 0f32;
    let n = ours.len().max(oracle_ids.len());
    for i in 0..n {
        let (Some((id, lp)), Some(&oid)) = (ours.get(i), oracle_ids.get(i)) else {
            first.get_or_insert(i);
            break;
        };
        let Some(olp_all) = oracle_lp else {
            anyhow::bail!("the mlx-lm trace has token ids but no logprobs to compare");
        };
        let olp = olp_all.index(i as i32);
        let diff = lp
            .as_dtype(Dtype::Float32)?
            .subtract(olp.as_dtype(Dtype::Float32)?)?
            .abs()?
            .max(None)?
            .try_item_exact::<f32>()?;
        max_diff = max_diff.max(diff);
        let same = *id as i64 == oid as i64 && same_bits(lp, &olp)?;
        if !same && first.is_none() {
            first = Some(i);
        }
    }
    Ok(ParityReport {
        oracle: String::new(),
        oracle_steps: oracle_ids.len(),
        mlxb_steps: ours.len(),
        first_divergence: first,
        max_abs_diff: max_diff,
        identical: first.is_none() && ours.len() == oracle_ids.len(),
    })
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
    let per_layer = forks.kv_quant == KvQuant::Config && plan.kv_bits.iter().any(Option::is_some);
    let (oracle, trace) = if per_layer {
        let trace = optiq::trace(
            &std::fs::canonicalize(&dir)?,
            &plan.kv_bits,
            &ids,
            args.max_tokens,
            args.model.prefill_step_size,
        )?;
        (optiq::ORACLE, trace)
    } else {
        let request = serde_json::json!({
            "model": std::fs::canonicalize(&dir)?,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(ids: &[u32], lps: &[[f32; 2]]) -> Vec<(u32, Array)> {
        ids.iter()
            .zip(lps)
            .map(|(&id, lp)| (id, Array::from_slice(lp, &[2])))
            .collect()
    }

    fn oracle(lps: &[[f32; 2]]) -> Array {
        let flat: Vec<f32> = lps.iter().flatten().copied().collect();
        Array::from_slice(&flat, &[lps.len() as i32, 2])
    }

    #[test]
    fn identical_steps_compare_identical() -> anyhow::Result<()> {
        let lps = [[-0.5, -1.0], [-0.25, f32::NAN]];
        let r = compare(&steps(&[3, 4], &lps), &[3, 4], Some(&oracle(&lps)))?;
        assert!(r.identical && r.first_divergence.is_none(), "{r:?}");
        Ok(())
    }

    #[test]
    fn a_signed_zero_a_token_or_a_missing_step_is_a_divergence() -> anyhow::Result<()> {
        let lps = [[-0.5, 0.0], [-0.25, -1.0]];
        let signed = [[-0.5, -0.0], [-0.25, -1.0]];
        let r = compare(&steps(&[3, 4], &signed), &[3, 4], Some(&oracle(&lps)))?;
        assert_eq!((r.first_divergence, r.identical), (Some(0), false));
        assert_eq!(
            r.max_abs_diff, 0.0,
            "the values agree; only the bits differ"
        );
        let r = compare(&steps(&[3, 5], &lps), &[3, 4], Some(&oracle(&lps)))?;
        assert_eq!(r.first_divergence, Some(1));
        let r = compare(&steps(&[3], &lps), &[3, 4], Some(&oracle(&lps)))?;
        assert_eq!((r.first_divergence, r.identical), (Some(1), false));
        Ok(())
    }

    #[test]
    fn a_trace_without_logprobs_is_an_error_not_a_pass() {
        let lps = [[-0.5, -1.0]];
        assert!(compare(&steps(&[3], &lps), &[3], None).is_err());
        let r = compare(&[], &[], None).map(|r| r.identical);
        assert!(matches!(r, Ok(true)), "{r:?}");
    }
}
