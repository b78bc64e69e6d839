//! The tool fields of a chat request: `tools` (given to the chat template, and to the parser
//! that types Qwen3-Coder's values), `tool_choice` and `parallel_tool_calls`.

use super::Fields;
use crate::server::error::ApiError;
use serde_json::Value;

/// How a request uses tools.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolUse {
    /// The request's `tools` (absent or empty: none), each `{"type": "function", "function":
    /// {"name", ...}}`.
    pub tools: Option<Vec<Value>>,
    /// Whether tool calls in the reply are parsed out of its text (`tool_choice` other than
    /// `none`), as mlx-lm does for every reply of a model with a tool-call format.
    pub parse: bool,
    /// `parallel_tool_calls` (default true): false keeps the first call only.
    pub parallel: bool,
}

impl Default for ToolUse {
    fn default() -> Self {
        Self {
            tools: None,
            parse: true,
            parallel: true,
        }
    }
}

impl ToolUse {
    /// The tools the chat template renders (none with `tool_choice: "none"`).
    pub fn template_tools(&self) -> Option<&[Value]> {
        self.tools.as_deref().filter(|_| self.parse)
    }
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`.
pub(super) fn tool_use(f: &Fields<'_>) -> Result<ToolUse, ApiError> {
    let tools = match f.get("tools") {
        None => None,
        Some(Value::Array(list)) => {
            for (i, t) in list.iter().enumerate() {
                check_tool(t, i)?;
            }
            (!list.is_empty()).then(|| list.clone())
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "tools",
                format!("`tools` must be an array of tools, got {v}"),
            ))
        }
    };
    let parse = match f.get("tool_choice") {
        None => true,
        Some(Value::String(s)) if s == "auto" => true,
        Some(Value::String(s)) if s == "none" => false,
        Some(v) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` must be \"auto\" or \"none\", got {v}: mlxb lets the model \
                     decide whether to call a tool and cannot force one"
                ),
            ))
        }
    };
    let parallel = f.boolean("parallel_tool_calls")?.unwrap_or(true);
    Ok(ToolUse {
        tools,
        parse,
        parallel,
    })
}

/// One entry of `tools`: an object whose `function` (when `type` is `function`, the only kind
/// chat templates render) has a string `name`.
fn check_tool(t: &Value, i: usize) -> Result<(), ApiError> {
    let field = format!("tools[{i}]");
    let bad = |msg: &str| ApiError::invalid(&field, format!("`{field}` {msg}"));
    let obj = t.as_object().ok_or_else(|| {
        bad("must be an object like {\"type\": \"function\", \"function\": {\"name\": ...}}")
    })?;
    match obj.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(bad(&format!(
                "has type {other:?}; only \"function\" tools are supported"
            )))
        }
        None => return Err(bad("needs \"type\": \"function\"")),
    }
    let named = obj
        .get("function")
        .and_then(|f| f.get("name"))
        .is_some_and(Value::is_string);
    if !named {
        return Err(bad("needs a `function` object with a string `name`"));
    }
    Ok(())
}
