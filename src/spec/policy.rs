//! How many drafted tokens a batched step verifies: the single-machine form of DeepSpec's
//! hardware-aware scheduler. Every row of a batched verify forward is as wide as the widest
//! block, so the step picks one width W for the batch: each row then offers
//! `min(its proposal, W - 1)` drafts, and W maximises the expected tokens the step hands out
//! per second, `Σ_rows E[tokens] / cost(B, W)`, with a row's expected tokens
//! `1 + α + α² + … + α^k` (α: that row's acceptance so far, starting from the acceptance
//! pooled over every row before it) and `cost(B, W)` the time of one forward of that shape
//! measured on this machine at start-up, replaced by a running average of the wall time of the
//! steps of that shape actually taken (real contexts are longer than the start-up probe's, and
//! a verify step also gives up the overlap of a plain step's forward with handing out the
//! previous tokens; steps that also prefilled are left out). A row whose next token is still
//! unread offers a guess of it first: that guess counts as one more draft to be kept.
//! W = 1 is plain batched decoding, so drafting turns itself off wherever batching alone hands
//! out more tokens per second; one step in [`EXPLORE_EVERY`] with drafts on offer still
//! verifies two-token blocks where they are estimated close to paying ([`EXPLORE_WITHIN`]), so
//! the acceptance keeps being measured.

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

/// One row as the policy sees it: how many tokens its drafter proposed, how sure the drafter
/// is of each, and how often its drafts have been kept.
#[derive(Debug, Clone, Default)]
pub struct RowOutlook {
    /// Drafted tokens on offer (after the guess, if there is one).
    pub proposed: usize,
    /// Whether they follow a guess of the row's unread next token.
    pub guessed: bool,
    /// Drafts kept so far.
    pub accepted: usize,
    /// Drafts verified so far.
    pub drafted: usize,
    /// The drafter's own chance that each proposed token (the guess first, if there is one)
    /// is kept once the ones before it are: DSpark's calibrated confidences. Positions past
    /// its end take the row's acceptance so far.
    pub keep: Vec<f64>,
}

impl RowOutlook {
    /// A row with nothing to offer (no drafter, or no room).
    pub fn plain() -> Self {
        Self::default()
    }

    /// The chance a draft is kept: kept / verified with two drafts kept at rate `prior`
    /// assumed beforehand, so a new row starts at `prior`.
    pub fn acceptance(&self, prior: f64) -> f64 {
        kept_rate(self.accepted, self.drafted, prior)
    }

    /// Tokens the row hands out from a block with `k` of its drafts (each kept only if every
    /// draft before it and the guess, if any, were right): each position kept with the
    /// drafter's own chance ([`Self::keep`]) where it gives one, else with the row's
    /// acceptance starting at `prior`.
    pub fn expected_tokens(&self, k: usize, prior: f64) -> f64 {
        let a = self.acceptance(prior);
        let k = k.min(self.proposed);
        let chance = |j: usize| self.keep.get(j).copied().unwrap_or(a);
        let guess = usize::from(self.guessed);
        let mut reach: f64 = (0..guess).map(chance).product();
        let mut sum = 1.0;
        for j in guess..guess + k {
            reach *= chance(j);
            sum += reach;
        }
        sum
    }
}

/// How drafting is sized (`--draft-policy`): a batched step's verify blocks, and whether a
/// single stream drafts its next round ([`super::draft_gate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DraftPolicy {
    /// By expected tokens per second: a batch from forward costs measured on this machine, a
    /// single stream from the rates its drafting and plain rounds achieve.
    #[default]
    Cost,
    /// Every proposal in full, every round.
    All,
}

impl DraftPolicy {
    /// A single stream's policy: the one asked for, else `cost`, or `all` where its rounds are
    /// traced (a trace is for studying the drafter round by round, and under `cost` which
    /// rounds draft depends on timing).
    pub fn for_stream(asked: Option<Self>, traced: bool) -> Self {
        asked.unwrap_or(if traced { Self::All } else { Self::Cost })
    }
}

