//! Parsing and validating OpenAI request bodies at the boundary. Fields are read one by one
//! from the JSON object so that every mistake is answered with a 400 naming the field;
//! fields this server does not use (`user`, `metadata`, ...) are ignored, as OpenAI does.
//! The prompt (`messages` or `prompt`, its token ids and their length limit) is read in
//! `prompt`; the sampling, budget and response fields here.

mod prompt;
mod tools;

pub use prompt::{check_prompt_length, prompt_ids};
pub use tools::ToolUse;

use super::error::ApiError;
use crate::engine::generate::GenerateConfig;
use crate::engine::sample::{ProcessorConfig, SamplerConfig};
use crate::engine::text::TextParams;
use crate::engine::tokenizer::ChatMessage;
use serde_json::{Map, Value};

/// Which endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

/// Server-wide bounds and defaults that requests are checked against.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Names a request's `model` may use (the served model's id and the `--model` value).
    pub model_ids: Vec<String>,
    /// The model's vocabulary size (token ids, `top_k` and `logit_bias` keys stay below it).
    pub vocab_size: usize,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
    /// The largest `max_tokens` a request may ask for.
    pub max_tokens_limit: usize,
    /// The longest prompt, in tokens, a request may send.
    pub max_prompt_tokens: usize,
    /// Prompt tokens per prefill forward.
    pub prefill_step_size: usize,
    /// Whether the server was started with a drafter (per-request `num_draft_tokens`).
    pub has_drafter: bool,
}

/// `serve --default-max-tokens`'s default (mlx-lm's server uses 512).
pub const DEFAULT_MAX_TOKENS: usize = 512;
/// `serve --max-tokens-limit`'s and `--max-prompt-tokens`'s default.
pub const DEFAULT_TOKEN_LIMIT: usize = 32768;

impl Limits {
    /// Limits for a model of `vocab_size` tokens served as `model_ids`, every bound at serve's
    /// flag defaults. Callers that set a few fields write `Limits { .., ..Limits::new(..) }`,
    /// so a new field does not break them (the fuzz target, tests).
    pub fn new(model_ids: Vec<String>, vocab_size: usize) -> Self {
        Self {
            model_ids,
            vocab_size,
            default_max_tokens: DEFAULT_MAX_TOKENS,
            max_tokens_limit: DEFAULT_TOKEN_LIMIT,
            max_prompt_tokens: DEFAULT_TOKEN_LIMIT,
            prefill_step_size: 2048,
            has_drafter: false,
        }
    }
}

/// Most tokens a speculative round may draft when a request sets `num_draft_tokens`.
pub const MAX_DRAFT_TOKENS: u64 = 64;
/// Most `top_logprobs` a request may ask for (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: u64 = 20;
/// Most stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;

/// The prompt as the client gave it.
#[derive(Debug, Clone)]
pub enum PromptInput {
    /// A conversation, formatted with the model's chat template.
    Messages(Vec<ChatMessage>),
    /// Plain text, tokenized with the tokenizer's special tokens.
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
}

/// A validated completion request.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    /// The endpoint it came through (decides the response shapes).
    pub endpoint: Endpoint,
    /// The prompt.
    pub prompt: PromptInput,
    /// Sampling, processors, token budget and seed.
    pub params: TextParams,
    /// Stop strings; generation ends at the first one and it is cut from the text.
    pub stop: Vec<String>,
    /// Answer with server-sent events.
    pub stream: bool,
    /// Streaming only: send a last chunk with `usage`.
    pub include_usage: bool,
    /// `Some(n)` when logprobs were asked for, with `n` top alternatives per token.
    pub logprobs: Option<usize>,
    /// Tokens per speculative round for this request (0 = no speculation); `None` keeps the
    /// server's setting.
    pub num_draft_tokens: Option<usize>,
    /// Return the generated token ids in the choice (vLLM's `return_token_ids`).
    pub return_token_ids: bool,
    /// Tools offered to the model and how its calls are returned (chat only).
    pub tool_use: ToolUse,
}

