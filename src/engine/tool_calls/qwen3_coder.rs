//! `qwen3_coder`: `<function=NAME>` with `<parameter=P>value</parameter>` children, the
//! values typed by the request's JSON schema for that function (strings stay text, integers
//! and numbers are converted, objects and arrays parsed as JSON or Python literals).

use super::py_literal::{self, py_float, py_int};
use super::{compiled, py_strip, truthy, ParsedCall, Pattern, ToolParseError};
use regex::Regex;
use serde_json::{Map, Value};
use std::sync::LazyLock;

static FUNCTION: Pattern =
    LazyLock::new(|| Regex::new(r"(?s)<function=(.*?)</function>\n?\z").ok());
static PARAMETER: Pattern = LazyLock::new(|| Regex::new(r"(?s)<parameter=(.*?)</parameter>").ok());
static NAME: Pattern = LazyLock::new(|| Regex::new(r"\A\s*([^\s<>]+)>?").ok());

const STRING_TYPES: [&str; 6] = ["string", "str", "text", "varchar", "char", "enum"];
const BOOL_TYPES: [&str; 3] = ["boolean", "bool", "binary"];
const OBJECT_TYPES: [&str; 3] = ["object", "array", "arr"];
const INT_PREFIXES: [&str; 5] = ["int", "uint", "long", "short", "unsigned"];

/// The function that runs to the end of the text (Python's `$`: before a final newline too).
pub(super) fn parse(text: &str, tools: Option<&[Value]>) -> Result<ParsedCall, ToolParseError> {
    let name_re = compiled(&NAME)?;
    let body = compiled(&FUNCTION)?
        .captures(text)
        .and_then(|c| c.get(1))
        .ok_or_else(|| ToolParseError::new("No function provided."))?
        .as_str();
    let name_match = name_re
        .captures(body)
        .ok_or_else(|| ToolParseError::new("No function provided."))?;
    let name = name_match[1].to_owned();
    let config = arguments_config(&name, tools)?;
    let mut arguments = Map::new();
    for m in compiled(&PARAMETER)?.captures_iter(&body[name_match.get(0).map_or(0, |m| m.end())..])
    {
        let inner = m.get(1).map_or("", |g| g.as_str());
        let Some(pm) = name_re.captures(inner) else {
            continue;
        };
        let key = pm[1].to_owned();
        let mut value = &inner[pm.get(0).map_or(0, |g| g.end())..];
        value = value.strip_prefix('\n').unwrap_or(value);
        value = value.strip_suffix('\n').unwrap_or(value);
        let converted = convert_value(value, config.get(&key))?;
        arguments.insert(key, converted);
    }
    let mut call = ParsedCall::new();
    call.insert("name".into(), Value::String(name));
    call.insert("arguments".into(), Value::Object(arguments));
    Ok(call)
}

/// `properties` of the named function's `parameters` in the request's tools (empty when the
/// request has none or does not name it).
fn arguments_config(
    name: &str,
    tools: Option<&[Value]>,
) -> Result<Map<String, Value>, ToolParseError> {
    for tool in tools.unwrap_or_default() {
        let Some(function) = tool.get("function").filter(|f| truthy(f)) else {
            continue;
        };
        let fname = function
            .get("name")
            .ok_or_else(|| ToolParseError::new("a tool's function has no name"))?;
        if fname.as_str() == Some(name) {
            return Ok(match function.get("parameters").filter(|p| truthy(p)) {
                Some(p) => p
                    .get("properties")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default(),
                None => Map::new(),
            });
        }
    }
    Ok(Map::new())
}

/// `_convert_param_value`: the text of one parameter, typed by its schema entry.
fn convert_value(value: &str, schema: Option<&Value>) -> Result<Value, ToolParseError> {
    let text = || Value::String(value.to_owned());
    if value.to_lowercase() == "null" {
        return Ok(Value::Null);
    }
    let Some(schema) = schema.filter(|s| truthy(s)) else {
        return Ok(text());
    };
    let Some(ty) = schema.get("type") else {
        // No type: JSON objects and arrays are parsed, anything else stays text.
        return Ok(match serde_json::from_str::<Value>(value) {
            Ok(v @ (Value::Object(_) | Value::Array(_))) => v,
            _ => text(),
        });
    };
    // Python's `str(type).strip().lower()`; a non-string type matches no name below.
    let ty = match ty {
        Value::String(s) => py_strip(s).to_lowercase(),
        _ => String::new(),
    };
    if STRING_TYPES.contains(&ty.as_str()) {
        return Ok(text());
    }
    if INT_PREFIXES.iter().any(|p| ty.starts_with(p)) {
        let f = py_float(value)?;
        let i = py_int(f)?;
        if f - i as f64 != 0.0 {
            return Err(ToolParseError::new(format!(
                "Invalid integer literal {value:?}"
            )));
        }
        return Ok(Value::from(i));
    }
    if ty.starts_with("num") || ty.starts_with("float") {
        let f = py_float(value)?;
        let i = py_int(f)?;
        return Ok(if f - i as f64 != 0.0 {
            Value::from(f)
        } else {
            Value::from(i)
        });
    }
    if BOOL_TYPES.contains(&ty.as_str()) {
        return Ok(Value::Bool(value.to_lowercase() == "true"));
    }
    if OBJECT_TYPES.contains(&ty.as_str()) || ty.starts_with("dict") || ty.starts_with("list") {
        if let Ok(v) = py_literal::json_loads_lenient(value) {
            return Ok(v);
        }
    }
    Ok(py_literal::literal_eval(value).unwrap_or_else(|_| text()))
}
