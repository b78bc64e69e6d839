//! `minicpm5`: `<function name="fn"><param name="p">value</param></function>` blocks (the
//! server hands over the text after `<function name=`), values in a CDATA block when they hold
//! `<`, `&` or newlines, each typed by the request's schema (integer, number, boolean, object
//! or array before string; JSON or the text itself otherwise), as mlx-lm's MiniMax-M2 typing
//! does it.

use super::py_literal::{json_loads_lenient, literal_eval, py_float, py_int, py_int_text};
use super::{compiled, py_strip, truthy, ParsedCall, Pattern, ToolParseError};
use regex::Regex;
use serde_json::{Map, Value};
use std::sync::LazyLock;

/// Types tried in order; the first that reads the value wins.
const TYPE_PRIORITY: [&str; 11] = [
    "integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str",
    "text",
];

static FUNCTION: Pattern = LazyLock::new(|| {
    Regex::new(
        r#"(?s)(?:<function\s+)?(?:name\s*=\s*)?(?P<name>"[^"]*"|'[^']*'|[^\s"'<>]+)\s*>(?P<body>.*?)(?:</function>|\n\z|\z)"#,
    )
    .ok()
});
static PARAM: Pattern = LazyLock::new(|| {
    Regex::new(
        r#"(?s)<param\s+name\s*=\s*(?P<name>"[^"]*"|'[^']*'|[^\s"'<>]+)\s*>(?P<value>.*?)</param>"#,
    )
    .ok()
});
static CDATA: Pattern = LazyLock::new(|| Regex::new(r"(?s)\A\s*<!\[CDATA\[(.*?)\]\]>\s*\z").ok());

/// Every function block of the text: one call as an object, several as a list.
pub(super) fn parse(text: &str, tools: Option<&[Value]>) -> Result<Value, ToolParseError> {
    let configs = param_configs(tools)?;
    let (function, param, cdata) = (compiled(&FUNCTION)?, compiled(&PARAM)?, compiled(&CDATA)?);
    let mut calls = Vec::new();
    for f in function.captures_iter(text) {
        let name = extract_name(f.name("name").map_or("", |m| m.as_str()));
        let config = configs.get(name);
        let mut arguments = Map::new();
        for p in param.captures_iter(f.name("body").map_or("", |m| m.as_str())) {
            let key = extract_name(p.name("name").map_or("", |m| m.as_str()));
            let raw = p.name("value").map_or("", |m| m.as_str());
            let value = match cdata.captures(raw).and_then(|c| c.get(1)) {
                Some(inner) => inner.as_str(),
                None => py_strip(raw),
            };
            let types = config.and_then(|c| c.get(key)).map(schema_types);
            let types = types.unwrap_or_else(|| vec!["string".into()]);
            arguments.insert(key.to_owned(), convert(value, &types)?);
        }
        let mut call = ParsedCall::new();
        call.insert("name".into(), Value::String(name.to_owned()));
        call.insert("arguments".into(), Value::Object(arguments));
        calls.push(Value::Object(call));
    }
    match calls.len() {
        0 => Err(ToolParseError::new("No function provided.")),
        1 => Ok(calls.remove(0)),
        _ => Ok(Value::Array(calls)),
    }
}

/// Each requested function's `parameters.properties`, by name.
fn param_configs(tools: Option<&[Value]>) -> Result<Map<String, Value>, ToolParseError> {
    let mut out = Map::new();
    for tool in tools.unwrap_or_default() {
        let Some(func) = tool.get("function").filter(|f| truthy(f)) else {
            continue;
        };
        let Some(params) = func.get("parameters").filter(|p| truthy(p)) else {
            continue;
        };
        let name = func
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ToolParseError::new("a tool's function has no name"))?;
        let props = params.get("properties").cloned().unwrap_or_default();
        out.insert(name.to_owned(), props);
    }
    Ok(out)
}

/// A name with one pair of matching quotes removed.
fn extract_name(s: &str) -> &str {
    let s = py_strip(s);
    let quoted = |q: char| s.starts_with(q) && s.ends_with(q);
    if quoted('"') || quoted('\'') {
        // Python's s[1:-1]: empty for a lone quote.
        s.get(1..s.len().saturating_sub(1).max(1)).unwrap_or("")
    } else {
        s
    }
}

/// Every type a schema allows: `type` (a name or a list), the types of `enum` values, and
/// those of `anyOf`/`oneOf`/`allOf`; `string` when it names none.
fn schema_types(schema: &Value) -> Vec<String> {
    let Some(o) = schema.as_object() else {
        return vec!["string".into()];
    };
    let mut types: Vec<String> = Vec::new();
    let mut add = |t: &str| {
        if !types.iter().any(|x| x == t) {
            types.push(t.to_owned());
        }
    };
    match o.get("type") {
        Some(Value::String(t)) => add(t),
        Some(Value::Array(list)) => list.iter().filter_map(Value::as_str).for_each(&mut add),
        _ => {}
    }
    if let Some(Value::Array(values)) = o.get("enum") {
        for v in values {
            add(match v {
                Value::Null => "null",
                Value::Bool(_) => "boolean",
                Value::Number(n) if n.is_f64() => "number",
                Value::Number(_) => "integer",
                Value::String(_) => "string",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            });
        }
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(choices)) = o.get(key) {
            for c in choices {
                schema_types(c).iter().for_each(|t| add(t));
            }
        }
    }
    if types.is_empty() {
        vec!["string".into()]
    } else {
        types
    }
}

/// `_convert_param_value_with_types`: the first type in priority order that reads the value.
fn convert(value: &str, types: &[String]) -> Result<Value, ToolParseError> {
    let lower = value.to_lowercase();
    if lower == "null" {
        return Ok(Value::Null);
    }
    let types: Vec<String> = types.iter().map(|t| t.to_lowercase()).collect();
    let has = |t: &str| types.iter().any(|x| x == t);
    if has("null") && ["null", "none", "nil"].contains(&lower.as_str()) {
        return Ok(Value::Null);
    }
    for t in TYPE_PRIORITY.iter().filter(|t| has(t)) {
        match *t {
            "string" | "str" | "text" => return Ok(Value::String(value.to_owned())),
            "integer" | "int" => {
                if let Ok(i) = py_int_text(value) {
                    return Ok(Value::from(i));
                }
            }
            "number" | "float" => {
                if let Ok(f) = py_float(value) {
                    // int() of an infinity fails the whole call in Python too.
                    let i = py_int(f)?;
                    return Ok(if f != i as f64 {
                        Value::from(f)
                    } else {
                        Value::from(i)
                    });
                }
            }
            "boolean" | "bool" => {
                let v = py_strip(&lower);
                if ["true", "1", "yes", "on"].contains(&v) {
                    return Ok(Value::Bool(true));
                }
                if ["false", "0", "no", "off"].contains(&v) {
                    return Ok(Value::Bool(false));
                }
            }
            _ => {
                if let Ok(v) = json_loads_lenient(value).or_else(|_| literal_eval(value)) {
                    return Ok(v);
                }
            }
        }
    }
    Ok(serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned())))
}
