//! What a benchmark reports while it runs, and the plain progress bar that shows it (the live
//! view of `--tui` is [`super::tui`]); benchmarks on a loaded machine take minutes, so the user
//! sees how far they got.

use super::report::Row;
use indicatif::{ProgressBar, ProgressStyle};

/// One progress report.
pub enum Event<'a> {
    /// Something slow without repetitions started (loading a configuration, KL divergence).
    Phase(&'a str),
    /// A repetition was recorded: the rows of the test being measured, as they stand now.
    Rep {
        /// The rows (samples so far; their baselines when measured).
        rows: &'a [Row],
        /// Repetitions recorded so far for this test (1-based).
        rep: usize,
        /// Repetitions planned per test.
        reps: usize,
    },
    /// Planned repetitions that will not run (a configuration skipped once its model loaded).
    Dropped(usize),
}

/// Something that shows a benchmark's progress.
pub trait Observer {
    /// Shows one report.
    fn event(&mut self, e: &Event);
    /// Clears the display before the results are printed.
    fn finish(&mut self);
}

/// The indicatif bar on stderr: one tick per recorded repetition.
pub struct Bar(ProgressBar);

impl Bar {
    /// A bar for `total` repetitions.
    pub fn new(total: usize) -> Self {
        let bar = ProgressBar::new(total as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg} (eta {eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Self(bar)
    }
}

impl Observer for Bar {
    fn event(&mut self, e: &Event) {
        match e {
            Event::Phase(what) => self.0.set_message(what.to_string()),
            Event::Rep { rows, rep, reps } => {
                if let Some(r) = rows.first() {
                    self.0
                        .set_message(format!("{} {} rep {rep}/{reps}", r.config, r.test));
                }
                self.0.inc(1);
            }
            Event::Dropped(n) => self.0.inc(*n as u64),
        }
    }

    fn finish(&mut self) {
        self.0.finish_and_clear();
    }
}
