//! The reply to a Messages request: one `message` object, or Anthropic's event stream
//! (`message_start`, `content_block_start`/`_delta`/`_stop` per text or `tool_use` block,
//! `message_delta` with the stop reason and usage, `message_stop`).

use crate::server::error::ApiError;
use crate::server::respond::{event_stream, EventFrames, Shape};
use crate::server::tool_reply::{Settled, ToolReply, WholeReply};
use crate::server::worker::{Event, Summary};
use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::collections::VecDeque;
use tokio::sync::mpsc::UnboundedReceiver;

/// What a Messages reply needs besides the engine's events.
pub struct MessageShape {
    /// The chat shape of the translated request (model, tool-call handling).
    pub shape: Shape,
    /// `msg_...`.
    pub id: String,
    /// Prompt tokens (`message_start` reports them before any output).
    pub input_tokens: usize,
}

impl MessageShape {
    /// The shape of the reply to a translated request with `input_tokens` prompt tokens.
    pub fn new(shape: Shape, input_tokens: usize) -> Self {
        Self {
            shape,
            id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
            input_tokens,
        }
    }
}

/// Anthropic's stop reason for how the engine (and the tool-call reader) ended the reply.
fn stop_reason(finish_reason: &str, summary: &Summary) -> &'static str {
    match finish_reason {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        _ if summary.stop_sequence.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

/// A `tool_use` block for a call in OpenAI's shape (its arguments text parsed back).
fn tool_use_block(call: &Value) -> Value {
    let input = call["function"]["arguments"]
        .as_str()
        .and_then(|a| serde_json::from_str(a).ok())
        .unwrap_or_else(|| json!({}));
    json!({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": input})
}

/// Waits for the whole reply and answers with one message.
pub async fn collect(m: MessageShape, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut reply = WholeReply::new(m.shape.tool_reply(false));
    loop {
        match rx.recv().await {
            Some(Event::Delta { text: t, .. }) => reply.push(&t),
            Some(Event::Done(s)) => {
                let reason = reply.finish(s.finish_reason);
                let mut content = Vec::new();
                if !reply.content.is_empty() || reply.calls.is_empty() {
                    content.push(json!({"type": "text", "text": reply.content}));
                }
                content.extend(reply.calls.iter().map(tool_use_block));
                return Json(json!({
                    "id": m.id,
                    "type": "message",
                    "role": "assistant",
                    "model": m.shape.model(),
                    "content": content,
                    "stop_reason": stop_reason(reason, &s),
                    "stop_sequence": s.stop_sequence,
                    "usage": {"input_tokens": s.usage.prompt_tokens,
                              "output_tokens": s.usage.completion_tokens},
                }))
                .into_response();
            }
            Some(Event::Error(e)) => return e.into_response(),
            None => {
                return ApiError::internal("the engine stopped before finishing this request")
                    .into_response()
            }
        }
    }
}

/// The block a stream has open.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Text,
}

struct EventStream {
    rx: UnboundedReceiver<Event>,
    frames: VecDeque<Bytes>,
    tools: Option<ToolReply>,
    open: Open,
    /// Index of the next content block.
    next: usize,
    finished: bool,
}

fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

impl EventStream {
    fn emit(&mut self, name: &str, data: Value) {
        self.frames.push_back(event(name, &data));
    }

    fn close_block(&mut self) {
        if self.open == Open::Text {
            let index = self.next - 1;
            self.emit(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            );
            self.open = Open::None;
        }
    }

    fn open_text(&mut self) {
        if self.open != Open::Text {
            let index = self.next;
            self.next += 1;
            self.open = Open::Text;
            self.emit(
                "content_block_start",
                json!({"type": "content_block_start", "index": index,
                       "content_block": {"type": "text", "text": ""}}),
            );
        }
    }

    fn text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        self.open_text();
        let index = self.next - 1;
        self.emit(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "text_delta", "text": text}}),
        );
    }

    fn call(&mut self, call: &Value) {
        self.close_block();
        let index = self.next;
        self.next += 1;
        let mut start = tool_use_block(call);
        let input = std::mem::replace(&mut start["input"], json!({}));
        self.emit(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": start}),
        );
        self.emit(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
        );
        self.emit(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        );
    }

    fn settled(&mut self, s: Settled) {
        self.text(&s.content);
        for c in &s.calls {
            self.call(c);
        }
    }

    fn push(&mut self, e: Event) {
        match e {
            Event::Delta { text, .. } => match self.tools.as_mut() {
                Some(r) => {
                    let s = r.push(&text);
                    self.settled(s);
                }
                None => self.text(&text),
            },
            Event::Done(s) => {
                let mut reason = s.finish_reason;
                if let Some(r) = self.tools.as_mut() {
                    let settled = r.finish(s.finish_reason);
                    reason = r.finish_reason(s.finish_reason);
                    self.settled(settled);
                }
                if self.next == 0 {
                    // A reply with no text still has its (empty) text block.
                    self.open_text();
                }
                self.close_block();
                self.emit(
                    "message_delta",
                    json!({"type": "message_delta",
                           "delta": {"stop_reason": stop_reason(reason, &s), "stop_sequence": s.stop_sequence},
                           "usage": {"output_tokens": s.usage.completion_tokens}}),
                );
                self.emit("message_stop", json!({"type": "message_stop"}));
                self.finished = true;
            }
            Event::Error(err) => {
                self.emit(
                    "error",
                    json!({"type": "error", "error": {"type": err.kind, "message": err.message}}),
                );
                self.finished = true;
            }
        }
    }
}

impl EventFrames for EventStream {
    fn parts(&mut self) -> (&mut VecDeque<Bytes>, &mut UnboundedReceiver<Event>, bool) {
        (&mut self.frames, &mut self.rx, self.finished)
    }

    fn push(&mut self, event: Event) {
        EventStream::push(self, event);
    }
}

/// Answers with Anthropic's event stream, starting with `first` (already received).
pub fn stream(m: MessageShape, rx: UnboundedReceiver<Event>, first: Event) -> Response {
    let tools = m.shape.tool_reply(true);
    let start = json!({"type": "message_start", "message": {
        "id": m.id, "type": "message", "role": "assistant", "model": m.shape.model(),
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": m.input_tokens, "output_tokens": 0}}});
    let mut s = EventStream {
        rx,
        frames: VecDeque::new(),
        tools,
        open: Open::None,
        next: 0,
        finished: false,
    };
    s.emit("message_start", start);
    s.emit("ping", json!({"type": "ping"}));
    s.push(first);
    event_stream(s)
}
