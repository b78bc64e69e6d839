//! `mlxb bench`: llama-bench-style tests with an interleaved mlx-lm baseline.

use super::common::SpecArgs;
use crate::bench::{self, report, runner::TestKind, runner::TestSpec, BenchPlan};
use crate::engine::error::EngineError;
use crate::engine::flags::Forks;
use crate::engine::session::{resolve_model, Session};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

/// Output formats (llama-bench's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Markdown table.
    Md,
    /// One JSON array.
    Json,
    /// One JSON object per line.
    Jsonl,
    /// CSV with the JSON field names.
    Csv,
}

/// Baselines measured in the same run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Baseline {
    /// mlx-lm 0.32.2 in the oracle env, on the same libmlx.
    #[value(name = "mlx-lm")]
    MlxLm,
}

/// Flags of `mlxb bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Model directory or short name.
    #[arg(long)]
    pub model: Option<String>,
    /// Prompt-processing tests (tokens), comma-separated; 0 disables.
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generation tests (tokens), comma-separated; 0 disables.
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Context depths, comma-separated.
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub n_depth: Vec<usize>,
    /// Repetitions per test (after one warm-up).
    #[arg(short = 'r', long, default_value_t = 5)]
    pub repetitions: usize,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Md)]
    pub output: Output,
    /// Measure a baseline in the same run, interleaved.
    #[arg(long, value_enum)]
    pub baseline: Option<Baseline>,
    /// Append the rows to this JSONL file (refused if it holds rows from another setup).
    #[arg(long)]
    pub results: Option<std::path::PathBuf>,
    /// Prompt tokens per prefill forward.
    #[arg(long, default_value_t = 2048)]
    pub prefill_step_size: usize,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// The test list: for each depth, every pp then every tg test (llama-bench's order).
pub fn plan_tests(args: &BenchArgs) -> anyhow::Result<Vec<TestSpec>> {
    let mut tests = Vec::new();
    for &depth in &args.n_depth {
        for &n in args.n_prompt.iter().filter(|&&n| n > 0) {
            tests.push(TestSpec {
                kind: TestKind::Prefill,
                n,
                depth,
            });
        }
        for &n in args.n_gen.iter().filter(|&&n| n > 0) {
            tests.push(TestSpec {
                kind: TestKind::Decode,
                n,
                depth,
            });
        }
    }
    if tests.is_empty() {
        return Err(EngineError::Input(
            "no tests selected: give -p and/or -n with a positive token count".into(),
        )
        .into());
    }
    if args.repetitions == 0 {
        return Err(EngineError::Input("-r must be at least 1".into()).into());
    }
    Ok(tests)
}

/// Entry point of `mlxb bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let tests = plan_tests(&args)?;
    let dir = resolve_model(args.model.as_deref())?;
    let mut session = Session::open(&dir, Forks::default())?;
    let plan = BenchPlan {
        tests,
        repetitions: args.repetitions,
        baseline: args.baseline.is_some(),
        spec: args.spec.options(),
        prefill_step_size: args.prefill_step_size,
    };
    let bar = ProgressBar::new((plan.tests.len() * plan.repetitions) as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg} (eta {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let rows = bench::run(&mut session, &dir, &plan, |msg| {
        bar.set_message(msg.to_owned());
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    if let Some(path) = &args.results {
        bench::append_results(path, &rows)?;
    }
    match args.output {
        Output::Md => print!("{}", report::markdown(&rows)),
        Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        Output::Jsonl => {
            for r in &rows {
                println!("{}", serde_json::to_string(r)?);
            }
        }
        Output::Csv => print!("{}", report::csv(&rows)),
    }
    Ok(())
}
