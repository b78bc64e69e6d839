//! A Messages request as the equivalent chat-completions body, so one parser validates both
//! APIs. Field names in errors are the Messages API's own where they differ.

use crate::server::error::ApiError;
use serde_json::{json, Map, Value};

/// The chat-completions body for a Messages request body.
pub fn to_chat_body(body: &[u8]) -> Result<Vec<u8>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    let req = value
        .as_object()
        .ok_or_else(|| ApiError::bad_request("the request body must be a JSON object"))?;
    let max_tokens = req
        .get("max_tokens")
        .filter(|v| !v.is_null())
        .ok_or_else(|| ApiError::invalid("max_tokens", "`max_tokens` is required"))?;
    let mut messages = Vec::new();
    if let Some(system) = req.get("system").filter(|v| !v.is_null()) {
        messages.push(json!({"role": "system", "content": text_of(system, "system")?}));
    }
    let list = req
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::invalid("messages", "`messages` must be an array of messages"))?;
    for (i, m) in list.iter().enumerate() {
        convert_message(m, i, &mut messages)?;
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    chat.insert("max_tokens".into(), max_tokens.clone());
    // Today's Messages API has no sampling fields; older clients' `temperature`, `top_p` and
    // `top_k` are honoured, and without them the reply is greedy, as on the chat route.
    for key in ["model", "temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = req.get(key) {
            chat.insert(key.into(), v.clone());
        }
    }
    if let Some(stop) = req.get("stop_sequences").filter(|v| !v.is_null()) {
        chat.insert("stop".into(), stop.clone());
    }
    if let Some(tools) = req.get("tools").filter(|v| !v.is_null()) {
        chat.insert("tools".into(), convert_tools(tools)?);
    }
    if let Some(choice) = req.get("tool_choice").filter(|v| !v.is_null()) {
        chat.insert("tool_choice".into(), convert_tool_choice(choice)?);
    }
    Ok(Value::Object(chat).to_string().into_bytes())
}

/// A string, or text blocks joined (`system`, `tool_result` content).
fn text_of(v: &Value, field: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(
                |b| match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                    _ => Err(ApiError::invalid(
                        field,
                        format!(
                            "`{field}` blocks must be text blocks (this model reads text only)"
                        ),
                    )),
                },
            )
            .collect::<Result<Vec<_>, _>>()
            .map(|parts| parts.concat()),
        _ => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a string or an array of text blocks"),
        )),
    }
}

/// One Messages message as chat messages: a user turn's `tool_result` blocks become `tool`
/// messages and its text a `user` message, in block order; an assistant turn's text and
/// `tool_use` blocks become one message with `tool_calls`.
fn convert_message(m: &Value, i: usize, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let at = |f: &str| format!("messages[{i}].{f}");
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => {
            return Err(ApiError::invalid(
                &at("role"),
                format!("`{}` must be \"user\" or \"assistant\"", at("role")),
            ))
        }
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(ApiError::invalid(
                &at("content"),
                format!("`{}` must be a string or an array of blocks", at("content")),
            ))
        }
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let field = format!("messages[{i}].content[{j}]");
        match (role, b.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            ("assistant", Some("tool_use")) => {
                let (Some(id), Some(name)) = (
                    b.get("id").and_then(Value::as_str),
                    b.get("name").and_then(Value::as_str),
                ) else {
                    return Err(ApiError::invalid(&field, format!("`{field}` needs `id` and `name`")));
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": input}}));
            }
            ("user", Some("tool_result")) => {
                if !text.is_empty() {
                    out.push(json!({"role": "user", "content": std::mem::take(&mut text)}));
                }
                let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(&field, format!("`{field}` needs `tool_use_id`"))
                })?;
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(c, &format!("{field}.content"))?,
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            (_, kind) => {
                return Err(ApiError::invalid(
                    &field,
                    format!(
                        "`{field}` is a {} block, which a {role} message cannot carry here (text, tool_use from the assistant, tool_result from the user)",
                        kind.unwrap_or("typeless")
                    ),
                ))
            }
        }
    }
    if role == "assistant" {
        let mut msg = json!({"role": "assistant", "content": text});
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        out.push(msg);
    } else if !text.is_empty() || blocks.is_empty() {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

/// `[{name, description, input_schema}]` as chat tools.
fn convert_tools(tools: &Value) -> Result<Value, ApiError> {
    let list = tools
        .as_array()
        .ok_or_else(|| ApiError::invalid("tools", "`tools` must be an array of tools"))?;
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let name = t.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(
                    &format!("tools[{i}]"),
                    format!("`tools[{i}]` needs a string `name`"),
                )
            })?;
            let mut function = Map::new();
            function.insert("name".into(), json!(name));
            if let Some(d) = t.get("description") {
                function.insert("description".into(), d.clone());
            }
            if let Some(s) = t.get("input_schema") {
                function.insert("parameters".into(), s.clone());
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// `{"type": "auto" | "none"}`; forcing a tool is refused as on the chat route.
fn convert_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice.get("type").and_then(Value::as_str) {
        Some(t @ ("auto" | "none")) => Ok(json!(t)),
        _ => Err(ApiError::invalid(
            "tool_choice",
            format!(
                "`tool_choice` must be {{\"type\": \"auto\"}} or {{\"type\": \"none\"}}, got {choice}: mlxb lets the model decide whether to call a tool and cannot force one"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Value {
        serde_json::from_slice(&to_chat_body(body.to_string().as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn a_tool_turn_becomes_chat_messages_in_block_order() {
        let c = chat(json!({
        "model": "m", "max_tokens": 10, "system": [{"type": "text", "text": "Be brief."}],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "18 C"}]}, {"type": "text", "text": "and?"}]}
        ]}));
        assert!(c.get("temperature").is_none());
        let m = c["messages"].as_array().unwrap();
        let roles: Vec<&str> = m.iter().map(|x| x["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"]["city"],
            "Paris"
        );
        assert_eq!(m[3]["tool_call_id"], "toolu_1");
        assert_eq!(m[3]["content"], "18 C");
        assert_eq!(c["tools"][0]["function"]["parameters"]["type"], "object");
    }

    #[test]
    fn mistakes_name_the_messages_api_field() {
        let param = |body: Value| to_chat_body(body.to_string().as_bytes()).unwrap_err().param;
        assert_eq!(
            param(json!({"messages": []})).as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            param(json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}))
                .as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            param(json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}))
                .as_deref(),
            Some("messages[0].content[0]")
        );
        assert_eq!(
            param(json!({"max_tokens": 5, "messages": [], "tool_choice": {"type": "any"}}))
                .as_deref(),
            Some("tool_choice")
        );
    }
}
