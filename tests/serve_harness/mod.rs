//! The `mlxb serve` test harness shared by `tests/serve.rs` and `tests/serve_openai.rs`: a
//! tiny random model, the real binary on a free loopback port, and HTTP helpers. Every wait
//! is bounded.
#![allow(dead_code)]

use super::common;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub const PROMPT: &str = "The quick brown fox jumps over the lazy dog. The quick brown fox";

/// The tiny model, built once per test process.
pub fn model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // One copy per test binary: binaries may run at the same time.
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(env!("CARGO_CRATE_NAME"))
            .join("serve-tiny-llama");
        let config = common::tiny_llama(json!({"num_hidden_layers": 2}));
        common::make_model(&dir, &config, "bf16", None);
        dir
    })
}

/// `serve` on `model`, loopback, on a free port.
fn serve_args(model: &str) -> [&str; 7] {
    [
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
}

/// A running `mlxb serve`; killed when dropped, even if the test failed.
pub struct Server {
    pub child: Child,
    pub url: String,
    pub agent: ureq::Agent,
    /// The `--api-key` it was started with, sent on every request.
    pub key: Option<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts the server on the tiny model on a free port and waits (bounded) until /health
    /// answers.
    pub fn start(extra: &[&str]) -> Server {
        Server::start_model(model().to_str().unwrap(), &[], extra)
    }

    /// Starts the server on `model` (a directory or a built-in name) with the environment
    /// variables `env` set.
    pub fn start_model(model: &str, env: &[(&str, &str)], extra: &[&str]) -> Server {
        let mut cmd = common::mlxb_command(&serve_args(model));
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.args(extra).stderr(Stdio::inherit());
        Server::start_command(cmd, extra)
    }

    /// Starts the server on `model` as two ranks (`mlxb launch -n 2`, the ring from `port`),
    /// with stderr kept for [`Server::stderr_text`].
    pub fn start_launched(port: &str, model: &str, extra: &[&str]) -> Server {
        let mut cmd = common::mlxb_command(&["launch", "-n", "2", "--starting-port", port, "--"]);
        cmd.args(serve_args(model))
            .args(extra)
            .stderr(Stdio::piped());
        Server::start_command(cmd, &[])
    }

    /// Starts `cmd` (a server whose ready card goes to stdout) and waits for it.
    fn start_command(mut cmd: std::process::Command, extra: &[&str]) -> Server {
        let mut child = cmd
            .stdout(Stdio::piped())
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

    /// Waits up to `secs` for the server process to exit; its exit code (`None`: still
    /// running, or ended by a signal).
    pub fn wait_exit(&mut self, secs: u64) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Everything the server wrote to stderr (for a server started with stderr piped, once
    /// it has exited).
    pub fn stderr_text(&mut self) -> String {
        let mut text = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut text);
        }
        text
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// A request to `path`, with the API key when the server has one.
    pub fn request(&self, method: &str, path: &str) -> ureq::Request {
        let r = self.agent.request(method, &self.url(path));
        match &self.key {
            Some(key) => r.set("Authorization", &format!("Bearer {key}")),
            None => r,
        }
    }

    /// POSTs raw bytes and returns (status, body).
    pub fn post_raw(&self, path: &str, body: &str) -> (u16, String) {
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
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.post_raw(path, &body.to_string());
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("response is not JSON ({e}): {text}"));
        (status, value)
    }

    /// POSTs a streaming request; returns the `data:` payloads in order.
    pub fn stream(&self, path: &str, body: &Value) -> Vec<String> {
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

    /// Opens a long streaming completion and reads its first event, so it surely holds the
    /// engine (or a concurrency slot); dropping the reader disconnects the client.
    pub fn open_long_stream(&self) -> BufReader<Box<dyn std::io::Read + Send + Sync>> {
        let long = json!({"prompt": "Hi", "max_tokens": 1000000, "stream": true});
        let r = self
            .request("POST", "/v1/completions")
            .send_json(long)
            .unwrap_or_else(|e| panic!("long stream failed: {e}"));
        let mut reader = BufReader::new(r.into_reader());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert!(line.starts_with("data: "), "{line}");
        reader
    }

    pub fn metrics(&self) -> String {
        self.request("GET", "/metrics")
            .call()
            .unwrap()
            .into_string()
            .unwrap()
    }

    /// The value of a metric line `name value` (0 when absent).
    pub fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }
}

/// `mlxb generate --json` for the same settings.
pub fn generate(prompt: &str, max_tokens: usize, extra: &[&str]) -> Value {
    let max_tokens = max_tokens.to_string();
    let args = [
        "generate",
        "--model",
        model().to_str().unwrap(),
        "--prompt",
        prompt,
        "--max-tokens",
        &max_tokens,
        "--json",
    ];
    let (code, out, err) = common::run_mlxb(&[&args[..], extra].concat());
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap()
}

pub fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

pub fn chat_body(prompt: &str, max_tokens: usize) -> Value {
    json!({"model": "serve-tiny-llama", "messages": [{"role": "user", "content": prompt}],
           "max_tokens": max_tokens, "temperature": 0, "return_token_ids": true})
}

/// Concatenates a chat or completions stream's text; checks the framing and [DONE].
pub fn stream_text(events: &[String]) -> (String, Option<String>, Option<Value>) {
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

/// Each prompt's non-streamed greedy text, asked one request at a time.
pub fn answers_alone(s: &Server, prompts: &[String], max_tokens: usize) -> Vec<String> {
    prompts
        .iter()
        .map(|p| {
            let body = json!({"prompt": p, "max_tokens": max_tokens});
            let (status, v) = s.post("/v1/completions", &body);
            assert_eq!(status, 200, "{v}");
            v["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect()
}

/// Sends `prompts` at once to a batched server drafting with `drafter`
/// (`--draft-policy policy`), checks every answer against `expected` and the counters;
/// returns the verify rounds that carried a draft.
pub fn concurrent_drafted_answers(
    model: &str,
    drafter: &[&str],
    policy: &str,
    prompts: &[String],
    expected: &[String],
) -> u64 {
    let mut flags = drafter.to_vec();
    flags.extend(["--max-batch", "6", "--draft-policy", policy]);
    let s = Server::start_model(model, &[], &flags);
    let url = s.url("/v1/completions");
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (agent, url, p) = (s.agent.clone(), url.clone(), p.clone());
            std::thread::spawn(move || -> Result<Value, String> {
                let body = json!({"prompt": p, "max_tokens": 40});
                let r = agent
                    .post(&url)
                    .send_json(body)
                    .map_err(|e| e.to_string())?;
                r.into_json().map_err(|e| e.to_string())
            })
        })
        .collect();
    let mut rounds = 0;
    for (i, (h, want)) in handles.into_iter().zip(expected).enumerate() {
        let v = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("client {i}: {e}"));
        assert_eq!(
            v["choices"][0]["text"].as_str().unwrap(),
            want,
            "{drafter:?} {policy}: client {i}"
        );
        rounds += v["timings"]["draft_rounds"].as_u64().unwrap_or(0);
    }
    assert_eq!(rounds as f64, s.metric("mlxb:spec_decode_num_drafts_total"));
    let widths: f64 = (1..=4)
        .map(|w| {
            s.metric(&format!(
                "mlxb:spec_decode_block_width_total{{width=\"{w}\"}}"
            ))
        })
        .sum();
    assert!(widths > 0.0, "{}", s.metrics());
    rounds
}
