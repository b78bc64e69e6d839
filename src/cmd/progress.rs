//! Draws the lower layers' [`Progress`] reports on stderr: notices as `mlxb: ...` lines,
//! counted steps as indicatif bars (hidden when stderr is not a terminal).

use crate::engine::startup::{StartupObserver, StartupTrace};
use crate::progress::Progress;
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::{Arc, Mutex};

/// mlxb's progress bar on stderr: `label [=====>    ] done/total unit elapsed (ETA ...)`.
pub fn bar(label: &str, total: u64, unit: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    let template = format!("{{msg}} [{{bar:30}}] {{pos}}/{{len}} {unit} {{elapsed}} (ETA {{eta}})");
    let style =
        ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style.progress_chars("=> "));
    bar.set_message(label.to_owned());
    bar
}

/// Progress on the terminal.
#[derive(Default)]
pub struct Terminal {
    bar: Mutex<Option<ProgressBar>>,
}

impl Terminal {
    fn with_bar(&self, f: impl FnOnce(&ProgressBar)) {
        if let Ok(bar) = self.bar.lock() {
            if let Some(bar) = bar.as_ref() {
                f(bar);
            }
        }
    }
}

impl Progress for Terminal {
    fn notice(&self, text: &str) {
        eprintln!("mlxb: {text}");
    }

    fn begin(&self, label: &str, total: u64, unit: &str) {
        let bar = bar(label, total, unit);
        if let Ok(mut slot) = self.bar.lock() {
            if let Some(old) = slot.replace(bar) {
                old.finish_and_clear();
            }
        }
    }

    fn set(&self, done: u64) {
        self.with_bar(|bar| bar.set_position(done));
    }

    fn relabel(&self, label: &str) {
        self.with_bar(|bar| bar.set_message(label.to_owned()));
    }

    fn end(&self) {
        if let Ok(mut slot) = self.bar.lock() {
            if let Some(bar) = slot.take() {
                bar.finish_and_clear();
            }
        }
    }
}

/// With `MLXB_TRACE_STARTUP` set, a trace that prints each start-up step to stderr as it
/// finishes (`startup: LABEL at MS ms`, MS since the exec of `mlxb`); otherwise one that
/// prints nothing.
pub fn startup_trace() -> StartupTrace {
    if std::env::var_os("MLXB_TRACE_STARTUP").is_none() {
        return StartupTrace::default();
    }
    StartupTrace::to(Arc::new(StartupLines))
}

/// Prints the start-up timeline.
struct StartupLines;

impl StartupObserver for StartupLines {
    fn reached(&self, label: &str, at_ms: Option<f64>) {
        let since_start = at_ms.map_or("?".to_owned(), |ms| format!("{ms:.0}"));
        eprintln!("startup: {label} at {since_start} ms");
    }
}
