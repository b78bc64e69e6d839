//! `json_tools`: the call is one JSON value between `<tool_call>` and `</tool_call>`.

use super::{py_strip, ToolParseError};
use serde_json::Value;

/// `json.loads(text.strip())`.
pub(super) fn parse(text: &str) -> Result<Value, ToolParseError> {
    serde_json::from_str(py_strip(text)).map_err(|e| ToolParseError::new(format!("not JSON: {e}")))
}
