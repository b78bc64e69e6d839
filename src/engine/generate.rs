//! The one generation loop, mirroring mlx-lm 0.32.2's `generate_step`: the prompt minus its
//! last token is prefilled in chunks of `prefill_step_size`, the last prompt token goes alone,
//! and decoding is pipelined (the next step is queued before the current token is read).
//! Chunk boundaries change matmul shapes, so they are copied exactly to keep bits identical.

use super::error::{EngineError, Result};
use super::kernels::reshaped_row;
use super::logprobs::{host_logprobs, logits_row};
use super::models::activations::CompiledOp;
use super::models::{Caches, ForwardOpts, LanguageModel};
use super::plan::ForkPlan;
use super::rollback::{rewind, Checkpoint, Rewind};
use super::sample::{LogitsProcessors, Sampler};
use super::startup::StartupTrace;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{memory, ops, Array};
use std::time::{Duration, Instant};

/// Knobs of one generation that are not sampling settings.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
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
    /// Every token fed so far, for the logits processors (mlx-lm's `tokens`).
    history: Option<Array>,
    /// What decodes after the first token when decoding speculatively.
    spec: Option<&'a mut dyn Speculator>,
    /// Positions the target's caches hold.
    positions: usize,
    /// The forks this generation runs with (KV quantization, attention plan).
    plan: ForkPlan,
    /// `--compiled-decode`: the compiled `logits - logsumexp(logits)` of each step.
    logprobs_op: Option<CompiledOp>,
    /// Tokens to feed instead of sampling (teacher forcing), in order.
    forced: Option<std::vec::IntoIter<u32>>,
    /// Where the caches go when the generation ends ([`Generator::with_carry`]).
    keep: Option<&'a mut Carry>,
    /// Where the prompt's prefill and the first token are marked as start-up steps.
    startup: StartupTrace,
}

/// KV caches handed from one generation to the next, so that a prompt sharing a prefix with
/// the previous one skips recomputing it (`mlxb serve`'s prefix reuse). The caller decides
/// how much is reusable and trims the caches to exactly that; the generation then leaves its
/// own caches here when it ends, whatever way it ends.
#[derive(Default)]
pub struct Carry {
    /// Per-layer caches (empty: none kept).
    pub caches: Caches,
    /// How many leading prompt positions `caches` hold for the next generation (0: start
    /// from fresh caches and ignore `caches`).
    pub reused: usize,
}

impl Drop for Generator<'_> {
    fn drop(&mut self) {
        if let Some(carry) = self.keep.take() {
            carry.caches = std::mem::take(&mut self.caches);
        }
    }
}

/// Decoding that produces several tokens per target forward once the first token is out:
/// speculative decoding (`crate::spec`) plugs in here, so the engine knows only this hook.
pub trait Speculator {
    /// Target layers whose outputs every target forward should hand to
    /// [`Speculator::observe_taps`] (the prompt's included).
    fn tap_layers(&self) -> Vec<usize>;

    /// Receives the tapped layer outputs of one target forward whose first row is at
    /// `first_position`.
    fn observe_taps(&mut self, first_position: usize, taps: Vec<Array>) -> Result<()>;

