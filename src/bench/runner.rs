//! mlxb's side of each benchmark test, timed like llama-bench (tokenization and warm-up
//! excluded): `pp` = prefill of `n` prompt tokens after `depth` context tokens, `tg` =
//! decoding `n` tokens after a prompt of `depth + 1` tokens (the first token is prompt time,
//! as in mlx-lm's own generation_tps).

use crate::engine::error::Result;
use crate::engine::generate::{Flow, GenerateConfig, Generator, Speculation};
use crate::engine::models::LanguageModel;
use crate::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
use crate::spec::metrics::SpecMetrics;
use crate::spec::source::{DraftSource, VerifyMode};
use mlx_rs::transforms::eval;
use mlx_rs::Array;
use std::time::Instant;

/// One test of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestKind {
    /// Prompt processing.
    Prefill,
    /// Token generation.
    Decode,
}

/// A test: kind, token count, context depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TestSpec {
    /// pp or tg.
    pub kind: TestKind,
    /// Tokens processed (pp) or generated (tg).
    pub n: usize,
    /// Context tokens already in the cache.
    pub depth: usize,
}

impl TestSpec {
    /// llama-bench's name: `pp512`, `tg128`, `tg128 @ d512`.
    pub fn name(&self) -> String {
        let base = match self.kind {
            TestKind::Prefill => format!("pp{}", self.n),
            TestKind::Decode => format!("tg{}", self.n),
        };
        if self.depth > 0 {
            format!("{base} @ d{}", self.depth)
        } else {
            base
        }
    }
}

/// Deterministic pseudo-random token ids in `[3, vocab)` (the same for mlxb and the baseline).
pub fn random_tokens(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            3 + (s % (vocab.max(4) as u64 - 3)) as u32
        })
        .collect()
}

fn prefill(
    model: &mut dyn LanguageModel,
    caches: &mut crate::engine::models::Caches,
    tokens: &[u32],
    step: usize,
) -> Result<()> {
    for chunk in tokens.chunks(step.max(1)) {
        let ids: Vec<i32> = chunk.iter().map(|&t| t as i32).collect();
        model.forward(&Array::from_slice(&ids, &[1, ids.len() as i32]), caches)?;
        let state: Vec<Array> = caches.iter().flat_map(|c| c.state()).collect();
        eval(&state)?;
    }
    Ok(())
}

/// Times a prefill test: seconds for `prompt` after `context` is already cached.
pub fn time_prefill(
    model: &mut dyn LanguageModel,
    context: &[u32],
    prompt: &[u32],
    step: usize,
) -> Result<f64> {
    let mut caches = model.make_caches();
    prefill(model, &mut caches, context, step)?;
    let t = Instant::now();
    prefill(model, &mut caches, prompt, step)?;
    Ok(t.elapsed().as_secs_f64())
}

/// Times a decode test: (seconds, tokens timed, speculative metrics). EOS is ignored.
pub fn time_decode(
    model: &mut dyn LanguageModel,
    prompt: &[u32],
    n: usize,
    draft: Option<(Box<dyn DraftSource + '_>, usize)>,
) -> Result<(f64, usize, Option<SpecMetrics>)> {
    let mut sampler = Sampler::new(&SamplerConfig::default())?;
    let mut processors = LogitsProcessors::new(&ProcessorConfig::default())?;
    let mut g = Generator::new(model, &mut sampler, &mut processors);
    if let Some((source, k)) = draft {
        g = g.with_speculation(Speculation {
            source,
            num_draft_tokens: k,
            verify: VerifyMode::Match,
            temp: 0.0,
            metrics: SpecMetrics::default(),
        });
    }
    let cfg = GenerateConfig {
        max_tokens: n,
        prefill_step_size: 2048,
    };
    let (stats, metrics) = g.run(prompt, &cfg, |_| Ok(Flow::Continue))?;
    let tokens = stats.generation_tokens.saturating_sub(1);
    Ok((stats.generation_time.as_secs_f64(), tokens, metrics))
}
