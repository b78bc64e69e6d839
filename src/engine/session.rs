//! A loaded model and its tokenizer: what every subcommand opens first.

use super::error::Result;
use super::forks::Forks;
use super::models::{self, LoadedModel};
use super::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// A model directory opened for generation.
pub struct Session {
    /// The model with its weights.
    pub model: LoadedModel,
    /// Its tokenizer and chat template.
    pub tokenizer: Tokenizer,
    /// The model directory.
    pub dir: PathBuf,
}

impl Session {
    /// Loads the model and tokenizer from `dir` with the given forks. The tokenizer (pure
    /// Rust, ~0.19 s for SmolLM2's 49k vocabulary) is parsed on a second thread while this one
    /// builds the model; MLX stays on this thread. With page-mapped weights (~0.04 s) the
    /// tokenizer is the longer of the two (`MLXB_TRACE_STARTUP=1` shows both).
    pub fn open(dir: &Path, forks: Forks) -> Result<Self> {
        trace_startup("session open");
        let (tokenizer, model) = std::thread::scope(|scope| {
            let tokenizer = scope.spawn(|| {
                let t = Tokenizer::load(dir);
                trace_startup("tokenizer parsed");
                t
            });
            let model = models::load(dir, forks);
            trace_startup("model built");
            let tokenizer = tokenizer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (tokenizer, model)
        });
        let (tokenizer, model) = (tokenizer?, model?);
        Ok(Self {
            model,
            tokenizer,
            dir: dir.to_path_buf(),
        })
    }
}

/// With `MLXB_TRACE_STARTUP` set, prints to stderr how long after process start (exec of
/// `mlxb`, 10 ms resolution) the start-up step `label` finished: the profile of issue #12.
pub fn trace_startup(label: &str) {
    if std::env::var_os("MLXB_TRACE_STARTUP").is_none() {
        return;
    }
    let since_start = process_age_ms().map_or("?".to_owned(), |ms| format!("{ms:.0}"));
    eprintln!("startup: {label} at {since_start} ms");
}

/// Milliseconds since this process started, from `/proc/self/stat` (Linux only).
fn process_age_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Field 22 (starttime, clock ticks since boot) counted after the `(comm)` field.
    let after_comm = &stat[stat.rfind(')')? + 2..];
    let ticks: f64 = after_comm.split_whitespace().nth(19)?.parse().ok()?;
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec; sysconf has no preconditions.
    let hz = unsafe {
        libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now);
        libc::sysconf(libc::_SC_CLK_TCK)
    };
    let now_ms = now.tv_sec as f64 * 1e3 + now.tv_nsec as f64 / 1e6;
    Some(now_ms - ticks * 1e3 / hz.max(1) as f64)
}
