//! Server metrics in Prometheus text format, named after vLLM's (`mlxb:` instead of
//! `vllm:`): request counts, prompt and generated tokens, queue depth, latency histograms,
//! and speculative-decoding counters with vLLM's definitions (acceptance rate = accepted /
//! drafted tokens, mean acceptance length = 1 + accepted / drafts).

use crate::spec::metrics::SpecMetrics;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Why a request was turned away before it reached the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rejection {
    /// The request was malformed or out of range (4xx).
    Invalid,
    /// The queue was full or the server was shutting down (503).
    Unavailable,
    /// More requests were in flight than `--max-concurrent` allows (429).
    Busy,
}

impl Rejection {
    fn label(self) -> &'static str {
        match self {
            Rejection::Invalid => "invalid",
            Rejection::Unavailable => "unavailable",
            Rejection::Busy => "concurrency",
        }
    }
}

/// A cumulative histogram with fixed upper bounds.
#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, x: f64) {
        for (b, c) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if x <= *b {
                *c += 1;
            }
        }
        self.sum += x;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
];
const TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0,
];
const RATE_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
];

#[derive(Debug)]
struct Inner {
    received: u64,
    success: BTreeMap<&'static str, u64>,
    rejected: BTreeMap<Rejection, u64>,
    aborted: u64,
    failed: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    generation_tokens: u64,
    waiting: u64,
    running: u64,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue_time: Histogram,
    decode_tps: Histogram,
    drafts: u64,
    draft_tokens: u64,
    accepted_tokens: u64,
    accepted_per_pos: Vec<u64>,
    /// Batched drafting steps per verify block width (index = width).
    block_widths: Vec<u64>,
    prompt_cache_bytes: u64,
}

/// All counters of one server, shared by the HTTP handlers and the engine thread.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                received: 0,
                success: BTreeMap::new(),
                rejected: BTreeMap::new(),
                aborted: 0,
                failed: 0,
                prompt_tokens: 0,
                cached_tokens: 0,
                generation_tokens: 0,
                waiting: 0,
                running: 0,
                ttft: Histogram::new(LATENCY_BUCKETS),
                itl: Histogram::new(TOKEN_LATENCY_BUCKETS),
                e2e: Histogram::new(LATENCY_BUCKETS),
                queue_time: Histogram::new(LATENCY_BUCKETS),
                decode_tps: Histogram::new(RATE_BUCKETS),
                drafts: 0,
                draft_tokens: 0,
                accepted_tokens: 0,
                accepted_per_pos: Vec::new(),
                block_widths: Vec::new(),
                prompt_cache_bytes: 0,
            }),
        }
    }
}

impl Metrics {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain counters behind; keep serving them.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request entered the queue.
    pub fn enqueued(&self) {
        let mut m = self.lock();
        m.received += 1;
        m.waiting += 1;
    }

    /// A request that was counted by [`Metrics::enqueued`] did not fit after all.
    pub fn unqueued(&self) {
        let mut m = self.lock();
        m.received = m.received.saturating_sub(1);
        m.waiting = m.waiting.saturating_sub(1);
    }

    /// The engine took a request off the queue after it waited `waited`.
    pub fn started(&self, waited: Duration) {
        let mut m = self.lock();
        m.waiting = m.waiting.saturating_sub(1);
        m.running += 1;
        m.queue_time.observe(waited.as_secs_f64());
    }

    /// The batch's kept prompt prefixes now hold `bytes`.
    pub fn prompt_cache(&self, bytes: usize) {
        self.lock().prompt_cache_bytes = bytes as u64;
    }

    /// The engine is done with a request (whatever the outcome).
    pub fn ended(&self) {
        let mut m = self.lock();
        m.running = m.running.saturating_sub(1);
    }

    /// A request was turned away before the queue.
    pub fn rejected(&self, why: Rejection) {
        *self.lock().rejected.entry(why).or_default() += 1;
    }

    /// The client went away (or the server shut down) before the generation finished.
    pub fn aborted(&self) {
        self.lock().aborted += 1;
    }

    /// The engine failed on a request.
    pub fn failed(&self) {
        self.lock().failed += 1;
    }