/// Reads typed fields of a JSON object; `null` counts as absent.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    /// The field read by `read`, or a 400 saying it must be `what`.
    fn typed<T>(
        &self,
        name: &str,
        what: &str,
        read: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => read(v).map(Some).ok_or_else(|| {
                ApiError::invalid(name, format!("`{name}` must be {what}, got {v}"))
            }),
        }
    }

    fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        self.typed(name, "a number", |v| v.as_f64().filter(|x| x.is_finite()))
    }

    fn integer(&self, name: &str) -> Result<Option<u64>, ApiError> {
        self.typed(name, "a non-negative integer", Value::as_u64)
    }

    fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.typed(name, "true or false", Value::as_bool)
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        self.typed(name, "a string", Value::as_str)
    }

    fn number_in(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        within(name, self.number(name)?, lo, hi)
    }

    fn integer_in(&self, name: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
        within(name, self.integer(name)?, lo, hi)
    }
}

/// `x` unless it lies outside `lo..=hi` (then a 400 naming `name`).
fn within<T: PartialOrd + std::fmt::Display + Copy>(
    name: &str,
    x: Option<T>,
    lo: T,
    hi: T,
) -> Result<Option<T>, ApiError> {
    match x {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid(
            name,
            format!("`{name}` must be between {lo} and {hi}, got {x}"),
        )),
        _ => Ok(x),
    }
}

fn usize_of(x: u64) -> usize {
    usize::try_from(x).unwrap_or(usize::MAX)
}

/// Parses and validates a request body for `endpoint`.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    limits: &Limits,
) -> Result<CompletionRequest, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    let map = value
        .as_object()
        .ok_or_else(|| ApiError::bad_request("the request body must be a JSON object"))?;
    let f = Fields(map);

    check_served(&f, limits)?;
    let prompt = match endpoint {
        Endpoint::Chat => PromptInput::Messages(prompt::messages(&f)?),
        Endpoint::Completions => {
            if f.boolean("echo")? == Some(true) {
                return Err(ApiError::invalid("echo", "`echo` is not supported"));
            }
            prompt::completion(&f, limits)?
        }
    };
    let max_tokens = max_tokens(&f, limits)?;
    let vocab = limits.vocab_size as u64;
    let sampler = sampler(&f, vocab)?;
    let processors = processors(&f, vocab)?;
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = include_usage(&f)?;
    let num_draft_tokens = num_draft_tokens(&f, limits)?;
    let tool_use = match endpoint {
        Endpoint::Chat => tools::tool_use(&f)?,
        Endpoint::Completions => ToolUse {
            parse: false,
            ..ToolUse::default()
        },
    };
    Ok(CompletionRequest {
        endpoint,
        prompt,
        params: TextParams {
            sampler,
            processors,
            generate: GenerateConfig {
                max_tokens,
                prefill_step_size: limits.prefill_step_size,
            },
            seed: f.integer("seed")?,
        },
        stop: stop(&f)?,
        stream,
        include_usage: stream && include_usage,
        logprobs: logprobs(endpoint, &f)?,
        num_draft_tokens,
        return_token_ids: f.boolean("return_token_ids")?.unwrap_or(false),
        tool_use,
    })
}

/// Refuses what this server cannot serve per request: another model, `n` other than 1, and
/// fields that would name files (drafter, adapters).
fn check_served(f: &Fields<'_>, limits: &Limits) -> Result<(), ApiError> {
    if let Some(model) = f.string("model")? {
        if !limits.model_ids.iter().any(|m| m == model) {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "model '{model}' is not served here; this server serves '{}' (see GET /v1/models)",
                    limits.model_ids.first().map(String::as_str).unwrap_or("")
                ),
            ));
        }
    }
    if let Some(n) = f.integer("n")? {
        if n != 1 {
            return Err(ApiError::invalid("n", "only `n` = 1 is supported"));
        }
    }
    if let Some(name) = ["draft_model", "adapters", "adapter_path"]
        .into_iter()
        .find(|k| f.get(k).is_some())
    {
        return Err(ApiError::invalid(
            name,
            format!("`{name}` is not accepted per request: requests never name files; choose it when starting `mlxb serve`"),
        ));
    }
    Ok(())
}

/// The token budget: `max_completion_tokens`, else `max_tokens`, else the server's default;
/// at least 1 and at most the server's limit.
fn max_tokens(f: &Fields<'_>, limits: &Limits) -> Result<usize, ApiError> {
    let (tokens_field, max_tokens) = match f.integer("max_completion_tokens")? {
        Some(n) => ("max_completion_tokens", Some(n)),
        None => ("max_tokens", f.integer("max_tokens")?),
    };
    match max_tokens {
        None => Ok(limits.default_max_tokens),
        Some(n) if n >= 1 && n <= limits.max_tokens_limit as u64 => Ok(usize_of(n)),
        Some(n) => Err(ApiError::invalid(
            tokens_field,
            format!(
                "`{tokens_field}` must be between 1 and {}, got {n}",
                limits.max_tokens_limit
            ),
        )),
    }
}

