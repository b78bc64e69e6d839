//! `mlxb serve` end to end: the real binary on a free loopback port (127.0.0.1 only) with a
//! tiny random model, driven by a real HTTP client. Greedy output over HTTP equals
//! `mlxb generate`, streams concatenate to the same text, speculative serving is lossless,
//! bad requests get OpenAI-style 400s naming the field, metrics move, the queue is bounded,
//! and a client that disconnects frees the engine. Every loop here is bounded.

mod common;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog. The quick brown fox";

/// The tiny model, built once per test process.
fn model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("serve-tiny-llama");
        let config = json!({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 384, "tie_word_embeddings": true
        });
        common::make_model(&dir, &config, "bf16", None);
        dir
    })
}

/// A running `mlxb serve`; killed when dropped, even if the test failed.
struct Server {
    child: Child,
    url: String,
    agent: ureq::Agent,
    /// The `--api-key` it was started with, sent on every request.
    key: Option<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts the server on a free port and waits (bounded) until /health answers.
    fn start(extra: &[&str]) -> Server {
        let model = model().to_str().unwrap().to_owned();
        let mut child = Command::new(common::mlxb())
            .args([
                "serve",
                "--model",
                &model,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("cannot start mlxb serve");
        let stdout = child.stdout.take().unwrap();
        let mut server = Server {
            child,
            url: String::new(),
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(120))
                .build(),
            key: extra
                .windows(2)
                .find(|w| w[0] == "--api-key")
                .map(|w| w[1].to_owned()),
        };
        // Read the ready card on a thread (which then keeps draining stdout).
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.trim().strip_prefix("url") {
                    let _ = tx.send(url.trim().to_owned());
                }
            }
        });
        server.url = rx
            .recv_timeout(Duration::from_secs(180))
            .expect("mlxb serve printed no URL within 180 s");
        assert!(
            server.url.starts_with("http://127.0.0.1:"),
            "{}",
            server.url
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = server.agent.get(&server.url("/health")).call() {
                assert_eq!(r.status(), 200);
                break;
            }
            assert!(Instant::now() < deadline, "/health never answered");
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// A request to `path`, with the API key when the server has one.
    fn request(&self, method: &str, path: &str) -> ureq::Request {
        let r = self.agent.request(method, &self.url(path));
        match &self.key {
            Some(key) => r.set("Authorization", &format!("Bearer {key}")),
            None => r,
        }
    }

    /// POSTs raw bytes and returns (status, body).
    fn post_raw(&self, path: &str, body: &str) -> (u16, String) {
        let result = self
            .request("POST", path)
            .set("Content-Type", "application/json")
            .send_string(body);
        match result {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
            Err(e) => panic!("POST {path} failed: {e}"),
        }
    }

    /// POSTs JSON and returns (status, parsed body).
    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.post_raw(path, &body.to_string());
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("response is not JSON ({e}): {text}"));
        (status, value)
    }

    /// POSTs a streaming request; returns the `data:` payloads in order.
    fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let r = self
            .request("POST", path)
            .send_json(body.clone())
            .unwrap_or_else(|e| panic!("stream {path} failed: {e}"));
        assert!(r
            .header("content-type")
            .unwrap_or("")
            .starts_with("text/event-stream"));
        let mut events = Vec::new();
        for line in BufReader::new(r.into_reader()).lines() {
            let line = line.unwrap();
            if let Some(data) = line.strip_prefix("data: ") {
                events.push(data.to_owned());
            }
        }
        events
    }

    fn metrics(&self) -> String {
        self.request("GET", "/metrics")
            .call()
            .unwrap()
            .into_string()
            .unwrap()
    }

    /// The value of a metric line `name value` (0 when absent).
    fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }
}

/// `mlxb generate --json` for the same settings.
fn generate(prompt: &str, max_tokens: usize, extra: &[&str]) -> Value {
    let out = Command::new(common::mlxb())
        .args([
            "generate",
            "--model",
            model().to_str().unwrap(),
            "--prompt",
            prompt,
        ])
        .args(["--max-tokens", &max_tokens.to_string(), "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn chat_body(prompt: &str, max_tokens: usize) -> Value {
    json!({"model": "serve-tiny-llama", "messages": [{"role": "user", "content": prompt}],
           "max_tokens": max_tokens, "temperature": 0, "return_token_ids": true})
}

/// Concatenates a chat or completions stream's text; checks the framing and [DONE].
fn stream_text(events: &[String]) -> (String, Option<String>, Option<Value>) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "error in stream: {v}");
        if let Some(u) = v.get("usage") {
            usage = Some(u.clone());
        }
        for c in v["choices"].as_array().unwrap() {
            let piece = c["delta"]["content"].as_str().or(c["text"].as_str());
            text.push_str(piece.unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
    }
    (text, finish, usage)
}

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
    let drafters: [&[&str]; 3] = [
        &["--draft-kind", "ngram", "--num-draft-tokens", "3"],
        &["--draft-kind", "model", "--draft-model", model],
        &["--draft-kind", "self", "--draft-layers", "1"],
    ];
    for flags in drafters {
        let s = Server::start(flags);
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
            assert!(spec["timings"]["draft_n"].as_u64().is_some());
        }
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
    assert!(s.metric("mlxb:request_rejected_total{reason=\"invalid\"}") >= 19.0);
}

#[test]
fn queue_is_bounded_and_disconnects_free_the_engine() {
    let s = Server::start(&["--max-queue", "1", "--max-tokens-limit", "1000000"]);
    // A: a long streaming generation; read one chunk so it is surely running.
    let long = json!({"prompt": PROMPT, "max_tokens": 1000000, "stream": true});
    let a = s
        .agent
        .post(&s.url("/v1/completions"))
        .send_json(long)
        .unwrap();
    let mut a_reader = BufReader::new(a.into_reader());
    let mut line = String::new();
    a_reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("data: "), "{line}");
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
    let long = json!({"prompt": PROMPT, "max_tokens": 1000000, "stream": true});
    let r = s
        .request("POST", "/v1/completions")
        .send_json(long)
        .unwrap();
    let mut reader = BufReader::new(r.into_reader());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("data: "), "{line}");
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
