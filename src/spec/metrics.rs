//! Acceptance metrics with vLLM's definitions: drafts = verify rounds that proposed at least
//! one token, acceptance rate = accepted / drafted, mean acceptance length = 1 + accepted /
//! drafts (the bonus/correction token included), per-position acceptance = accepted at
//! position i / drafts.

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
        })
    }
}
