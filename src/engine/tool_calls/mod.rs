//! Tool calls in generated text, found and parsed as mlx-lm 0.32.2 does it: one parser per
//! tool-call format, chosen from the chat template and vocabulary (or `tool_parser_type` in
//! `tokenizer_config.json`), the text between the format's start and end markers handed to it,
//! and each parsed call turned into OpenAI's `{id, type, function: {name, arguments}}`.
//!
//! The parsers return what mlx-lm's return for the same text (a call is a JSON object with
//! `name` and `arguments`, plus whatever else the model wrote); a text a parser cannot read is
//! [`ToolParseError`], which the server logs and drops, as mlx-lm's server does.

mod function_gemma;
mod gemma4;
mod json_tools;
mod minicpm5;
mod mistral;
mod py_literal;
mod qwen3_coder;
mod splitter;

pub use splitter::{Segment, ToolSplitter};

use crate::engine::chat_template::py_json_dumps;
use regex::Regex;
use serde_json::{Map, Value};
use std::sync::LazyLock;

/// A call as a parser returns it: `name`, `arguments` and anything else the model wrote.
pub type ParsedCall = Map<String, Value>;

/// Why a tool-call text could not be parsed (mlx-lm's `ValueError`/`JSONDecodeError`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ToolParseError(pub String);

impl ToolParseError {
    fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

/// A tool-call format mlxb parses (mlx-lm's `mlx_lm/tool_parsers/<name>.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolParser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3).
    JsonTools,
    /// `<tool_call><function=NAME><parameter=P>V</parameter></function></tool_call>`
    /// (Qwen3-Coder, Qwen3.5), values typed by the request's tool schema.
    Qwen3Coder,
    /// `[TOOL_CALLS]` followed by a JSON list or `name[ARGS]{...}` calls (Mistral).
    Mistral,
    /// `<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>` (Gemma 4).
    Gemma4,
    /// `<start_function_call>call:NAME{key:<escape>text<escape>,...}<end_function_call>`
    /// (FunctionGemma).
    FunctionGemma,
    /// `<function name="NAME"><param name="P">V</param></function>` (MiniCPM), values typed by
    /// the request's schema.
    MiniCpm5,
}

/// Every format mlxb parses, by mlx-lm's module name.
pub const PARSERS: [(&str, ToolParser); 6] = [
    ("json_tools", ToolParser::JsonTools),
    ("qwen3_coder", ToolParser::Qwen3Coder),
    ("mistral", ToolParser::Mistral),
    ("gemma4", ToolParser::Gemma4),
    ("function_gemma", ToolParser::FunctionGemma),
    ("minicpm5", ToolParser::MiniCpm5),
];

impl ToolParser {
    /// The parser mlx-lm calls `name`, if mlxb has it.
    pub fn from_name(name: &str) -> Option<Self> {
        PARSERS.iter().find(|(n, _)| *n == name).map(|(_, p)| *p)
    }

    /// mlx-lm's module name.
    pub fn name(self) -> &'static str {
        PARSERS
            .iter()
            .find(|(_, p)| *p == self)
            .map_or("", |(n, _)| n)
    }

    /// The text that opens a tool call.
    pub fn start(self) -> &'static str {
        match self {
            ToolParser::JsonTools | ToolParser::Qwen3Coder => "<tool_call>",
            ToolParser::Mistral => "[TOOL_CALLS]",
            ToolParser::Gemma4 => "<|tool_call>",
            ToolParser::FunctionGemma => "<start_function_call>",
            ToolParser::MiniCpm5 => "<function name=",
        }
    }

    /// The text that closes it (empty: the call runs to the end of the reply).
    pub fn end(self) -> &'static str {
        match self {
            ToolParser::JsonTools | ToolParser::Qwen3Coder => "</tool_call>",
            ToolParser::Mistral => "",
            ToolParser::Gemma4 => "<tool_call|>",
            ToolParser::FunctionGemma => "<end_function_call>",
            ToolParser::MiniCpm5 => "</function>",
        }
    }

    /// The calls in the text between the markers; `tools` is the request's `tools` (the
    /// schema types Qwen3-Coder's values).
    pub fn parse(
        self,
        text: &str,
        tools: Option<&[Value]>,
    ) -> Result<Vec<ParsedCall>, ToolParseError> {
        let parsed = match self {
            ToolParser::JsonTools => json_tools::parse(text)?,
            ToolParser::Qwen3Coder => Value::Object(qwen3_coder::parse(text, tools)?),
            ToolParser::Mistral => mistral::parse(text)?,
            ToolParser::Gemma4 => gemma4::parse(text)?,
            ToolParser::FunctionGemma => Value::Object(function_gemma::parse(text)?),
            ToolParser::MiniCpm5 => minicpm5::parse(text, tools)?,
        };
        // The server's formatter takes a list or one call.
        let calls = match parsed {
            Value::Array(items) => items,
            one => vec![one],
        };
        calls
            .into_iter()
            .map(|c| match c {
                Value::Object(m) => Ok(m),
                other => Err(ToolParseError::new(format!(
                    "a tool call must be an object, got {other}"
                ))),
            })
            .collect()
    }
}

