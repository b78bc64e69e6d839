//! The one generation loop, mirroring mlx-lm 0.32.2's `generate_step`: the prompt minus its
//! last token is prefilled in chunks of `prefill_step_size`, the last prompt token goes alone,
//! and decoding is pipelined (the next step is queued before the current token is read).
//! Chunk boundaries change matmul shapes, so they are copied exactly to keep bits identical.

use super::error::{EngineError, Result};
use super::models::{Caches, LanguageModel};
use super::sample::{LogitsProcessors, Sampler};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{memory, ops, Array};
use std::time::{Duration, Instant};

/// Knobs of one generation that are not sampling settings.
#[derive(Debug, Clone)]
pub struct GenerateConfig {
    /// Tokens to generate at most (mlx-lm `--max-tokens`).
    pub max_tokens: usize,
    /// Prompt tokens per prefill forward (mlx-lm's default 2048).
    pub prefill_step_size: usize,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            prefill_step_size: 2048,
        }
    }
}

/// One generated token with the full-vocabulary logprobs it was sampled from.
pub struct Step {
    /// Position in the generated sequence (0-based).
    pub index: usize,
    /// The sampled token id.
    pub token: u32,
    /// Logprobs `[V]` in the model's dtype (after logits processors), as mlx-lm yields them.
    pub logprobs: Array,
}

/// Whether the consumer wants more tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Keep generating.
    Continue,
    /// Stop now (EOS, stop string, client gone).
    Stop,
}

/// Timings with mlx-lm's definitions (prompt time runs until the first token is available).
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Time from the start until the first generated token was read.
    pub prompt_time: Duration,
    /// Tokens handed to the consumer.
    pub generation_tokens: usize,
    /// Time from the first token to the last.
    pub generation_time: Duration,
    /// MLX peak memory in bytes.
    pub peak_memory: usize,
}

impl GenerationStats {
    /// Prompt tokens per second.
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }
    /// Generated tokens per second.
    pub fn generation_tps(&self) -> f64 {
        self.generation_tokens as f64 / self.generation_time.as_secs_f64().max(1e-9)
    }
}

/// The model, its caches and the sampling state for one request.
pub struct Generator<'a> {
    model: &'a mut dyn LanguageModel,
    caches: Caches,
    sampler: &'a mut Sampler,
    processors: &'a mut LogitsProcessors,
    /// Every token seen so far, for the logits processors (mlx-lm's `tokens`).
    history: Option<Array>,
}

impl<'a> Generator<'a> {
    /// Prepares a generation with fresh caches from the model.
    pub fn new(
        model: &'a mut dyn LanguageModel,
        sampler: &'a mut Sampler,
        processors: &'a mut LogitsProcessors,
    ) -> Self {
        let caches = model.make_caches();
        Self {
            model,
            caches,
            sampler,
            processors,
            history: None,
        }
    }

    fn remember(&mut self, tokens: &Array) -> Result<()> {
        if self.processors.is_empty() || tokens.size() == 0 {
            return Ok(());
        }
        self.history = Some(match self.history.take() {
            Some(h) => ops::concatenate(&[h, tokens.clone()], 0)?,
            None => tokens.clone(),
        });
        Ok(())
    }

    /// mlx-lm's `_step`: forward `tokens` ([L]), keep the last position, process, sample.
    fn step(&mut self, tokens: &Array) -> Result<(Array, Array)> {
        let logits = self
            .model
            .forward(&tokens.expand_dims(0)?, &mut self.caches)?;
        let mut logits = logits.index((.., -1, ..));
        if !self.processors.is_empty() && tokens.size() > 0 {
            self.remember(tokens)?;
            if let Some(h) = &self.history {
                logits = self.processors.apply(h, &logits)?;
            }
        }
        let logprobs = logits.subtract(logits.logsumexp(true)?)?;
        let sampled = self.sampler.sample(&logprobs)?;
        Ok((sampled, logprobs.squeeze_axes(&[0])?))
    }

    /// Runs the prompt then generates, calling `on_token` for each token until it returns
    /// [`Flow::Stop`] or `max_tokens` tokens were produced.
    pub fn run(
        mut self,
        prompt: &[u32],
        cfg: &GenerateConfig,
        mut on_token: impl FnMut(&Step) -> Result<Flow>,
    ) -> Result<GenerationStats> {
        if prompt.is_empty() {
            return Err(EngineError::Input(
                "the prompt is empty; give at least one token".into(),
            ));
        }
        let step_size = cfg.prefill_step_size.max(1);
        let start = Instant::now();
        let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let mut rest: &[i32] = &ids;
        while rest.len() > 1 {
            let n = step_size.min(rest.len() - 1);
            let chunk = Array::from_slice(&rest[..n], &[n as i32]);
            self.model
                .forward(&chunk.expand_dims(0)?, &mut self.caches)?;
            let state: Vec<Array> = self.caches.iter().flat_map(|c| c.state()).collect();
            eval(&state)?;
            self.remember(&chunk)?;
            rest = &rest[n..];
            memory::clear_cache()?;
        }
        let last = Array::from_slice(rest, &[rest.len() as i32]);
        let (mut y, mut logprobs) = self.step(&last)?;
        async_eval([&y, &logprobs])?;

        let mut stats = GenerationStats {
            prompt_tokens: prompt.len(),
            ..Default::default()
        };
        let mut first_token_at = start;
        let mut n = 0usize;
        loop {
            let next = if n != cfg.max_tokens {
                let (ny, nl) = self.step(&y)?;
                async_eval([&ny, &nl])?;
                Some((ny, nl))
            } else {
                None
            };
            if n == 0 {
                eval([&y])?;
                first_token_at = Instant::now();
                stats.prompt_time = first_token_at - start;
            }
            if n == cfg.max_tokens {
                break;
            }
            let token: u32 = y.try_item_cast::<u32>()?;
            stats.generation_tokens += 1;
            let flow = on_token(&Step {
                index: n,
                token,
                logprobs: logprobs.clone(),
            })?;
            if flow == Flow::Stop {
                break;
            }
            if n.is_multiple_of(256) {
                memory::clear_cache()?;
            }
            let Some((ny, nl)) = next else { break };
            y = ny;
            logprobs = nl;
            n += 1;
        }
        stats.generation_time = first_token_at.elapsed();
        stats.peak_memory = memory::peak_memory()?;
        Ok(stats)
    }

    /// One forward over `prompt` with fresh caches, returning all positions' logits `[L, V]`
    /// (what the parity tests compare position by position).
    pub fn prompt_logits(model: &mut dyn LanguageModel, prompt: &[u32]) -> Result<Array> {
        let mut caches = model.make_caches();
        let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let x = Array::from_slice(&ids, &[1, ids.len() as i32]);
        let logits = model.forward(&x, &mut caches)?;
        Ok(logits.squeeze_axes(&[0])?)
    }
}
