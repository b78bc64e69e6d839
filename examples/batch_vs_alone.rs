//! Measures whether a request's greedy output in a batch equals its output alone, on a real
//! model: `B` prompts decoded together by the batched engine against each prompt through the
//! single-stream loop. Prints how many sequences keep the same ids, how many logprob rows are
//! bit-identical (up to each sequence's first differing id) and the largest logprob difference.
//!
//! `cargo run --release --example batch_vs_alone -- MODEL_DIR [B=8] [TOKENS=48]`

use mlx_rs::{Array, Dtype};
use mlxb::engine::batch::{generate_all, BatchSettings, SequenceRequest};
use mlxb::engine::forks::Forks;
use mlxb::engine::generate::{Flow, GenerateConfig, Generator};
use mlxb::engine::models;
use mlxb::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};

fn values(a: &Array) -> anyhow::Result<Vec<f32>> {
    Ok(a.as_dtype(Dtype::Float32)?.try_as_slice::<f32>()?.to_vec())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(
        args.get(1)
            .ok_or_else(|| anyhow::anyhow!("usage: batch_vs_alone MODEL_DIR [B] [TOKENS]"))?,
    );
    let b: usize = args.get(2).map_or(Ok(8), |s| s.parse())?;
    let n: usize = args.get(3).map_or(Ok(48), |s| s.parse())?;
    let mut loaded = models::load(&dir, Forks::default())?;
    let vocab = loaded.model.vocab_size() as u32;
    // Deterministic prompts of different lengths (9..=44 tokens) in [3, vocab).
    let prompts: Vec<Vec<u32>> = (0..b as u32)
        .map(|i| {
            (0..9 + (i * 13) % 36)
                .map(|j| 3 + (j * 7919 + (i + 1) * 104_729) % (vocab - 3))
                .collect()
        })
        .collect();
    let greedy = || Sampler::new(&SamplerConfig::default());
    let requests = prompts
        .iter()
        .map(|p| SequenceRequest::new(p.clone(), n))
        .collect();
    let batched = generate_all(
        &mut loaded,
        greedy()?,
        vec![],
        BatchSettings::default(),
        requests,
    )?;
    let plan = loaded.plan.clone();
    let (mut same_ids, mut rows, mut same_rows, mut max_diff) = (0, 0, 0, 0f32);
    for (prompt, got) in prompts.iter().zip(&batched) {
        let mut sampler = greedy()?;
        let mut processors = LogitsProcessors::new(&ProcessorConfig::default())?;
        let cfg = GenerateConfig {
            max_tokens: n,
            prefill_step_size: 2048,
        };
        let mut alone = vec![];
        Generator::new(loaded.model.as_mut(), &mut sampler, &mut processors)
            .with_plan(&plan)
            .run(prompt, &cfg, |s| {
                alone.push((s.token, s.logprobs.clone()));
                Ok(Flow::Continue)
            })?;
        let first_diff = alone.iter().zip(&got.tokens).position(|((a, _), b)| a != b);
        same_ids += usize::from(first_diff.is_none());
        for ((_, lp), row) in alone
            .iter()
            .zip(&got.logprobs)
            .take(first_diff.unwrap_or(n))
        {
            let (a, b) = (values(lp)?, values(row)?);
            let d = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            rows += 1;
            same_rows += usize::from(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
            max_diff = max_diff.max(d);
        }
    }
    println!(
        "batch of {b}, {n} tokens each: same greedy ids {same_ids}/{b} sequences; bit-identical logprob rows {same_rows}/{rows}; max |logprob difference| {max_diff:.3e}"
    );
    Ok(())
}
