//! `mlxb serve`: an OpenAI-compatible local server. One engine thread owns the model (MLX
//! streams are not thread-safe); axum handlers on a small tokio runtime validate requests,
//! queue them FIFO (bounded) and turn the engine's token events into JSON or SSE.
//!
//! - `routes` — the endpoints, API-key check and admission path;
//! - `bind` — loopback unless `--allow-remote`;
//! - `limit` — the concurrency limit (429);
//! - `prefix` — bit-exact prompt-prefix KV reuse between requests;
//! - `request` — request parsing and validation (400s name the field);
//! - `respond` / `types` — OpenAI response objects and stream chunks;
//! - `queue` — the bounded job queue (503 when full);
//! - `worker` — the engine thread and its events;
//! - `batching` — continuous batching of requests on the engine thread (`--max-batch`);
//! - `ranks` — serving across ranks (`mlxb launch`): rank 0's requests run on every rank;
//! - `stop` — stop strings on streamed text;
//! - `metrics` — Prometheus counters and histograms;
//! - `web` — the chat page served at `/`.

pub mod anthropic;
pub mod batching;
pub mod bind;
pub mod error;
pub mod limit;
pub mod metrics;
pub mod prefix;
pub mod prefix_store;
pub mod queue;
pub mod ranks;
pub mod request;
pub mod respond;
pub mod routes;
pub mod stop;
pub mod tool_reply;
pub mod types;
pub mod web;
pub mod worker;

use crate::engine::tokenizer::Tokenizer;
use crate::spec::factory::SpecOptions;
use anyhow::Context;
use axum::serve::ListenerExt;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `--max-batch` by default, mlx-lm's `--decode-concurrency`: measured against 8 (same
/// throughput at 8 clients, TTFT p50 1.8 s instead of 11.5 s at 32; docs/serving.md).
pub const DEFAULT_MAX_BATCH: usize = 32;

/// `--prompt-cache-bytes` by default: 1 GiB of kept prompt prefixes (about 23,000 positions of
/// SmolLM2-135M in f32).
pub const DEFAULT_PROMPT_CACHE_BYTES: usize = 1 << 30;

/// Everything `mlxb serve` was told.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Model directory.
    pub dir: PathBuf,
    /// What the user called the model (`--model`), also accepted as a request's `model`.
    pub model_ref: Option<String>,
    /// Address to bind.
    pub host: String,
    /// Port to bind (0: any free port; the ready card says which).
    pub port: u16,
    /// Drafter every request decodes with.
    pub spec: Option<SpecOptions>,
    /// Prompt tokens per prefill forward.
    pub prefill_step_size: usize,
    /// Most requests waiting for the engine.
    pub max_queue: usize,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_limit: usize,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// Bearer key required on every route but `/health`.
    pub api_key: Option<String>,
    /// Listening beyond loopback was asked for explicitly (`--allow-remote`).
    pub allow_remote: bool,
    /// Longest prompt a request may send, in tokens.
    pub max_prompt_tokens: usize,
    /// Most HTTP requests in flight at once (streams count until they end).
    pub max_concurrent: usize,
    /// Reuse the previous request's KV for a shared prompt prefix.
    pub prefix_reuse: bool,
    /// The fork flags every request runs with (`--l1/--l2/--l3` and per-fork flags).
    pub forks: crate::engine::forks::Forks,
    /// optiq's per-layer KV allocation given with `--kv-config` (else the one beside the model).
    pub kv_config: Option<PathBuf>,
    /// The parity tier the resolved forks keep (for the ready card).
    pub parity: crate::engine::forks::Tier,
    /// Where the engine marks its start-up steps (`MLXB_TRACE_STARTUP`).
    pub startup: crate::engine::startup::StartupTrace,
    /// Most requests decoded at once (continuous batching; 1: one at a time).
    pub max_batch: usize,
    /// Most bytes of prompt prefixes the batch keeps for reuse (0: none).
    pub prompt_cache_bytes: usize,
    /// Most prompts prefilled together (mlx-lm's `--prompt-concurrency`).
    pub prompt_concurrency: usize,
    /// How batched drafting steps size their verify blocks.
    pub draft_policy: crate::spec::policy::DraftPolicy,
}