/// A rate of drafts kept, `kept` of `tried`, with two drafts kept at rate `prior` assumed
/// beforehand: `prior` until anything is seen, the observed rate in the long run.
fn kept_rate(kept: usize, tried: usize, prior: f64) -> f64 {
    (kept as f64 + 2.0 * prior) / (tried as f64 + 2.0)
}

/// Weight of the newest step in a shape's running average of costs.
const NEWEST_STEP_WEIGHT: f64 = 0.2;

/// Per proposal group, per draft position: how often a draft that was reached (every draft
/// before it kept) was kept.
#[derive(Debug, Clone, Default)]
struct GroupAcceptance {
    /// `(kept, reached)` by group, then by draft position.
    counts: HashMap<usize, Vec<(usize, usize)>>,
}

impl GroupAcceptance {
    /// Groups beyond this share its counts (the n-gram drafter's groups stay below it).
    const MAX_GROUP: usize = 16;

    fn observe(&mut self, group: usize, proposed: usize, accepted: usize) {
        let cells = self.counts.entry(group.min(Self::MAX_GROUP)).or_default();
        let reached = proposed.min(accepted + 1);
        if cells.len() < reached {
            cells.resize(reached, (0, 0));
        }
        for (j, cell) in cells.iter_mut().take(reached).enumerate() {
            cell.0 += usize::from(j < accepted);
            cell.1 += 1;
        }
    }

    /// Each position's kept / reached, with two drafts kept at rate `prior` assumed first.
    fn chances(&self, group: usize, n: usize, prior: f64) -> Vec<f64> {
        let cells = self.counts.get(&group.min(Self::MAX_GROUP));
        (0..n)
            .map(|j| {
                let (kept, reached) = cells.and_then(|c| c.get(j)).copied().unwrap_or((0, 0));
                kept_rate(kept, reached, prior)
            })
            .collect()
    }
}

/// Picks each step's block width from a [`CostTable`] and the steps taken since.
#[derive(Debug, Clone)]
pub struct DraftLengthPolicy {
    /// `None`: verify every proposal in full ([`DraftPolicy::All`]).
    table: Option<CostTable>,
    /// Running average of the seconds of steps taken, by rows and width.
    seen: HashMap<(usize, usize), f64>,
    /// Drafts kept and drafts verified over every row so far: a new row's acceptance starts
    /// from what the drafter achieves on this workload rather than from 1/2.
    pooled: (usize, usize),
    /// Acceptance by proposal group and draft position, for drafters that group their
    /// proposals instead of giving confidences (n-gram: by match length).
    groups: GroupAcceptance,
    /// Steps with drafts on offer that were decoded plainly since the last verify step.
    plain_since_verify: usize,
    /// An exploring width was given and its step may ask again (once its pending tokens are
    /// read): the answer stays 2.
    exploring: bool,
}

/// With drafts on offer, one step in this many verifies two-token blocks even where the
/// estimates say plain decoding is faster, so acceptance keeps being measured: estimates from a
/// few unlucky early drafts would otherwise turn drafting off for good. (A step whose rows'
/// next tokens are unread asks again once they are read, and is then no longer exploring: see
/// serving.md.)
const EXPLORE_EVERY: usize = 16;

/// An exploring step is taken only where two-token blocks are estimated to hand out at least
/// this share of plain decoding's tokens per second: one far below could hardly change the
/// decision, and every row of the batch pays for it (with eight rows on two cores, exploring
/// regardless cost the n-gram server about a tenth of its throughput).
const EXPLORE_WITHIN: f64 = 0.8;

impl DraftLengthPolicy {
    /// A policy over `table`.
    pub fn new(table: CostTable) -> Self {
        Self::with_table(Some(table))
    }

