//! How many drafted tokens a batched step verifies: the single-machine form of DeepSpec's
//! hardware-aware scheduler. Every row of a batched verify forward is as wide as the widest
//! block, so the step picks one width W for the batch: each row then offers
//! `min(its proposal, W - 1)` drafts, and W maximises the expected tokens the step hands out
//! per second, `Σ_rows E[tokens] / cost(B, W)`, with a row's expected tokens
//! `1 + α + α² + … + α^k` (α: that row's acceptance so far, from a neutral prior) and
//! `cost(B, W)` the time of one forward of that shape measured on this machine at start-up,
//! replaced by a running average of the wall time of the steps of that shape actually taken
//! (real contexts are longer than the start-up probe's, and a verify step also gives up the
//! overlap of a plain step's forward with handing out the previous tokens). A row whose next
//! token is still unread offers a guess of it first: that guess counts as one more draft to be
//! kept.
//! W = 1 is plain batched decoding, so drafting turns itself off wherever batching alone hands
//! out more tokens per second.

use crate::engine::batch::BatchGenerator;
use crate::engine::error::Result;
use crate::engine::models::LanguageModel;
use std::collections::HashMap;

/// Seconds per batched forward by rows and width, measured at a few row counts (1, 2, 4, …,
/// the batch's most) for every width, interpolated linearly between them.
#[derive(Debug, Clone)]
pub struct CostTable {
    /// Row counts measured, ascending.
    rows: Vec<usize>,
    /// `seconds[r][w - 1]`: a forward of `rows[r]` rows × `w` tokens.
    seconds: Vec<Vec<f64>>,
}

impl CostTable {
    /// Times forwards of up to `max_rows` rows × `max_width` tokens on `model`.
    pub fn measure(
        gen: &BatchGenerator,
        model: &mut dyn LanguageModel,
        max_rows: usize,
        max_width: usize,
    ) -> Result<Self> {
        let mut rows = Vec::new();
        let mut b = 1;
        while b < max_rows {
            rows.push(b);
            b *= 2;
        }
        rows.push(max_rows.max(1));
        let mut seconds = Vec::with_capacity(rows.len());
        for &b in &rows {
            seconds.push(gen.forward_seconds(model, b, max_width.max(1))?);
        }
        Ok(Self { rows, seconds })
    }

    /// A table from known times (`seconds[r][w - 1]` for `rows[r]` rows).
    pub fn from_times(rows: Vec<usize>, seconds: Vec<Vec<f64>>) -> Self {
        Self { rows, seconds }
    }

    /// The widest block measured.
    pub fn max_width(&self) -> usize {
        self.seconds.first().map_or(1, Vec::len)
    }

    /// Seconds of one forward of `rows` × `width` (clamped to the measured range).
    pub fn cost(&self, rows: usize, width: usize) -> f64 {
        let w = width.clamp(1, self.max_width()) - 1;
        let at = |r: usize| self.seconds[r][w];
        let Some(upper) = self.rows.iter().position(|&b| b >= rows) else {
            return self.seconds.last().map_or(0.0, |s| s[w]);
        };
        if upper == 0 || self.rows[upper] == rows {
            return at(upper);
        }
        let (b0, b1) = (self.rows[upper - 1] as f64, self.rows[upper] as f64);
        let t = (rows as f64 - b0) / (b1 - b0);
        at(upper - 1) + t * (at(upper) - at(upper - 1))
    }
}

/// What one step cost: its shape and its wall time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    /// Rows in the step.
    pub rows: usize,
    /// Its block width.
    pub width: usize,
    /// Seconds from one step to the next.
    pub seconds: f64,
}

/// One row as the policy sees it: how many tokens its drafter proposed and how often its
/// drafts have been kept.
#[derive(Debug, Clone, Copy)]
pub struct RowOutlook {
    /// Drafted tokens on offer (after the guess, if there is one).
    pub proposed: usize,
    /// Whether they follow a guess of the row's unread next token.
    pub guessed: bool,
    /// Drafts kept so far.
    pub accepted: usize,
    /// Drafts verified so far.
    pub drafted: usize,
}

impl RowOutlook {
    /// A row with nothing to offer (no drafter, or no room).
    pub fn plain() -> Self {
        Self {
            proposed: 0,
            guessed: false,
            accepted: 0,
            drafted: 0,
        }
    }

    /// The chance a draft is kept: kept / verified with one kept and one rejected draft
    /// assumed beforehand, so a new row starts at 1/2.
    pub fn acceptance(&self) -> f64 {
        (self.accepted as f64 + 1.0) / (self.drafted as f64 + 2.0)
    }

    /// Tokens the row hands out from a block with `k` of its drafts (each kept only if every
    /// draft before it and the guess, if any, were right).
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let a = self.acceptance();
        let k = k.min(self.proposed);
        let start = if self.guessed { a } else { 1.0 };
        (1..=k)
            .fold((1.0, start), |(sum, p), _| (sum + p * a, p * a))
            .0
    }
}

/// How a batched drafting step sizes its verify blocks (`mlxb serve --draft-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DraftPolicy {
    /// By expected tokens per second, from forward costs measured on this machine.
    #[default]
    Cost,
    /// Every proposal in full, as a single stream verifies it.
    All,
}

/// Weight of the newest step in a shape's running average of costs.
const NEWEST_STEP_WEIGHT: f64 = 0.2;

/// Picks each step's block width from a [`CostTable`] and the steps taken since.
#[derive(Debug, Clone)]
pub struct DraftLengthPolicy {
    /// `None`: verify every proposal in full ([`DraftPolicy::All`]).
    table: Option<CostTable>,
    /// Running average of the seconds of steps taken, by rows and width.
    seen: HashMap<(usize, usize), f64>,
}

