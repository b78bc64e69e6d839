//! mlxb's side of each benchmark test, timed like llama-bench (tokenization and warm-up
//! excluded): `pp` = prefill of `n` prompt tokens after `depth` context tokens, `tg` =
//! decoding `n` tokens after a prompt of `depth + 1` tokens (the first token is prompt time,
//! as in mlx-lm's own generation_tps), `v` = one forward of an `n`-token block after `depth`
//! context tokens with every row's logits computed (a speculative verify), timed beside a
//! one-token step at the same depth, `tg x B` = `B` sequences decoded together by the batched
//! engine, each `n` tokens after its own `depth + 1`-token prompt (aggregate tokens per second,
//! every sequence's first token counted as prompt time, like llama.cpp's batched-bench `S_TG`).

use crate::engine::batch::{BatchGenerator, BatchSettings, SequenceRequest};
use crate::engine::error::Result;
use crate::engine::generate::{Flow, GenerateConfig, Generator};
use crate::engine::models::{Caches, LanguageModel, LoadedModel};
use crate::engine::plan::ForkPlan;
use crate::engine::sample::{LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
use crate::spec::executor::Speculation;
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
    /// One verify block (all of its logits), beside a one-token step.
    Verify,
    /// Token generation for [`TestSpec::batch`] sequences at once.
    Parallel,
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
    /// Sequences decoded at once ([`TestKind::Parallel`]; 1 otherwise).
    pub batch: usize,
}

