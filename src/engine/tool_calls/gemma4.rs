//! `gemma4`: `call:NAME{key:value,...}` with bare keys and `<|"|>` as the string delimiter
//! (braces inside a delimited string do not count), rewritten to JSON and parsed.

use super::{compiled, Pattern, ToolParseError};
use regex::Regex;
use serde_json::{Map, Value};
use std::sync::LazyLock;

/// Gemma 4's string delimiter.
const QUOTE: &str = "<|\"|>";

/// Every `call:NAME{...}` with balanced braces: one call as an object, several as a list.
pub(super) fn parse(text: &str) -> Result<Value, ToolParseError> {
    let calls = find_calls(text)?;
    if calls.is_empty() {
        return Err(ToolParseError::new("No function provided."));
    }
    let mut parsed = Vec::with_capacity(calls.len());
    for (name, args) in calls {
        let arguments = serde_json::from_str(&args_to_json(args)?)
            .map_err(|e| ToolParseError::new(format!("arguments of {name} are not JSON: {e}")))?;
        let mut call = Map::new();
        call.insert("name".into(), Value::String(name.to_owned()));
        call.insert("arguments".into(), arguments);
        parsed.push(Value::Object(call));
    }
    Ok(if parsed.len() == 1 {
        parsed.remove(0)
    } else {
        Value::Array(parsed)
    })
}

/// Non-overlapping `call:([\w-]+)(\{...\})` matches, left to right: after `call:` a name of
/// word characters and `-`, then a brace group balanced over plain characters, lone `<`s and
/// complete `<|"|>...<|"|>` strings. A start with no such group is skipped.
fn find_calls(text: &str) -> Result<Vec<(&str, &str)>, ToolParseError> {
    static NAME: Pattern = LazyLock::new(|| Regex::new(r"call:([\w-]+)").ok());
    let mut out = Vec::new();
    let mut pos = 0;
    let name_re = compiled(&NAME)?;
    while let Some(c) = name_re.captures_at(text, pos) {
        let (Some(whole), Some(name)) = (c.get(0), c.get(1)) else {
            break;
        };
        match balanced_group(&text[whole.end()..]) {
            Some(len) => {
                let args = &text[whole.end()..whole.end() + len];
                out.push((name.as_str(), args));
                pos = whole.end() + len;
            }
            // The regex engine retries one character further on.
            None => pos = whole.start() + 1,
        }
    }
    Ok(out)
}

/// The length of the brace group at the start of `s`, if it is one.
fn balanced_group(s: &str) -> Option<usize> {
    if !s.starts_with('{') {
        return None;
    }
    let mut depth = 0usize;
    let mut i = 0;
    while i < s.len() {
        let rest = &s[i..];
        if let Some(after) = rest.strip_prefix(QUOTE) {
            // A complete string, or no match here at all.
            let end = after.find(QUOTE)?;
            i += QUOTE.len() + end + QUOTE.len();
            continue;
        }
        let c = rest.chars().next()?;
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += c.len_utf8();
    }
    None
}

/// Gemma 4's arguments as JSON: delimited strings become JSON strings, bare keys after `{` or
/// `,` get quotes.
fn args_to_json(text: &str) -> Result<String, ToolParseError> {
    static STRING: Pattern = LazyLock::new(|| Regex::new(r#"(?s)<\|"\|>(.*?)<\|"\|>"#).ok());
    static KEY: Pattern = LazyLock::new(|| Regex::new(r"([{,])(\w+):").ok());
    let mut strings: Vec<String> = Vec::new();
    let masked = compiled(&STRING)?.replace_all(text, |c: &regex::Captures| {
        strings.push(c[1].to_owned());
        format!("\u{0}{}\u{0}", strings.len() - 1)
    });
    let mut keyed = quote_keys(&masked, compiled(&KEY)?);
    for (i, s) in strings.iter().enumerate() {
        let json = serde_json::to_string(s).unwrap_or_default();
        keyed = keyed.replace(&format!("\u{0}{i}\u{0}"), &json);
    }
    Ok(keyed)
}

/// `re.sub(r"(?<=[{,])(\w+):", r'"\1":', text)`: the `{` or `,` before a key is not part of a
/// match, so `{a:{b:1}` quotes both keys; matches do not overlap.
fn quote_keys(text: &str, key: &Regex) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    let mut last = 0;
    let mut pos = 0;
    while let Some(c) = key.captures_at(text, pos) {
        let (Some(lead), Some(word)) = (c.get(1), c.get(2)) else {
            break;
        };
        out.push_str(&text[last..lead.end()]);
        out.push('"');
        out.push_str(word.as_str());
        out.push_str("\":");
        last = word.end() + 1;
        pos = last;
    }
    out.push_str(&text[last..]);
    out
}
