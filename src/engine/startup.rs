//! The start-up timeline: the engine marks when each start-up step
//! finished (session open, tokenizer parsed, model built, prompt prefilled, first token
//! computed) on a [`StartupTrace`]; a front end that wants the timeline hands one in with an
//! observer and shows it.

use std::sync::Arc;

/// Hears each start-up step as it finishes.
pub trait StartupObserver: Send + Sync {
    /// Step `label` finished `at_ms` milliseconds after the process started (exec of `mlxb`,
    /// 10 ms resolution; `None` where the process's start time cannot be read).
    fn reached(&self, label: &str, at_ms: Option<f64>);
}

/// Where start-up steps are reported: nowhere by default (marking is then free); clones
/// report to the same observer.
#[derive(Clone, Default)]
pub struct StartupTrace(Option<Arc<dyn StartupObserver>>);

impl StartupTrace {
    /// A trace that reports to `observer`.
    pub fn to(observer: Arc<dyn StartupObserver>) -> Self {
        Self(Some(observer))
    }

    /// Step `label` finished now.
    pub fn mark(&self, label: &str) {
        if let Some(observer) = &self.0 {
            observer.reached(label, process_age_ms());
        }
    }
}

impl std::fmt::Debug for StartupTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "StartupTrace(on)"
        } else {
            "StartupTrace(off)"
        })
    }
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