impl DraftLengthPolicy {
    /// A policy over `table`.
    pub fn new(table: CostTable) -> Self {
        Self {
            table: Some(table),
            seen: HashMap::new(),
        }
    }

    /// The policy of kind `kind` for batches of `gen`'s shape on `model`: for
    /// [`DraftPolicy::Cost`], forwards of up to `max_rows` rows × `max_width` tokens are timed
    /// first.
    pub fn for_batch(
        kind: DraftPolicy,
        gen: &BatchGenerator,
        model: &mut dyn LanguageModel,
        max_rows: usize,
        max_width: usize,
    ) -> Result<Self> {
        Ok(match kind {
            DraftPolicy::All => Self::all(),
            DraftPolicy::Cost => Self::new(CostTable::measure(gen, model, max_rows, max_width)?),
        })
    }

    /// The policy that verifies every proposal in full.
    pub fn all() -> Self {
        Self {
            table: None,
            seen: HashMap::new(),
        }
    }

    /// Takes in what a step of some shape cost.
    pub fn observe(&mut self, step: &StepCost) {
        self.seen
            .entry((step.rows, step.width))
            .and_modify(|s| *s += NEWEST_STEP_WEIGHT * (step.seconds - *s))
            .or_insert(step.seconds);
    }

    /// Seconds a step of `rows` × `width` is expected to take.
    pub fn cost(&self, rows: usize, width: usize) -> f64 {
        match (self.seen.get(&(rows, width)), &self.table) {
            (Some(&s), _) => s,
            (None, Some(table)) => table.cost(rows, width),
            (None, None) => 0.0,
        }
    }

    /// The block width (1 = no drafts) that hands out the most expected tokens per second
    /// for these rows.
    pub fn width(&self, rows: &[RowOutlook]) -> usize {
        let widest = rows.iter().map(|r| r.proposed + 1).max().unwrap_or(1);
        let Some(table) = &self.table else {
            return widest;
        };
        let mut best = (1, 0.0);
        for w in 1..=widest.min(table.max_width()) {
            let tokens: f64 = rows.iter().map(|r| r.expected_tokens(w - 1)).sum();
            let rate = tokens / self.cost(rows.len(), w).max(f64::MIN_POSITIVE);
            if rate > best.1 {
                best = (w, rate);
            }
        }
        best.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(proposed: usize, accepted: usize, drafted: usize) -> RowOutlook {
        RowOutlook {
            proposed,
            guessed: false,
            accepted,
            drafted,
        }
    }

    #[test]
    fn costs_interpolate_between_measured_row_counts() {
        let t = CostTable::from_times(
            vec![1, 2, 4],
            vec![vec![1.0, 2.0], vec![2.0, 3.0], vec![4.0, 8.0]],
        );
        assert_eq!(t.cost(1, 1), 1.0);
        assert_eq!(t.cost(3, 1), 3.0);
        assert_eq!(t.cost(3, 2), 5.5);
        assert_eq!(t.cost(9, 2), 8.0);
        assert_eq!(t.cost(2, 7), 3.0);
    }

    #[test]
    fn expected_tokens_are_a_geometric_sum_of_the_acceptance() {
        let r = row(3, 3, 4); // acceptance 4/6
        let a = 4.0 / 6.0;
        assert!((r.expected_tokens(2) - (1.0 + a + a * a)).abs() < 1e-12);
        assert_eq!(r.expected_tokens(0), 1.0);
        assert_eq!(row(1, 0, 0).expected_tokens(5), 1.5);
        let guessed = RowOutlook {
            guessed: true,
            ..row(2, 0, 0)
        };
        assert_eq!(guessed.expected_tokens(2), 1.0 + 0.25 + 0.125);
    }

    #[test]
    fn drafting_turns_off_where_a_wider_block_costs_more_than_it_brings() {
        // A block of 2 costs 1.6x a plain step: a row kept half the time gains 1.5x, not enough.
        let costly = CostTable::from_times(vec![1], vec![vec![1.0, 1.6, 1.8]]);
        assert_eq!(DraftLengthPolicy::new(costly).width(&[row(2, 0, 0)]), 1);
        // Nearly free verify blocks and a row that is almost always right: draft all.
        let cheap = CostTable::from_times(vec![1], vec![vec![1.0, 1.05, 1.1]]);
        assert_eq!(
            DraftLengthPolicy::new(cheap.clone()).width(&[row(2, 98, 100)]),
            3
        );
        // `--draft-policy all`: every proposal in full, whatever it costs.
        assert_eq!(
            DraftLengthPolicy::all().width(&[row(2, 0, 0), row(5, 0, 9)]),
            6
        );
        // Nothing proposed: nothing to verify.
        assert_eq!(
            DraftLengthPolicy::new(cheap.clone()).width(&[row(0, 98, 100)]),
            1
        );
        // Steps taken replace the start-up estimate: wide blocks turned out dear.
        let mut policy = DraftLengthPolicy::new(cheap);
        for width in 2..=3 {
            let seconds = 4.0;
            policy.observe(&StepCost {
                rows: 1,
                width,
                seconds,
            });
        }
        assert_eq!(policy.width(&[row(2, 98, 100)]), 1);
        policy.observe(&StepCost {
            rows: 1,
            width: 2,
            seconds: 0.5,
        });
        assert!((policy.cost(1, 2) - (4.0 + 0.2 * (0.5 - 4.0))).abs() < 1e-12);
    }
}
