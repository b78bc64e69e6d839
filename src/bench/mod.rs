//! `mlxb bench`: llama-bench-style measurement. Each test is warmed up once, then repeated;
//! mlxb's repetitions are interleaved with the mlx-lm baseline's (and, for speculative
//! configs, with vanilla mlxb's) in one invocation, so ratios compare like with like.

pub mod baseline;
pub mod report;
pub mod runner;
pub mod stats;

use crate::engine::error::{EngineError, Result};
use crate::engine::runtime;
use crate::engine::session::Session;
use crate::spec::source::{open_source, SpecOptions};
use report::{Row, Setup};
use runner::{random_tokens, time_decode, time_prefill, TestKind, TestSpec};
use std::path::Path;

/// What to run.
pub struct BenchPlan {
    /// Tests in order.
    pub tests: Vec<TestSpec>,
    /// Repetitions after the warm-up.
    pub repetitions: usize,
    /// Also run mlx-lm in the oracle env.
    pub baseline: bool,
    /// A drafter to measure against vanilla decoding.
    pub spec: Option<SpecOptions>,
    /// Prefill chunk size.
    pub prefill_step_size: usize,
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

fn tps(tokens: usize, secs: f64) -> f64 {
    tokens as f64 / secs.max(1e-9)
}

/// Runs the plan on an opened session; `progress` is told about every finished repetition.
pub fn run(
    session: &mut Session,
    dir: &Path,
    plan: &BenchPlan,
    mut progress: impl FnMut(&str),
) -> Result<Vec<Row>> {
    let setup = current_setup();
    let quant_bits = session
        .model
        .config
        .get("quantization")
        .and_then(|q| q.get("bits"))
        .and_then(|b| b.as_i64())
        .map(|b| b as i32);
    let (size, params) = crate::engine::weights::checkpoint_size(dir, quant_bits)?;
    let vocab = session.model.model.vocab_size() as u32;
    let mut worker = if plan.baseline {
        Some(baseline::MlxLmWorker::start(dir)?)
    } else {
        None
    };
    let model_name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut rows = Vec::new();
    for (t_index, test) in plan.tests.iter().enumerate() {
        let seed = 1000 + t_index as u64;
        let context = random_tokens(test.depth, vocab, seed);
        let tokens = random_tokens(test.n, vocab, seed + 1);
        let decode_prompt = random_tokens(test.depth + 1, vocab, seed);
        let new_row = |config: &str| Row {
            setup: setup.clone(),
            model: model_name.clone(),
            model_size: size,
            model_n_params: params,
            config: config.to_owned(),
            test: test.name(),
            n_prompt: if test.kind == TestKind::Prefill {
                test.n
            } else {
                0
            },
            n_gen: if test.kind == TestKind::Decode {
                test.n
            } else {
                0
            },
            n_depth: test.depth,
            avg_ts: 0.0,
            stddev_ts: 0.0,
            samples_ts: Vec::new(),
            baseline_samples_ts: worker.as_ref().map(|_| Vec::new()),
            ratio: None,
            mean_acceptance_length: None,
        };
        let mut vanilla = new_row("vanilla");
        let spec_kind = plan.spec.as_ref().filter(|_| test.kind == TestKind::Decode);
        let mut speculative = spec_kind.map(|o| {
            let mut r =
                new_row(&format!("draft {:?} k={}", o.kind, o.num_draft_tokens).to_lowercase());
            r.baseline_samples_ts = Some(Vec::new());
            r
        });
        let mut accepted_len = Vec::new();
        // Repetition 0 is the warm-up and is not recorded.
        for rep in 0..=plan.repetitions {
            let model = session.model.model.as_mut();
            let ours = match test.kind {
                TestKind::Prefill => tps(
                    test.n,
                    time_prefill(model, &context, &tokens, plan.prefill_step_size)?,
                ),
                TestKind::Decode => {
                    let (s, n, _) = time_decode(model, &decode_prompt, test.n, None)?;
                    tps(n, s)
                }
            };
            let theirs = match worker.as_mut() {
                Some(w) => {
                    let req = match test.kind {
                        TestKind::Prefill => {
                            serde_json::json!({"op": "pp", "context": context, "prompt": tokens, "prefill_step_size": plan.prefill_step_size})
                        }
                        TestKind::Decode => {
                            serde_json::json!({"op": "tg", "prompt": decode_prompt, "n": test.n})
                        }
                    };
                    let (s, n) = w.time(&req)?;
                    Some(tps(n, s))
                }
                None => None,
            };
            let spec_tps = match spec_kind {
                Some(opts) => {
                    let source = open_source(
                        opts,
                        session,
                        crate::engine::flags::Forks::default(),
                        plan.prefill_step_size,
                    )?;
                    let model = session.model.model.as_mut();
                    let (s, n, m) = time_decode(
                        model,
                        &decode_prompt,
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
            vanilla.samples_ts.push(ours);
            if let (Some(b), Some(t)) = (vanilla.baseline_samples_ts.as_mut(), theirs) {
                b.push(t);
            }
            if let (Some(row), Some(t)) = (speculative.as_mut(), spec_tps) {
                row.samples_ts.push(t);
                // The speculative row's baseline is vanilla mlxb in the same repetition.
                if let Some(b) = row.baseline_samples_ts.as_mut() {
                    b.push(ours);
                }
            }
            progress(&format!("{} rep {rep}/{}", test.name(), plan.repetitions));
        }
        vanilla.finish();
        rows.push(vanilla);
        if let Some(mut row) = speculative {
            row.mean_acceptance_length = Some(stats::mean(&accepted_len));
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
