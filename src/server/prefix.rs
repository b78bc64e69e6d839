//! Prompt-prefix KV reuse between consecutive requests on the engine thread.
//!
//! Reuse must not change a single bit of the output, and it would if reused positions had
//! been computed in differently shaped forwards: on MLX's CPU backend the same position
//! prefilled in a chunk of another length gives logits that differ in the last bits
//! (measured ~4e-5 on SmolLM2). So a prefix is reused only up to a boundary at which a
//! fresh run of the new prompt would also have cut its prefill: a multiple of
//! `prefill_step_size`, or the whole prompt but its last token when the previous prompt had
//! the same length and the same tokens there (a repeated prompt, the common case). The
//! positions before such a boundary were computed by exactly the forwards a fresh run makes.
//! The last prompt token is always recomputed (it produces the first logits).

use crate::engine::generate::Carry;

/// The caches the previous request left and the prompt they were filled for.
pub struct PrefixCache {
    carry: Carry,
    /// Prompt of the request that left `carry.caches` (empty: nothing reusable).
    prompt: Vec<u32>,
    /// The server's prefill chunk size (fixes where a fresh run cuts its prefill).
    step: usize,
    /// `false` with `--no-prefix-reuse`, or when the drafter reads target hidden states
    /// during prefill (DSpark): then every request starts fresh.
    enabled: bool,
}

impl PrefixCache {
    /// An empty cache for a server prefilling `step` tokens per forward.
    pub fn new(step: usize, enabled: bool) -> Self {
        Self {
            carry: Carry::default(),
            prompt: Vec::new(),
            step: step.max(1),
            enabled,
        }
    }

    /// Readies the carry for `prompt`: keeps and trims the caches when a bit-exact prefix
    /// exists, otherwise drops them. `carry.reused` says how many prompt tokens are reused.
    pub fn prepare(&mut self, prompt: &[u32]) -> &mut Carry {
        let mut reuse = if self.enabled {
            exact_prefix(&self.prompt, prompt, self.step)
        } else {
            0
        };
        let caches = &mut self.carry.caches;
        // Only plain trimmable caches: a wrapped window, a recurrent state or a quantized
        // cache (quantized at a point a fresh run may not reach) means a fresh prefill.
        let trimmable = caches.iter_mut().all(|c| {
            c.is_trimmable() && c.as_quantized_mut().is_none() && c.offset() as usize >= reuse
        });
        if reuse > 0 && trimmable && !caches.is_empty() {
            for c in caches.iter_mut() {
                let extra = c.offset() - reuse as i32;
                if c.trim(extra) != extra {
                    reuse = 0;
                }
            }
        } else {
            reuse = 0;
        }
        if reuse == 0 {
            caches.clear();
        }
        self.carry.reused = reuse;
        self.prompt.clear();
        &mut self.carry
    }

    /// Records the outcome of the request started by [`Self::prepare`]: after a clean end
    /// (finished or cancelled by the client) the caches hold `prompt`'s prefill and may be
    /// reused; after a failure they are dropped.
    pub fn finish(&mut self, prompt: &[u32], clean: bool) {
        if clean && self.enabled {
            self.prompt = prompt.to_vec();
        } else {
            self.carry.caches.clear();
            self.prompt.clear();
        }
    }
}

/// The longest prefix of `next` whose KV, taken from a run on `prev`, is bit-identical to a
/// fresh run's (see the module doc); always less than `next.len()`.
pub fn exact_prefix(prev: &[u32], next: &[u32], step: usize) -> usize {
    if prev.is_empty() || next.len() < 2 {
        return 0;
    }
    let common = prev.iter().zip(next).take_while(|(a, b)| a == b).count();
    let last = next.len() - 1;
    if prev.len() == next.len() && common >= last {
        return last;
    }
    let bound = common.min(prev.len() - 1).min(last);
    bound / step.max(1) * step.max(1)
}

#[cfg(test)]
mod tests {
    use super::exact_prefix;

    #[test]
    fn reuses_only_where_a_fresh_run_cuts_its_prefill() {
        let a = [1, 2, 3, 4, 5, 6];
        // Same prompt, or same length with only the last token changed: all but the last.
        assert_eq!(exact_prefix(&a, &a, 2048), 5);
        assert_eq!(exact_prefix(&a, &[1, 2, 3, 4, 5, 9], 2048), 5);
        // Other lengths share only whole prefill chunks.
        assert_eq!(exact_prefix(&a, &[1, 2, 3, 4, 5, 6, 7], 2048), 0);
        assert_eq!(exact_prefix(&a, &[1, 2, 3, 4, 5, 6, 7], 2), 4);
        assert_eq!(exact_prefix(&a, &[1, 2, 3, 4, 5, 6, 7], 5), 5);
        assert_eq!(exact_prefix(&a, &[1, 2, 3], 2), 2);
        assert_eq!(exact_prefix(&a, &[1, 2, 7, 4, 5, 6], 2), 2);
        // Nothing before, nothing shared, or a one-token prompt: nothing.
        assert_eq!(exact_prefix(&[], &a, 2), 0);
        assert_eq!(exact_prefix(&a, &[9, 2, 3, 4, 5, 6], 1), 0);
        assert_eq!(exact_prefix(&a, &[1], 1), 0);
    }
}
