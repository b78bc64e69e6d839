//! `mlxb serve` through the official `openai` Python client (pinned in
//! scripts/requirements-oracle.txt): chat and completions, streamed and not, with `usage`
//! (incl. `cached_tokens` on a repeated prompt) and `logprobs`, parsed by the client's own
//! types; the texts equal `mlxb generate`'s.

mod common;
mod serve_harness;

use serde_json::Value;
use serve_harness::{generate, Server, PROMPT};

#[test]
fn the_openai_client_reads_every_shape() {
    // One request at a time (`--max-batch 1`): the repeated prompt is served from the reused
    // prefix, which only the single-stream path keeps.
    let s = Server::start(&["--api-key", "sk-test", "--max-batch", "1"]);
    let max_tokens = 20;
    let chat_want = generate(PROMPT, max_tokens, &[]);
    let comp_want = generate(PROMPT, max_tokens, &["--ignore-chat-template"]);
    let out = common::run_python(
        &common::root().join("tests/oracle/serve_openai.py"),
        &[&s.url, "serve-tiny-llama", PROMPT, &max_tokens.to_string()],
    );
    let got: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(got["models"], serde_json::json!(["serve-tiny-llama"]));
    let completion_tokens = chat_want["token_ids"].as_array().unwrap().len();
    let prompt_tokens = chat_want["prompt_token_ids"].as_array().unwrap().len();

    // Chat: whole, repeated (served from the reused prefix), streamed: one text.
    assert_eq!(got["chat_text"], chat_want["text"]);
    assert_eq!(got["chat_finish"], chat_want["finish_reason"]);
    assert_eq!(got["chat_again_text"], chat_want["text"]);
    assert_eq!(got["chat_stream_text"], chat_want["text"]);
    assert_eq!(got["chat_stream_finish"], chat_want["finish_reason"]);
    let usage = &got["chat_usage"];
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    assert_eq!(usage["completion_tokens"], completion_tokens);
    assert_eq!(usage["total_tokens"], prompt_tokens + completion_tokens);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(got["chat_again_cached"], prompt_tokens - 1);
    assert_eq!(
        got["chat_stream_usage"]["completion_tokens"],
        completion_tokens
    );
    assert_eq!(
        got["chat_stream_usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens - 1
    );
    let lps = got["chat_logprobs"].as_array().unwrap();
    assert!(!lps.is_empty() && lps.iter().all(|l| l.as_f64().unwrap() <= 0.0));

    // Completions: the raw prompt, as `generate --ignore-chat-template`.
    assert_eq!(got["comp_text"], comp_want["text"]);
    assert_eq!(got["comp_stream_text"], comp_want["text"]);
    assert_eq!(
        got["comp_usage"]["prompt_tokens"],
        comp_want["prompt_token_ids"].as_array().unwrap().len()
    );
    assert!(!got["comp_logprobs"].as_array().unwrap().is_empty());

    // A path as `model` is a 400 the client raises as BadRequestError.
    assert_eq!(
        got["wrong_model"],
        serde_json::json!({"status": 400, "param": "model"})
    );
}
