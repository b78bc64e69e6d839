//! Text generation on top of the token loop: seeding, the sampler and logits processors,
//! EOS handling, streaming detokenization and an optional [`Speculator`] (a drafter from
//! `crate::spec`). `mlxb generate`, `mlxb serve` and `mlxb measure` all drive their generations
//! through [`generate_text`], so they produce the same tokens and the same text for the same
//! settings.

use super::error::Result;
use super::generate::{Carry, Flow, GenerateConfig, GenerationStats, Generator, Speculator, Step};
use super::runtime;
use super::sample::{self, LogitsProcessors, ProcessorConfig, Sampler, SamplerConfig};
use super::session::Session;
use super::tokenizer::StreamingDetokenizer;

/// Everything one text generation needs besides the prompt and the drafter.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TextParams {
    /// Sampler settings; `xtc_special_tokens` is replaced by mlx-lm's choice (the encoding of
    /// "\n" plus the EOS ids).
    pub sampler: SamplerConfig,
    /// Logits-processor settings.
    pub processors: ProcessorConfig,
    /// Token budget and prefill chunking.
    pub generate: GenerateConfig,
    /// PRNG seed (like `mx.random.seed`), applied before the generation starts.
    pub seed: Option<u64>,
}

/// What the consumer of a generation is told.
pub enum TextEvent<'s> {
    /// A generated token other than EOS, with the text it completed (often empty while a
    /// multi-byte character or a word piece is still open).
    Token {
        /// The token, its position and its logprobs.
        step: &'s Step,
        /// Text this token released.
        text: &'s str,
    },
    /// Text the detokenizer released when the generation ended (never empty).
    Tail(&'s str),
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// The token budget ran out.
    Length,
    /// The consumer returned [`Flow::Stop`] (a stop string, a client that went away).
    Stopped,
}

impl FinishReason {
    /// The OpenAI / mlx-lm name: `length` when the budget ran out, `stop` otherwise.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Eos | FinishReason::Stopped => "stop",
        }
    }
}

/// What one generation produced.
pub struct Outcome {
    /// Decoded text (EOS excluded).
    pub text: String,
    /// Generated ids (EOS included when it ended the generation).
    pub token_ids: Vec<u32>,
    /// Why the generation ended.
    pub finish_reason: FinishReason,
    /// Timings and memory.
    pub stats: GenerationStats,
}

/// Generates from `prompt_ids` with `params`, reporting each token and the text it completes
/// to `on_event` until EOS, the token budget, or `on_event` returning [`Flow::Stop`]. With
/// `speculator` decoding runs in its rounds after the first token (it keeps its own counters);
/// with `carry` the generation starts from (and leaves its caches in) it: the server's
/// prompt-prefix reuse (see [`Carry`]).
pub fn generate_text(
    session: &mut Session,
    prompt_ids: &[u32],
    params: &TextParams,
    speculator: Option<&mut dyn Speculator>,
    carry: Option<&mut Carry>,
    mut on_event: impl FnMut(TextEvent<'_>) -> Result<Flow>,
) -> Result<Outcome> {
    if let Some(s) = params.seed {
        sample::seed(s)?;
    }
    let eos = session.tokenizer.eos_token_ids();
    let mut specials = session.tokenizer.encode("\n", false)?;
    specials.extend(eos.iter().copied());
    let mut sampler = Sampler::new(&SamplerConfig {
        xtc_special_tokens: specials,
        ..params.sampler.clone()
    })?;
    let mut processors = LogitsProcessors::new(&params.processors)?;
    let mut detok = StreamingDetokenizer::new(&session.tokenizer);
    let mut ids = Vec::new();
    let mut text = String::new();
    let mut finish_reason = FinishReason::Length;
    let plan = session.model.plan.clone();
    let mut generator = Generator::new(session.model.model.as_mut(), &mut sampler, &mut processors)
        .with_startup(session.startup.clone());
    if let Some(carry) = carry {
        generator = generator.with_carry(carry, prompt_ids)?;
    }
    let mut generator = generator.with_plan(&plan);
    if let Some(spec) = speculator {
        generator = generator.with_speculation(spec);
    }
    let result = generator.run(prompt_ids, &params.generate, |step| {
        ids.push(step.token);
        if eos.contains(&step.token) {
            finish_reason = FinishReason::Eos;
            return Ok(Flow::Stop);
        }
        detok.add_token(step.token);
        let seg = detok.last_segment();
        text.push_str(&seg);
        let flow = on_event(TextEvent::Token { step, text: &seg })?;
        if flow == Flow::Stop {
            finish_reason = FinishReason::Stopped;
        }
        Ok(flow)
    });
    // Let the step queued ahead finish before anyone (a CLI about to exit) moves on.
    let synced = runtime::synchronize();
    let stats = result?;
    synced?;
    detok.finalize();
    let seg = detok.last_segment();
    if !seg.is_empty() {
        text.push_str(&seg);
        on_event(TextEvent::Tail(&seg))?;
    }
    Ok(Outcome {
        text,
        token_ids: ids,
        finish_reason,
        stats,
    })
}