impl TestSpec {
    /// llama-bench's name: `pp512`, `tg128`, `tg128 @ d512`.
    pub fn name(&self) -> String {
        let base = match self.kind {
            TestKind::Prefill => format!("pp{}", self.n),
            TestKind::Decode => format!("tg{}", self.n),
            TestKind::Verify => format!("v{}", self.n),
            TestKind::Parallel => format!("tg{} x{}", self.n, self.batch),
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

/// The token ids of one test, the same for every configuration measured on it.
pub struct TestInputs {
    /// Context already cached before a `pp` test.
    pub context: Vec<u32>,
    /// The `pp` test's prompt.
    pub tokens: Vec<u32>,
    /// The `tg` test's prompt (`depth + 1` tokens).
    pub decode_prompt: Vec<u32>,
    /// The `tg x B` test's prompts (`depth + 1` tokens each, all different).
    pub parallel_prompts: Vec<Vec<u32>>,
}

impl TestInputs {
    /// Deterministic inputs for the `index`-th test of a run on a `vocab`-token model.
    pub fn new(test: &TestSpec, vocab: u32, index: usize) -> Self {
        let seed = 1000 + index as u64;
        Self {
            context: random_tokens(test.depth, vocab, seed),
            tokens: random_tokens(test.n, vocab, seed + 1),
            decode_prompt: random_tokens(test.depth + 1, vocab, seed),
            parallel_prompts: (0..test.batch)
                .filter(|_| test.kind == TestKind::Parallel)
                .map(|i| random_tokens(test.depth + 1, vocab, seed + 2 + i as u64))
                .collect(),
        }
    }
}

/// Tokens per second of one repetition of `test` on `loaded` (with its forks), no drafter.
pub fn measure(
    loaded: &mut LoadedModel,
    test: &TestSpec,
    inputs: &TestInputs,
    prefill_step: usize,
) -> Result<f64> {
    Ok(match test.kind {
        TestKind::Prefill => tps(
            test.n,
            time_prefill(loaded, &inputs.context, &inputs.tokens, prefill_step)?,
        ),
        TestKind::Decode => {
            let (s, n, _) = time_decode(loaded, &inputs.decode_prompt, test.n, None)?;
            tps(n, s)
        }
        TestKind::Verify => tps(test.n, time_verify(loaded, inputs)?.block),
        TestKind::Parallel => {
            let (s, n) = time_parallel(loaded, &inputs.parallel_prompts, test.n)?;
            tps(n, s)
        }
    })
}

/// Times a parallel decode test: (seconds, tokens timed). All sequences decode `n` tokens
/// (EOS ignored) in the batched engine with mlx-lm's default batch sizes; the clock starts when
/// every sequence has its first token.
pub fn time_parallel(
    loaded: &mut LoadedModel,
    prompts: &[Vec<u32>],
    n: usize,
) -> Result<(f64, usize)> {
    let LoadedModel { model, plan, .. } = loaded;
    let sampler = Sampler::new(&SamplerConfig::default())?;
    let settings = BatchSettings::default();
    let mut gen = BatchGenerator::new(model.as_ref(), plan, sampler, Vec::new(), settings)?;
    let requests = prompts
        .iter()
        .map(|p| SequenceRequest::new(p.clone(), n))
        .collect();
    gen.insert(requests)?;
    let (mut started, mut tokens, mut firsts) = (None, 0, 0);
    loop {
        let out = gen.next_tokens(model.as_mut())?;
        if out.is_empty() {
            break;
        }
        match started {
            None => {
                firsts += out.len();
                if firsts >= prompts.len() {
                    started = Some(Instant::now());
                }
            }
            Some(_) => tokens += out.len(),
        }
    }
    let secs = started.map_or(0.0, |t| t.elapsed().as_secs_f64());
    Ok((secs, tokens))
}

/// Seconds of one verify test: the block, and a one-token step at the same depth.
#[derive(Debug, Clone, Copy)]
pub struct VerifyTiming {
    /// The `n`-token forward.
    pub block: f64,
    /// The one-token forward (the block's first token).
    pub step: f64,
}

impl VerifyTiming {
    /// What the block costs in one-token steps.
    pub fn cost(&self) -> f64 {
        self.block / self.step.max(1e-9)
    }
}

/// Times a verify test: after `inputs.context` is cached, a one-token step and then the whole
/// `inputs.tokens` block, each a forward with every row's logits and the caches evaluated, the
/// caches put back after each. The context's last token goes in as the generation loop's first
/// step does (one token on MLX after the prompt), so the block meets the caches a verify meets
/// in generation.
pub fn time_verify(loaded: &mut LoadedModel, inputs: &TestInputs) -> Result<VerifyTiming> {
    let LoadedModel { model, plan, .. } = loaded;
    let mut caches = model.make_caches();
    plan.prepare(&mut caches);
    let (prompt, first) = inputs
        .context
        .split_at(inputs.context.len().saturating_sub(1));
    prefill(model.as_mut(), plan, &mut caches, prompt, 2048)?;
    crate::engine::kernels::mlx_only(|| prefill(model.as_mut(), plan, &mut caches, first, 1))?;
    let mut timed = |tokens: &[u32]| -> Result<f64> {
        let saved: Vec<_> = caches.iter().map(|c| c.snapshot()).collect();
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let t = Instant::now();
        let logits = model.forward(
            &Array::from_slice(&ids, &[1, ids.len() as i32]),
            &mut caches,
        )?;
        let mut outputs: Vec<Array> = caches.iter().flat_map(|c| c.state()).collect();
        outputs.push(logits);
        eval(&outputs)?;
        let secs = t.elapsed().as_secs_f64();
        for (cache, snapshot) in caches.iter_mut().zip(saved) {
            cache.restore(snapshot)?;
        }
        Ok(secs)
    };
    let step = timed(&inputs.tokens[..1])?;
    let block = timed(&inputs.tokens)?;
    Ok(VerifyTiming { block, step })
}

/// Tokens per second (a zero duration reads as a nanosecond).
pub fn tps(tokens: usize, secs: f64) -> f64 {
    tokens as f64 / secs.max(1e-9)
}

/// Prefill as the generation loop does it: one forward per chunk, then the fork plan's KV
/// quantization (mlx-lm's point), then an eval of the caches.
fn prefill(
    model: &mut dyn LanguageModel,
    plan: &ForkPlan,
    caches: &mut Caches,
    tokens: &[u32],
    step: usize,
) -> Result<()> {
    for chunk in tokens.chunks(step.max(1)) {
        let ids: Vec<i32> = chunk.iter().map(|&t| t as i32).collect();
        model.forward(&Array::from_slice(&ids, &[1, ids.len() as i32]), caches)?;
        plan.quantize(caches)?;
        let state: Vec<Array> = caches.iter().flat_map(|c| c.state()).collect();
        eval(&state)?;
    }
    Ok(())
}

/// Times a prefill test: seconds for `prompt` after `context` is already cached.
pub fn time_prefill(
    loaded: &mut LoadedModel,
    context: &[u32],
    prompt: &[u32],
    step: usize,
) -> Result<f64> {
    let LoadedModel { model, plan, .. } = loaded;
    let mut caches = model.make_caches();
    plan.prepare(&mut caches);
    prefill(model.as_mut(), plan, &mut caches, context, step)?;
    let t = Instant::now();
    prefill(model.as_mut(), plan, &mut caches, prompt, step)?;
    Ok(t.elapsed().as_secs_f64())
}

/// Times a decode test: (seconds, tokens timed, speculative metrics). EOS is ignored.
pub fn time_decode<'a>(
    loaded: &'a mut LoadedModel,
    prompt: &[u32],
    n: usize,
    draft: Option<(Box<dyn DraftSource + 'a>, usize)>,
) -> Result<(f64, usize, Option<SpecMetrics>)> {
    let LoadedModel { model, plan, .. } = loaded;
    let mut sampler = Sampler::new(&SamplerConfig::default())?;
    let mut processors = LogitsProcessors::new(&ProcessorConfig::default())?;
    let mut spec = draft.map(|(source, k)| Speculation::new(source, k, VerifyMode::Match));
    let mut g = Generator::new(model.as_mut(), &mut sampler, &mut processors).with_plan(plan);
    if let Some(spec) = spec.as_mut() {
        g = g.with_speculation(spec);
    }
    let cfg = GenerateConfig {
        max_tokens: n,
        prefill_step_size: 2048,
    };
    let stats = g.run(prompt, &cfg, |_| Ok(Flow::Continue))?;
    let tokens = stats.generation_tokens.saturating_sub(1);
    let metrics = spec.map(|s| s.metrics);
    Ok((stats.generation_time.as_secs_f64(), tokens, metrics))
}