    fn with_table(table: Option<CostTable>) -> Self {
        Self {
            table,
            seen: HashMap::new(),
            pooled: (0, 0),
            groups: GroupAcceptance::default(),
            plain_since_verify: 0,
            exploring: false,
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
        Self::with_table(None)
    }

    /// Takes in what a step of some shape cost.
    pub fn observe(&mut self, step: &StepCost) {
        self.seen
            .entry((step.rows, step.width))
            .and_modify(|s| *s += NEWEST_STEP_WEIGHT * (step.seconds - *s))
            .or_insert(step.seconds);
    }

    /// Takes in one row's verify result: `accepted` of its `proposed` drafts kept.
    pub fn observe_acceptance(&mut self, proposed: usize, accepted: usize) {
        self.pooled.0 += accepted;
        self.pooled.1 += proposed;
    }

    /// Takes in a verify result of a proposal in group `group`
    /// ([`crate::spec::source::DraftSource::proposal_group`]).
    pub fn observe_group(&mut self, group: usize, proposed: usize, accepted: usize) {
        self.groups.observe(group, proposed, accepted);
    }

    /// The chance that each of the first `n` drafts of a proposal in group `group` is kept
    /// once the ones before it are, as learnt from that group's earlier proposals (from the
    /// pooled prior where it has seen few).
    pub fn group_chances(&self, group: usize, n: usize) -> Vec<f64> {
        self.groups.chances(group, n, self.prior())
    }

    /// A new row's acceptance: the pooled rate of every row so far, from 1/2 with one kept and
    /// one rejected draft assumed.
    pub fn prior(&self) -> f64 {
        kept_rate(self.pooled.0, self.pooled.1, 0.5)
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
    /// for these rows (2 every [`EXPLORE_EVERY`]-th step with drafts on offer that would
    /// otherwise be plain, where two-token blocks are estimated within [`EXPLORE_WITHIN`] of
    /// it).
    pub fn width(&mut self, rows: &[RowOutlook]) -> usize {
        let widest = rows.iter().map(|r| r.proposed + 1).max().unwrap_or(1);
        let Some(table) = &self.table else {
            return widest;
        };
        let prior = self.prior();
        let mut best = (1, 0.0);
        let mut two_blocks = 0.0;
        for w in 1..=widest.min(table.max_width()) {
            let tokens: f64 = rows.iter().map(|r| r.expected_tokens(w - 1, prior)).sum();
            let rate = tokens / self.cost(rows.len(), w).max(f64::MIN_POSITIVE);
            if w == 2 {
                two_blocks = rate;
            }
            if rate > best.1 {
                best = (w, rate);
            }
        }
        if best.0 > 1 || widest == 1 {
            self.plain_since_verify = 0;
            self.exploring = false;
            return best.0;
        }
        if std::mem::take(&mut self.exploring) {
            return 2;
        }
        self.plain_since_verify += 1;
        if self.plain_since_verify >= EXPLORE_EVERY && two_blocks >= EXPLORE_WITHIN * best.1 {
            self.plain_since_verify = 0;
            self.exploring = true;
            return 2;
        }
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(proposed: usize, accepted: usize, drafted: usize) -> RowOutlook {
        RowOutlook {
            proposed,
            accepted,
            drafted,
            ..RowOutlook::default()
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
        let r = row(3, 3, 4); // acceptance (3 + 2 × 1/2) / (4 + 2)
        let a = 4.0 / 6.0;
        assert!((r.expected_tokens(2, 0.5) - (1.0 + a + a * a)).abs() < 1e-12);
        assert_eq!(r.expected_tokens(0, 0.5), 1.0);
        assert_eq!(row(1, 0, 0).expected_tokens(5, 0.5), 1.5);
        assert_eq!(row(1, 0, 0).expected_tokens(5, 0.25), 1.25);
        let guessed = RowOutlook {
            guessed: true,
            ..row(2, 0, 0)
        };
        assert_eq!(guessed.expected_tokens(2, 0.5), 1.0 + 0.25 + 0.125);
    }

    #[test]
    fn a_drafters_own_confidences_replace_the_acceptance_where_given() {
        // Confidences 0.9 then 0.5, the third position at the acceptance 1/2.
        let sure = RowOutlook {
            keep: vec![0.9, 0.5],
            ..row(3, 0, 0)
        };
        let want = 1.0 + 0.9 + 0.45 + 0.225;
        assert!((sure.expected_tokens(3, 0.5) - want).abs() < 1e-12);
        // With a guess, its confidence comes first.
        let guessed = RowOutlook {
            guessed: true,
            keep: vec![0.8, 0.5],
            ..row(1, 0, 0)
        };
        assert!((guessed.expected_tokens(1, 0.5) - (1.0 + 0.4)).abs() < 1e-12);
    }

    #[test]
    fn grouped_proposals_learn_each_positions_acceptance() {
        let mut policy = DraftLengthPolicy::all();
        // Nothing seen: every position at the prior of 1/2.
        assert_eq!(policy.group_chances(3, 2), vec![0.5, 0.5]);
        // Group 3: four drafts kept in full, then one rejected at its second position.
        for _ in 0..4 {
            policy.observe_group(3, 4, 4);
        }
        policy.observe_group(3, 4, 1);
        // Group 1: always rejected at once (the later positions are never reached).
        for _ in 0..6 {
            policy.observe_group(1, 4, 0);
        }
        let prior = policy.prior();
        let sure = policy.group_chances(3, 5);
        let want = [
            (5.0 + 2.0 * prior) / 7.0,
            (4.0 + 2.0 * prior) / 7.0,
            (4.0 + 2.0 * prior) / 6.0,
            (4.0 + 2.0 * prior) / 6.0,
            prior,
        ];
        for (got, want) in sure.iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{sure:?}");
        }
        let unsure = policy.group_chances(1, 2);
        assert!((unsure[0] - 2.0 * prior / 8.0).abs() < 1e-12);
        assert_eq!(unsure[1], prior);
        // Long matches share one group.
        policy.observe_group(40, 1, 1);
        assert_eq!(policy.group_chances(9, 1), policy.group_chances(8, 1));
    }

    #[test]
    fn new_rows_start_from_the_acceptance_pooled_over_every_row() {
        // A block of 2 costs 1.4x a plain step: a new row pays at the neutral prior of 1/2...
        let table = CostTable::from_times(vec![1], vec![vec![1.0, 1.4]]);
        let mut policy = DraftLengthPolicy::new(table);
        assert_eq!(policy.prior(), 0.5);
        assert_eq!(policy.width(&[row(1, 0, 0)]), 2);
        // ...but not once earlier rows had a fifth of their drafts kept...
        for _ in 0..10 {
            policy.observe_acceptance(5, 1);
        }
        assert!((policy.prior() - 11.0 / 52.0).abs() < 1e-12);
        let widths: Vec<usize> = (0..2 * EXPLORE_EVERY + 1)
            .map(|_| policy.width(&[row(1, 0, 0)]))
            .collect();
        // ...except one step in EXPLORE_EVERY, which keeps measuring the acceptance (and a
        // step that asks again once its pending tokens are read gets the same answer).
        let mut want = vec![1; 2 * EXPLORE_EVERY + 1];
        want[EXPLORE_EVERY - 1] = 2;
        want[EXPLORE_EVERY] = 2;
        want[2 * EXPLORE_EVERY] = 2;
        assert_eq!(widths, want);
        // A row's own record still outweighs the pool once it has one.
        assert_eq!(policy.width(&[row(1, 18, 20)]), 2);
    }

    #[test]
    fn no_exploring_where_drafting_is_far_from_paying() {
        // A block of 2 costs 2x a plain step and a fifth of the drafts are kept: two-token
        // blocks would hand out 0.6x the tokens per second, so no step explores them...
        let table = CostTable::from_times(vec![1], vec![vec![1.0, 2.0]]);
        let mut policy = DraftLengthPolicy::new(table);
        for _ in 0..10 {
            policy.observe_acceptance(5, 1);
        }
        assert!((0..3 * EXPLORE_EVERY).all(|_| policy.width(&[row(1, 0, 0)]) == 1));
        // ...until a row's record (two in three kept: 0.83x) brings them within reach.
        let widths: Vec<usize> = (0..EXPLORE_EVERY)
            .map(|_| policy.width(&[row(1, 14, 20)]))
            .collect();
        assert!(widths.contains(&2), "{widths:?}");
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
        // Nothing proposed: nothing to verify, and nothing to explore.
        let mut idle = DraftLengthPolicy::new(cheap.clone());
        assert!((0..2 * EXPLORE_EVERY).all(|_| idle.width(&[row(0, 98, 100)]) == 1));
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
