//! Turning engine events into OpenAI responses: one JSON object when not streaming, or
//! server-sent events (`data: {chunk}` … `data: [DONE]`) when streaming.

use super::error::ApiError;
use super::request::{CompletionRequest, Endpoint};
use super::routes::AppState;
use super::tool_reply::{ToolCalls, ToolReply, WholeReply};
use super::types::{
    AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatLogprobs, Delta,
    TextChoice, TextCompletion, TextLogprobs, TokenLogprob, TopLogprob,
};
use super::worker::{Event, Summary, TokenScore};
use crate::engine::tokenizer::Tokenizer;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

/// Unix seconds now.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What the response shapes need to know about a request.
#[derive(Debug, Clone)]
pub struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    return_token_ids: bool,
    /// How the reply's tool calls are found, when they are.
    tool_calls: Option<ToolCalls>,
}

impl Shape {
    /// The shape of the answer to `request`, for the served model `model` whose tool calls
    /// `tool_parser` reads.
    pub fn new(
        request: &CompletionRequest,
        model: &str,
        tool_parser: Option<crate::engine::tool_calls::ToolParser>,
    ) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let prefix = match request.endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        let created = unix_now();
        Self {
            endpoint: request.endpoint,
            id: format!(
                "{prefix}-{created:x}{:06x}",
                NEXT.fetch_add(1, Ordering::Relaxed)
            ),
            created,
            model: model.to_owned(),
            include_usage: request.include_usage,
            return_token_ids: request.return_token_ids,
            tool_calls: ToolCalls::new(tool_parser, &request.tool_use),
        }
    }

    /// The served model's id.
    pub(crate) fn model(&self) -> &str {
        &self.model
    }

    /// The tool-call state of a new reply, if its calls are parsed.
    pub(crate) fn tool_reply(&self, streaming: bool) -> Option<ToolReply> {
        self.tool_calls
            .clone()
            .map(|c| ToolReply::new(c, streaming))
    }

    fn token_ids(&self, summary: &Summary) -> Option<Vec<u32>> {
        self.return_token_ids.then(|| summary.token_ids.clone())
    }

    fn text_completion(
        &self,
        choices: Vec<TextChoice>,
        summary: Option<&Summary>,
    ) -> TextCompletion {
        TextCompletion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: summary.map(|s| s.usage.clone()),
            timings: summary.map(|s| s.timings.clone()),
        }
    }

    fn chat_chunk(&self, choices: Vec<ChatChunkChoice>, summary: Option<&Summary>) -> ChatChunk {
        ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: summary.map(|s| s.usage.clone()),
            timings: summary.map(|s| s.timings.clone()),
        }
    }
}

/// A token's text (decoded alone) and its UTF-8 bytes.
fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let text = tok.decode(&[id]).unwrap_or_default();
    let bytes = text.as_bytes().to_vec();
    (text, bytes)
}

/// OpenAI's logprob entry for a scored token.
fn token_logprob(tok: &Tokenizer, s: &TokenScore) -> TokenLogprob {
    let (token, bytes) = token_text(tok, s.id);
    TokenLogprob {
        token,
        logprob: s.logprob,
        bytes,
        top_logprobs: s
            .top
            .iter()
            .map(|&(id, logprob)| {
                let (token, bytes) = token_text(tok, id);
                TopLogprob {
                    token,
                    logprob,
                    bytes,
                }
            })
            .collect(),
    }
}

/// Logprobs gathered in the shape of one endpoint.
enum Logprobs {
    Chat(ChatLogprobs),
    Text(TextLogprobs),
}

impl Logprobs {
    fn new(endpoint: Endpoint) -> Self {
        match endpoint {
            Endpoint::Chat => Logprobs::Chat(ChatLogprobs::default()),
            Endpoint::Completions => Logprobs::Text(TextLogprobs::default()),
        }
    }

    fn push(&mut self, entry: TokenLogprob, offset: usize) {
        match self {
            Logprobs::Chat(l) => l.content.push(entry),
            Logprobs::Text(l) => l.push(entry, offset),
        }
    }
}

