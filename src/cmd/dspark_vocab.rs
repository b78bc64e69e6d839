//! `mlxb dspark-vocab`: gives a DSpark drafter a reduced draft vocabulary, the target's most
//! frequent reply tokens in a sequences file of `train-dspark` (see [`crate::train::draft_vocab`]).

use crate::engine::error::EngineError;
use crate::spec::dspark::checkpoint;
use crate::train::draft_vocab::{choose, write};
use clap::Args;
use std::path::PathBuf;

/// Flags of `mlxb dspark-vocab`.
#[derive(Debug, Args)]
pub struct DsparkVocabArgs {
    /// DSpark checkpoint directory (mlxb format) to patch in place; `default` = the shipped
    /// drafter.
    #[arg(long, value_parser = crate::spec::dspark::shipped::parse_drafter_arg)]
    pub drafter: PathBuf,
    /// Sequences file written by `train-dspark` (its `--sequences`, default
    /// `CACHE/sequences.jsonl`) for the drafter's target.
    #[arg(long, value_name = "FILE")]
    pub sequences: PathBuf,
    /// Draft ids to keep (the most frequent reply tokens).
    #[arg(long, default_value_t = 8192)]
    pub size: usize,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    pub json: bool,
}

/// Entry point of `mlxb dspark-vocab`.
pub fn run(args: DsparkVocabArgs) -> anyhow::Result<()> {
    if args.size == 0 {
        return Err(EngineError::Input("--size must be at least 1".into()).into());
    }
    // A drafter that cannot be patched is refused before the sequences are read.
    let (dir, config) = checkpoint::patchable(&args.drafter, "a draft vocabulary")?;
    let vocab = config.vocab_size;
    let choice = choose(&args.sequences, vocab, args.size)?;
    write(&dir, &choice.ids, vocab)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "drafter": args.drafter, "draft_vocab": choice.ids.len(), "vocab": vocab,
                "distinct_reply_tokens": choice.distinct, "reply_tokens": choice.reply_tokens,
                "coverage": choice.coverage, "sequences": choice.sequences,
            })
        );
    } else {
        println!(
            "kept {} of {} distinct reply tokens ({:.2} % of {} reply tokens in {} sequences) as the draft vocabulary of {}",
            choice.ids.len(),
            choice.distinct,
            100.0 * choice.coverage,
            choice.reply_tokens,
            choice.sequences,
            args.drafter.display()
        );
    }
    Ok(())
}
