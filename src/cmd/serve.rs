//! `mlxb serve`: flags of the OpenAI-compatible server, handed to `crate::server`.

use super::common::resolve_model;
use super::common::{ModelArgs, SpecArgs};
use super::flags::ForkArgs;
use crate::engine::error::EngineError;
use crate::server::{serve, ServeConfig};
use clap::Args;

/// Flags of `mlxb serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub forks: ForkArgs,
    /// Address to listen on (loopback by default; anything else needs --allow-remote).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Allow a --host beyond loopback (0.0.0.0, a LAN address): other machines can then use
    /// the model; combine with --api-key.
    #[arg(long)]
    pub allow_remote: bool,
    /// Across ranks (`mlxb launch`): whole layers per rank (pipeline parallelism, mlx-lm's
    /// `--pipeline`) instead of a slice of every layer
    #[arg(long)]
    pub pipeline: bool,
    /// Port to listen on (0 picks a free one; the ready card prints the URL).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most requests decoded at once by continuous batching (1: one at a time, the
    /// single-stream path); requests beyond it wait in the queue. With an n-gram drafter each
    /// request drafts for itself and every step verifies all their blocks at once.
    #[arg(long, default_value_t = crate::server::DEFAULT_MAX_BATCH)]
    pub max_batch: usize,
    /// Most requests waiting for the engine; more get 503 until the queue drains.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// `max_tokens` for requests that give none (mlx-lm's server uses 512).
    #[arg(long, default_value_t = crate::server::request::DEFAULT_MAX_TOKENS)]
    pub default_max_tokens: usize,
    /// Largest `max_tokens` a request may ask for.
    #[arg(long, default_value_t = crate::server::request::DEFAULT_TOKEN_LIMIT)]
    pub max_tokens_limit: usize,
    /// Largest request body in bytes (larger ones get 413).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Longest prompt in tokens (longer ones get 400 `context_length_exceeded`).
    #[arg(long, default_value_t = crate::server::request::DEFAULT_TOKEN_LIMIT)]
    pub max_prompt_tokens: usize,
    /// Most completion requests in flight at once, queued and streaming ones included (more
    /// get 429); /health, /metrics and /v1/models are exempt.
    #[arg(long, default_value_t = 256)]
    pub max_concurrent: usize,
    /// Prefill every prompt in full instead of reusing the previous request's KV for a
    /// shared prefix (reuse is bit-exact either way; this is for comparisons).
    #[arg(long)]
    pub no_prefix_reuse: bool,
    /// Most prompts prefilled together, as mlx-lm's --prompt-concurrency (1: each prompt is
    /// prefilled alone, so every prompt can be kept for reuse).
    #[arg(long, default_value_t = 8)]
    pub prompt_concurrency: usize,
    /// Most bytes of prompt prefixes kept for reuse by batched requests (an LRU shared by all
    /// conversations; 0 keeps none).
    #[arg(long, default_value_t = crate::server::DEFAULT_PROMPT_CACHE_BYTES)]
    pub prompt_cache_bytes: usize,
    /// How a batched step sizes the blocks it verifies when requests draft for themselves:
    /// `cost` picks the width that hands out the most tokens per second by forward costs
    /// measured on this machine (drafting off where plain batching is faster), and a request
    /// decoded alone drafts only while drafting rounds hand out more tokens per second than
    /// plain steps (as `generate --draft-policy cost`); `all` verifies every proposal in full.
    #[arg(long, value_enum, default_value_t = crate::spec::policy::DraftPolicy::Cost)]
    pub draft_policy: crate::spec::policy::DraftPolicy,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long)]
    pub api_key: Option<String>,
}

/// Entry point of `mlxb serve`.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    for (flag, value) in [
        ("--max-tokens-limit", args.max_tokens_limit),
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--max-concurrent", args.max_concurrent),
        ("--max-body-bytes", args.max_body_bytes),
        ("--max-batch", args.max_batch),
        ("--prompt-concurrency", args.prompt_concurrency),
    ] {
        if value == 0 {
            return Err(EngineError::Input(format!("{flag} must be at least 1")).into());
        }
    }
    // Refuse a remote --host before a first run spends time fetching the model.
    crate::server::bind::check_host(&args.host, args.allow_remote)?;
    let spec = args.spec.options()?;
    if let Some(opts) = &spec {
        opts.validate()?;
        if crate::engine::distributed::world().is_some() {
            return Err(EngineError::Input(
                "mlxb serve across ranks decodes without a drafter (as mlx-lm's server does); leave out the drafter flags, or serve from one process to draft".into(),
            )
            .into());
        }
    }
    super::common::choose_split(args.pipeline, None)?;
    let dir = resolve_model(args.model.model.as_deref())?;
    let resolution = args.forks.resolve()?;
    for w in &resolution.warnings {
        eprintln!("mlxb: warning: {w}");
    }
    serve(ServeConfig {
        dir,
        forks: resolution.forks,
        kv_config: args.forks.kv_config.clone(),
        parity: resolution.holds(),
        model_ref: args.model.model.clone(),
        host: args.host,
        port: args.port,
        spec,
        prefill_step_size: args.model.prefill_step_size,
        max_queue: args.max_queue,
        default_max_tokens: args.default_max_tokens,
        max_tokens_limit: args.max_tokens_limit,
        max_body_bytes: args.max_body_bytes,
        api_key: args.api_key,
        allow_remote: args.allow_remote,
        max_prompt_tokens: args.max_prompt_tokens,
        max_concurrent: args.max_concurrent,
        prefix_reuse: !args.no_prefix_reuse,
        startup: super::progress::startup_trace(),
        max_batch: args.max_batch,
        prompt_cache_bytes: args.prompt_cache_bytes,
        prompt_concurrency: args.prompt_concurrency,
        draft_policy: args.draft_policy,
    })
}
