//! Tool calls in a chat reply, as mlx-lm's server returns them: the text between the model's
//! tool-call markers leaves `content`, each call is parsed when it closes and returned in
//! OpenAI's `tool_calls` (streamed as one `delta.tool_calls` entry per call, with its
//! `index`), and a reply that stopped after making a call finishes with `tool_calls`. A call
//! the parser cannot read is logged and dropped, never an error response.

use super::request::ToolUse;
use crate::engine::tool_calls::{openai_tool_call, Segment, ToolParser, ToolSplitter};
use serde_json::Value;

/// What a request's reply needs to find its tool calls.
#[derive(Debug, Clone)]
pub struct ToolCalls {
    parser: ToolParser,
    tools: Option<Vec<Value>>,
    parallel: bool,
}

impl ToolCalls {
    /// Tool-call handling for a request, when the model has a format mlxb parses and the
    /// request does not turn it off (`tool_choice: "none"`).
    pub fn new(parser: Option<ToolParser>, tool_use: &ToolUse) -> Option<Self> {
        Some(Self {
            parser: parser.filter(|_| tool_use.parse)?,
            tools: tool_use.tools.clone(),
            parallel: tool_use.parallel,
        })
    }
}

/// The reply so far: text settled for `content` and the calls found.
#[derive(Debug, Default)]
pub struct Settled {
    /// Text for `content`.
    pub content: String,
    /// Calls in OpenAI's shape.
    pub calls: Vec<Value>,
}

/// One reply's tool-call state.
#[derive(Debug)]
pub struct ToolReply {
    config: ToolCalls,
    splitter: ToolSplitter,
    /// Streamed calls carry their position in the reply.
    streaming: bool,
    /// Calls returned so far.
    returned: usize,
    /// Whether the model opened any call (even one that did not parse).
    made_call: bool,
}

impl ToolReply {
    /// A reply outside any call.
    pub fn new(config: ToolCalls, streaming: bool) -> Self {
        let splitter = ToolSplitter::new(config.parser);
        Self {
            config,
            splitter,
            streaming,
            returned: 0,
            made_call: false,
        }
    }

    /// Takes the next piece of generated text.
    pub fn push(&mut self, text: &str) -> Settled {
        let segments = self.splitter.push(text);
        self.settle(segments)
    }

    /// Ends the reply (`finish_reason` as the engine gives it); returns what was held back.
    pub fn finish(&mut self, finish_reason: &str) -> Settled {
        let segments = self.splitter.finish(finish_reason == "length");
        self.settle(segments)
    }

    /// The reply's `finish_reason`: `tool_calls` for one that stopped after making a call.
    pub fn finish_reason(&self, engine: &'static str) -> &'static str {
        if engine == "stop" && self.made_call {
            "tool_calls"
        } else {
            engine
        }
    }

    fn settle(&mut self, segments: Vec<Segment>) -> Settled {
        let mut out = Settled::default();
        for s in segments {
            match s {
                Segment::Text(t) => out.content.push_str(&t),
                Segment::ToolCall(text) => {
                    self.made_call = true;
                    self.parse_into(&text, &mut out.calls);
                }
            }
        }
        out
    }

    fn parse_into(&mut self, text: &str, calls: &mut Vec<Value>) {
        let parsed = self.config.parser.parse(text, self.config.tools.as_deref());
        let parsed = match parsed {
            Ok(p) => p,
            Err(e) => {
                eprintln!(
                    "mlxb serve: dropped a tool call the {} parser cannot read ({e}); the text was likely cut short",
                    self.config.parser.name()
                );
                return;
            }
        };
        for call in parsed {
            if !self.config.parallel && self.returned > 0 {
                return;
            }
            let index = self.streaming.then_some(self.returned);
            match openai_tool_call(call, index) {
                Ok(c) => {
                    calls.push(c);
                    self.returned += 1;
                }
                Err(e) => eprintln!("mlxb serve: dropped a tool call ({e})"),
            }
        }
    }
}

/// A reply read whole (not streamed): its content and calls, its tool calls parsed out when
/// `tools` is set; both APIs' non-streamed answers are built from it.
#[derive(Debug)]
pub struct WholeReply {
    tools: Option<ToolReply>,
    /// Text for `content`.
    pub content: String,
    /// Calls in OpenAI's shape.
    pub calls: Vec<Value>,
}

impl WholeReply {
    /// An empty reply, parsing tool calls with `tools` if given.
    pub fn new(tools: Option<ToolReply>) -> Self {
        Self {
            tools,
            content: String::new(),
            calls: Vec::new(),
        }
    }

    /// Takes the next piece of generated text.
    pub fn push(&mut self, text: &str) {
        match self.tools.as_mut() {
            Some(r) => {
                let settled = r.push(text);
                self.settle(settled);
            }
            None => self.content.push_str(text),
        }
    }

    /// Ends the reply; returns its `finish_reason` (`tool_calls` after a call).
    pub fn finish(&mut self, engine: &'static str) -> &'static str {
        let Some(r) = self.tools.as_mut() else {
            return engine;
        };
        let settled = r.finish(engine);
        let reason = r.finish_reason(engine);
        self.settle(settled);
        reason
    }

    fn settle(&mut self, s: Settled) {
        self.content.push_str(&s.content);
        self.calls.extend(s.calls);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(parallel: bool, streaming: bool) -> ToolReply {
        let use_ = ToolUse {
            parallel,
            ..ToolUse::default()
        };
        ToolReply::new(
            ToolCalls::new(Some(ToolParser::JsonTools), &use_).unwrap(),
            streaming,
        )
    }

    #[test]
    fn calls_leave_the_content_and_set_the_finish_reason() {
        let mut r = reply(true, true);
        let a = r.push("Let me check.<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}");
        assert_eq!(a.content, "Let me check.\n");
        assert_eq!(a.calls.len(), 1);
        assert_eq!(a.calls[0]["function"]["arguments"], "{\"x\": 1}");
        assert_eq!(a.calls[0]["index"], 0);
        let b = r.finish("stop");
        assert_eq!(b.calls[0]["function"]["name"], "g");
        assert_eq!(b.calls[0]["index"], 1);
        assert_eq!(r.finish_reason("stop"), "tool_calls");
        assert_eq!(r.finish_reason("length"), "length");
    }

    #[test]
    fn unreadable_calls_are_dropped_and_parallel_false_keeps_the_first() {
        let mut r = reply(false, false);
        let a = r.push("<tool_call>{broken</tool_call><tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>");
        assert_eq!(a.content, "");
        assert_eq!(a.calls.len(), 1);
        assert_eq!(a.calls[0]["function"]["name"], "a");
        assert!(a.calls[0].get("index").is_none());
        assert_eq!(r.finish_reason("stop"), "tool_calls");
    }
}
