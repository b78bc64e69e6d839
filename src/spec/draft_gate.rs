//! Whether a single stream drafts its next round: the one-stream form of the batched steps'
//! cost policy ([`super::policy`]). A round with drafts costs the drafter's time and a wider
//! verify forward; it pays only while it hands out more tokens per second than a plain step.
//! Where it does not (a 4-bit model whose verify blocks cost nearly a step per token, a drafter
//! that is seldom right on this text), speculation would make decoding slower than decoding
//! without it, so the stream decodes plainly instead.
//!
//! The gate keeps the rate of each kind of round (tokens handed out over seconds spent, from
//! the round's start to the drafter's commit): for drafting rounds from running totals in which
//! older rounds weigh less, for plain rounds the median of the latest few. It drafts while
//! drafting is ahead. A drafting round hands out anywhere from one token to a whole block, so
//! its rate is uncertain for many rounds: drafting counts as ahead while its rate with the mean
//! tokens a round [`HOPE`] standard errors higher is, and turns off only once it is behind
//! beyond that (compared mean for mean, a drafter that pays by a fifth was turned off by runs
//! of unlucky rounds for a tenth of its rounds). Both rates drift (contexts grow; a drafter is
//! right more often on some text than on other), so the kind not in use is tried again every
//! so often. Which rounds draft never changes what is emitted: the target decides every token.

use super::policy::DraftPolicy;
use std::collections::VecDeque;

/// Drafting rounds measured before the first plain round is tried.
const FIRST_DRAFTING_ROUNDS: usize = 16;

/// While drafting is ahead, one round in this many is plain, to keep the plain rate current.
const TRY_PLAIN_EVERY: usize = 64;

/// While plain rounds are ahead, one round in this many drafts, to keep the drafting rate
/// current (a drafter that starts being right is noticed within a few of these).
const TRY_DRAFTING_EVERY: usize = 8;

/// How much of the totals each new drafting round keeps: about the last 64 rounds count.
const DRAFTING_MEMORY: f64 = 1.0 - 1.0 / 64.0;

/// Plain rounds measured in a row once drafting has been measured.
const FIRST_PLAIN_ROUNDS: usize = 3;

/// Plain rounds whose median rate is the plain rate: a plain round hands out one token, and
/// only its seconds vary, by a stray slow round now and then (another process, a first use of
/// something), which one of them must not decide alone.
const PLAIN_ROUNDS_KEPT: usize = 5;

/// Drafting rounds left out of the totals at the start: the first verify forwards of a
/// stream do one-time work (the host step checks a block size against MLX at its first use)
/// that would otherwise weigh on drafting for a long time.
const DRAFTING_ROUNDS_UNCOUNTED: usize = 2;

/// A later drafting round counts at most this many times the median seconds of the latest
/// [`RECENT_DRAFTING_ROUNDS`] drafting rounds (a block size's first use, a stray slow round).
const STRAY_ROUND: f64 = 4.0;

/// Drafting rounds whose median seconds bound a stray one.
const RECENT_DRAFTING_ROUNDS: usize = 8;

/// Standard errors of a drafting round's mean tokens by which drafting is given the benefit of
/// the doubt.
const HOPE: f64 = 1.5;

/// The latest few values of something, oldest first.
#[derive(Debug, Clone)]
struct Recent {
    values: VecDeque<f64>,
    kept: usize,
}

impl Recent {
    fn new(kept: usize) -> Self {
        Self {
            values: VecDeque::with_capacity(kept),
            kept,
        }
    }

    fn push(&mut self, value: f64) {
        if self.values.len() == self.kept {
            self.values.pop_front();
        }
        self.values.push_back(value);
    }

    fn len(&self) -> usize {
        self.values.len()
    }

    fn median(&self) -> f64 {
        let mut sorted: Vec<f64> = self.values.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
    }
}

/// Totals of the drafting rounds, older rounds weighing less.
#[derive(Debug, Clone)]
struct Tally {
    /// The rounds' weight.
    rounds: f64,
    tokens: f64,
    squared_tokens: f64,
    seconds: f64,
    /// Rounds seen, unweighted.
    seen: usize,
    /// The latest rounds' seconds, as measured.
    recent_seconds: Recent,
}

impl Tally {
    fn new() -> Self {
        Self {
            rounds: 0.0,
            tokens: 0.0,
            squared_tokens: 0.0,
            seconds: 0.0,
            seen: 0,
            recent_seconds: Recent::new(RECENT_DRAFTING_ROUNDS),
        }
    }

