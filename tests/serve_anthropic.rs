//! `POST /v1/messages` driven by Anthropic's official Python client (pinned in
//! scripts/requirements-oracle.txt): at temperature 0 the message's text is the chat route's
//! text for the same prompt, streamed and whole alike, with Anthropic's stop reasons, usage and
//! `x-api-key` authentication; an agent's `tool_use`/`tool_result` turn is answered; forcing a
//! tool is a 400.

mod common;
mod serve_harness;

use serde_json::{json, Value};
use serve_harness::{Server, PROMPT};

#[test]
fn the_anthropic_client_reads_every_shape() {
    let s = Server::start(&["--api-key", "sk-ant-test"]);
    let (status, chat) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(status, 200, "{chat}");
    let want = chat["choices"][0]["message"]["content"].as_str().unwrap();
    let out = common::run_python(
        &common::root().join("tests/oracle/serve_anthropic.py"),
        &[&s.url, "serve-tiny-llama", PROMPT, "12", "sk-ant-test"],
    );
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["text"], want, "{v}");
    assert_eq!(v["streamed"], want, "{v}");
    assert_eq!(v["role"], "assistant");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    let reason = match chat["choices"][0]["finish_reason"].as_str().unwrap() {
        "length" => "max_tokens",
        _ => "end_turn",
    };
    assert_eq!(v["stop_reason"], reason, "{v}");
    assert_eq!(v["streamed_stop_reason"], reason, "{v}");
    let usage = json!([
        chat["usage"]["prompt_tokens"],
        chat["usage"]["completion_tokens"]
    ]);
    assert_eq!(v["usage"], usage, "{v}");
    assert_eq!(v["streamed_usage"], usage, "{v}");
    let stopped = &v["stopped"];
    let stop = stopped["stop"]
        .as_str()
        .expect("the reply is long enough to stop in");
    assert_eq!(stopped["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(stopped["stop_sequence"], stop, "{v}");
    assert_eq!(stopped["text"], &want[..want.find(stop).unwrap()], "{v}");
    assert_eq!(v["tool_turn"]["types"][0], "text", "{v}");
    assert_eq!(v["forced"]["status"], 400, "{v}");
    assert_eq!(v["forced"]["body"]["error"]["param"], "tool_choice", "{v}");
}
