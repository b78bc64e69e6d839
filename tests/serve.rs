//! `mlxb serve` end to end: the real binary on a free loopback port (127.0.0.1 only) with a
//! tiny random model, driven by a real HTTP client. Greedy output over HTTP equals
//! `mlxb generate`, streams concatenate to the same text, speculative serving is lossless,
//! bad requests get OpenAI-style 400s naming the field, metrics move, the queue is bounded,
//! and a client that disconnects frees the engine. Every loop here is bounded.

mod common;
mod serve_harness;

use serde_json::{json, Value};
use serve_harness::{
    answers_alone, chat_body, concurrent_drafted_answers, generate, ids, model, stream_text,
    Server, PROMPT,
};
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// A two-character stop string whose first occurrence in `text` comes after at least four
/// characters, and the text before it.
fn stop_probe(text: &str) -> (String, String) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    chars
        .windows(2)
        .skip(4)
        .find_map(|w| {
            let stop: String = w.iter().map(|&(_, c)| c).collect();
            (text.find(&stop) == Some(w[0].0)).then(|| (stop, text[..w[0].0].to_owned()))
        })
        .unwrap_or_else(|| panic!("no usable stop string in {text:?}"))
}

#[test]
fn greedy_http_matches_generate_streams_and_stops() {
    let s = Server::start(&[]);
    let want = generate(PROMPT, 24, &[]);
    let (status, chat) = s.post("/v1/chat/completions", &chat_body(PROMPT, 24));
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["object"], "chat.completion");
    let choice = &chat["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], want["text"]);
    assert_eq!(ids(&choice["token_ids"]), ids(&want["token_ids"]));
    assert_eq!(choice["finish_reason"], want["finish_reason"]);
    let usage = &chat["usage"];
    assert_eq!(
        usage["prompt_tokens"].as_u64().unwrap() as usize,
        ids(&want["prompt_token_ids"]).len()
    );
    assert_eq!(
        usage["completion_tokens"].as_u64().unwrap() as usize,
        ids(&want["token_ids"]).len()
    );
    assert!(chat["timings"]["predicted_per_second"].as_f64().unwrap() > 0.0);

    // Completions take the prompt as-is, like `generate --ignore-chat-template`.
    let plain = generate(PROMPT, 24, &["--ignore-chat-template"]);
    let (status, comp) = s.post(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 24, "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{comp}");
    assert_eq!(comp["object"], "text_completion");
    assert_eq!(comp["choices"][0]["text"], plain["text"]);
    assert_eq!(
        ids(&comp["choices"][0]["token_ids"]),
        ids(&plain["token_ids"])
    );

    // Streaming: the chunks concatenate to the same text and end with [DONE].
    let mut body = chat_body(PROMPT, 24);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = s.stream("/v1/chat/completions", &body);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (text, finish, usage) = stream_text(&events);
    assert_eq!(text, want["text"].as_str().unwrap());
    assert_eq!(finish.as_deref(), want["finish_reason"].as_str());
    assert_eq!(
        usage.unwrap()["completion_tokens"],
        chat["usage"]["completion_tokens"]
    );
    let events = s.stream(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 24, "stream": true}),
    );
    assert_eq!(stream_text(&events).0, plain["text"].as_str().unwrap());

    // Stop strings end the generation and are cut from the text, streamed or not.
    let whole = plain["text"].as_str().unwrap();
    let (stop, expected) = stop_probe(whole);
    let expected = expected.as_str();
    let body = json!({"prompt": PROMPT, "max_tokens": 24, "stop": [stop, "\u{1}never"]});
    let (_, cut) = s.post("/v1/completions", &body);
    assert!(!expected.is_empty());
    assert_eq!(cut["choices"][0]["text"], expected, "stop {stop:?}");
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    let mut body = body;
    body["stream"] = json!(true);
    let (text, finish, _) = stream_text(&s.stream("/v1/completions", &body));
    assert_eq!((text.as_str(), finish.as_deref()), (expected, Some("stop")));

    // Logprobs: one entry per token, the chosen token's logprob is the best at T=0.
    let mut body = chat_body(PROMPT, 4);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let (_, lp) = s.post("/v1/chat/completions", &body);
    let content = lp["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for entry in content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(entry["logprob"], top[0]["logprob"]);
    }

    // The model list and the metrics.
    let models: Value = s
        .agent
        .get(&s.url("/v1/models"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(models["data"][0]["id"], "serve-tiny-llama");
    let m = s.metrics();
    for name in [
        "mlxb:requests_received_total",
        "mlxb:prompt_tokens_total",
        "mlxb:generation_tokens_total",
        "mlxb:num_requests_waiting",
        "mlxb:time_to_first_token_seconds_count",
        "mlxb:decode_tokens_per_second_count",
        "mlxb:spec_decode_num_drafts_total",
        "mlxb:spec_decode_mean_acceptance_length",
    ] {
        assert!(m.contains(name), "{name} missing from /metrics:\n{m}");
    }
    assert_eq!(s.metric("mlxb:requests_received_total"), 7.0);
    let before = s.metric("mlxb:generation_tokens_total");
    s.post(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 3}),
    );
    assert!(s.metric("mlxb:generation_tokens_total") > before);
    assert_eq!(s.metric("mlxb:num_requests_running"), 0.0);
}

