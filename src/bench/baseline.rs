//! The mlx-lm baseline: a persistent worker process in the oracle env (same libmlx, same
//! BLAS) that mlxb drives line by line, so both sides' repetitions interleave in one run.

use crate::engine::error::{EngineError, Result};
use crate::oracle::mlx_lm;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

const WORKER: &str = include_str!("../../assets/oracle/mlx_lm_bench.py");

/// What the worker measured for one request.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Seconds of the timed part.
    pub seconds: f64,
    /// Tokens it processed or generated.
    pub tokens: usize,
    /// A verify request's one-token step at the same depth.
    pub step_seconds: Option<f64>,
}

/// A running mlx-lm worker with the model loaded.
pub struct MlxLmWorker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    _script: tempfile::TempPath,
}

impl MlxLmWorker {
    /// Starts the worker and waits until mlx-lm has loaded `model`.
    pub fn start(model: &Path) -> Result<Self> {
        let mut script = tempfile::Builder::new()
            .suffix(".py")
            .tempfile()
            .map_err(|e| {
                EngineError::Runtime(format!("cannot create the baseline script ({e})"))
            })?;
        script
            .write_all(WORKER.as_bytes())
            .map_err(|e| EngineError::Runtime(format!("cannot write the baseline script ({e})")))?;
        let script = script.into_temp_path();
        let mut child = Command::new(mlx_lm::python()?)
            .arg(&script)
            .arg(model)
            .env("HF_HUB_OFFLINE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                EngineError::Runtime(format!(
                    "cannot start the mlx-lm baseline ({e}); run scripts/setup.sh"
                ))
            })?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| EngineError::Runtime("baseline has no stdin".into()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| EngineError::Runtime("baseline has no stdout".into()))?;
        let mut worker = Self {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            _script: script,
        };
        worker.read_line()?;
        Ok(worker)
    }

    fn read_line(&mut self) -> Result<serde_json::Value> {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).map_err(|e| {
            EngineError::Runtime(format!("mlx-lm baseline stopped answering ({e})"))
        })?;
        if n == 0 {
            return Err(EngineError::Runtime(
                "the mlx-lm baseline exited (see its error above)".into(),
            ));
        }
        serde_json::from_str(&line)
            .map_err(|e| EngineError::Runtime(format!("bad reply from the mlx-lm baseline ({e})")))
    }

    /// Sends one request and returns its timing.
    pub fn time(&mut self, request: &serde_json::Value) -> Result<Timing> {
        writeln!(self.stdin, "{request}").map_err(|e| {
            EngineError::Runtime(format!("cannot talk to the mlx-lm baseline ({e})"))
        })?;
        let reply = self.read_line()?;
        Ok(Timing {
            seconds: reply["seconds"].as_f64().unwrap_or(0.0),
            tokens: reply["tokens"].as_u64().unwrap_or(0) as usize,
            step_seconds: reply["step_seconds"].as_f64(),
        })
    }
}

impl Drop for MlxLmWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