    /// Decodes after the prompt: `first` (sampled from the prompt exactly as the plain loop
    /// does, with `first_logprobs`) and what follows, reporting each token to `on_token`, until
    /// it returns [`Flow::Stop`] or `cfg.max_tokens` tokens are out. `stats` holds the prompt's
    /// timings; the generation's are added.
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        generator: Generator<'_>,
        prompt: &[u32],
        first: u32,
        first_logprobs: Array,
        cfg: &GenerateConfig,
        stats: GenerationStats,
        on_token: &mut dyn FnMut(&Step) -> Result<Flow>,
    ) -> Result<GenerationStats>;
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
            spec: None,
            positions: 0,
            plan: ForkPlan::default(),
            logprobs_op: None,
            forced: None,
            keep: None,
            startup: StartupTrace::default(),
        }
    }

    /// Marks the end of the prompt's prefill and the first token computed on `startup`.
    pub fn with_startup(mut self, startup: StartupTrace) -> Self {
        self.startup = startup;
        self
    }

    /// Starts from `carry`'s caches, which hold exactly the first `carry.reused` positions of
    /// `prompt` (then only the rest of the prompt is prefilled), and leaves this generation's
    /// caches in `carry` when it ends. Call before [`Generator::with_plan`].
    pub fn with_carry(mut self, carry: &'a mut Carry, prompt: &[u32]) -> Result<Self> {
        let reused = carry.reused;
        if reused > 0 {
            let held = carry.caches.iter().map(|c| c.offset()).collect::<Vec<_>>();
            if reused >= prompt.len() || held.iter().any(|&o| o as usize != reused) {
                return Err(EngineError::Runtime(format!(
                    "reused caches hold {held:?} positions, expected {reused} of a {}-token prompt",
                    prompt.len()
                )));
            }
            self.caches = std::mem::take(&mut carry.caches);
            self.positions = reused;
            let ids: Vec<i32> = prompt[..reused].iter().map(|&t| t as i32).collect();
            self.remember(&Array::from_slice(&ids, &[reused as i32]))?;
        }
        self.keep = Some(carry);
        Ok(self)
    }

    /// Teacher forcing: the steps emit `tokens` in order instead of sampling (while they
    /// last), each still reported with the logprobs the model computed for it. Used to compare
    /// two fork combinations' distributions on the same token sequence.
    pub fn with_forced_tokens(mut self, tokens: Vec<u32>) -> Self {
        self.forced = Some(tokens.into_iter());
        self
    }

    /// Runs with `plan` (from [`crate::engine::models::LoadedModel::plan`]) instead of the
    /// L1 defaults: sets the attention plan on the caches, quantizes KV caches where the plan
    /// says (at mlx-lm's points: after every forward), compiles the logprobs tail under
    /// `--compiled-decode`.
    pub fn with_plan(mut self, plan: &ForkPlan) -> Self {
        plan.prepare(&mut self.caches);
        self.logprobs_op = plan.forks.compiled_decode.then(|| {
            CompiledOp::new(
                |a: &[Array]| Ok(vec![a[0].subtract(a[0].logsumexp(true)?)?]),
                false,
                true,
            )
        });
        self.plan = plan.clone();
        self
    }

    /// Decodes speculatively: `spec` takes over after the first token (same prefill, same
    /// first step) and receives the tapped layers of every target forward.
    pub fn with_speculation(mut self, spec: &'a mut dyn Speculator) -> Self {
        self.spec = Some(spec);
        self
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

    /// Forwards `tokens` (`[L]`) through the target, handing tapped layers to the attached
    /// [`Speculator`].
    fn forward_tokens(&mut self, tokens: &Array) -> Result<Array> {
        let layers = self
            .spec
            .as_ref()
            .map(|s| s.tap_layers())
            .unwrap_or_default();
        let (logits, first, taps) = self.forward_tapped(tokens, layers)?;
        if let Some(spec) = self.spec.as_mut() {
            if !taps.is_empty() {
                spec.observe_taps(first, taps)?;
            }
        }
        Ok(logits)
    }

    /// Forwards `tokens` (`[L]`) through the target, returning the logits, the position of the
    /// first row and the outputs of the layers `taps` asks for.
    pub fn forward_tapped(
        &mut self,
        tokens: &Array,
        taps: Vec<usize>,
    ) -> Result<(Array, usize, Vec<Array>)> {
        let opts = ForwardOpts {
            exit_after: None,
            taps,
        };
        let out = self
            .model
            .forward_ext(&reshaped_row(tokens, true)?, &mut self.caches, &opts)?;
        let first = self.positions;
        self.positions += tokens.size();
        Ok((out.logits, first, out.taps))
    }

    /// mlx-lm's logits → processors → logprobs for one row `[1, V]` whose input token was
    /// `fed` (added to the processors' history first, as `_step` does).
    pub fn logprobs_row(&mut self, row: Array, fed: &Array) -> Result<Array> {
        let mut logits = row;
        if !self.processors.is_empty() && fed.size() > 0 {
            self.remember(fed)?;
            if let Some(h) = &self.history {
                logits = self.processors.apply(h, &logits)?;
            }
        }
        if let Some(op) = self.logprobs_op.as_mut() {
            return op.call1(&[logits]);
        }
        // Logits the host step made are still on the host: the tail runs there, same bits.
        if self.plan.forks.host_elem() {
            if let Some(logprobs) = host_logprobs(&logits)? {
                return Ok(logprobs);
            }
        }
        Ok(logits.subtract(logits.logsumexp(true)?)?)
    }

    /// Positions the target's caches hold.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// The target and its caches, for a drafter that reads them (the caches read-only).
    pub fn target(&mut self) -> (&mut dyn LanguageModel, &Caches) {
        (&mut *self.model, &self.caches)
    }

    /// The sampler this generation samples with.
    pub fn sampler(&mut self) -> &mut Sampler {
        self.sampler
    }

    /// Whether logits processors change the logits before sampling.
    pub fn has_processors(&self) -> bool {
        !self.processors.is_empty()
    }

    /// The most tokens a block fed at the current position may hold so that it does not
    /// straddle the switch to quantized KV caches; `None`: no limit.
    pub fn max_block(&self) -> Option<usize> {
        self.plan.max_draft(self.positions)
    }

    /// Saves the caches before a block that may be partly taken back ([`Generator::rewind`]).
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint::take(&self.caches, self.positions)
    }

    /// Takes the caches back to `keep` positions after a block fed since `checkpoint`
    /// (`tokens`: the ids of positions `checkpoint.positions()..keep`, replayed where a cache
    /// cannot trim exactly), then quantizes them where the plan says, as after any forward.
    pub fn rewind(
        &mut self,
        checkpoint: Checkpoint,
        keep: usize,
        tokens: &[u32],
    ) -> Result<Rewind> {
        let model = &mut *self.model;
        let how = rewind(
            &mut self.caches,
            checkpoint,
            self.positions,
            keep,
            tokens,
            |t, caches| {
                let ids: Vec<i32> = t.iter().map(|&x| x as i32).collect();
                let x = Array::from_slice(&ids, &[1, ids.len() as i32]);
                model.forward(&x, caches).map(|_| ())
            },
        )?;
        self.positions = keep;
        self.plan.quantize(&mut self.caches)?;
        Ok(how)
    }

    /// mlx-lm's `_step`: forward `tokens` ([L]), keep the last position, process, sample.
    fn step(&mut self, tokens: &Array) -> Result<(Array, Array)> {
        let logits = self.forward_tokens(tokens)?;
        self.plan.quantize(&mut self.caches)?;
        let last = logits.shape()[1].max(1) as usize - 1;
        let logprobs = self.logprobs_row(logits_row(&logits, last), tokens)?;
        let sampled = match self.forced.as_mut().and_then(Iterator::next) {
            Some(t) => Array::from_slice(&[t], &[1]),
            None => self.sampler.sample(&logprobs)?,
        };
        Ok((sampled, reshaped_row(&logprobs, false)?))
    }

    /// Builds the step that feeds `y` and starts evaluating it without waiting.
    fn queue_step(&mut self, y: &Array) -> Result<(Array, Array)> {
        let (ny, nl) = self.step(y)?;
        async_eval([&ny, &nl])?;
        Ok((ny, nl))
    }

    /// Runs the prompt then generates, calling `on_token` for each token until it returns
    /// [`Flow::Stop`] or `max_tokens` tokens were produced. Returns the timings (an attached
    /// [`Speculator`] keeps its own counters).
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
        // Positions carried over from an earlier generation are not prefilled again.
        let mut rest: &[i32] = &ids[self.positions.min(ids.len() - 1)..];
        while rest.len() > 1 {
            let n = step_size.min(rest.len() - 1);
            let chunk = Array::from_slice(&rest[..n], &[n as i32]);
            self.forward_tokens(&chunk)?;
            self.plan.quantize(&mut self.caches)?;
            let state: Vec<Array> = self.caches.iter().flat_map(|c| c.state()).collect();
            eval(&state)?;
            self.remember(&chunk)?;
            rest = &rest[n..];
            memory::clear_cache()?;
        }
        self.startup.mark("prompt prefilled");
        let last = Array::from_slice(rest, &[rest.len() as i32]);
        // The first token on MLX alone: its graph stays lazy and the host kernels' first-use
        // checks wait for the second token (same bits either way).
        let (mut y, mut logprobs) = super::kernels::mlx_only(|| self.step(&last))?;
        async_eval([&y, &logprobs])?;

        let mut stats = GenerationStats {
            prompt_tokens: prompt.len(),
            ..Default::default()
        };
        if let Some(spec) = self.spec.take() {
            eval([&y])?;
            stats.prompt_time = start.elapsed();
            let first = y.try_item_cast::<u32>()?;
            return spec.decode(self, prompt, first, logprobs, cfg, stats, &mut on_token);
        }
        eval([&y])?;
        self.startup.mark("first token computed");
        let first_token_at = Instant::now();
        stats.prompt_time = first_token_at - start;
        let mut n = 0usize;
        while n < cfg.max_tokens {
            // Step n+1 is queued before token n is handed out, so the consumer's work overlaps
            // the model's. Not for the first token (it goes out the moment it exists: with the
            // host mat-vec a queued step runs at once, delaying it by a whole step) nor for the
            // last one (a step whose token would never be emitted).
            let wanted = n + 1 < cfg.max_tokens;
            let mut next = if n > 0 && wanted {
                Some(self.queue_step(&y)?)
            } else {
                None
            };
            let token: u32 = y.try_item_cast::<u32>()?;
            stats.generation_tokens += 1;
            let flow = on_token(&Step {
                index: n,
                token,
                logprobs: logprobs.clone(),
            })?;
            if flow == Flow::Stop || !wanted {
                break;
            }
            if n.is_multiple_of(256) {
                memory::clear_cache()?;
            }
            (y, logprobs) = match next.take() {
                Some(queued) => queued,
                None => self.queue_step(&y)?,
            };
            n += 1;
        }
        stats.generation_time = first_token_at.elapsed();
        // The loop queues one step ahead; let it finish before anything is torn down
        // (exiting with MLX still running it aborted the process now and then).
        super::runtime::synchronize()?;
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
