//! `mlxb bench`: llama-bench-style measurement. Each test is warmed up once, then repeated;
//! mlxb's repetitions are interleaved with the mlx-lm baseline's (and, for speculative
//! configs, with vanilla mlxb's) in one invocation, so ratios compare like with like.
//! `--matrix` ([`matrix`]) does the same for every fork and tier against L1.

pub mod baseline;
pub mod llama_cpp;
pub mod matrix;
pub mod progress;
pub mod report;
pub mod runner;
pub mod stats;
pub mod tui;

use crate::engine::error::{EngineError, Result};
use crate::engine::runtime;
use crate::engine::session::Session;
use crate::spec::factory::{open_source, SpecOptions};
use progress::Event;
use report::{Row, Setup};
use runner::{measure, time_decode, time_verify, tps, TestInputs, TestKind, TestSpec};
use std::path::Path;

/// What to run.
pub struct BenchPlan {
    /// Tests in order.
    pub tests: Vec<TestSpec>,
    /// Repetitions after the warm-up.
    pub repetitions: usize,
    /// A baseline measured in the same run, interleaved.
    pub baseline: Option<BaselineSpec>,
    /// A drafter to measure against vanilla decoding.
    pub spec: Option<SpecOptions>,
    /// Prefill chunk size.
    pub prefill_step_size: usize,
}

impl BenchPlan {
    /// Repetitions recorded in all (what a progress bar counts).
    pub fn total_reps(&self) -> usize {
        self.tests.len() * self.repetitions
    }
}

/// Which baseline a plan measures beside mlxb.
#[derive(Debug, Clone)]
pub enum BaselineSpec {
    /// mlx-lm in the oracle env, on the same model directory.
    MlxLm,
    /// llama.cpp's llama-bench on the same weights as a GGUF file.
    LlamaCpp(llama_cpp::LlamaBench),
}

/// A started baseline.
enum BaselineRunner {
    MlxLm(baseline::MlxLmWorker),
    LlamaCpp {
        bench: llama_cpp::LlamaBench,
        /// The build its rows named, once known.
        build: Option<String>,
    },
}

impl BaselineRunner {
    fn start(spec: &BaselineSpec, dir: &Path) -> Result<Self> {
        Ok(match spec {
            BaselineSpec::MlxLm => Self::MlxLm(baseline::MlxLmWorker::start(dir)?),
            BaselineSpec::LlamaCpp(bench) => Self::LlamaCpp {
                bench: bench.clone(),
                build: None,
            },
        })
    }

    /// The baseline's name in the report.
    fn name(&self) -> String {
        match self {
            Self::MlxLm(_) => "mlx-lm".into(),
            Self::LlamaCpp { build: Some(b), .. } if !b.is_empty() => format!("llama.cpp {b}"),
            Self::LlamaCpp { .. } => "llama.cpp".into(),
        }
    }

    /// Tokens per second of one repetition of `test` (and, for a verify test, the seconds of
    /// the one-token step beside it); `None` for llama.cpp's warm-up repetition, which
    /// llama-bench does by itself.
    fn time(
        &mut self,
        test: &TestSpec,
        inputs: &TestInputs,
        prefill_step_size: usize,
        warm_up: bool,
    ) -> Result<Option<(f64, Option<f64>)>> {
        match self {
            Self::MlxLm(w) => {
                let req = match test.kind {
                    TestKind::Prefill => {
                        serde_json::json!({"op": "pp", "context": inputs.context, "prompt": inputs.tokens, "prefill_step_size": prefill_step_size})
                    }
                    TestKind::Decode => {
                        serde_json::json!({"op": "tg", "prompt": inputs.decode_prompt, "n": test.n})
                    }
                    TestKind::Verify => {
                        serde_json::json!({"op": "verify", "context": inputs.context, "block": inputs.tokens, "prefill_step_size": prefill_step_size})
                    }
                    TestKind::Parallel => {
                        serde_json::json!({"op": "batch", "prompts": inputs.parallel_prompts, "n": test.n})
                    }
                };
                let reply = w.time(&req)?;
                Ok(Some((tps(reply.tokens, reply.seconds), reply.step_seconds)))
            }
            Self::LlamaCpp { .. } if warm_up => Ok(None),
            Self::LlamaCpp { bench, build } => {
                let run = bench.run(test)?;
                *build = Some(run.build);
                Ok(Some((run.tokens_per_second, None)))
            }
        }
    }
}

/// The setup this process measures on.
pub fn current_setup() -> Setup {
    let cpu_info = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned());
    Setup {
        mlxb: format!(
            "{} ({})",
            env!("CARGO_PKG_VERSION"),
            env!("MLXB_GIT_COMMIT")
        ),
        mlx_version: runtime::mlx_version().unwrap_or_default(),
        backend: runtime::backend().name().to_owned(),
        blas: runtime::blas(),
        cpu_info,
    }
}

/// The fields every row of one model shares (setup, model name, size, parameters).
fn row_template(session: &Session, dir: &Path) -> Result<Row> {
    let quant_bits = session
        .model
        .config
        .get("quantization")
        .and_then(|q| q.get("bits"))
        .and_then(|b| b.as_i64())
        .map(|b| b as i32);
    let (model_size, model_n_params) = crate::engine::weights::checkpoint_size(dir, quant_bits)?;
    Ok(Row {
        setup: current_setup(),
        model: dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        model_size,
        model_n_params,
        ..Row::default()
    })
}