/// mlx-lm's `_infer_tool_parser` rules, in its order: a format is chosen when the template
/// contains every marker of one of its groups.
const TEMPLATE_RULES: [(&str, &[&[&str]]); 12] = [
    ("minimax_m2", &[&["<minimax:tool_call>"]]),
    ("gemma4", &[&["<|tool_call>", "<tool_call|>"]]),
    ("function_gemma", &[&["<start_function_call>"]]),
    ("longcat", &[&["<longcat_tool_call>"]]),
    ("glm47", &[&["<arg_key>"]]),
    (
        "pythonic",
        &[&["<|tool_list_start|>"], &["<|tool_call_start|>"]],
    ),
    (
        "qwen3_coder",
        &[&["<tool_call>\\n<function="], &["<tool_call>\n<function="]],
    ),
    ("kimi_k2", &[&["<|tool_calls_section_begin|>"]]),
    ("minicpm5", &[&["<function name=\"", "<param name=\""]]),
    ("mistral", &[&["[TOOL_CALLS]"]]),
    ("muse_spark", &[&["<atem:function_calls>"]]),
    ("json_tools", &[&["<tool_call>", "tool_call.name"]]),
];

/// What mlx-lm's `_infer_tool_parser` picks for a chat template (when the model has one
/// template, as a string) and a vocabulary: mlx-lm's module name, which may be one mlxb
/// does not parse ([`ToolParser::from_name`] says).
pub fn infer_parser_name(
    template: Option<&str>,
    in_vocab: impl Fn(&str) -> bool,
) -> Option<&'static str> {
    if let Some(t) = template {
        let rule = TEMPLATE_RULES.iter().find(|(_, groups)| {
            groups
                .iter()
                .any(|markers| markers.iter().all(|m| t.contains(m)))
        });
        if let Some((name, _)) = rule {
            return Some(name);
        }
    }
    if in_vocab("<|tool_call_start|>") && in_vocab("<|tool_call_end|>") {
        return Some("pythonic");
    }
    None
}

/// OpenAI's form of a parsed call, as mlx-lm's server writes it: the model's `id` or a new
/// one, `arguments` as Python's `json.dumps(..., ensure_ascii=False)` text, `index` when
/// streaming. A call without `arguments` is an error (mlx-lm fails the request there).
pub fn openai_tool_call(
    mut call: ParsedCall,
    index: Option<usize>,
) -> Result<Value, ToolParseError> {
    let id = match call.shift_remove("id") {
        Some(Value::String(s)) if !s.is_empty() => s,
        _ => new_call_id(),
    };
    let args = call
        .get_mut("arguments")
        .ok_or_else(|| ToolParseError::new("the tool call has no `arguments`"))?;
    *args = Value::String(py_json_dumps(args));
    let mut out = Map::new();
    out.insert("function".into(), Value::Object(call));
    out.insert("type".into(), Value::String("function".into()));
    out.insert("id".into(), Value::String(id));
    if let Some(i) = index {
        out.insert("index".into(), Value::from(i));
    }
    Ok(Value::Object(out))
}

/// A random version-4 UUID in its usual text form (mlx-lm's `str(uuid.uuid4())`).
fn new_call_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Python's `str.strip()`: Unicode whitespace and the four ASCII information separators.
fn py_strip(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}

/// A constant pattern, compiled on first use. It is `None` only if the pattern were invalid
/// (the tests compile every one), and then the parser reports the text as unreadable.
type Pattern = LazyLock<Option<Regex>>;

/// The compiled pattern of a [`Pattern`].
fn compiled(p: &'static Pattern) -> Result<&'static Regex, ToolParseError> {
    p.as_ref()
        .ok_or_else(|| ToolParseError::new("internal: a tool-call pattern does not compile"))
}

/// Python truthiness of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}
