//! OpenAI response shapes (chat completions, text completions, their stream chunks, models)
//! plus llama.cpp's `timings` object.

use crate::engine::generate::GenerationStats;
use crate::spec::metrics::SpecMetrics;
use serde::Serialize;
use std::collections::BTreeMap;

/// Token counts of one request.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (EOS included when it ended the generation).
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// Prompt details (`cached_tokens`: prompt tokens served from a reused cache).
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the previous request (see `server::prefix`).
    pub cached_tokens: usize,
}

impl Usage {
    /// Usage for `prompt` prompt tokens (`cached` of them reused from an earlier request) and
    /// `completion` generated ones.
    pub fn new(prompt: usize, cached: usize, completion: usize) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }
}

/// llama.cpp's per-request `timings`, with `draft_n`/`draft_n_accepted` when speculating.
#[derive(Debug, Clone, Serialize)]
pub struct Timings {
    /// Prompt tokens.
    pub prompt_n: usize,
    /// Prompt time in ms (to the first token, as mlx-lm measures it).
    pub prompt_ms: f64,
    /// ms per prompt token.
    pub prompt_per_token_ms: f64,
    /// Prompt tokens per second.
    pub prompt_per_second: f64,
    /// Generated tokens.
    pub predicted_n: usize,
    /// Generation time in ms (first token to last).
    pub predicted_ms: f64,
    /// ms per generated token.
    pub predicted_per_token_ms: f64,
    /// Generated tokens per second.
    pub predicted_per_second: f64,
    /// Drafted tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_n: Option<usize>,
    /// Drafted tokens the target accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_n_accepted: Option<usize>,
    /// Verify rounds that carried a draft (mlxb's own field: the mean acceptance length is
    /// `1 + draft_n_accepted / draft_rounds`, vLLM's definition).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_rounds: Option<usize>,
}

impl Timings {
    /// Timings of a finished generation.
    pub fn new(stats: &GenerationStats, spec: Option<&SpecMetrics>) -> Self {
        let prompt_ms = stats.prompt_time.as_secs_f64() * 1e3;
        let predicted_ms = stats.generation_time.as_secs_f64() * 1e3;
        let per = |ms: f64, n: usize| ms / n.max(1) as f64;
        Self {
            prompt_n: stats.prompt_tokens,
            prompt_ms,
            prompt_per_token_ms: per(prompt_ms, stats.prompt_tokens),
            prompt_per_second: stats.prompt_tps(),
            predicted_n: stats.generation_tokens,
            predicted_ms,
            predicted_per_token_ms: per(predicted_ms, stats.generation_tokens),
            predicted_per_second: stats.generation_tps(),
            draft_n: spec.map(|s| s.drafted_tokens),
            draft_n_accepted: spec.map(|s| s.accepted_tokens),
            draft_rounds: spec.map(|s| s.drafts),
        }
    }
}

/// One alternative token with its logprob.
#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the text.
    pub bytes: Vec<u8>,
}

/// A generated token with its logprob and the most likely alternatives (chat format).
#[derive(Debug, Clone, Serialize)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the text.
    pub bytes: Vec<u8>,
    /// The most likely tokens at this position, best first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// Chat `choices[].logprobs`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<TokenLogprob>,
}

/// Completions `choices[].logprobs` (the legacy shape).
#[derive(Debug, Clone, Default, Serialize)]
pub struct TextLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// The most likely alternatives at each position.
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    /// Character offset of each token in the completion text.
    pub text_offset: Vec<usize>,
}

impl TextLogprobs {
    /// Appends one token that starts at `offset` in the text.
    pub fn push(&mut self, t: TokenLogprob, offset: usize) {
        self.top_logprobs.push(
            t.top_logprobs
                .into_iter()
                .map(|a| (a.token, a.logprob))
                .collect(),
        );
        self.tokens.push(t.token);
        self.token_logprobs.push(t.logprob);
        self.text_offset.push(offset);
    }
}

/// The assistant's message.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text (tool calls cut out).
    pub content: String,
    /// The calls the reply makes (OpenAI's `tool_calls`), when it makes any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Always 0 (n = 1).
    pub index: usize,
    /// The reply.
    pub message: AssistantMessage,
    /// Logprobs, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
    /// Generated ids, with `return_token_ids`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// `POST /v1/chat/completions` without streaming.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model id.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
    /// llama.cpp timings.
    pub timings: Timings,
}

/// The incremental part of a streamed chat message.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    /// `assistant` in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Calls completed since the last chunk, each with its `index` in the reply.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
}

/// One choice of a chat stream chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    /// Always 0.
    pub index: usize,
    /// New text.
    pub delta: Delta,
    /// Logprobs of the tokens in this chunk, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the last chunk.
    pub finish_reason: Option<&'static str>,
    /// Generated ids, in the last chunk with `return_token_ids`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A `chat.completion.chunk` server-sent event.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    /// Same id in every chunk of a stream.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model id.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<ChatChunkChoice>,
    /// In the usage chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// In the usage chunk (or the last chunk) only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// One choice of a text completion (whole or chunk).
#[derive(Debug, Clone, Serialize)]
pub struct TextChoice {
    /// Always 0.
    pub index: usize,
    /// Generated text (all of it, or this chunk's).
    pub text: String,
    /// Logprobs, when asked for.
    pub logprobs: Option<TextLogprobs>,
    /// `stop`/`length` at the end, `null` in earlier chunks.
    pub finish_reason: Option<&'static str>,
    /// Generated ids, with `return_token_ids`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// `POST /v1/completions`, whole or as a stream chunk (OpenAI uses one shape for both).
#[derive(Debug, Clone, Serialize)]
pub struct TextCompletion {
    /// `cmpl-...`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model id.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<TextChoice>,
    /// Token counts (whole responses and the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// llama.cpp timings (whole responses and the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// An entry of `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// Model id for requests' `model`.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds (server start).
    pub created: u64,
    /// `mlxb`.
    pub owned_by: &'static str,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
}