/// `template` labelled `config` for `test`, with no samples yet.
fn test_row(template: &Row, config: &str, test: &TestSpec) -> Row {
    let n = |kind| if test.kind == kind { test.n } else { 0 };
    Row {
        config: config.to_owned(),
        test: test.name(),
        n_prompt: n(TestKind::Prefill),
        n_gen: n(TestKind::Decode).max(n(TestKind::Parallel)),
        n_parallel: if test.kind == TestKind::Parallel {
            test.batch
        } else {
            0
        },
        n_verify: n(TestKind::Verify),
        n_depth: test.depth,
        ..template.clone()
    }
}

/// Runs the plan on an opened session (with its forks); `progress` is told about every
/// recorded repetition.
pub fn run(
    session: &mut Session,
    dir: &Path,
    plan: &BenchPlan,
    mut progress: impl FnMut(&Event),
) -> Result<Vec<Row>> {
    let template = row_template(session, dir)?;
    let forks = session.model.plan.forks;
    let vocab = session.model.model.vocab_size() as u32;
    let mut worker = match &plan.baseline {
        Some(spec) => Some(BaselineRunner::start(spec, dir)?),
        None => None,
    };
    let mut rows = Vec::new();
    for (t_index, test) in plan.tests.iter().enumerate() {
        let inputs = TestInputs::new(test, vocab, t_index);
        let mut vanilla = test_row(&template, "vanilla", test);
        vanilla.baseline_samples_ts = worker.as_ref().map(|_| Vec::new());
        let spec_kind = plan.spec.as_ref().filter(|_| test.kind == TestKind::Decode);
        let mut current = vec![vanilla];
        if let Some(o) = spec_kind {
            let mut r = test_row(
                &template,
                &format!("draft {:?} k={}", o.kind, o.num_draft_tokens).to_lowercase(),
                test,
            );
            r.baseline_samples_ts = Some(Vec::new());
            current.push(r);
        }
        let mut accepted_len = Vec::new();
        // Repetition 0 is the warm-up and is not recorded.
        for rep in 0..=plan.repetitions {
            let (ours, our_cost) = if test.kind == TestKind::Verify {
                let timing = time_verify(&mut session.model, &inputs)?;
                (tps(test.n, timing.block), Some(timing.cost()))
            } else {
                let ours = measure(&mut session.model, test, &inputs, plan.prefill_step_size)?;
                (ours, None)
            };
            let theirs = match worker.as_mut() {
                Some(w) => w.time(test, &inputs, plan.prefill_step_size, rep == 0)?,
                None => None,
            };
            let spec_tps = match spec_kind {
                Some(opts) => {
                    let source = open_source(opts, session, forks, plan.prefill_step_size)?;
                    let (s, n, m) = time_decode(
                        &mut session.model,
                        &inputs.decode_prompt,
                        test.n,
                        Some((source, opts.num_draft_tokens)),
                    )?;
                    if rep > 0 {
                        if let Some(m) = m {
                            accepted_len.push(m.mean_acceptance_length());
                        }
                    }
                    Some(tps(n, s))
                }
                None => None,
            };
            if rep == 0 {
                continue;
            }
            current[0].samples_ts.push(ours);
            current[0].verify_cost_samples.extend(our_cost);
            if let (Some(b), Some((t, step))) = (current[0].baseline_samples_ts.as_mut(), theirs) {
                b.push(t);
                if let Some(step) = step.filter(|_| test.kind == TestKind::Verify) {
                    let block = test.n as f64 / t.max(1e-9);
                    current[0]
                        .baseline_verify_cost_samples
                        .push(block / step.max(1e-9));
                }
            }
            if let (Some(row), Some(t)) = (current.get_mut(1), spec_tps) {
                row.samples_ts.push(t);
                // The speculative row's baseline is vanilla mlxb in the same repetition.
                if let Some(b) = row.baseline_samples_ts.as_mut() {
                    b.push(ours);
                }
            }
            progress(&Event::Rep {
                rows: &current,
                rep,
                reps: plan.repetitions,
            });
        }
        if let Some(row) = current.get_mut(1) {
            row.mean_acceptance_length = Some(stats::mean(&accepted_len));
        }
        current[0].baseline = worker.as_ref().map(BaselineRunner::name);
        for mut row in current {
            row.finish();
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Appends rows to a JSONL results file, refusing to mix setups (rows measured with another
/// MLX, build, CPU or BLAS are not comparable). Written atomically (temp file + rename).
pub fn append_results(path: &Path, rows: &[Row]) -> Result<()> {
    let existing = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => {
            return Err(EngineError::file(
                path,
                format!("cannot read the results file ({e})"),
            ))
        }
    };
    for (i, line) in existing
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let old: Row = serde_json::from_str(line).map_err(|e| {
            EngineError::file(
                path,
                format!(
                    "line {} is not a bench row ({e}); use a new results file",
                    i + 1
                ),
            )
        })?;
        if let Some(new) = rows.first() {
            if old.setup != new.setup {
                return Err(EngineError::file(
                    path,
                    format!(
                        "holds rows from another setup ({} / MLX {} / {}); rows from different setups are not comparable — use a new results file",
                        old.setup.mlxb, old.setup.mlx_version, old.setup.blas
                    ),
                ));
            }
        }
    }
    let mut text = existing;
    for r in rows {
        let line = serde_json::to_string(r)
            .map_err(|e| EngineError::Runtime(format!("cannot encode a row ({e})")))?;
        text.push_str(&line);
        text.push('\n');
    }
    crate::engine::fsutil::write_atomic(path, text.as_bytes())
}