    fn observe(&mut self, tokens: usize, seconds: f64) {
        let seconds = seconds.max(0.0);
        let counted = if self.recent_seconds.len() >= 3 {
            seconds.min(STRAY_ROUND * self.recent_seconds.median())
        } else {
            seconds
        };
        self.recent_seconds.push(seconds);
        self.seen += 1;
        if self.seen <= DRAFTING_ROUNDS_UNCOUNTED {
            return;
        }
        let t = tokens as f64;
        let keep = DRAFTING_MEMORY;
        self.rounds = self.rounds * keep + 1.0;
        self.tokens = self.tokens * keep + t;
        self.squared_tokens = self.squared_tokens * keep + t * t;
        self.seconds = self.seconds * keep + counted;
    }

    /// The rate with the mean tokens a round [`HOPE`] standard errors higher.
    fn hopeful_tokens_per_second(&self) -> f64 {
        if self.rounds == 0.0 {
            return f64::INFINITY;
        }
        let mean = self.tokens / self.rounds;
        let variance = (self.squared_tokens / self.rounds - mean * mean).max(0.0);
        let hopeful = mean + HOPE * (variance / self.rounds).sqrt();
        hopeful * self.rounds / self.seconds.max(f64::MIN_POSITIVE)
    }
}

/// Decides round by round whether a single stream drafts.
#[derive(Debug, Clone)]
pub struct DraftGate {
    /// `false`: every round drafts ([`DraftPolicy::All`]).
    by_cost: bool,
    drafting: Tally,
    /// The latest plain rounds' tokens per second.
    plain: Recent,
    /// Plain rounds seen.
    plain_seen: usize,
    /// Rounds of the kind ahead since the other kind was last tried.
    since_other: usize,
}

impl DraftGate {
    /// The gate of `policy`: [`DraftPolicy::Cost`] drafts while drafting pays,
    /// [`DraftPolicy::All`] drafts every round.
    pub fn new(policy: DraftPolicy) -> Self {
        Self {
            by_cost: policy == DraftPolicy::Cost,
            drafting: Tally::new(),
            plain: Recent::new(PLAIN_ROUNDS_KEPT),
            plain_seen: 0,
            since_other: 0,
        }
    }

    /// Whether the next round drafts.
    pub fn drafts(&mut self) -> bool {
        if !self.by_cost || self.drafting.seen < FIRST_DRAFTING_ROUNDS {
            return true;
        }
        if self.plain_seen < FIRST_PLAIN_ROUNDS {
            return false;
        }
        let ahead = self.drafting.hopeful_tokens_per_second() >= self.plain.median();
        let other_every = if ahead {
            TRY_PLAIN_EVERY
        } else {
            TRY_DRAFTING_EVERY
        };
        self.since_other += 1;
        if self.since_other >= other_every {
            self.since_other = 0;
            return !ahead;
        }
        ahead
    }