/// `temperature`, `top_p`, `min_p` and `top_k` (below the vocabulary size `vocab`).
fn sampler(f: &Fields<'_>, vocab: u64) -> Result<SamplerConfig, ApiError> {
    let temp = match f.number("temperature")? {
        Some(t) if t < 0.0 => {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be >= 0, got {t}"),
            ))
        }
        t => t.unwrap_or(0.0),
    };
    let top_p = f.number_in("top_p", 0.0, 1.0)?.unwrap_or(1.0);
    let min_p = f.number_in("min_p", 0.0, 1.0)?.unwrap_or(0.0);
    let top_k = f
        .integer_in("top_k", 0, vocab.saturating_sub(1))?
        .map_or(0, usize_of);
    Ok(SamplerConfig {
        temp,
        top_p,
        min_p,
        top_k,
        ..SamplerConfig::default()
    })
}

/// The logits processors: repetition, presence and frequency penalties and `logit_bias`.
fn processors(f: &Fields<'_>, vocab: u64) -> Result<ProcessorConfig, ApiError> {
    let repetition_penalty = match f.number("repetition_penalty")? {
        Some(p) if p < 0.0 => {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("`repetition_penalty` must be >= 0, got {p}"),
            ))
        }
        p => p,
    };
    let defaults = ProcessorConfig::default();
    Ok(ProcessorConfig {
        logit_bias: logit_bias(f, vocab)?,
        repetition_penalty,
        repetition_context_size: f.integer("repetition_context_size")?.map_or(20, usize_of),
        presence_penalty: f.number_in("presence_penalty", -2.0, 2.0)?,
        frequency_penalty: f.number_in("frequency_penalty", -2.0, 2.0)?,
        ..defaults
    })
}

/// `stream_options.include_usage` (an object's boolean field; absent is false).
fn include_usage(f: &Fields<'_>) -> Result<bool, ApiError> {
    match f.get("stream_options") {
        None => Ok(false),
        Some(Value::Object(o)) => Ok(Fields(o)
            .boolean("include_usage")
            .map_err(|_| {
                ApiError::invalid(
                    "stream_options.include_usage",
                    "`stream_options.include_usage` must be true or false",
                )
            })?
            .unwrap_or(false)),
        Some(v) => Err(ApiError::invalid(
            "stream_options",
            format!("`stream_options` must be an object, got {v}"),
        )),
    }
}

/// `num_draft_tokens` (at most [`MAX_DRAFT_TOKENS`]); a positive value needs a drafter.
fn num_draft_tokens(f: &Fields<'_>, limits: &Limits) -> Result<Option<usize>, ApiError> {
    let num_draft_tokens = f
        .integer_in("num_draft_tokens", 0, MAX_DRAFT_TOKENS)?
        .map(usize_of);
    if num_draft_tokens.is_some_and(|k| k > 0) && !limits.has_drafter {
        return Err(ApiError::invalid(
            "num_draft_tokens",
            "this server has no drafter; start it with --draft-kind (and --draft-model for `model`)",
        ));
    }
    Ok(num_draft_tokens)
}

/// `stop`: a string or an array of non-empty strings.
fn stop(f: &Fields<'_>) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "stop",
            format!("`stop` must be a non-empty string or an array of at most {MAX_STOP_STRINGS} non-empty strings"),
        )
    };
    let list = match f.get("stop") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOP_STRINGS => a
            .iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(bad))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad()),
    };
    if list.iter().any(String::is_empty) {
        return Err(bad());
    }
    Ok(list)
}