/// Waits for the whole generation and answers with one JSON object.
pub async fn collect(shape: Shape, state: &AppState, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut logprobs: Option<Logprobs> = None;
    let mut reply = WholeReply::new(shape.tool_reply(false));
    // Text offsets of logprobs count all generated text, tool calls included.
    let mut generated = 0;
    loop {
        match rx.recv().await {
            Some(Event::Delta { text: t, token }) => {
                if let Some(s) = token {
                    logprobs
                        .get_or_insert_with(|| Logprobs::new(shape.endpoint))
                        .push(token_logprob(&state.tokenizer, &s), generated);
                }
                generated += t.len();
                reply.push(&t);
            }
            Some(Event::Done(mut summary)) => {
                summary.finish_reason = reply.finish(summary.finish_reason);
                let WholeReply { content, calls, .. } = reply;
                let calls = (!calls.is_empty()).then_some(calls);
                return whole(&shape, content, calls, logprobs, &summary);
            }
            Some(Event::Error(e)) => return e.into_response(),
            None => {
                return ApiError::internal("the engine stopped before finishing this request")
                    .into_response()
            }
        }
    }
}

/// The non-streaming response object.
fn whole(
    shape: &Shape,
    text: String,
    tool_calls: Option<Vec<serde_json::Value>>,
    logprobs: Option<Logprobs>,
    s: &Summary,
) -> Response {
    match shape.endpoint {
        Endpoint::Chat => Json(ChatCompletion {
            id: shape.id.clone(),
            object: "chat.completion",
            created: shape.created,
            model: shape.model.clone(),
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant",
                    content: text,
                    tool_calls,
                },
                logprobs: match logprobs {
                    Some(Logprobs::Chat(l)) => Some(l),
                    _ => None,
                },
                finish_reason: s.finish_reason,
                token_ids: shape.token_ids(s),
            }],
            usage: s.usage.clone(),
            timings: s.timings.clone(),
        })
        .into_response(),
        Endpoint::Completions => Json(shape.text_completion(
            vec![TextChoice {
                index: 0,
                text,
                logprobs: match logprobs {
                    Some(Logprobs::Text(l)) => Some(l),
                    _ => None,
                },
                finish_reason: Some(s.finish_reason),
                token_ids: shape.token_ids(s),
            }],
            Some(s),
        ))
        .into_response(),
    }
}

/// The state of one SSE stream: frames ready to send, and the events still to come.
struct Stream {
    shape: Shape,
    state: Arc<AppState>,
    rx: UnboundedReceiver<Event>,
    frames: VecDeque<Bytes>,
    /// Characters of text sent so far (completions' `text_offset`).
    offset: usize,
    finished: bool,
    /// The reply's tool-call state, when its calls are parsed.
    tools: Option<ToolReply>,
}

fn frame(data: &impl Serialize) -> Bytes {
    let json = serde_json::to_string(data).unwrap_or_else(|_| "{}".to_owned());
    Bytes::from(format!("data: {json}\n\n"))
}

impl Stream {
    /// A chat chunk with the content and calls `text` settles (nothing when it settles
    /// neither and carries no logprob: held-back or tool-call text).
    fn tool_chunk(&mut self, text: &str, entry: Option<TokenLogprob>) {
        let Some(tools) = self.tools.as_mut() else {
            return;
        };
        let settled = tools.push(text);
        self.push_settled(settled, entry);
    }

    fn push_settled(&mut self, settled: super::tool_reply::Settled, entry: Option<TokenLogprob>) {
        if settled.content.is_empty() && settled.calls.is_empty() && entry.is_none() {
            return;
        }
        let delta = Delta {
            role: None,
            content: (!settled.content.is_empty() || settled.calls.is_empty())
                .then_some(settled.content),
            tool_calls: (!settled.calls.is_empty()).then_some(settled.calls),
        };
        let chunk = self.shape.chat_chunk(
            vec![ChatChunkChoice {
                index: 0,
                delta,
                logprobs: entry.map(|e| ChatLogprobs { content: vec![e] }),
                finish_reason: None,
                token_ids: None,
            }],
            None,
        );
        self.frames.push_back(frame(&chunk));
    }