/// Loads the model, binds, prints the ready card and serves until Ctrl-C or SIGTERM; then
/// stops taking connections, cancels what is running or queued, and returns. Only the
/// engine thread touches MLX.
pub fn serve(cfg: ServeConfig) -> anyhow::Result<()> {
    let started = Instant::now();
    if let Some(group) = crate::engine::distributed::world().filter(|g| !g.is_leader()) {
        // Rank 0 serves HTTP; this rank runs its generations over its shard of the model. It
        // ends when rank 0 says so: Ctrl-C in the terminal reaches every rank, and rank 0
        // shuts down gracefully, so this rank ignores it.
        // SAFETY: setting a signal's disposition to "ignore" before any handler is installed.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_IGN);
        }
        return Ok(worker::follow(&engine_config(&cfg), &group)?);
    }
    let loopback = bind::check_host(&cfg.host, cfg.allow_remote)?;
    if !loopback && cfg.api_key.is_none() {
        eprintln!(
            "mlxb serve: warning: listening on {} (beyond this machine) without --api-key: anyone who can reach it can use the model",
            cfg.host
        );
    }
    let metrics = Arc::new(metrics::Metrics::default());
    let shutdown = Arc::new(AtomicBool::new(false));
    let (queue, jobs) = queue::JobQueue::new(cfg.max_queue);
    let engine = worker::spawn(engine_config(&cfg), jobs, metrics.clone(), shutdown.clone())?;
    let tokenizer = Tokenizer::load(&cfg.dir)?;
    let model_id = model_id(&cfg);
    // Requests name the served id (or a built-in short name such as `gemma3`), never a path.
    let mut model_ids = vec![model_id.clone()];
    model_ids.extend(
        cfg.model_ref
            .iter()
            .filter(|r| !r.contains(['/', '\\']))
            .cloned(),
    );
    let concurrency = limit::Concurrency::new(cfg.max_concurrent, metrics.clone());
    let state = Arc::new(routes::AppState {
        model_id,
        tokenizer,
        queue,
        metrics,
        limits: request::Limits {
            model_ids,
            vocab_size: engine.info.vocab_size,
            default_max_tokens: cfg.default_max_tokens.min(cfg.max_tokens_limit),
            max_tokens_limit: cfg.max_tokens_limit,
            max_prompt_tokens: cfg.max_prompt_tokens,
            prefill_step_size: cfg.prefill_step_size,
            has_drafter: engine.info.drafter.is_some(),
        },
        api_key: cfg.api_key.clone(),
        created: respond::unix_now(),
    });
    let app = routes::router(state.clone(), cfg.max_body_bytes, concurrency);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    runtime.block_on(async {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr} (is the port in use? try --port)"))?;
        let local = listener.local_addr()?;
        print_card(&cfg, &state, &engine.info, local, started.elapsed());
        let stop = shutdown.clone();
        // Token chunks are small writes: send each at once (no Nagle delay).
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                wait_for_signal().await;
                eprintln!("mlxb serve: shutting down (cancelling running and queued requests)");
                stop.store(true, Ordering::Relaxed);
            })
            .await
            .context("the HTTP server failed")
    })?;
    // The handlers are gone; dropping the last queue sender lets the engine thread end.
    drop(state);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !engine.handle.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if engine.handle.is_finished() {
        // Join, not just "finished": the thread's MLX thread-locals are freed after its
        // function returns, and must be gone before the process's own destructors run.
        let _ = engine.handle.join();
    } else {
        eprintln!("mlxb serve: the engine did not stop within 10 s; exiting anyway");
    }
    Ok(())
}

