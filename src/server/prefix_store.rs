//! Prompt prefixes kept for the continuous-batching path: an LRU of keys and values, bounded in
//! bytes, that many conversations share (mlx-lm's server keeps an `LRUPromptCache` for the same
//! purpose).
//!
//! The reuse rule keeps answers exact: a prompt's keys and values are kept only when the batch
//! prefilled it alone (a prefill forward of several rows rounds each row differently from a
//! forward of one), and a new prompt reuses a kept one only up to [`exact_prefix`]'s boundary,
//! a point where a fresh prefill of the new prompt would also cut. A request that reuses a
//! prefix and is itself prefilled alone therefore gets the bits of a fresh single-stream run.

use super::prefix::exact_prefix;
use crate::engine::batch::PrefixKv;
use std::collections::VecDeque;

/// One kept prompt: its tokens and the keys and values of all but its last.
struct Entry {
    prompt: Vec<u32>,
    kv: PrefixKv,
    bytes: usize,
}

/// The LRU (see the module docs); the front is the least recently used.
pub struct PrefixStore {
    entries: VecDeque<Entry>,
    bytes: usize,
    budget: usize,
    /// The server's prefill chunk size (fixes where a fresh run cuts its prefill).
    step: usize,
}

impl PrefixStore {
    /// A store of at most `budget` bytes (0: keeps nothing) for a server prefilling `step`
    /// tokens per forward.
    pub fn new(budget: usize, step: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            bytes: 0,
            budget,
            step: step.max(1),
        }
    }

    /// Whether it keeps anything at all.
    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The longest exactly reusable prefix of `prompt` among the kept prompts, cut to its
    /// length (that entry becomes the most recently used).
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<PrefixKv> {
        let (best, reuse) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, exact_prefix(&e.prompt, prompt, self.step).min(e.kv.len)))
            .max_by_key(|&(i, n)| (n, i))?;
        if reuse == 0 {
            return None;
        }
        let entry = self.entries.remove(best)?;
        let kv = entry.kv.truncated(reuse);
        self.entries.push_back(entry);
        Some(kv)
    }

    /// Keeps `kv` (all but the last token of `prompt`), replacing an entry for the same prompt
    /// and dropping the least recently used ones past the budget.
    pub fn insert(&mut self, prompt: &[u32], kv: PrefixKv) {
        if let Some(i) = self.entries.iter().position(|e| e.prompt == prompt) {
            if let Some(old) = self.entries.remove(i) {
                self.bytes -= old.bytes;
            }
        }
        let bytes = kv.nbytes();
        if bytes > self.budget {
            return;
        }
        self.bytes += bytes;
        self.entries.push_back(Entry {
            prompt: prompt.to_vec(),
            kv,
            bytes,
        });
        while self.bytes > self.budget {
            match self.entries.pop_front() {
                Some(old) => self.bytes -= old.bytes,
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PrefixStore;
    use crate::engine::batch::PrefixKv;
    use mlx_rs::Array;

    /// A prefix of `len` positions of one layer (keys and values `[1, 1, len, 2]` f32: 16 bytes
    /// a position).
    fn kv(len: usize) -> PrefixKv {
        let a = Array::from_slice(&vec![0f32; len * 2], &[1, 1, len as i32, 2]);
        PrefixKv {
            len,
            layers: vec![(a.clone(), a)],
        }
    }

    #[test]
    fn reuses_the_longest_exact_prefix_and_drops_the_least_recently_used() {
        let mut store = PrefixStore::new(16 * 20, 4);
        let a: Vec<u32> = (0..10).collect();
        let b: Vec<u32> = (100..110).collect();
        store.insert(&a, kv(9));
        store.insert(&b, kv(9));
        // A longer prompt continuing `a`: whole chunks of 4 inside the 10 shared tokens.
        let next: Vec<u32> = (0..14).collect();
        assert_eq!(store.lookup(&next).map(|p| p.len), Some(8));
        // The same prompt again: all but its last token.
        assert_eq!(store.lookup(&b).map(|p| p.len), Some(9));
        assert_eq!(store.lookup(&[7, 8, 9]).map(|p| p.len), None);
        // `a` was used before `b`: a third entry past the budget drops `a`.
        store.insert(&(200..210).collect::<Vec<_>>(), kv(9));
        assert_eq!(store.bytes(), 16 * 18);
        assert_eq!(store.lookup(&next).map(|p| p.len), None);
        assert_eq!(store.lookup(&b).map(|p| p.len), Some(9));
        // Nothing larger than the budget is kept; a zero budget keeps nothing.
        store.insert(&[1, 2], kv(21));
        assert_eq!(store.bytes(), 16 * 18);
        let mut off = PrefixStore::new(0, 4);
        off.insert(&a, kv(9));
        assert!(!off.enabled());
        assert_eq!(off.lookup(&a).map(|p| p.len), None);
    }
}
