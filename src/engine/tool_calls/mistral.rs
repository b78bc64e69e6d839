//! `mistral`: everything after `[TOOL_CALLS]` (there is no end mark), either a JSON list of
//! `{"name", "arguments"}` objects or one or more `name[ARGS]{...}` calls.

use super::{compiled, ParsedCall, Pattern, ToolParseError};
use regex::Regex;
use serde_json::Value;
use std::sync::LazyLock;

/// The calls of the text: one call as an object, several as a list.
pub(super) fn parse(text: &str) -> Result<Value, ToolParseError> {
    let mut calls = json_calls(text)?;
    if calls.is_empty() {
        calls = header_calls(text)?;
    }
    let fail = || ToolParseError::new(format!("Could not parse tool call from: {text}"));
    match calls.len() {
        0 => Err(fail()),
        1 => Ok(Value::Object(calls.remove(0))),
        _ => Ok(Value::Array(calls.into_iter().map(Value::Object).collect())),
    }
}

/// `[{"name": ..., "arguments": ...}]`; text that is not a JSON list gives no calls, a list
/// whose items are not calls is an error (so it cannot be read as `name[ARGS]` calls).
fn json_calls(text: &str) -> Result<Vec<ParsedCall>, ToolParseError> {
    let Ok(Value::Array(items)) = serde_json::from_str::<Value>(text) else {
        return Ok(Vec::new());
    };
    let mut calls = Vec::new();
    for item in items {
        let (name, arguments, id) = match &item {
            Value::Object(o) => {
                let arguments = match o.get("arguments") {
                    // Some templates render the arguments as a JSON string.
                    Some(Value::String(s)) => serde_json::from_str(s).ok(),
                    None => Some(Value::Object(Default::default())),
                    Some(v) => Some(v.clone()),
                };
                (o.get("name").cloned(), arguments, o.get("id").cloned())
            }
            _ => (None, None, None),
        };
        let (Some(Value::String(name)), Some(Value::Object(arguments))) = (name, arguments) else {
            return Err(ToolParseError::new(format!(
                "Could not parse tool call from: {text}"
            )));
        };
        let mut call = ParsedCall::new();
        call.insert("name".into(), Value::String(name));
        call.insert("arguments".into(), Value::Object(arguments));
        if let Some(Value::String(id)) = id {
            // The server prefers the model's id over a fresh one.
            call.insert("id".into(), Value::String(id));
        }
        calls.push(call);
    }
    Ok(calls)
}

/// `name[ARGS]{...}`, repeated: each header is followed by exactly one JSON value.
fn header_calls(text: &str) -> Result<Vec<ParsedCall>, ToolParseError> {
    static HEADER: Pattern = LazyLock::new(|| Regex::new(r"([\w-]+)\s*\[ARGS\]\s*").ok());
    let mut calls = Vec::new();
    let mut pos = 0;
    let header = compiled(&HEADER)?;
    while let Some(c) = header.captures_at(text, pos) {
        let (name, end) = (c[1].to_owned(), c.get(0).map_or(pos, |m| m.end()));
        let (arguments, used) = raw_decode(&text[end..]).ok_or_else(|| {
            ToolParseError::new(format!("Could not parse tool call from: {text}"))
        })?;
        pos = end + used;
        let mut call = ParsedCall::new();
        call.insert("name".into(), Value::String(name));
        call.insert("arguments".into(), arguments);
        calls.push(call);
    }
    Ok(calls)
}

/// Python's `JSONDecoder.raw_decode`: one JSON value at the very start of `s` (no leading
/// whitespace) and the bytes it took.
fn raw_decode(s: &str) -> Option<(Value, usize)> {
    if s.starts_with(char::is_whitespace) {
        return None;
    }
    let mut it = serde_json::Deserializer::from_str(s).into_iter::<Value>();
    let v = it.next()?.ok()?;
    Some((v, it.byte_offset()))
}