/// `logit_bias`: `{"token id": bias}` with biases in [-100, 100].
fn logit_bias(f: &Fields<'_>, vocab: u64) -> Result<Vec<(u32, f64)>, ApiError> {
    let Some(value) = f.get("logit_bias") else {
        return Ok(Vec::new());
    };
    let bad = |msg: String| ApiError::invalid("logit_bias", msg);
    let map = value
        .as_object()
        .ok_or_else(|| bad(format!("`logit_bias` must be an object, got {value}")))?;
    map.iter()
        .map(|(k, v)| {
            let id = k
                .parse::<u64>()
                .ok()
                .filter(|&id| id < vocab)
                .ok_or_else(|| {
                    bad(format!(
                        "`logit_bias` keys must be token ids below {vocab}, got {k:?}"
                    ))
                })?;
            let bias = v
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    bad(format!(
                        "`logit_bias` values must be numbers in [-100, 100], got {v}"
                    ))
                })?;
            Ok((id as u32, bias))
        })
        .collect()
}

/// `logprobs` (+ `top_logprobs` for chat) → how many alternatives per token, if any.
fn logprobs(endpoint: Endpoint, f: &Fields<'_>) -> Result<Option<usize>, ApiError> {
    match endpoint {
        Endpoint::Chat => {
            let on = f.boolean("logprobs")?.unwrap_or(false);
            let top = f.integer_in("top_logprobs", 0, MAX_TOP_LOGPROBS)?;
            if top.is_some() && !on {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs`: true",
                ));
            }
            Ok(on.then(|| top.map_or(0, usize_of)))
        }
        Endpoint::Completions => Ok(f.integer_in("logprobs", 0, MAX_TOP_LOGPROBS)?.map(usize_of)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            model_ids: vec!["tiny".into()],
            vocab_size: 384,
            default_max_tokens: 16,
            max_tokens_limit: 100,
            max_prompt_tokens: 1000,
            prefill_step_size: 2048,
            has_drafter: false,
        }
    }

    fn param_of(endpoint: Endpoint, body: &str) -> Option<String> {
        parse(endpoint, body.as_bytes(), &limits())
            .err()
            .map(|e| e.param.unwrap_or_default())
    }

    #[test]
    fn accepts_a_plain_chat_request() {
        let r = parse(
            Endpoint::Chat,
            br#"{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stop":"x","stream":true,"stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":2}"#,
            &limits(),
        )
        .unwrap();
        assert_eq!(r.params.generate.max_tokens, 5);
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert!(r.stream && r.include_usage);
        assert_eq!(r.logprobs, Some(2));
    }

    #[test]
    fn names_the_field_at_fault() {
        let chat = |extra: &str| {
            param_of(
                Endpoint::Chat,
                &format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#),
            )
        };
        assert_eq!(chat(r#","temperature":-1"#).as_deref(), Some("temperature"));
        assert_eq!(
            chat(r#","temperature":"hot""#).as_deref(),
            Some("temperature")
        );
        assert_eq!(chat(r#","max_tokens":0"#).as_deref(), Some("max_tokens"));
        assert_eq!(
            chat(r#","max_completion_tokens":1000"#).as_deref(),
            Some("max_completion_tokens")
        );
        assert_eq!(chat(r#","model":"other""#).as_deref(), Some("model"));
        assert_eq!(chat(r#","top_k":384"#).as_deref(), Some("top_k"));
        assert_eq!(chat(r#","stop":[1]"#).as_deref(), Some("stop"));
        assert_eq!(
            chat(r#","num_draft_tokens":2"#).as_deref(),
            Some("num_draft_tokens")
        );
        assert_eq!(
            chat(r#","draft_model":"/etc""#).as_deref(),
            Some("draft_model")
        );
        assert_eq!(
            chat(r#","top_logprobs":2"#).as_deref(),
            Some("top_logprobs")
        );
        assert_eq!(
            param_of(
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":5}]}"#
            )
            .as_deref(),
            Some("messages[0].content")
        );
        assert_eq!(
            param_of(Endpoint::Completions, r#"{"prompt":[1,2,999]}"#).as_deref(),
            Some("prompt")
        );
        assert_eq!(
            param_of(Endpoint::Completions, "{}").as_deref(),
            Some("prompt")
        );
        assert_eq!(param_of(Endpoint::Chat, "{oops").as_deref(), Some(""));
    }

    #[test]
    fn reads_token_id_prompts() {
        let r = parse(Endpoint::Completions, br#"{"prompt":[[5,6,7]]}"#, &limits()).unwrap();
        assert!(matches!(r.prompt, PromptInput::Ids(ref ids) if ids == &[5, 6, 7]));
        assert_eq!(r.params.generate.max_tokens, 16);
        assert_eq!(r.params.sampler.temp, 0.0);
    }
}
