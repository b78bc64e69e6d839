//! Subcommands: one module each with its argument struct and thin glue; no model math here.

pub mod bench;
pub mod calibrate;
pub mod common;
pub mod convert;
pub mod dspark_init;
pub mod dspark_vocab;
pub mod flags;
pub mod generate;
pub mod launch;
pub mod lookup_table;
pub mod measure;
pub mod models;
pub mod parity;
pub mod progress;
pub mod serve;
pub mod train_dspark;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

use crate::engine::{error::EngineError, runtime};

/// Top-level command line.
#[derive(Debug, Parser)]
#[command(
    name = "mlxb",
    about = "Fast, exact local LLM inference on MLX",
    disable_version_flag = true
)]
pub struct Cli {
    /// Print mlxb, MLX, backend and BLAS versions.
    #[arg(short = 'V', long = "version")]
    pub version: bool,
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The subcommands that exist so far.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text for one prompt (like `mlx_lm generate`).
    Generate(generate::GenerateArgs),
    /// Measure prefill/decode speed like llama-bench, optionally against mlx-lm in the same run.
    Bench(bench::BenchArgs),
    /// Compare mlxb with its tier's oracle (mlx-lm for L1, mlx-optiq for L2) bit for bit on
    /// one prompt (greedy ids and logprobs).
    Parity(parity::ParityArgs),
    /// Show what --l1/--l2/--l3 and fork flags resolve to and which oracle that keeps.
    Flags(flags::FlagsArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (with speculative decoding and /metrics).
    Serve(serve::ServeArgs),
    /// Import a GGUF file (llama.cpp) into an MLX-format model directory.
    Convert(convert::ConvertArgs),
    /// Write a randomly initialised DSpark drafter for a target.
    DsparkInit(dspark_init::DsparkInitArgs),
    /// Give a DSpark drafter a reduced draft vocabulary: the target's most frequent reply tokens.
    DsparkVocab(dspark_vocab::DsparkVocabArgs),
    /// Build a lookup table of the target's own replies for the n-gram lookups of drafting.
    LookupTable(lookup_table::LookupTableArgs),
    /// List the supported model types, or check whether `--model DIR` is supported and why not.
    Models(models::ModelsArgs),
    /// Regenerate data with the target, cache its hidden states and train a DSpark drafter.
    TrainDspark(train_dspark::TrainDsparkArgs),
    /// Fit a DSpark drafter's confidence temperatures and pruning thresholds on a prompt file.
    Calibrate(calibrate::CalibrateArgs),
    /// Measure a drafter against vanilla decoding on a prompt file (acceptance, speed, calibration).
    Measure(measure::MeasureArgs),
    /// Run `generate` or `serve` as several ranks, the model split over them (like `mlx.launch`).
    Launch(launch::LaunchArgs),
}

impl Command {
    /// The subcommand's name, as typed.
    fn name(&self) -> &'static str {
        match self {
            Command::Generate(_) => "generate",
            Command::Bench(_) => "bench",
            Command::Parity(_) => "parity",
            Command::Flags(_) => "flags",
            Command::Serve(_) => "serve",
            Command::Convert(_) => "convert",
            Command::DsparkInit(_) => "dspark-init",
            Command::DsparkVocab(_) => "dspark-vocab",
            Command::LookupTable(_) => "lookup-table",
            Command::Models(_) => "models",
            Command::TrainDspark(_) => "train-dspark",
            Command::Calibrate(_) => "calibrate",
            Command::Measure(_) => "measure",
            Command::Launch(_) => "launch",
        }
    }
}

/// Under `mlxb launch` / `mlx.launch`: joins the other ranks, for the subcommands that run
/// across ranks.
fn join_ranks(command: &Command) -> anyhow::Result<()> {
    if !crate::engine::distributed::launched_as_rank() {
        return Ok(());
    }
    if !matches!(command, Command::Generate(_) | Command::Serve(_)) {
        return Err(EngineError::Input(format!(
            "mlxb {} runs as one process; of mlxb's subcommands only generate and serve run across ranks",
            command.name()
        ))
        .into());
    }
    crate::engine::distributed::join()?;
    Ok(())
}

/// Runs the parsed command line and maps errors to exit codes (2 = the user's input).
pub fn run(cli: Cli) -> ExitCode {
    if cli.version {
        println!("{}", runtime::version_report());
        return ExitCode::SUCCESS;
    }
    let Some(command) = cli.command else {
        eprintln!("mlxb: no subcommand given; see `mlxb --help`");
        return ExitCode::from(2);
    };
    if let Err(err) = runtime::check() {
        return report(Err(err.into()));
    }
    if let Err(err) = join_ranks(&command) {
        return report(Err(err));
    }
    report(match command {
        Command::Generate(a) => generate::run(a),
        Command::Parity(a) => parity::run(a),
        Command::Flags(a) => flags::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Convert(a) => convert::run(a),
        Command::DsparkInit(a) => dspark_init::run(a),
        Command::DsparkVocab(a) => dspark_vocab::run(a),
        Command::LookupTable(a) => lookup_table::run(a),
        Command::Models(a) => models::run(a),
        Command::TrainDspark(a) => train_dspark::run(a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::Measure(a) => measure::run(a),
        Command::Launch(a) => launch::run(a),
    })
}

/// Prints an error as one sentence; user errors exit 2, internal ones 1.
pub fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            match std::env::var(crate::engine::distributed::RANK_ENV) {
                Ok(rank) => eprintln!("mlxb (rank {rank}): error: {err:#}"),
                Err(_) => eprintln!("mlxb: error: {err:#}"),
            }
            let user = err
                .downcast_ref::<EngineError>()
                .map(EngineError::is_user_error)
                .unwrap_or(true);
            ExitCode::from(if user { 2 } else { 1 })
        }
    }
}