    /// Time to the first token (from arrival, queueing included).
    pub fn first_token(&self, ttft: Duration) {
        self.lock().ttft.observe(ttft.as_secs_f64());
    }

    /// Time between two consecutive generated tokens of one request.
    pub fn inter_token(&self, gap: Duration) {
        self.lock().itl.observe(gap.as_secs_f64());
    }

    /// A request finished normally.
    pub fn finished(&self, f: &Finished<'_>) {
        let mut m = self.lock();
        *m.success.entry(f.finish_reason).or_default() += 1;
        m.prompt_tokens += f.prompt_tokens as u64;
        m.cached_tokens += f.cached_tokens as u64;
        m.generation_tokens += f.generation_tokens as u64;
        m.e2e.observe(f.latency.as_secs_f64());
        if f.generation_tokens > 1 {
            m.decode_tps.observe(f.decode_tps);
        }
        if let Some(s) = f.spec {
            m.drafts += s.drafts as u64;
            m.draft_tokens += s.drafted_tokens as u64;
            m.accepted_tokens += s.accepted_tokens as u64;
            if m.accepted_per_pos.len() < s.accepted_per_position.len() {
                m.accepted_per_pos.resize(s.accepted_per_position.len(), 0);
            }
            for (slot, &a) in m.accepted_per_pos.iter_mut().zip(&s.accepted_per_position) {
                *slot += a as u64;
            }
        }
    }

    /// A batched drafting step verified blocks `width` tokens wide (1: plain decoding, the
    /// draft-length policy found drafting not worth it this step).
    pub fn block_width(&self, width: usize) {
        let mut m = self.lock();
        if m.block_widths.len() <= width {
            m.block_widths.resize(width + 1, 0);
        }
        m.block_widths[width] += 1;
    }

    /// Requests waiting in the queue now.
    pub fn waiting(&self) -> u64 {
        self.lock().waiting
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let m = self.lock();
        let mut out = String::new();
        let mut scalar = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        scalar(
            "mlxb:requests_received_total",
            "counter",
            "Generation requests accepted into the queue.",
            m.received.to_string(),
        );
        scalar(
            "mlxb:request_aborted_total",
            "counter",
            "Requests whose client went away (or that shutdown cancelled) before they finished.",
            m.aborted.to_string(),
        );
        scalar(
            "mlxb:request_failure_total",
            "counter",
            "Requests the engine failed on.",
            m.failed.to_string(),
        );
        scalar(
            "mlxb:num_requests_running",
            "gauge",
            "Requests the engine is generating for now.",
            m.running.to_string(),
        );
        scalar(
            "mlxb:num_requests_waiting",
            "gauge",
            "Requests waiting in the queue (queue depth).",
            m.waiting.to_string(),
        );
        scalar(
            "mlxb:prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            m.prompt_tokens.to_string(),
        );
        scalar(
            "mlxb:prompt_tokens_cached_total",
            "counter",
            "Prompt tokens of finished requests whose KV was reused from an earlier request.",
            m.cached_tokens.to_string(),
        );
        scalar(
            "mlxb:prompt_cache_bytes",
            "gauge",
            "Bytes of prompt prefixes kept for reuse by batched requests (--prompt-cache-bytes).",
            m.prompt_cache_bytes.to_string(),
        );
        scalar(
            "mlxb:generation_tokens_total",
            "counter",
            "Generated tokens of finished requests.",
            m.generation_tokens.to_string(),
        );
        scalar(
            "mlxb:spec_decode_num_drafts_total",
            "counter",
            "Speculative verify rounds that drafted at least one token.",
            m.drafts.to_string(),
        );
        scalar(
            "mlxb:spec_decode_num_draft_tokens_total",
            "counter",
            "Tokens proposed by the drafter.",
            m.draft_tokens.to_string(),
        );
        scalar(
            "mlxb:spec_decode_num_accepted_tokens_total",
            "counter",
            "Drafted tokens the target accepted.",
            m.accepted_tokens.to_string(),
        );
        scalar(
            "mlxb:spec_decode_acceptance_rate",
            "gauge",
            "Accepted / drafted tokens since start (0 before any draft).",
            ratio(m.accepted_tokens, m.draft_tokens).to_string(),
        );
        scalar(
            "mlxb:spec_decode_mean_acceptance_length",
            "gauge",
            "1 + accepted tokens / drafts since start (tokens per verify round, bonus included).",
            (1.0 + ratio(m.accepted_tokens, m.drafts)).to_string(),
        );
        labelled(
            &mut out,
            "mlxb:request_success_total",
            "Requests that finished, by finish reason.",
            "finished_reason",
            m.success.iter().map(|(k, v)| (k.to_string(), *v)),
        );
        labelled(
            &mut out,
            "mlxb:request_rejected_total",
            "Requests turned away before the queue, by reason.",
            "reason",
            m.rejected.iter().map(|(k, v)| (k.label().to_string(), *v)),
        );
        labelled(
            &mut out,
            "mlxb:spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted tokens at each draft position (0 = first drafted token).",
            "position",
            m.accepted_per_pos
                .iter()
                .enumerate()
                .map(|(i, v)| (i.to_string(), *v)),
        );
        labelled(
            &mut out,
            "mlxb:spec_decode_block_width_total",
            "Batched drafting steps by the verify block width the draft-length policy chose (1 = no drafts).",
            "width",
            m.block_widths
                .iter()
                .enumerate()
                .skip(1)
                .map(|(i, v)| (i.to_string(), *v)),
        );
        m.ttft.render(
            &mut out,
            "mlxb:time_to_first_token_seconds",
            "Time from arrival to the first generated token, queueing included.",
        );
        m.itl.render(
            &mut out,
            "mlxb:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
        );
        m.e2e.render(
            &mut out,
            "mlxb:e2e_request_latency_seconds",
            "Time from arrival to the last token of finished requests.",
        );
        m.queue_time.render(
            &mut out,
            "mlxb:request_queue_time_seconds",
            "Time requests waited in the queue.",
        );
        m.decode_tps.render(
            &mut out,
            "mlxb:decode_tokens_per_second",
            "Decode speed of finished requests (mlx-lm's generation tokens-per-sec).",
        );
        out
    }
}

