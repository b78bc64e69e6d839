//! The prompt of a request: the chat endpoint's `messages`, the completions endpoint's
//! `prompt`, and their token ids with the server's length limit.

use super::{CompletionRequest, Endpoint, Fields, Limits, PromptInput};
use crate::engine::tokenizer::{ChatMessage, Tokenizer};
use crate::server::error::ApiError;
use serde_json::{Map, Value};

/// `messages`: a non-empty array of `{role, content}` (content a string or text parts).
pub(super) fn messages(f: &Fields<'_>) -> Result<Vec<ChatMessage>, ApiError> {
    let list = match f.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ))
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages` must be an array, got {v}"),
            ))
        }
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = |field: &str| format!("messages[{i}].{field}");
            let obj = m.as_object().ok_or_else(|| {
                ApiError::invalid(&format!("messages[{i}]"), "each message must be an object")
            })?;
            let role = match obj.get("role") {
                Some(Value::String(r)) if !r.is_empty() => r.clone(),
                _ => {
                    return Err(ApiError::invalid(
                        &at("role"),
                        format!("`{}` must be a non-empty string", at("role")),
                    ))
                }
            };
            let content = match obj.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => text_parts(parts, &at("content"))?,
                Some(_) => {
                    return Err(ApiError::invalid(
                        &at("content"),
                        format!(
                            "`{}` must be a string or an array of text parts",
                            at("content")
                        ),
                    ))
                }
            };
            let mut fields: Map<String, Value> = obj
                .iter()
                .filter(|(k, _)| *k != "role" && *k != "content")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if let Some(Value::Array(calls)) = fields.get_mut("tool_calls") {
                parse_call_arguments(calls, &at("tool_calls"))?;
            }
            Ok(ChatMessage {
                role,
                content,
                fields,
            })
        })
        .collect()
}

/// An assistant message's `tool_calls` as templates expect them: each non-empty
/// `function.arguments` string parsed into its JSON value, as mlx-lm's server does.
fn parse_call_arguments(calls: &mut [Value], field: &str) -> Result<(), ApiError> {
    for (j, call) in calls.iter_mut().enumerate() {
        let Some(args) = call
            .get_mut("function")
            .and_then(|f| f.get_mut("arguments"))
        else {
            continue;
        };
        let Value::String(text) = args else {
            continue;
        };
        if text.is_empty() {
            continue;
        }
        *args = serde_json::from_str(text).map_err(|e| {
            let at = format!("{field}[{j}].function.arguments");
            ApiError::invalid(&at, format!("`{at}` must be JSON text ({e})"))
        })?;
    }
    Ok(())
}

/// Joins `[{"type": "text", "text": ...}, ...]` content parts.
fn text_parts(parts: &[Value], field: &str) -> Result<String, ApiError> {
    let mut out = String::new();
    for p in parts {
        match (p.get("type").and_then(Value::as_str), p.get("text")) {
            (Some("text"), Some(Value::String(t))) => out.push_str(t),
            _ => {
                return Err(ApiError::invalid(
                    field,
                    format!("`{field}` parts must be {{\"type\": \"text\", \"text\": \"...\"}} (this model reads text only)"),
                ))
            }
        }
    }
    Ok(out)
}

/// `prompt` of `/v1/completions`: a string, a one-string array, or token ids (flat or one
/// nested list).
pub(super) fn completion(f: &Fields<'_>, limits: &Limits) -> Result<PromptInput, ApiError> {
    let bad = |msg: String| ApiError::invalid("prompt", msg);
    let value = f
        .get("prompt")
        .ok_or_else(|| bad("`prompt` is required".into()))?;
    let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&id| id < limits.vocab_size as u64)
                    .map(|id| id as u32)
                    .ok_or_else(|| {
                        bad(format!(
                            "`prompt` token ids must be integers below the vocabulary size {}, got {v}",
                            limits.vocab_size
                        ))
                    })
            })
            .collect()
    };
    match value {
        Value::String(s) => Ok(PromptInput::Text(s.clone())),
        Value::Array(a) if a.is_empty() => Err(bad("`prompt` must not be empty".into())),
        Value::Array(a) => match &a[0] {
            Value::String(s) if a.len() == 1 => Ok(PromptInput::Text(s.clone())),
            Value::Array(inner) if a.len() == 1 => Ok(PromptInput::Ids(ids(inner)?)),
            Value::Number(_) => Ok(PromptInput::Ids(ids(a)?)),
            _ => Err(bad(
                "`prompt` must be one string or one list of token ids (batches are not supported)"
                    .into(),
            )),
        },
        v => Err(bad(format!("`prompt` must be a string, got {v}"))),
    }
}

/// Token ids for a request's prompt, as mlx-lm's server computes them: a conversation goes
/// through the chat template (which writes the special tokens), text is encoded with them.
pub fn prompt_ids(
    tokenizer: &Tokenizer,
    prompt: &PromptInput,
    tools: Option<&[Value]>,
) -> Result<Vec<u32>, ApiError> {
    let (field, ids) = match prompt {
        PromptInput::Ids(ids) => ("prompt", ids.clone()),
        PromptInput::Text(text) => ("prompt", encode(tokenizer.encode(text, true))?),
        PromptInput::Messages(messages) => {
            if !tokenizer.has_chat_template() {
                return Err(ApiError::invalid(
                    "messages",
                    "this model has no chat template; use /v1/completions with a plain prompt",
                ));
            }
            let rendered = tokenizer
                .apply_chat_template_with_tools(messages, tools, true)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            ("messages", encode(tokenizer.encode(&rendered, false))?)
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid(
            field,
            format!("`{field}` gives no tokens; send some text"),
        ));
    }
    Ok(ids)
}

/// A 400 (`context_length_exceeded`) when the tokenized prompt is longer than the server
/// allows (`--max-prompt-tokens`).
pub fn check_prompt_length(
    request: &CompletionRequest,
    tokens: usize,
    limits: &Limits,
) -> Result<(), ApiError> {
    if tokens <= limits.max_prompt_tokens {
        return Ok(());
    }
    let field = match request.endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Completions => "prompt",
    };
    Err(ApiError {
        code: Some("context_length_exceeded"),
        ..ApiError::invalid(
            field,
            format!(
                "`{field}` is {tokens} tokens long; this server takes at most {} (--max-prompt-tokens); shorten it",
                limits.max_prompt_tokens
            ),
        )
    })
}

fn encode(r: crate::engine::error::Result<Vec<u32>>) -> Result<Vec<u32>, ApiError> {
    r.map_err(|e| ApiError::invalid("prompt", e.to_string()))
}