#[test]
fn speculative_serving_is_lossless() {
    let want = generate(PROMPT, 40, &[]);
    let other = "What is the capital of France? Paris is the capital of France.";
    let want_other = generate(other, 40, &[]);
    let model = model().to_str().unwrap();
    // A random DSpark drafter for the tiny target (lossless whatever it proposes).
    let tmp = tempfile::tempdir().unwrap();
    let dspark = tmp.path().join("dspark");
    let dspark = dspark.to_str().unwrap();
    let (code, _, err) = common::run_mlxb(&common::dspark_init_args(
        model,
        dspark,
        &["--tap-layers", "0"],
    ));
    assert_eq!(code, 0, "{err}");
    let drafters: [&[&str]; 4] = [
        &["--draft-kind", "ngram", "--num-draft-tokens", "3"],
        &["--draft-kind", "model", "--draft-model", model],
        &["--draft-kind", "self", "--draft-layers", "1"],
        &["--drafter", dspark, "--dspark-min-conf", "0"],
    ];
    for drafter in drafters {
        // Every proposal in full: the cost policy may rightly find drafting does not pay on a
        // given machine, and this test is about what drafting does to the answers and counters.
        let flags = [drafter, &["--draft-policy", "all"][..]].concat();
        let s = Server::start(&flags);
        let mut rounds = 0;
        // Two different prompts in a row: the one drafter must start afresh for each.
        for (prompt, want) in [(PROMPT, &want), (other, &want_other), (PROMPT, &want)] {
            let (status, spec) = s.post("/v1/chat/completions", &chat_body(prompt, 40));
            assert_eq!(status, 200, "{flags:?}: {spec}");
            assert_eq!(
                ids(&spec["choices"][0]["token_ids"]),
                ids(&want["token_ids"]),
                "{flags:?}"
            );
            assert_eq!(spec["choices"][0]["message"]["content"], want["text"]);
            let timings = &spec["timings"];
            let drafted = timings["draft_n"].as_u64().unwrap();
            let with_draft = timings["draft_rounds"].as_u64().unwrap();
            assert!(
                with_draft <= drafted && (with_draft > 0) == (drafted > 0),
                "{timings}"
            );
            rounds += with_draft;
        }
        // Per-request rounds add up to the server's count of drafts.
        assert_eq!(
            rounds as f64,
            s.metric("mlxb:spec_decode_num_drafts_total"),
            "{flags:?}"
        );
        // Streamed, and with speculation turned off for one request: still the same text.
        let mut body = chat_body(PROMPT, 40);
        body["stream"] = json!(true);
        assert_eq!(
            stream_text(&s.stream("/v1/chat/completions", &body)).0,
            want["text"].as_str().unwrap()
        );
        let mut body = chat_body(PROMPT, 40);
        body["num_draft_tokens"] = json!(0);
        let (_, off) = s.post("/v1/chat/completions", &body);
        assert_eq!(off["choices"][0]["message"]["content"], want["text"]);
        assert!(off["timings"].get("draft_n").is_none());

        let drafts = s.metric("mlxb:spec_decode_num_drafts_total");
        let drafted = s.metric("mlxb:spec_decode_num_draft_tokens_total");
        let accepted = s.metric("mlxb:spec_decode_num_accepted_tokens_total");
        assert!(drafts > 0.0, "{flags:?}: {}", s.metrics());
        assert!(drafted >= drafts && accepted <= drafted);
        let rate = s.metric("mlxb:spec_decode_acceptance_rate");
        assert!((rate - accepted / drafted).abs() < 1e-9);
        let mal = s.metric("mlxb:spec_decode_mean_acceptance_length");
        assert!((mal - (1.0 + accepted / drafts)).abs() < 1e-9);
        if flags[1] == "model" {
            // The target drafting for itself: every drafted token is accepted.
            assert_eq!(accepted, drafted, "{}", s.metrics());
        }
    }
}