/// What the engine reports when a request finished normally.
pub struct Finished<'a> {
    /// `stop` or `length`.
    pub finish_reason: &'static str,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused (not prefilled again).
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generation_tokens: usize,
    /// Arrival to last token.
    pub latency: Duration,
    /// Decode tokens per second.
    pub decode_tps: f64,
    /// Acceptance counters when the request decoded speculatively.
    pub spec: Option<&'a SpecMetrics>,
}

fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b.max(1) as f64
}

/// A counter with one label, one line per label value.
fn labelled(
    out: &mut String,
    name: &str,
    help: &str,
    label: &str,
    rows: impl Iterator<Item = (String, u64)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for (value, count) in rows {
        let _ = writeln!(out, "{name}{{{label}=\"{value}\"}} {count}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histograms_and_spec_rates() {
        let m = Metrics::default();
        m.enqueued();
        m.started(Duration::from_millis(3));
        m.first_token(Duration::from_millis(20));
        let spec = SpecMetrics {
            drafts: 2,
            drafted_tokens: 6,
            accepted_tokens: 3,
            accepted_per_position: vec![2, 1, 0],
            ..SpecMetrics::default()
        };
        m.finished(&Finished {
            finish_reason: "length",
            prompt_tokens: 7,
            cached_tokens: 6,
            generation_tokens: 9,
            latency: Duration::from_millis(50),
            decode_tps: 300.0,
            spec: Some(&spec),
        });
        m.ended();
        let text = m.render();
        for line in [
            "mlxb:requests_received_total 1",
            "mlxb:prompt_tokens_total 7",
            "mlxb:prompt_tokens_cached_total 6",
            "mlxb:generation_tokens_total 9",
            "mlxb:num_requests_waiting 0",
            "mlxb:spec_decode_num_drafts_total 2",
            "mlxb:spec_decode_acceptance_rate 0.5",
            "mlxb:spec_decode_mean_acceptance_length 2.5",
            "mlxb:spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} 1",
            "mlxb:request_success_total{finished_reason=\"length\"} 1",
            "mlxb:time_to_first_token_seconds_bucket{le=\"0.02\"} 1",
            "mlxb:time_to_first_token_seconds_count 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
