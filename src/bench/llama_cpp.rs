//! The llama.cpp baseline: `llama-bench` run once per repetition on the same weights as a GGUF
//! file, so its repetitions interleave with mlxb's in one run as the mlx-lm worker's do.
//! llama-bench times its own tests (`pp N @ dD`: N prompt tokens after D context tokens;
//! `tg N @ dD`: N decode steps after D context tokens), each after its own warm-up run, and
//! reports tokens per second; mlxb's tests are timed the same way (see [`super::runner`]).

use super::runner::{TestKind, TestSpec};
use crate::engine::error::{EngineError, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How to run llama-bench.
#[derive(Debug, Clone)]
pub struct LlamaBench {
    /// The `llama-bench` binary.
    pub binary: PathBuf,
    /// The model as a GGUF file (the same weights mlxb measures).
    pub gguf: PathBuf,
    /// Threads (`-t`).
    pub threads: usize,
}

impl LlamaBench {
    /// Checks that both files exist, naming the one that does not.
    pub fn new(binary: PathBuf, gguf: PathBuf, threads: usize) -> Result<Self> {
        if !binary.is_file() {
            return Err(EngineError::file(
                &binary,
                "is not a llama-bench binary; build one with scripts/build_llama_cpp.sh or give its path with --llama-bench",
            ));
        }
        if !gguf.is_file() {
            return Err(EngineError::file(
                &gguf,
                "does not exist; give the model's weights as a GGUF file with --gguf",
            ));
        }
        Ok(Self {
            binary,
            gguf,
            threads,
        })
    }

    /// llama-bench's arguments for one repetition of `test`.
    pub fn args(&self, test: &TestSpec) -> Result<Vec<String>> {
        let (p, n) = match test.kind {
            TestKind::Prefill => (test.n, 0),
            TestKind::Decode => (0, test.n),
            TestKind::Verify | TestKind::Parallel => {
                return Err(EngineError::Input(format!(
                    "--baseline llama.cpp measures -p and -n tests only (llama-bench has no {} test); drop --n-verify and --n-parallel, or use --baseline mlx-lm",
                    test.name()
                )))
            }
        };
        Ok(vec![
            "-m".into(),
            self.gguf.display().to_string(),
            "-p".into(),
            p.to_string(),
            "-n".into(),
            n.to_string(),
            "-d".into(),
            test.depth.to_string(),
            "-r".into(),
            "1".into(),
            "-t".into(),
            self.threads.to_string(),
            "-o".into(),
            "json".into(),
        ])
    }

    /// One llama-bench repetition of `test`.
    pub fn run(&self, test: &TestSpec) -> Result<LlamaRun> {
        let out = Command::new(&self.binary)
            .args(self.args(test)?)
            .output()
            .map_err(|e| {
                EngineError::file(&self.binary, format!("cannot run llama-bench ({e})"))
            })?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or("").trim();
            return Err(EngineError::Runtime(format!(
                "llama-bench failed on {} ({}): {last}",
                self.gguf.display(),
                out.status
            )));
        }
        parse_run(&out.stdout, &self.binary)
    }
}

/// What one llama-bench repetition reported.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaRun {
    /// Its `avg_ts`.
    pub tokens_per_second: f64,
    /// Its `build_commit` (empty when it gives none).
    pub build: String,
}

/// llama-bench's only JSON row.
fn parse_run(stdout: &[u8], binary: &Path) -> Result<LlamaRun> {
    let bad = |why: String| EngineError::file(binary, format!("gave no usable JSON row ({why})"));
    let rows: serde_json::Value = serde_json::from_slice(stdout).map_err(|e| bad(e.to_string()))?;
    let row = match rows.as_array().map(Vec::as_slice) {
        Some([row]) => row,
        _ => return Err(bad("expected one row".into())),
    };
    let tokens_per_second = row["avg_ts"]
        .as_f64()
        .filter(|t| t.is_finite() && *t > 0.0)
        .ok_or_else(|| bad("no positive avg_ts".into()))?;
    Ok(LlamaRun {
        tokens_per_second,
        build: row["build_commit"].as_str().unwrap_or("").to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test(kind: TestKind, n: usize, depth: usize) -> TestSpec {
        TestSpec {
            kind,
            n,
            depth,
            batch: 1,
        }
    }

    #[test]
    fn each_test_maps_to_one_llama_bench_repetition() {
        let b = LlamaBench {
            binary: "llama-bench".into(),
            gguf: "m.gguf".into(),
            threads: 2,
        };
        let args = b.args(&test(TestKind::Prefill, 64, 512)).unwrap().join(" ");
        assert_eq!(args, "-m m.gguf -p 64 -n 0 -d 512 -r 1 -t 2 -o json");
        let args = b.args(&test(TestKind::Decode, 32, 0)).unwrap().join(" ");
        assert_eq!(args, "-m m.gguf -p 0 -n 32 -d 0 -r 1 -t 2 -o json");
        let err = b.args(&test(TestKind::Verify, 8, 0)).unwrap_err();
        assert!(err.to_string().contains("--baseline mlx-lm"), "{err}");
    }

    #[test]
    fn only_one_row_with_a_positive_rate_is_read() {
        let p = Path::new("llama-bench");
        let ok = br#"[{"build_commit": "0c1e570", "n_gen": 32, "avg_ts": 51.5}]"#;
        let run = parse_run(ok, p).unwrap();
        assert_eq!(
            (run.tokens_per_second, run.build.as_str()),
            (51.5, "0c1e570")
        );
        for bad in [
            &b"[]"[..],
            b"not json",
            br#"[{"avg_ts": 0}]"#,
            br#"[{}, {}]"#,
        ] {
            assert!(parse_run(bad, p).is_err());
        }
    }
}