/// What the engine thread loads for `cfg`.
fn engine_config(cfg: &ServeConfig) -> worker::EngineConfig {
    worker::EngineConfig {
        dir: cfg.dir.clone(),
        spec: cfg.spec.clone(),
        prefill_step_size: cfg.prefill_step_size,
        prefix_reuse: cfg.prefix_reuse,
        forks: cfg.forks,
        kv_config: cfg.kv_config.clone(),
        startup: cfg.startup.clone(),
        max_batch: cfg.max_batch,
        prompt_cache_bytes: cfg.prompt_cache_bytes,
        prompt_concurrency: cfg.prompt_concurrency,
        draft_policy: cfg.draft_policy,
    }
}

/// The id requests use: the model directory's name.
fn model_id(cfg: &ServeConfig) -> String {
    cfg.dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| cfg.dir.display().to_string())
}

/// The ready card: what is served, how, and where.
fn print_card(
    cfg: &ServeConfig,
    state: &routes::AppState,
    info: &worker::EngineInfo,
    addr: SocketAddr,
    load_time: Duration,
) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "mlxb serve: ready in {:.1}s\n  model    {} ({}, {})\n  backend  {}\n  tier     {} (oracle: {})\n  drafter  {}\n  tools    {}\n  queue    {} waiting at most, {}; max_tokens {} by default, {} at most\n  limits   prompt {} tokens, body {} bytes, {} requests in flight\n  prefix   {}\n  auth     {}\n  url      http://{addr}\n  routes   GET / (chat page), POST /v1/chat/completions, POST /v1/completions, POST /v1/messages, GET /v1/models, GET /health, GET /metrics",
        load_time.as_secs_f64(),
        state.model_id,
        cfg.dir.display(),
        info.model_type,
        info.backend,
        cfg.parity,
        cfg.parity.oracle(),
        info.drafter.as_deref().unwrap_or("none"),
        tools_line(&state.tokenizer),
        cfg.max_queue.max(1),
        batch_line(info),
        state.limits.default_max_tokens,
        cfg.max_tokens_limit,
        cfg.max_prompt_tokens,
        cfg.max_body_bytes,
        cfg.max_concurrent.max(1),
        prefix_line(cfg, info),
        if cfg.api_key.is_some() { "Bearer key required (all routes but /health)" } else { "none" },
    );
    let _ = out.flush();
}

/// The ready card's account of tool calls: the model's format and whether mlxb parses it.
fn tools_line(tokenizer: &Tokenizer) -> String {
    match (tokenizer.tool_format(), tokenizer.tool_parser()) {
        (Some(_), Some(p)) => format!("calls parsed as `{}` (mlx-lm's parser)", p.name()),
        (Some(name), None) => format!(
            "the model's `{name}` call format is not parsed by mlxb: calls stay in the reply text"
        ),
        (None, _) => "no tool-call format in the chat template (tools are still rendered)".into(),
    }
}

/// The ready card's account of prompt-prefix reuse.
fn prefix_line(cfg: &ServeConfig, info: &worker::EngineInfo) -> String {
    if !info.prefix_reuse {
        return "off".into();
    }
    let kept = if info.max_batch > 1 && cfg.prompt_cache_bytes > 0 {
        format!(
            "; batched requests share up to {} MiB of kept prompts",
            cfg.prompt_cache_bytes >> 20
        )
    } else {
        String::new()
    };
    format!("reused across requests where bit-exact{kept}")
}

/// The ready card's account of how many requests decode at once.
fn batch_line(info: &worker::EngineInfo) -> String {
    match (&info.batch_note, info.max_batch) {
        (Some(why), _) => format!("1 generating ({why})"),
        (None, 1) => "1 generating".into(),
        (None, n) if info.drafter.is_some() => format!(
            "up to {n} generating together (continuous batching, each request drafting for itself, block widths by measured cost)"
        ),
        (None, n) => format!("up to {n} generating together (continuous batching)"),
    }
}

/// Resolves on Ctrl-C or (on Unix) SIGTERM.
async fn wait_for_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