#[test]
fn bad_requests_get_400_naming_the_field() {
    let s = Server::start(&[
        "--max-tokens-limit",
        "64",
        "--max-body-bytes",
        "4096",
        "--api-key",
        "sk-test",
    ]);
    // The key guards every route but /health.
    let bare = |path: &str| match s.agent.get(&s.url(path)).call() {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(code, _)) => code,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(
        (bare("/health"), bare("/v1/models"), bare("/metrics")),
        (200, 401, 401)
    );
    let wrong = s
        .agent
        .post(&s.url("/v1/completions"))
        .set("Authorization", "Bearer sk-wrong")
        .send_json(json!({"prompt": "hi"}));
    match wrong {
        Err(ureq::Error::Status(401, r)) => {
            let err: Value = r.into_json().unwrap();
            assert_eq!(err["error"]["code"], "invalid_api_key");
        }
        other => panic!("a wrong key was not refused: {other:?}"),
    }
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"messages": user, "temperature": -0.5}),
            "temperature",
        ),
        (
            json!({"messages": user, "temperature": "warm"}),
            "temperature",
        ),
        (json!({"messages": user, "max_tokens": 0}), "max_tokens"),
        (json!({"messages": user, "max_tokens": 65}), "max_tokens"),
        (json!({"messages": user, "max_tokens": 2.5}), "max_tokens"),
        (json!({"messages": user, "model": "gpt-4"}), "model"),
        (json!({"messages": user, "top_p": 2}), "top_p"),
        (json!({"messages": user, "stop": [1, 2]}), "stop"),
        (json!({"messages": user, "stream": "yes"}), "stream"),
        (
            json!({"messages": user, "draft_model": "/tmp"}),
            "draft_model",
        ),
        (json!({"messages": "hi"}), "messages"),
        (json!({"messages": [{"role": "user"}], "seed": -1}), "seed"),
        (json!({"messages": [{"content": "hi"}]}), "messages[0].role"),
        (json!({"messages": user, "tools": {"a": 1}}), "tools"),
        (
            json!({"messages": user, "tools": [{"type": "function"}]}),
            "tools[0]",
        ),
        (
            json!({"messages": user, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools[0]",
        ),
        (
            json!({"messages": user, "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": user, "parallel_tool_calls": "no"}),
            "parallel_tool_calls",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
    ];
    for (body, field) in cases {
        let (status, err) = s.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body} → {err}");
        assert_eq!(err["error"]["param"], field, "{body} → {err}");
        assert_eq!(err["error"]["type"], "invalid_request_error");
        assert!(!err["error"]["message"].as_str().unwrap().is_empty());
    }
    let (status, err) = s.post("/v1/completions", &json!({"prompt": 5}));
    assert_eq!(
        (status, err["error"]["param"].as_str()),
        (400, Some("prompt"))
    );
    for raw in ["{not json", "[1, 2]", ""] {
        let (status, text) = s.post_raw("/v1/chat/completions", raw);
        assert_eq!(status, 400, "{raw:?} → {text}");
        let err: Value = serde_json::from_str(&text).unwrap();
        assert!(err["error"]["message"].is_string(), "{text}");
    }
    let big = json!({"prompt": "x".repeat(8192)}).to_string();
    let (status, text) = s.post_raw("/v1/completions", &big);
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("\"error\""), "{text}");
    let (status, _) = s.post_raw("/v1/nothing", "{}");
    assert_eq!(status, 404);
    // Still serving, and the rejections were counted.
    let (status, ok) = s.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(status, 200, "{ok}");
    // A whole agent turn is accepted: tools, an assistant call with JSON-text arguments, the
    // tool's answer, `tool_choice` and `parallel_tool_calls`.
    let agent = json!({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        "tool_choice": "auto", "parallel_tool_calls": false, "max_tokens": 2});
    let (status, ok) = s.post("/v1/chat/completions", &agent);
    assert_eq!(status, 200, "{ok}");
    assert!(s.metric("mlxb:request_rejected_total{reason=\"invalid\"}") >= 25.0);
}

