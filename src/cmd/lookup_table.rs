//! `mlxb lookup-table`: builds a lookup table of a target's own replies
//! ([`crate::spec::lookup_table`]) from a sequences file of `train-dspark`, for the `ngram`
//! drafter and a model drafter's lookup (`--lookup-table`; a DSpark drafter's own as
//! `lookup.safetensors` in its directory).

use crate::engine::error::EngineError;
use crate::spec::lookup_table::{LookupTable, TableSettings};
use crate::train::sequences::read_sequences;
use clap::Args;
use std::path::PathBuf;

/// Flags of `mlxb lookup-table`.
#[derive(Debug, Args)]
pub struct LookupTableArgs {
    /// Sequences file written by `train-dspark` (its `--sequences`) for the target the table is
    /// for: their replies are what the table learns.
    #[arg(long, value_name = "FILE")]
    pub sequences: PathBuf,
    /// Where to write the table (safetensors; for a DSpark drafter, `DIR/lookup.safetensors`).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Keep an n-gram that occurs in the replies at least this often.
    #[arg(long, default_value_t = TableSettings::default().min_count)]
    pub min_count: u32,
    /// Keep its most frequent continuation where that follows at least this share of its
    /// occurrences (drafting stops at an n-gram without one).
    #[arg(long, default_value_t = TableSettings::default().min_share)]
    pub min_share: f64,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    pub json: bool,
}

/// Entry point of `mlxb lookup-table`.
pub fn run(args: LookupTableArgs) -> anyhow::Result<()> {
    if args.min_count == 0 {
        return Err(EngineError::Input("--min-count must be at least 1".into()).into());
    }
    if !(0.0..=1.0).contains(&args.min_share) {
        return Err(EngineError::Input(format!(
            "--min-share {} is out of range; give a share between 0 and 1",
            args.min_share
        ))
        .into());
    }
    let (header, sequences) = read_sequences(&args.sequences)?;
    let settings = TableSettings {
        min_count: args.min_count,
        min_share: args.min_share,
    };
    let (table, summary) = LookupTable::build(&sequences, settings);
    if summary.kept.iter().all(|&k| k == 0) {
        return Err(EngineError::file(
            &args.sequences,
            format!(
                "has no n-gram in its replies {} times or more; lower --min-count or regenerate more sequences",
                args.min_count
            ),
        )
        .into());
    }
    let about = serde_json::json!({
        "sequences_file": args.sequences.file_name().map(|n| n.to_string_lossy()),
        "target_config_sha256": header.get("target_config_sha256"),
        "sequences": summary.sequences,
        "reply_tokens": summary.reply_tokens,
        "min_count": args.min_count,
        "min_share": args.min_share,
    });
    table.save(&args.out, &about)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "out": args.out, "sequences": summary.sequences,
                "reply_tokens": summary.reply_tokens, "ngrams_by_order": summary.kept,
                "min_count": args.min_count, "min_share": args.min_share,
            })
        );
    } else {
        println!(
            "kept {} n-grams (of 1 to 4 tokens: {}) of {} reply tokens in {} sequences in {}",
            summary.kept.iter().sum::<usize>(),
            summary
                .kept
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            summary.reply_tokens,
            summary.sequences,
            args.out.display()
        );
    }
    Ok(())
}
