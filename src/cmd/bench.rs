//! `mlxb bench`: llama-bench-style tests with an interleaved baseline (mlx-lm, or llama.cpp's
//! llama-bench), run with the fork flags of `generate`, or `--matrix`: every fork and tier
//! against L1.

use super::common::resolve_model;
use super::common::SpecArgs;
use super::flags::{open_session, ForkArgs};
use crate::bench::llama_cpp::LlamaBench;
use crate::bench::matrix::{self, MatrixOptions};
use crate::bench::progress::{Bar, Observer};
use crate::bench::report::Row;
use crate::bench::{
    self, report, runner::TestKind, runner::TestSpec, tui, BaselineSpec, BenchPlan,
};
use crate::engine::error::EngineError;
use clap::{Args, ValueEnum};
use std::io::IsTerminal;

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
    /// llama.cpp's llama-bench on the same weights as a GGUF file (`--gguf`; -p and -n tests).
    #[value(name = "llama.cpp")]
    LlamaCpp,
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
    /// Verify-cost tests: one forward of a block of this many tokens with all of its logits
    /// (a speculative verify), timed beside a one-token step at the same depth; comma-separated,
    /// each 1 to 16 for the host products to take it (e.g. 2,4,8,16).
    #[arg(long = "n-verify", value_delimiter = ',')]
    pub n_verify: Vec<usize>,
    /// Parallel decode tests: this many sequences decoded at once by the batched engine, each
    /// generating every `-n` count (aggregate tokens/second), comma-separated (e.g. 1,4,8).
    #[arg(long = "n-parallel", value_delimiter = ',')]
    pub n_parallel: Vec<usize>,
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
    /// `--baseline llama.cpp`: the llama-bench binary (default: the one
    /// scripts/build_llama_cpp.sh builds, under mlxb's cache directory).
    #[arg(long, value_name = "PATH")]
    pub llama_bench: Option<std::path::PathBuf>,
    /// `--baseline llama.cpp`: the model's weights as a GGUF file, for llama-bench.
    #[arg(long, value_name = "FILE")]
    pub gguf: Option<std::path::PathBuf>,
    /// Append the rows to this JSONL file (refused if it holds rows from another setup).
    #[arg(long)]
    pub results: Option<std::path::PathBuf>,
    /// Prompt tokens per prefill forward.
    #[arg(long, default_value_t = 2048)]
    pub prefill_step_size: usize,
    /// Measure every fork value and tier (derived from the fork table) as a paired A/B
    /// against L1, with the KL divergence of output-changing ones.
    #[arg(long)]
    pub matrix: bool,
    /// `--matrix`: flag a configuration whose mean KL divergence from L1 (nats) is above this.
    #[arg(long, default_value_t = 1e-3)]
    pub kl_warn: f64,
    /// `--matrix`: greedy steps per prompt of the KL comparison.
    #[arg(long, default_value_t = 16)]
    pub kl_steps: usize,
    /// Show a live view (per-test progress, running mean ± std, speedup so far) on the
    /// terminal while measuring.
    #[arg(long)]
    pub tui: bool,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub forks: ForkArgs,
}

/// The test list: for each depth, every pp then every tg test (llama-bench's order), then every
/// verify test.
pub fn plan_tests(args: &BenchArgs) -> anyhow::Result<Vec<TestSpec>> {
    let mut tests = Vec::new();
    for &depth in &args.n_depth {
        for &n in args.n_prompt.iter().filter(|&&n| n > 0) {
            tests.push(TestSpec {
                kind: TestKind::Prefill,
                n,
                depth,
                batch: 1,
            });
        }
        for &n in args.n_gen.iter().filter(|&&n| n > 0) {
            tests.push(TestSpec {
                kind: TestKind::Decode,
                n,
                depth,
                batch: 1,
            });
        }
        for &n in args.n_verify.iter().filter(|&&n| n > 0) {
            tests.push(TestSpec {
                kind: TestKind::Verify,
                n,
                depth,
                batch: 1,
            });
        }
        for &batch in args.n_parallel.iter().filter(|&&b| b > 0) {
            for &n in args.n_gen.iter().filter(|&&n| n > 0) {
                tests.push(TestSpec {
                    kind: TestKind::Parallel,
                    n,
                    depth,
                    batch,
                });
            }
        }
    }
    if tests.is_empty() {
        return Err(EngineError::Input(
            "no tests selected: give -p, -n (with --n-parallel for batched decoding) and/or --n-verify with a positive token count".into(),
        )
        .into());
    }
    if args.repetitions == 0 {
        return Err(EngineError::Input("-r must be at least 1".into()).into());
    }
    Ok(tests)
}

