//! How far a fork combination's output moves from L1: the KL divergence of its next-token
//! distributions from L1's, teacher-forced on L1's greedy tokens over a fixed prompt set
//! (`mlxb bench --matrix` reports it for every output-changing fork; it is 0 for L1-valid ones).

use crate::engine::error::Result;
use crate::engine::forks::Forks;
use crate::engine::generate::{Flow, GenerateConfig, Generator};
use crate::engine::models::{self, LoadedModel};
use crate::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
use crate::engine::tokenizer::Tokenizer;
use mlx_rs::transforms::eval;
use mlx_rs::{Array, Dtype};
use std::path::Path;

/// The fixed prompt set (chat-templated when the tokenizer has a template).
pub const KL_PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "def fibonacci(n):",
];

/// KL divergence of one combination from L1.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KlReport {
    /// Prompts compared.
    pub prompts: usize,
    /// Steps compared in total.
    pub steps: usize,
    /// Mean over steps of KL(L1 || forks), in nats.
    pub mean_kl: f64,
    /// Largest single-step KL.
    pub max_kl: f64,
    /// Fraction of steps whose greedy token equals L1's.
    pub top1_agreement: f64,
    /// Whether every step's logprobs are bit-identical to L1's.
    pub identical: bool,
}

/// Greedy steps of `loaded` on `prompt` (or teacher-forced on `forced`): tokens and the
/// logprobs exactly as the generator returns them.
pub fn greedy_steps(
    loaded: &mut LoadedModel,
    prompt: &[u32],
    steps: usize,
    prefill_step_size: usize,
    forced: Option<Vec<u32>>,
) -> Result<Vec<(u32, Array)>> {
    let mut sampler = Sampler::new(&SamplerConfig::default())?;
    let mut processors = LogitsProcessors::new(&ProcessorConfig::default())?;
    let plan = loaded.plan.clone();
    let mut g =
        Generator::new(loaded.model.as_mut(), &mut sampler, &mut processors).with_plan(&plan);
    if let Some(f) = forced {
        g = g.with_forced_tokens(f);
    }
    let cfg = GenerateConfig {
        max_tokens: steps,
        prefill_step_size,
    };
    let mut out = Vec::new();
    g.run(prompt, &cfg, |s| {
        out.push((s.token, s.logprobs.clone()));
        Ok(Flow::Continue)
    })?;
    Ok(out)
}

/// [`greedy_steps`] with the logprobs renormalized in f32 (low-precision logprobs do not sum
/// to exactly one).
fn run(
    loaded: &mut LoadedModel,
    prompt: &[u32],
    steps: usize,
    prefill_step_size: usize,
    forced: Option<Vec<u32>>,
) -> Result<Vec<(u32, Array)>> {
    greedy_steps(loaded, prompt, steps, prefill_step_size, forced)?
        .into_iter()
        .map(|(t, lp)| {
            let lp = lp.as_dtype(Dtype::Float32)?;
            Ok((t, lp.subtract(lp.logsumexp(true)?)?))
        })
        .collect()
}

/// KL(L1 || `forks`) per step for the model in `dir` on `prompts`, `steps` greedy steps each.
pub fn kl_to_l1(
    dir: &Path,
    forks: Forks,
    prompts: &[Vec<u32>],
    steps: usize,
    prefill_step_size: usize,
) -> Result<KlReport> {
    let mut base = models::load(dir, Forks::default())?;
    let mut other = models::load(dir, forks)?;
    let (mut n, mut sum, mut max, mut agree, mut identical) = (0usize, 0f64, 0f64, 0usize, true);
    for prompt in prompts {
        let want = run(&mut base, prompt, steps, prefill_step_size, None)?;
        let tokens: Vec<u32> = want.iter().map(|(t, _)| *t).collect();
        let got = run(&mut other, prompt, steps, prefill_step_size, Some(tokens))?;
        for ((t, p), (_, q)) in want.iter().zip(&got) {
            let kl = p.exp()?.multiply(p.subtract(q)?)?.sum(None)?;
            let top = mlx_rs::ops::indexing::argmax(q, None)?;
            let same = p.eq(q)?.all(None)?;
            eval([&kl, &top, &same])?;
            // Clamped: f32 rounding can leave a zero divergence a hair below zero.
            let kl = (kl.try_item_exact::<f32>()? as f64).max(0.0);
            sum += kl;
            max = max.max(kl);
            agree += usize::from(top.try_item_exact::<u32>()? == *t);
            identical &= same.try_item_exact::<bool>()?;
            n += 1;
        }
    }
    Ok(KlReport {
        prompts: prompts.len(),
        steps: n,
        mean_kl: sum / n.max(1) as f64,
        max_kl: max,
        top1_agreement: agree as f64 / n.max(1) as f64,
        identical,
    })
}

/// [`KL_PROMPTS`] as prompt ids for `tokenizer`.
pub fn default_prompts(tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>> {
    KL_PROMPTS
        .iter()
        .map(|p| tokenizer.prompt_ids(p, None, true))
        .collect()
}
