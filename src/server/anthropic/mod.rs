//! Anthropic's Messages API, `POST /v1/messages`, over the same engine, limits and tool-call
//! handling as the OpenAI routes: a request is translated into a chat request (system prompt,
//! text, `tool_use` and `tool_result` blocks become the chat messages a template renders), and
//! the reply is written as a message (`text` and `tool_use` blocks, `stop_reason`, `usage`)
//! or as Anthropic's stream of events.

pub mod request;
pub mod respond;
