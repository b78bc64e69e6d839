//! `mlxb serve`: flags of the OpenAI-compatible server, handed to `crate::server`.

use super::common::{ModelArgs, SpecArgs};
use crate::engine::session::resolve_model;
use crate::server::{serve, ServeConfig};
use clap::Args;

/// Flags of `mlxb serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Address to listen on (loopback by default; anything else should use --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the ready card prints the URL).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most requests waiting for the engine; more get 503 until the queue drains.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// `max_tokens` for requests that give none (mlx-lm's server uses 512).
    #[arg(long, default_value_t = 512)]
    pub default_max_tokens: usize,
    /// Largest `max_tokens` a request may ask for.
    #[arg(long, default_value_t = 32768)]
    pub max_tokens_limit: usize,
    /// Largest request body in bytes (larger ones get 413).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long)]
    pub api_key: Option<String>,
}

/// Entry point of `mlxb serve`.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    if args.max_tokens_limit == 0 {
        anyhow::bail!("--max-tokens-limit must be at least 1");
    }
    let spec = args.spec.options();
    if let Some(opts) = &spec {
        opts.validate()?;
    }
    let dir = resolve_model(args.model.model.as_deref())?;
    serve(ServeConfig {
        dir,
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
    })
}
