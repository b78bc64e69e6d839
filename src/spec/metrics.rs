//! Acceptance metrics with vLLM's definitions: drafts = verify rounds that proposed at least
//! one token, acceptance rate = accepted / drafted, mean acceptance length = 1 + accepted /
//! drafts (the bonus/correction token included), per-position acceptance = accepted at
//! position i / drafts. Each round's wall time is split into the drafter's share (drafting and
//! taking the committed tokens), the target's verify forward with acceptance, and the cache
//! rollback, so the cost of a round can be read next to a vanilla decode step.

use serde::Serialize;

/// Counters of one speculative generation.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SpecMetrics {
    /// Drafter name.
    pub drafter: String,
    /// Verify rounds with at least one drafted token.
    pub drafts: usize,
    /// Tokens proposed in all rounds.
    pub drafted_tokens: usize,
    /// Proposed tokens the target accepted.
    pub accepted_tokens: usize,
    /// Accepted count per draft position (index 0 = first drafted token).
    pub accepted_per_position: Vec<usize>,
    /// Target forwards spent on verification.
    pub target_forwards: usize,
    /// Rounds whose rollback needed snapshot + replay instead of a trim.
    pub replays: usize,
    /// Seconds the drafter spent proposing and taking in committed tokens, all rounds.
    pub draft_seconds: f64,
    /// Seconds of the target's verify forwards and acceptance, all rounds.
    pub verify_seconds: f64,
    /// Seconds of cache rollback to the kept positions, all rounds.
    pub rollback_seconds: f64,
}

impl SpecMetrics {
    /// Records one round: `proposed` tokens, of which the first `accepted` were kept.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        self.target_forwards += 1;
        if proposed == 0 {
            return;
        }
        self.drafts += 1;
        self.drafted_tokens += proposed;
        self.accepted_tokens += accepted;
        if self.accepted_per_position.len() < proposed {
            self.accepted_per_position.resize(proposed, 0);
        }
        for slot in &mut self.accepted_per_position[..accepted] {
            *slot += 1;
        }
    }

    /// accepted / drafted.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted_tokens as f64 / self.drafted_tokens.max(1) as f64
    }

    /// 1 + accepted / drafts.
    pub fn mean_acceptance_length(&self) -> f64 {
        1.0 + self.accepted_tokens as f64 / self.drafts.max(1) as f64
    }

    /// Acceptance rate at each draft position (accepted there / drafts).
    pub fn per_position_rate(&self) -> Vec<f64> {
        self.accepted_per_position
            .iter()
            .map(|&a| a as f64 / self.drafts.max(1) as f64)
            .collect()
    }

    /// Milliseconds per round of `seconds` (one of the three parts of a round).
    pub fn ms_per_round(&self, seconds: f64) -> f64 {
        seconds * 1e3 / self.target_forwards.max(1) as f64
    }

    /// Adds another generation's counters and times to these.
    pub fn add(&mut self, m: &SpecMetrics) {
        self.drafter.clone_from(&m.drafter);
        self.drafts += m.drafts;
        self.drafted_tokens += m.drafted_tokens;
        self.accepted_tokens += m.accepted_tokens;
        self.target_forwards += m.target_forwards;
        self.replays += m.replays;
        self.draft_seconds += m.draft_seconds;
        self.verify_seconds += m.verify_seconds;
        self.rollback_seconds += m.rollback_seconds;
        if self.accepted_per_position.len() < m.accepted_per_position.len() {
            self.accepted_per_position
                .resize(m.accepted_per_position.len(), 0);
        }
        for (t, a) in self
            .accepted_per_position
            .iter_mut()
            .zip(&m.accepted_per_position)
        {
            *t += a;
        }
    }

    /// Lines printed after mlx-lm's footer in `generate --verbose`.
    pub fn footer(&self) -> String {
        let per: Vec<String> = self
            .per_position_rate()
            .iter()
            .map(|r| format!("{r:.3}"))
            .collect();
        format!(
            "Speculative ({}): {} drafts, {} drafted, {} accepted, acceptance rate {:.3}, mean acceptance length {:.3}\nPer-position acceptance: [{}]",
            self.drafter,
            self.drafts,
            self.drafted_tokens,
            self.accepted_tokens,
            self.acceptance_rate(),
            self.mean_acceptance_length(),
            per.join(", ")
        )
    }

    /// The JSON object for `--json`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "drafter": self.drafter,
            "drafts": self.drafts,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate(),
            "mean_acceptance_length": self.mean_acceptance_length(),
            "per_position_acceptance": self.per_position_rate(),
            "target_forwards": self.target_forwards,
            "replays": self.replays,
            "draft_ms_per_round": self.ms_per_round(self.draft_seconds),
            "verify_ms_per_round": self.ms_per_round(self.verify_seconds),
            "rollback_ms_per_round": self.ms_per_round(self.rollback_seconds),
        })
    }
}
