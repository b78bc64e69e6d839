//! `mlxb dspark-init`: writes a randomly initialised DSpark drafter for a target (mlxb's
//! `dspark.json` + `model.safetensors`), the starting point of training.

use super::common::{resolve_model, value_enum};
use crate::engine::error::EngineError;
use crate::engine::forks::Forks;
use crate::engine::session::Session;
use crate::spec::dspark::checkpoint::{self, SeqHead};
use crate::train::init::{init_for_session, InitOptions};
use clap::Args;
use std::path::PathBuf;

value_enum! {
    /// `--seq-head`.
    SeqHeadArg => SeqHead {
        /// No head: plain DFlash (the base logits alone).
        None => SeqHead::None,
        /// z_k = U_k + W2 W1[x_{k-1}] (the paper's Eq. 5; DeepSpec's "vanilla").
        Markov => SeqHead::Markov,
        /// The paper's gated recurrent cell over [s; W1[x]; h] (Eq. 6).
        Rnn => SeqHead::Rnn,
        /// DeepSpec's code-only variant: W2(sigmoid(gate([h; W1[x]])) * W1[x]).
        Gated => SeqHead::Gated,
    }
}

/// The shape of a new drafter (shared by `dspark-init` and `train-dspark`).
#[derive(Debug, Args)]
pub struct ShapeArgs {
    /// Sequential head.
    #[arg(long, value_enum, default_value_t = SeqHeadArg::Markov)]
    pub seq_head: SeqHeadArg,
    /// Backbone layers (shaped like the target's, qwen3-style attention).
    #[arg(long, default_value_t = 2)]
    pub layers: i32,
    /// Block size γ (tokens drafted per round).
    #[arg(long, default_value_t = 7)]
    pub gamma: usize,
    /// Rank of the Markov embedding W1 and projection W2.
    #[arg(long, default_value_t = 256)]
    pub markov_rank: i32,
    /// Tapped target layers, comma-separated (default: up to five spread from 1 to n-3).
    #[arg(long, value_delimiter = ',')]
    pub tap_layers: Option<Vec<usize>>,
}

impl ShapeArgs {
    /// Init options with this shape and `seed` (everything else at its default).
    pub fn init_options(&self, seed: u64) -> InitOptions {
        InitOptions {
            seq_head: self.seq_head.into(),
            layers: self.layers,
            block_size: self.gamma,
            markov_rank: self.markov_rank,
            tap_layers: self.tap_layers.clone(),
            seed,
            ..InitOptions::default()
        }
    }
}

/// Flags of `mlxb dspark-init`.
#[derive(Debug, Args)]
pub struct DsparkInitArgs {
    /// Target model directory (or built-in name) the drafter is for.
    #[arg(long)]
    pub model: Option<String>,
    /// Output directory for the drafter checkpoint.
    #[arg(long)]
    pub out: PathBuf,
    /// The drafter's shape.
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Mask token id (default: the first padded vocabulary row, else the last id).
    #[arg(long)]
    pub mask_token_id: Option<u32>,
    /// Leave out the confidence head (the drafter then always drafts γ tokens).
    #[arg(long)]
    pub no_confidence_head: bool,
    /// Zero the sequential head's output projection W2 (it then starts as plain DFlash).
    #[arg(long)]
    pub zero_seq_head: bool,
    /// Seed of the random init.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Replace an existing checkpoint in --out.
    #[arg(long)]
    pub force: bool,
}

/// Entry point of `mlxb dspark-init`.
pub fn run(args: DsparkInitArgs) -> anyhow::Result<()> {
    if !args.force && checkpoint::is_artifact(&args.out) {
        return Err(EngineError::file(
            &args.out,
            "already holds a DSpark checkpoint; pass --force to replace it or choose another --out",
        )
        .into());
    }
    let dir = resolve_model(args.model.as_deref())?;
    let session = Session::open_traced(&dir, Forks::default(), super::progress::startup_trace())?;
    let opts = InitOptions {
        mask_token_id: args.mask_token_id,
        confidence_head: !args.no_confidence_head,
        zero_seq_output: args.zero_seq_head,
        ..args.shape.init_options(args.seed)
    };
    let (config, tensors) = init_for_session(&session, &dir, &opts)?;
    checkpoint::save(&args.out, &config, &tensors)?;
    println!(
        "wrote a random {:?} DSpark drafter for {} to {} ({} layers, γ {}, taps {:?}, mask token {})",
        config.seq_head,
        dir.display(),
        args.out.display(),
        config.num_hidden_layers,
        config.block_size,
        config.target_layer_ids,
        config.mask_token_id
    );
    Ok(())
}