/// The baseline `args` ask for, its files checked.
fn baseline_spec(args: &BenchArgs, tests: &[TestSpec]) -> anyhow::Result<Option<BaselineSpec>> {
    let llama_only = match (&args.llama_bench, &args.gguf) {
        (Some(_), _) => Some("--llama-bench"),
        (None, Some(_)) => Some("--gguf"),
        (None, None) => None,
    };
    Ok(match args.baseline {
        None | Some(Baseline::MlxLm) => {
            if let Some(flag) = llama_only {
                return Err(EngineError::Input(format!(
                    "{flag} is only used by --baseline llama.cpp; add --baseline llama.cpp or drop {flag}"
                ))
                .into());
            }
            args.baseline.map(|_| BaselineSpec::MlxLm)
        }
        Some(Baseline::LlamaCpp) => {
            let gguf = args.gguf.clone().ok_or_else(|| {
                EngineError::Input(
                    "--baseline llama.cpp needs the model's weights as a GGUF file: add --gguf FILE"
                        .into(),
                )
            })?;
            let binary = match &args.llama_bench {
                Some(p) => p.clone(),
                None => crate::convert::registry::cache_root()?.join("llama.cpp/bin/llama-bench"),
            };
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let bench = LlamaBench::new(binary, gguf, threads)?;
            for test in tests {
                bench.args(test)?;
            }
            Some(BaselineSpec::LlamaCpp(bench))
        }
    })
}

/// `--matrix` compares against L1 by itself; flags that would change either side are refused.
fn check_matrix_args(args: &BenchArgs, drafter: bool) -> Result<(), EngineError> {
    let clash = if args.forks.tier.is_some() || !args.forks.explicit.is_empty() {
        Some("fork and tier flags")
    } else if args.baseline.is_some() {
        Some("--baseline")
    } else if drafter {
        Some("drafter flags")
    } else {
        None
    };
    match clash {
        Some(what) => Err(EngineError::Input(format!(
            "--matrix measures every fork and tier against --l1 by itself; drop the {what}"
        ))),
        None if args.kl_steps == 0 => {
            Err(EngineError::Input("--kl-steps must be at least 1".into()))
        }
        None => Ok(()),
    }
}

/// The live view with `--tui` on a terminal, else the progress bar on stderr.
fn observer(tui: bool, total: usize) -> Box<dyn Observer> {
    if tui {
        if !std::io::stdout().is_terminal() {
            eprintln!(
                "mlxb: --tui needs a terminal on stdout; showing the plain progress bar instead"
            );
        } else {
            match tui::LiveView::start(total) {
                Ok(view) => return Box::new(view),
                Err(e) => eprintln!(
                    "mlxb: cannot start the --tui view ({e}); showing the plain progress bar instead"
                ),
            }
        }
    }
    Box::new(Bar::new(total))
}

/// Entry point of `mlxb bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let tests = plan_tests(&args)?;
    let baseline = baseline_spec(&args, &tests)?;
    let spec = args.spec.options()?;
    if args.matrix {
        check_matrix_args(&args, spec.is_some())?;
    }
    let dir = resolve_model(args.model.as_deref())?;
    let (mut session, _) = open_session(&dir, &args.forks)?;
    let rows = if args.matrix {
        let entries = matrix::plan_for(&session.model, &dir);
        let opts = MatrixOptions {
            tests,
            repetitions: args.repetitions,
            prefill_step_size: args.prefill_step_size,
            kl_steps: args.kl_steps,
            kl_warn: args.kl_warn,
        };
        let mut view = observer(args.tui, opts.total_reps(&entries));
        let rows = matrix::run(&mut session, &dir, &entries, &opts, |e| view.event(e));
        view.finish();
        rows?
    } else {
        let plan = BenchPlan {
            tests,
            repetitions: args.repetitions,
            baseline,
            spec,
            prefill_step_size: args.prefill_step_size,
        };
        let mut view = observer(args.tui, plan.total_reps());
        let rows = bench::run(&mut session, &dir, &plan, |e| view.event(e));
        view.finish();
        rows?
    };
    if let Some(path) = &args.results {
        bench::append_results(path, &rows)?;
    }
    print_rows(&rows, args.output, args.matrix)?;
    warn_kl(&rows, args.kl_warn);
    Ok(())
}

fn print_rows(rows: &[Row], output: Output, matrix: bool) -> anyhow::Result<()> {
    match output {
        Output::Md if matrix => print!("{}", report::matrix_markdown(rows)),
        Output::Md => print!("{}", report::markdown(rows)),
        Output::Json => println!("{}", serde_json::to_string_pretty(rows)?),
        Output::Jsonl => {
            for r in rows {
                println!("{}", serde_json::to_string(r)?);
            }
        }
        Output::Csv => print!("{}", report::csv(rows)),
    }
    Ok(())
}

/// One WARN line on stderr per configuration whose mean KL is above `--kl-warn`.
fn warn_kl(rows: &[Row], threshold: f64) {
    let mut seen: Vec<&str> = Vec::new();
    for r in rows.iter().filter(|r| r.kl_warn == Some(true)) {
        if !seen.contains(&r.config.as_str()) {
            seen.push(&r.config);
            eprintln!(
                "mlxb: WARN: {}: mean KL divergence from L1 {:.3e} nats is above --kl-warn {threshold:e}",
                r.config,
                r.kl_mean.unwrap_or(f64::NAN)
            );
        }
    }
}
