//! `function_gemma`: `call:NAME{key:value,key:<escape>text<escape>,...}`; a value between
//! `<escape>` marks is a string, any other is JSON when it parses and a string when not.

use super::{compiled, ParsedCall, Pattern, ToolParseError};
use regex::Regex;
use serde_json::Value;
use std::sync::LazyLock;

const ESCAPE: &str = "<escape>";

/// The first `call:(\w+)\{(.*?)\}` of the text, its arguments read left to right.
pub(super) fn parse(text: &str) -> Result<ParsedCall, ToolParseError> {
    let (name, mut args) =
        first_call(text)?.ok_or_else(|| ToolParseError::new("No function provided."))?;
    let mut arguments = ParsedCall::new();
    let missing = || ToolParseError::new("substring not found");
    while !args.is_empty() {
        let split = args.find(':').ok_or_else(missing)?;
        let key = &args[..split];
        args = &args[split + 1..];
        if let Some(rest) = args.strip_prefix(ESCAPE) {
            let end = rest.find(ESCAPE).ok_or_else(missing)?;
            arguments.insert(key.to_owned(), Value::String(rest[..end].to_owned()));
            // One character (the separator) is skipped after the closing mark.
            let after = &rest[end + ESCAPE.len()..];
            args = after.chars().next().map_or("", |c| &after[c.len_utf8()..]);
            continue;
        }
        let split = args.find(',').unwrap_or(args.len());
        let value = &args[..split];
        args = args.get(split + 1..).unwrap_or("");
        let v = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()));
        arguments.insert(key.to_owned(), v);
    }
    let mut call = ParsedCall::new();
    call.insert("name".into(), Value::String(name.to_owned()));
    call.insert("arguments".into(), Value::Object(arguments));
    Ok(call)
}

/// The first match of `call:(\w+)\{(.*?)\}` (DOTALL): a word name, then everything up to the
/// first `}`.
fn first_call(text: &str) -> Result<Option<(&str, &str)>, ToolParseError> {
    static RE: Pattern = LazyLock::new(|| Regex::new(r"(?s)call:(\w+)\{(.*?)\}").ok());
    let found = compiled(&RE)?.captures(text);
    Ok(found.and_then(|c| Some((c.get(1)?.as_str(), c.get(2)?.as_str()))))
}
