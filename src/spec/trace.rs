//! Per-round speculative traces (`--spec-trace FILE`): one JSON object per verify round, for
//! every drafter, so runs can be compared round by round with another implementation (for
//! DSpark, DeepSpec's reference loop).
//!
//! The executor builds a [`RoundTrace`] after each round from what it already holds (anchor,
//! proposal, accepted count, emitted token) plus the drafter's optional [`RoundNote`]
//! (confidences, threshold, pruning mode), and hands it to a [`TraceSink`]. Recording reads
//! only host values the round has already computed, so it cannot change what is emitted.

pub use super::source::RoundNote;
use crate::engine::error::{EngineError, Result};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::io::Write;
use std::path::Path;
use std::rc::Rc;

/// One verify round, as written to the trace (one JSON object per line).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundTrace {
    /// Index of the prompt in a multi-prompt run (0 for a single prompt).
    pub prompt: usize,
    /// Round number within this prompt's generation, from 0.
    pub round: usize,
    /// Absolute position of the anchor token (the last committed token, fed first).
    pub anchor_pos: usize,
    /// The anchor token id.
    pub anchor: u32,
    /// Draft token ids the target verified (after pruning; empty = a plain decode step).
    pub proposed: Vec<u32>,
    /// Sigmoid confidence per proposed position (DSpark only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<Vec<f64>>,
    /// Confidence of every position of the unpruned block (DSpark only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_confidence: Option<Vec<f64>>,
    /// The global confidence threshold in force (`null` = none, or a per-position table).
    pub threshold: Option<f64>,
    /// Per-position thresholds, when the checkpoint's calibrated table is in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thresholds: Option<Vec<f64>>,
    /// The DSpark pruning mode in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prune: Option<String>,
    /// Proposed tokens the target accepted.
    pub accepted: usize,
    /// The token the target emitted after the accepted ones (correction or bonus); `None`
    /// when the generation stopped on an accepted token.
    pub next: Option<u32>,
}

impl RoundTrace {
    /// Adds the drafter's note (confidences, threshold, mode); the confidences are cut to the
    /// proposal as verified (the executor may shorten a draft further).
    pub fn with_note(mut self, note: Option<RoundNote>) -> Self {
        if let Some(n) = note {
            let mut confidence = n.confidence;
            confidence.truncate(self.proposed.len());
            self.confidence = Some(confidence);
            self.block_confidence = Some(n.block_confidence);
            self.threshold = n.threshold;
            self.thresholds = n.thresholds;
            self.prune = n.prune;
        }
        self
    }
}

/// Where round traces go.
pub trait TraceSink {
    /// Records one round.
    fn record(&mut self, round: &RoundTrace) -> Result<()>;
}

/// Writes each round as one JSON line, tagged with a prompt index.
pub struct JsonlTrace<W: Write> {
    out: W,
    prompt: usize,
}

impl JsonlTrace<std::io::BufWriter<std::fs::File>> {
    /// Creates (truncates) the trace file at `path`.
    pub fn create(path: &Path) -> Result<Self> {
        let f = std::fs::File::create(path)
            .map_err(|e| EngineError::file(path, format!("cannot create the trace file ({e})")))?;
        Ok(Self::new(std::io::BufWriter::new(f)))
    }
}

impl<W: Write> JsonlTrace<W> {
    /// Wraps a writer (prompt index 0).
    pub fn new(out: W) -> Self {
        Self { out, prompt: 0 }
    }

    /// Sets the prompt index written with the following rounds.
    pub fn set_prompt(&mut self, prompt: usize) {
        self.prompt = prompt;
    }

    /// Flushes buffered lines.
    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .map_err(|e| EngineError::Runtime(format!("cannot write the trace ({e})")))
    }
}

impl<W: Write> TraceSink for JsonlTrace<W> {
    fn record(&mut self, round: &RoundTrace) -> Result<()> {
        let line = serde_json::to_string(&RoundTrace {
            prompt: self.prompt,
            ..round.clone()
        })
        .map_err(|e| EngineError::Runtime(format!("cannot serialize a trace round ({e})")))?;
        writeln!(self.out, "{line}")
            .map_err(|e| EngineError::Runtime(format!("cannot write the trace ({e})")))
    }
}

/// A sink shared with its creator (tests, multi-prompt drivers): rounds are appended in order.
impl TraceSink for Rc<RefCell<Vec<RoundTrace>>> {
    fn record(&mut self, round: &RoundTrace) -> Result<()> {
        self.borrow_mut().push(round.clone());
        Ok(())
    }
}

/// A borrowed sink records like the sink itself (one file across several generations).
impl<T: TraceSink + ?Sized> TraceSink for &mut T {
    fn record(&mut self, round: &RoundTrace) -> Result<()> {
        (**self).record(round)
    }
}

/// Reads a JSONL trace back (blank lines skipped).
pub fn read(path: &Path) -> Result<Vec<RoundTrace>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EngineError::file(path, format!("cannot read the trace ({e})")))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                EngineError::file(path, format!("line {} is not a trace round ({e})", i + 1))
            })
        })
        .collect()
}