    /// Takes in a finished round: whether it drafted, the tokens it handed out and its
    /// seconds from start to commit.
    pub fn observe(&mut self, drafted: bool, tokens: usize, seconds: f64) {
        if drafted {
            self.drafting.observe(tokens, seconds);
            return;
        }
        self.plain
            .push(tokens as f64 / seconds.max(f64::MIN_POSITIVE));
        self.plain_seen += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `rounds` rounds where a drafting round hands out `tokens` in `draft_seconds` and a
    /// plain round one token in a second; returns which rounds drafted.
    fn run(gate: &mut DraftGate, rounds: usize, tokens: usize, draft_seconds: f64) -> Vec<bool> {
        (0..rounds)
            .map(|_| {
                let drafts = gate.drafts();
                if drafts {
                    gate.observe(true, tokens, draft_seconds);
                } else {
                    gate.observe(false, 1, 1.0);
                }
                drafts
            })
            .collect()
    }

    #[test]
    fn drafting_that_pays_keeps_drafting_and_rechecks_plain_steps_now_and_then() {
        let mut gate = DraftGate::new(DraftPolicy::Cost);
        // Two tokens for 1.3 s of drafting round against one token a second.
        let first = FIRST_DRAFTING_ROUNDS;
        let drafted = run(&mut gate, first + FIRST_PLAIN_ROUNDS + 64, 2, 1.3);
        assert!(drafted[..first].iter().all(|&d| d));
        let measuring = first + FIRST_PLAIN_ROUNDS;
        assert!(
            drafted[first..measuring].iter().all(|&d| !d),
            "the first plain rounds measure plain decoding"
        );
        let plain = drafted[measuring..].iter().filter(|&&d| !d).count();
        assert_eq!(plain, 64 / TRY_PLAIN_EVERY);
    }

    #[test]
    fn drafting_that_costs_more_than_it_brings_turns_off_but_is_retried() {
        let mut gate = DraftGate::new(DraftPolicy::Cost);
        // 1.3 tokens a round would need the round to cost under 1.3 s; it costs 2.
        let first = FIRST_DRAFTING_ROUNDS;
        let measuring = first + FIRST_PLAIN_ROUNDS;
        let drafted = run(&mut gate, measuring + 64, 1, 2.0);
        let later = &drafted[measuring..];
        assert_eq!(
            later.iter().filter(|&&d| d).count(),
            64 / TRY_DRAFTING_EVERY
        );
        // Once the drafter starts paying, the retries notice and drafting resumes.
        let resumed = run(&mut gate, 5 * TRY_DRAFTING_EVERY, 4, 1.2);
        assert!(
            resumed[4 * TRY_DRAFTING_EVERY..].iter().all(|&d| d),
            "{resumed:?}"
        );
    }

    /// Share of `rounds` rounds that drafted, over `starts` gates, where a drafting round hands
    /// out 5 tokens one time in five and 1 otherwise (a mean of 1.8, as spread as a real
    /// drafter's) in `draft_seconds`, against plain rounds of one token a second.
    fn drafting_share(starts: u64, rounds: usize, draft_seconds: f64) -> f64 {
        let mut drafted = 0;
        for seed in 0..starts {
            let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut gate = DraftGate::new(DraftPolicy::Cost);
            for _ in 0..rounds {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                if gate.drafts() {
                    drafted += 1;
                    let tokens = if state % 5 == 0 { 5 } else { 1 };
                    gate.observe(true, tokens, draft_seconds);
                } else {
                    gate.observe(false, 1, 1.0);
                }
            }
        }
        drafted as f64 / (starts as usize * rounds) as f64
    }

    #[test]
    fn spread_out_rounds_neither_turn_off_a_drafter_that_pays_nor_keep_one_that_does_not() {
        // 1.8 tokens for 1.5 s: drafting is 1.2x plain decoding.
        let paying = drafting_share(64, 256, 1.5);
        assert!(paying > 0.93, "{paying}");
        // 1.8 tokens for 2.6 s: 0.7x.
        let costly = drafting_share(64, 256, 2.6);
        assert!(costly < 0.25, "{costly}");
    }

    #[test]
    fn one_stray_slow_plain_round_does_not_keep_a_costly_drafter_on() {
        let mut gate = DraftGate::new(DraftPolicy::Cost);
        for _ in 0..FIRST_DRAFTING_ROUNDS {
            assert!(gate.drafts());
            gate.observe(true, 1, 2.0);
        }
        assert!(!gate.drafts());
        gate.observe(false, 1, 30.0);
        let rest = run(&mut gate, 64, 1, 2.0);
        assert!(
            rest.iter().filter(|&&d| d).count() <= 64 / TRY_DRAFTING_EVERY,
            "{rest:?}"
        );
    }

    #[test]
    fn a_slow_first_use_does_not_turn_off_a_drafter_that_pays() {
        let mut gate = DraftGate::new(DraftPolicy::Cost);
        // The first round of each of two block sizes does one-time work: 50 s, then 80 s at
        // the tenth; every round hands out two tokens in 1.3 s otherwise.
        for round in 0..FIRST_DRAFTING_ROUNDS {
            assert!(gate.drafts());
            let seconds = match round {
                0 => 50.0,
                9 => 80.0,
                _ => 1.3,
            };
            gate.observe(true, 2, seconds);
        }
        let rest = run(&mut gate, FIRST_PLAIN_ROUNDS + 64, 2, 1.3);
        let plain = rest[FIRST_PLAIN_ROUNDS..].iter().filter(|&&d| !d).count();
        assert_eq!(plain, 64 / TRY_PLAIN_EVERY, "{rest:?}");
    }

    #[test]
    fn the_all_policy_drafts_every_round() {
        let mut gate = DraftGate::new(DraftPolicy::All);
        assert!(run(&mut gate, 100, 1, 10.0).into_iter().all(|d| d));
    }
}