    fn push(&mut self, event: Event) {
        match event {
            Event::Delta { text, token } => {
                let entry = token.map(|s| token_logprob(&self.state.tokenizer, &s));
                if self.tools.is_some() {
                    self.tool_chunk(&text, entry);
                    return;
                }
                let f = match self.shape.endpoint {
                    Endpoint::Chat => frame(&self.shape.chat_chunk(
                        vec![ChatChunkChoice {
                            index: 0,
                            delta: Delta {
                                role: None,
                                content: Some(text.clone()),
                                tool_calls: None,
                            },
                            logprobs: entry.map(|e| ChatLogprobs { content: vec![e] }),
                            finish_reason: None,
                            token_ids: None,
                        }],
                        None,
                    )),
                    Endpoint::Completions => frame(&self.shape.text_completion(
                        vec![TextChoice {
                            index: 0,
                            text: text.clone(),
                            logprobs: entry.map(|e| {
                                let mut l = TextLogprobs::default();
                                l.push(e, self.offset);
                                l
                            }),
                            finish_reason: None,
                            token_ids: None,
                        }],
                        None,
                    )),
                };
                self.offset += text.len();
                self.frames.push_back(f);
            }
            Event::Done(mut s) => {
                if let Some(tools) = self.tools.as_mut() {
                    let settled = tools.finish(s.finish_reason);
                    s.finish_reason = tools.finish_reason(s.finish_reason);
                    self.push_settled(settled, None);
                }
                let token_ids = self.shape.token_ids(&s);
                let last = match self.shape.endpoint {
                    Endpoint::Chat => frame(&self.shape.chat_chunk(
                        vec![ChatChunkChoice {
                            index: 0,
                            delta: Delta::default(),
                            logprobs: None,
                            finish_reason: Some(s.finish_reason),
                            token_ids,
                        }],
                        None,
                    )),
                    Endpoint::Completions => frame(&self.shape.text_completion(
                        vec![TextChoice {
                            index: 0,
                            text: String::new(),
                            logprobs: None,
                            finish_reason: Some(s.finish_reason),
                            token_ids,
                        }],
                        None,
                    )),
                };
                self.frames.push_back(last);
                if self.shape.include_usage {
                    let usage = match self.shape.endpoint {
                        Endpoint::Chat => frame(&self.shape.chat_chunk(Vec::new(), Some(&s))),
                        Endpoint::Completions => {
                            frame(&self.shape.text_completion(Vec::new(), Some(&s)))
                        }
                    };
                    self.frames.push_back(usage);
                }
                self.end();
            }
            Event::Error(e) => {
                self.frames
                    .push_back(Bytes::from(format!("data: {}\n\n", e.to_json())));
                self.end();
            }
        }
    }

    fn end(&mut self) {
        self.frames
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.finished = true;
    }
}

impl EventFrames for Stream {
    fn parts(&mut self) -> (&mut VecDeque<Bytes>, &mut UnboundedReceiver<Event>, bool) {
        (&mut self.frames, &mut self.rx, self.finished)
    }

    fn push(&mut self, event: Event) {
        Stream::push(self, event);
    }
}

/// A response stream that turns the engine's events into server-sent-event frames (the
/// OpenAI chunks here, Anthropic's events in `anthropic::respond`).
pub(crate) trait EventFrames: Send + 'static {
    /// The frames ready to send, the events still to come, and whether the last frame is queued.
    fn parts(&mut self) -> (&mut VecDeque<Bytes>, &mut UnboundedReceiver<Event>, bool);
    /// Turns one event into frames.
    fn push(&mut self, event: Event);
}

/// The next frame, waiting for the engine when none is ready; `None` ends the body.
async fn next_frame<S: EventFrames>(s: &mut S) -> Option<Bytes> {
    loop {
        let (frames, rx, finished) = s.parts();
        if let Some(f) = frames.pop_front() {
            return Some(f);
        }
        if finished {
            return None;
        }
        let event = rx.recv().await.unwrap_or_else(|| {
            Event::Error(ApiError::internal(
                "the engine stopped before finishing this request",
            ))
        });
        s.push(event);
    }
}

/// A `text/event-stream` response whose body is `s`'s frames.
pub(crate) fn event_stream<S: EventFrames>(s: S) -> Response {
    let body = futures_util::stream::unfold(s, |mut s| async move {
        next_frame(&mut s)
            .await
            .map(|f| (Ok::<_, Infallible>(f), s))
    });
    let mut response = Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Answers with server-sent events, starting with `first` (already received, so that an
/// error before any output can still get its own status code).
pub fn stream(
    shape: Shape,
    state: Arc<AppState>,
    rx: UnboundedReceiver<Event>,
    first: Event,
) -> Response {
    let mut s = Stream {
        shape,
        state,
        rx,
        frames: VecDeque::new(),
        offset: 0,
        finished: false,
        tools: None,
    };
    s.tools = s.shape.tool_reply(true);
    if s.shape.endpoint == Endpoint::Chat {
        let role = s.shape.chat_chunk(
            vec![ChatChunkChoice {
                index: 0,
                delta: Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    tool_calls: None,
                },
                logprobs: None,
                finish_reason: None,
                token_ids: None,
            }],
            None,
        );
        s.frames.push_back(frame(&role));
    }
    s.push(first);
    event_stream(s)
}