#[test]
fn queue_is_bounded_and_disconnects_free_the_engine() {
    // One at a time (`--max-batch 1`): B waits in the queue while A generates.
    let s = Server::start(&[
        "--max-batch",
        "1",
        "--max-queue",
        "1",
        "--max-tokens-limit",
        "1000000",
    ]);
    // A: a long streaming generation; read one chunk so it is surely running.
    let a_reader = s.open_long_stream();
    // B waits in the queue (its own thread), C finds the queue full.
    let agent = s.agent.clone();
    let b_url = s.url("/v1/completions");
    let b = std::thread::spawn(move || {
        agent
            .post(&b_url)
            .send_json(json!({"prompt": PROMPT, "max_tokens": 8}))
            .map(|r| r.into_json::<Value>().unwrap())
            .map_err(|e| e.to_string())
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.metric("mlxb:num_requests_waiting") < 1.0 {
        assert!(Instant::now() < deadline, "B never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, err) = s.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(status, 503, "{err}");
    assert_eq!(err["error"]["code"], "server_overloaded");
    // A's client goes away: its generation stops and B gets the engine.
    drop(a_reader);
    let b = b.join().unwrap().expect("B failed");
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    assert_eq!(s.metric("mlxb:request_aborted_total"), 1.0);
    assert_eq!(
        s.metric("mlxb:request_rejected_total{reason=\"unavailable\"}"),
        1.0
    );
    assert_eq!(s.metric("mlxb:num_requests_running"), 0.0);

    // Concurrent streaming clients all complete, each with its own uncorrupted stream.
    let prompts: Vec<String> = (0..4).map(|i| format!("{PROMPT} {i}")).collect();
    let expected: Vec<String> = prompts
        .iter()
        .map(|p| {
            let (_, v) = s.post("/v1/completions", &json!({"prompt": p, "max_tokens": 12}));
            v["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    let s2 = Server::start(&["--max-queue", "8"]);
    let url = s2.url("/v1/completions");
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (agent, url, p) = (s2.agent.clone(), url.clone(), p.clone());
            std::thread::spawn(move || {
                let body = json!({"prompt": p, "max_tokens": 12, "stream": true});
                let r = agent.post(&url).send_json(body).unwrap();
                BufReader::new(r.into_reader())
                    .lines()
                    .map_while(Result::ok)
                    .filter_map(|l| l.strip_prefix("data: ").map(str::to_owned))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (h, want) in handles.into_iter().zip(&expected) {
        let events = h.join().unwrap();
        assert_eq!(&stream_text(&events).0, want);
    }
    assert_eq!(
        s2.metric("mlxb:request_success_total{finished_reason=\"length\"}"),
        4.0
    );
}

#[test]
fn sigterm_cancels_running_requests_and_exits() {
    let mut s = Server::start(&["--max-tokens-limit", "1000000"]);
    let reader = s.open_long_stream();
    // SIGTERM: the running stream is cancelled with an error event, then the server exits.
    let pid = i32::try_from(s.child.id()).unwrap();
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let rest: Vec<String> = reader.lines().map_while(Result::ok).collect();
    let data: Vec<&str> = rest
        .iter()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(
        data.last().copied(),
        Some("[DONE]"),
        "{:?}",
        &data[data.len().saturating_sub(3)..]
    );
    let err: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    assert_eq!(err["error"]["code"], "server_shutting_down", "{err}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}

/// A completions request on token ids with greedy decoding, logprobs and returned ids.
fn ids_body(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "logprobs": 2, "return_token_ids": true})
}

/// What must not change with prefix reuse: text, ids, every logprob (as f32 JSON, which
/// round-trips bits) and the alternatives.
fn output_of(v: &Value) -> Value {
    let c = &v["choices"][0];
    json!([c["text"], c["token_ids"], c["logprobs"], c["finish_reason"]])
}

/// `mlxb generate --prompt-ids` on `prompt` with prefill chunks of `step` (its `--json`).
fn generate_ids(prompt: &[u32], max_tokens: usize, step: usize) -> Value {
    let ids = common::ids_arg(prompt);
    let step = step.to_string();
    generate(
        "",
        max_tokens,
        &["--prompt-ids", &ids, "--prefill-step-size", &step],
    )
}

fn cached_tokens(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
}

#[test]
fn prefix_reuse_is_bit_exact() {
    // 23 tokens: a repeated prompt reuses 22, other prompts whole 4-token chunks (20).
    let base = common::prompt_ids(23, 384, 5);
    let longer: Vec<u32> = base
        .iter()
        .copied()
        .chain(common::prompt_ids(6, 384, 9))
        .collect();
    // Same first 22 tokens, a different last one.
    let mut last_changed = base.clone();
    *last_changed.last_mut().unwrap() = 7;
    // Prefix reuse is the single-stream path's (`--max-batch 1`).
    let step = ["--prefill-step-size", "4", "--max-batch", "1"];
    let reuse = Server::start(&step);
    let fresh = Server::start(&[&step[..], &["--no-prefix-reuse"]].concat());
    let ask = |s: &Server, body: &Value| {
        let (status, v) = s.post("/v1/completions", body);
        assert_eq!(status, 200, "{v}");
        v
    };
    // (prompt, repetition penalty, cached tokens expected on the reusing server)
    let steps: [(&[u32], Option<f64>, u64); 6] = [
        (&base, None, 0),
        (&base, None, 22),         // repeated: all but the last token
        (&last_changed, None, 22), // same length, last token differs
        (&longer, None, 20),       // longer: whole 4-token prefill chunks only
        (&base, Some(1.3), 20),    // shorter: the same; processors see it as history
        (&longer, Some(1.3), 20),  // after a shorter prompt: whole chunks again
    ];
    for (i, (prompt, penalty, cached)) in steps.into_iter().enumerate() {
        let mut body = ids_body(prompt, 12);
        if let Some(p) = penalty {
            body["repetition_penalty"] = json!(p);
        }
        let got = ask(&reuse, &body);
        let want = ask(&fresh, &body);
        assert_eq!(
            output_of(&got),
            output_of(&want),
            "step {i}: reuse changed the output"
        );
        assert_eq!(cached_tokens(&got), cached, "step {i}");
        assert_eq!(cached_tokens(&want), 0, "step {i}");
        assert_eq!(got["usage"]["prompt_tokens"], prompt.len(), "step {i}");
    }
    // And both equal `mlxb generate` on the same ids (an independent process, fresh caches).
    let cli = generate_ids(&longer, 12, 4);
    let got = ask(&reuse, &ids_body(&longer, 12));
    assert_eq!(cached_tokens(&got), 28);
    assert_eq!(ids(&got["choices"][0]["token_ids"]), ids(&cli["token_ids"]));
    assert_eq!(got["choices"][0]["text"], cli["text"]);
    assert_eq!(reuse.metric("mlxb:prompt_tokens_cached_total"), 132.0);
    assert_eq!(fresh.metric("mlxb:prompt_tokens_cached_total"), 0.0);

    // A drafter's requests reuse the target's caches too and stay lossless.
    let spec = Server::start(&["--draft-kind", "ngram", "--num-draft-tokens", "3"]);
    let first = ask(&spec, &ids_body(&base, 16));
    let again = ask(&spec, &ids_body(&base, 16));
    assert_eq!(cached_tokens(&again), 22);
    assert_eq!(output_of(&first), output_of(&again));
    assert_eq!(
        output_of(&again)[1],
        output_of(&ask(&fresh, &ids_body(&base, 16)))[1]
    );
}

/// The batched server keeps prompts it prefilled alone (an LRU bounded by
/// `--prompt-cache-bytes`) and a later request reuses one only where a fresh prefill would also
/// cut: answers stay bit-identical to a server that keeps nothing, and to `mlxb generate`.
#[test]
fn batched_requests_reuse_kept_prefixes_bit_exactly() {
    let base = common::prompt_ids(23, 384, 5);
    let longer: Vec<u32> = base
        .iter()
        .copied()
        .chain(common::prompt_ids(6, 384, 9))
        .collect();
    let other = common::prompt_ids(17, 384, 11);
    let step = ["--prefill-step-size", "4"];
    let keep = Server::start(&step);
    let none = Server::start(&[&step[..], &["--prompt-cache-bytes", "0"]].concat());
    let ask = |s: &Server, prompt: &[u32]| {
        let (status, v) = s.post("/v1/completions", &ids_body(prompt, 12));
        assert_eq!(status, 200, "{v}");
        v
    };
    // (prompt, cached tokens expected): other prompts in between stay in the LRU beside them.
    let steps: [(&[u32], u64); 5] = [
        (&base, 0),
        (&other, 0),
        (&base, 22),   // repeated: all but the last token
        (&longer, 20), // longer: whole 4-token prefill chunks only
        (&longer, 28), // repeated in turn
    ];
    for (i, (prompt, cached)) in steps.into_iter().enumerate() {
        let got = ask(&keep, prompt);
        let want = ask(&none, prompt);
        assert_eq!(
            output_of(&got),
            output_of(&want),
            "step {i}: reuse changed the output"
        );
        assert_eq!(cached_tokens(&got), cached, "step {i}");
        assert_eq!(cached_tokens(&want), 0, "step {i}");
    }
    let cli = generate_ids(&longer, 12, 4);
    let got = ask(&keep, &longer);
    assert_eq!(ids(&got["choices"][0]["token_ids"]), ids(&cli["token_ids"]));
    assert_eq!(keep.metric("mlxb:prompt_tokens_cached_total"), 98.0);
    assert_eq!(none.metric("mlxb:prompt_tokens_cached_total"), 0.0);
    // The kept prompts are counted in bytes; a server that keeps nothing holds none.
    assert!(keep.metric("mlxb:prompt_cache_bytes") > 0.0);
    assert_eq!(none.metric("mlxb:prompt_cache_bytes"), 0.0);

    // With --prompt-concurrency 1, prompts arriving together are still prefilled one at a time,
    // so each is kept: asked again, each reuses all but its last token.
    let alone = Server::start(&[&step[..], &["--prompt-concurrency", "1"]].concat());
    let prompts = [base.clone(), other.clone(), common::prompt_ids(21, 384, 13)];
    std::thread::scope(|scope| {
        for p in &prompts {
            let alone = &alone;
            scope.spawn(move || ask(alone, p));
        }
    });
    for p in &prompts {
        let again = ask(&alone, p);
        assert_eq!(cached_tokens(&again), p.len() as u64 - 1);
        assert_eq!(output_of(&again), output_of(&ask(&none, p)));
    }
}

#[test]
fn sixteen_concurrent_streams_stay_intact() {
    let s = Server::start(&[
        "--max-batch",
        "1",
        "--max-queue",
        "32",
        "--max-concurrent",
        "17",
        "--max-tokens-limit",
        "1000000",
    ]);
    let prompts: Vec<String> = (0..16).map(|i| format!("Client {i}: {PROMPT}")).collect();
    // The non-concurrent greedy text of each prompt, one request at a time.
    let expected = answers_alone(&s, &prompts, 16);
    // A client holds the engine, 16 streams queue behind it, then it disconnects mid-stream:
    // the 16 can only finish if its slot is freed.
    let holder = s.open_long_stream();
    let handles = spawn_streams(&s, &prompts, 16);
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("mlxb:num_requests_waiting") < 16.0 {
        assert!(Instant::now() < deadline, "the 16 streams never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(holder);
    check_streams(handles, &expected);
    assert_eq!(s.metric("mlxb:request_aborted_total"), 1.0);
    assert_eq!(
        s.metric("mlxb:request_success_total{finished_reason=\"length\"}"),
        32.0
    );
    assert_eq!(s.metric("mlxb:num_requests_running"), 0.0);
}

#[test]
fn security_defaults_and_limits() {
    let model = model().to_str().unwrap().to_owned();
    // Beyond loopback only on purpose; zero limits are refused. Exit code 2, one sentence.
    for (flags, phrase) in [
        (&["--host", "0.0.0.0"][..], "--allow-remote"),
        (&["--host", "::"][..], "--allow-remote"),
        (&["--max-prompt-tokens", "0"][..], "--max-prompt-tokens"),
        (&["--max-concurrent", "0"][..], "--max-concurrent"),
    ] {
        let (code, _, err) = common::run_mlxb(&[&["serve", "--model", &model][..], flags].concat());
        common::assert_refused(&format!("{flags:?}"), code, &err, &[phrase]);
    }
    // With --allow-remote and no key it warns on stderr (checked before anything binds).
    let mut child = common::mlxb_command(&[
        "serve",
        "--model",
        &model,
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--allow-remote",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut first = String::new();
    BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        first.contains("warning") && first.contains("--api-key"),
        "{first}"
    );

    let s = Server::start(&[
        "--max-prompt-tokens",
        "12",
        "--max-tokens-limit",
        "1000000",
        "--max-body-bytes",
        "2048",
        "--max-concurrent",
        "1",
    ]);
    let too_long = common::prompt_ids(13, 384, 1);
    let user = |text: &str| json!([{"role": "user", "content": text}]);
    let cases: Vec<(&str, Value, &str, Option<&str>)> = vec![
        (
            "/v1/completions",
            json!({"prompt": too_long}),
            "prompt",
            Some("context_length_exceeded"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user(PROMPT)}),
            "messages",
            Some("context_length_exceeded"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 1000001}),
            "max_tokens",
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "model": model}),
            "model",
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "model": "../serve-tiny-llama"}),
            "model",
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("hi"), "adapter_path": "/tmp"}),
            "adapter_path",
            None,
        ),
    ];
    for (path, body, field, code) in cases {
        let (status, err) = s.post(path, &body);
        assert_eq!(status, 400, "{body} → {err}");
        assert_eq!(err["error"]["param"], field, "{body} → {err}");
        assert_eq!(err["error"]["type"], "invalid_request_error");
        assert_eq!(err["error"]["code"].as_str(), code, "{err}");
    }
    let (status, text) = s.post_raw(
        "/v1/completions",
        &json!({"prompt": "x".repeat(4096)}).to_string(),
    );
    assert_eq!(status, 413, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["error"]["code"],
        "request_too_large"
    );
    // The served id works; one request in flight at most, /health exempt.
    let ok = json!({"prompt": "hi", "max_tokens": 2, "model": "serve-tiny-llama"});
    assert_eq!(s.post("/v1/completions", &ok).0, 200);
    let holder = s.open_long_stream();
    let (status, err) = s.post("/v1/completions", &ok);
    assert_eq!(status, 429, "{err}");
    assert_eq!(err["error"]["code"], "rate_limit_exceeded");
    assert_eq!(s.agent.get(&s.url("/health")).call().unwrap().status(), 200);
    // The streaming client goes away: its slot frees and the server keeps serving.
    drop(holder);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, v) = s.post("/v1/completions", &ok);
        if status == 200 {
            break;
        }
        assert_eq!(status, 429, "{v}");
        assert!(Instant::now() < deadline, "the slot was never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(s.metric("mlxb:request_rejected_total{reason=\"concurrency\"}") >= 1.0);
}

/// Continuous batching: with four slots, a long stream and sixteen short ones share the engine;
/// the batch fills, the rest wait, the long stream's client leaves and frees its slot, and every
/// short stream's text equals that prompt's answer when it ran alone.
#[test]
fn batched_streams_join_leave_and_stay_intact() {
    let s = Server::start(&[
        "--max-batch",
        "4",
        "--max-queue",
        "32",
        "--max-tokens-limit",
        "1000000",
    ]);
    let prompts: Vec<String> = (0..16).map(|i| format!("Batch {i}: {PROMPT}")).collect();
    let expected = answers_alone(&s, &prompts, 16);
    let holder = s.open_long_stream();
    let handles = spawn_streams(&s, &prompts, 16);
    // The batch fills (the holder and three short streams) while others wait.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut most = 0.0f64;
    while most < 4.0 {
        assert!(
            Instant::now() < deadline,
            "the batch never filled (most {most} running)"
        );
        most = most.max(s.metric("mlxb:num_requests_running"));
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(holder);
    check_streams(handles, &expected);
    assert_eq!(s.metric("mlxb:request_aborted_total"), 1.0);
    assert_eq!(
        s.metric("mlxb:request_success_total{finished_reason=\"length\"}"),
        32.0
    );
    assert_eq!(s.metric("mlxb:num_requests_running"), 0.0);
}

/// One thread per prompt streaming `/v1/completions` (`max_tokens`), each returning its SSE
/// data lines.
fn spawn_streams(
    s: &Server,
    prompts: &[String],
    max_tokens: usize,
) -> Vec<std::thread::JoinHandle<Result<Vec<String>, String>>> {
    let url = s.url("/v1/completions");
    prompts
        .iter()
        .map(|p| {
            let (agent, url, p) = (s.agent.clone(), url.clone(), p.clone());
            std::thread::spawn(move || {
                let body = json!({"prompt": p, "max_tokens": max_tokens, "stream": true});
                let r = agent
                    .post(&url)
                    .send_json(body)
                    .map_err(|e| e.to_string())?;
                Ok(BufReader::new(r.into_reader())
                    .lines()
                    .map_while(Result::ok)
                    .filter_map(|l| l.strip_prefix("data: ").map(str::to_owned))
                    .collect())
            })
        })
        .collect()
}

/// Every stream ended and its text equals the expected answer.
fn check_streams(
    handles: Vec<std::thread::JoinHandle<Result<Vec<String>, String>>>,
    expected: &[String],
) {
    for (i, (h, want)) in handles.into_iter().zip(expected).enumerate() {
        let events = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("client {i}: {e}"));
        assert_eq!(&stream_text(&events).0, want, "client {i}'s stream");
    }
}

/// Drafting per slot (`--max-batch 6` with the n-gram drafter, a DSpark drafter, which reads
/// each row's tapped target outputs, a draft model and the target's first layer): six
/// concurrent greedy requests, each
/// drafting for itself and verified together, answer exactly as the same prompts asked one
/// at a time of a server without a drafter; per-request draft counters add up to the
/// server's, and the draft-length policy's choices are counted by block width. Both
/// policies: `all` (every proposal verified, so drafts surely meet the batch) and the
/// default `cost`.
#[test]
fn batched_drafting_answers_as_alone() {
    let prompts: Vec<String> = (0..6)
        .map(|i| format!("Round {i}: one two three one two three one two three. {PROMPT}"))
        .collect();
    let plain = Server::start(&["--max-batch", "1"]);
    let expected = answers_alone(&plain, &prompts, 40);
    drop(plain);
    // A random DSpark drafter for the tiny target, every block unpruned.
    let tmp = tempfile::tempdir().unwrap();
    let dspark = tmp.path().join("dspark");
    let dspark = dspark.to_str().unwrap();
    let model = model().to_str().unwrap();
    let (code, _, err) = common::run_mlxb(&common::dspark_init_args(
        model,
        dspark,
        &["--tap-layers", "0"],
    ));
    assert_eq!(code, 0, "{err}");
    let n3 = ["--num-draft-tokens", "3"];
    let drafters: [Vec<&str>; 4] = [
        [&["--draft-kind", "ngram"][..], &n3].concat(),
        vec!["--drafter", dspark, "--dspark-min-conf", "0"],
        // The target as its own draft model: every slot's own caches, one shared model.
        [&["--draft-kind", "model", "--draft-model", model][..], &n3].concat(),
        [&["--draft-kind", "self", "--draft-layers", "1"][..], &n3].concat(),
    ];
    for flags in &drafters {
        for policy in ["all", "cost"] {
            let rounds = concurrent_drafted_answers(model, flags, policy, &prompts, &expected);
            assert!(
                rounds > 0 || policy == "cost",
                "{flags:?}: no request drafted"
            );
        }
    }
}

/// The same on a model with sliding-window layers (window 8, which every request wraps): rows
/// roll back by restoring their caches and replaying what they kept.
#[test]
fn batched_drafting_answers_as_alone_past_a_sliding_window() {
    let prompts: Vec<String> = (0..6)
        .map(|i| format!("Round {i}: one two three one two three one two three. {PROMPT}"))
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    common::make_model(tmp.path(), &common::tiny_gemma3(), "f32", None);
    let model = tmp.path().to_str().unwrap();
    let plain = Server::start_model(model, &[], &["--max-batch", "1"]);
    let expected = answers_alone(&plain, &prompts, 40);
    drop(plain);
    let ngram = ["--draft-kind", "ngram", "--num-draft-tokens", "3"];
    let rounds = concurrent_drafted_answers(model, &ngram, "all", &prompts, &expected);
    assert!(rounds > 0, "no request drafted");
}
