//! `mlxb bench --tui`: a live ratatui view of a running benchmark, drawn inline below the
//! command line (no alternate screen and no raw mode, so Ctrl-C still stops the run and the
//! terminal stays usable): overall progress, the current phase, and per test its
//! repetitions, running mean ± std, baseline and speedup so far.

use super::progress::{Event, Observer};
use super::report::Row;
use super::stats;
use ratatui::backend::CrosstermBackend;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::widgets::{Cell, Gauge, Paragraph, Row as Line, Table};
use ratatui::{Frame, Terminal, TerminalOptions, Viewport};
use std::io::Stdout;

/// Lines the inline view takes.
const HEIGHT: u16 = 16;

/// One test's line: its latest row and repetitions.
struct Entry {
    row: Row,
    rep: usize,
    reps: usize,
}

/// What the view shows, updated from [`Event`]s.
#[derive(Default)]
pub struct ViewState {
    total: usize,
    done: usize,
    phase: String,
    lines: Vec<Entry>,
}

impl ViewState {
    /// A view for `total` repetitions.
    pub fn new(total: usize) -> Self {
        Self {
            total,
            ..Self::default()
        }
    }

    /// Takes one report into account.
    pub fn apply(&mut self, e: &Event) {
        match e {
            Event::Phase(what) => self.phase = what.to_string(),
            Event::Dropped(n) => self.done += n,
            Event::Rep { rows, rep, reps } => {
                self.done += 1;
                for r in rows.iter() {
                    let mut row = r.clone();
                    row.finish();
                    let entry = Entry {
                        row,
                        rep: *rep,
                        reps: *reps,
                    };
                    let same = |l: &&mut Entry| l.row.config == r.config && l.row.test == r.test;
                    match self.lines.iter_mut().find(same) {
                        Some(line) => *line = entry,
                        None => self.lines.push(entry),
                    }
                }
                if let Some(r) = rows.first() {
                    self.phase = format!("{} {}", r.config, r.test);
                }
            }
        }
    }
}

/// Draws the view into `frame`.
pub fn render(state: &ViewState, frame: &mut Frame) {
    let [gauge, phase, table] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Min(2),
    ])
    .areas(frame.area());
    let ratio = state.done as f64 / state.total.max(1) as f64;
    frame.render_widget(
        Gauge::default()
            .ratio(ratio.clamp(0.0, 1.0))
            .label(format!("{}/{} repetitions", state.done, state.total)),
        gauge,
    );
    frame.render_widget(Paragraph::new(format!("now: {}", state.phase)), phase);
    render_table(state, frame, table);
}

fn render_table(state: &ViewState, frame: &mut Frame, area: Rect) {
    let fit = usize::from(area.height.saturating_sub(1));
    let skip = state.lines.len().saturating_sub(fit);
    let lines = state.lines[skip..].iter().map(|l| {
        let r = &l.row;
        let base = r
            .baseline_samples_ts
            .as_deref()
            .map(|b| format!("{:.2}", stats::mean(b)))
            .unwrap_or_default();
        Line::new([
            Cell::from(r.config.clone()),
            Cell::from(r.test.clone()),
            Cell::from(format!("{}/{}", l.rep, l.reps)),
            Cell::from(format!("{:.2} ± {:.2}", r.avg_ts, r.stddev_ts)),
            Cell::from(base),
            Cell::from(r.ratio_text()),
        ])
    });
    let header = Line::new([
        "config",
        "test",
        "reps",
        "t/s",
        "baseline t/s",
        "speedup so far",
    ]);
    let widths = [
        Constraint::Fill(3),
        Constraint::Length(14),
        Constraint::Length(6),
        Constraint::Length(18),
        Constraint::Length(13),
        Constraint::Length(24),
    ];
    frame.render_widget(Table::new(lines, widths).header(header), area);
}

/// The live view on stdout.
pub struct LiveView {
    terminal: Terminal<CrosstermBackend<Stdout>>,
    state: ViewState,
    area: Option<Rect>,
}

impl LiveView {
    /// Starts the view for `total` repetitions (stdout must be a terminal).
    pub fn start(total: usize) -> std::io::Result<Self> {
        let terminal = Terminal::with_options(
            CrosstermBackend::new(std::io::stdout()),
            TerminalOptions {
                viewport: Viewport::Inline(HEIGHT),
            },
        )?;
        let mut view = Self {
            terminal,
            state: ViewState::new(total),
            area: None,
        };
        view.draw();
        Ok(view)
    }

    fn draw(&mut self) {
        let state = &self.state;
        // A failed redraw only loses one frame of a progress display.
        if let Ok(done) = self.terminal.draw(|f| render(state, f)) {
            self.area = Some(done.area);
        }
    }
}

impl Observer for LiveView {
    fn event(&mut self, e: &Event) {
        self.state.apply(e);
        self.draw();
    }

    fn finish(&mut self) {
        // The results are printed where the view was.
        let _ = self.terminal.clear();
        if let Some(area) = self.area {
            let _ = self.terminal.set_cursor_position(area.as_position());
        }
        let _ = self.terminal.show_cursor();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;

    #[test]
    fn shows_running_mean_and_speedup() {
        let mut row = Row {
            config: "fused-decode on".into(),
            test: "tg8".into(),
            samples_ts: vec![30.0, 34.0],
            baseline_samples_ts: Some(vec![20.0, 20.0]),
            ..Row::default()
        };
        let mut state = ViewState::new(4);
        state.apply(&Event::Rep {
            rows: std::slice::from_ref(&row),
            rep: 2,
            reps: 2,
        });
        row.test = "pp16".into();
        state.apply(&Event::Rep {
            rows: std::slice::from_ref(&row),
            rep: 1,
            reps: 2,
        });
        state.apply(&Event::Phase("KL divergence of --l3"));
        assert_eq!((state.done, state.lines.len()), (2, 2));
        let mut t = Terminal::new(TestBackend::new(110, HEIGHT)).unwrap();
        t.draw(|f| render(&state, f)).unwrap();
        let text: String = t
            .backend()
            .buffer()
            .content()
            .iter()
            .map(|c| c.symbol())
            .collect();
        // mean 32 ± std 2.83, paired ratio (1.5, 1.7) → 1.600.
        for want in [
            "2/4 repetitions",
            "now: KL divergence of --l3",
            "fused-decode on",
            "32.00 ± 2.83",
            "20.00",
            "1.600",
        ] {
            assert!(text.contains(want), "{want:?} missing from {text:?}");
        }
    }
}
