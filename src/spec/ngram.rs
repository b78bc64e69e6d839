//! Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n-gram
//! (longest first) and propose what followed it. No model; the only state is the length of
//! the latest match (a longer match is kept more often, which a batch's policy learns).

use super::source::{Draft, DraftSource, TargetView};
use crate::engine::error::Result;

/// The `ngram` drafter.
#[derive(Debug, Clone)]
pub struct NgramSource {
    max: usize,
    min: usize,
    /// The n-gram size the latest proposal continued (`None`: it found no match).
    last_match: Option<usize>,
}

impl NgramSource {
    /// Matches n-grams of `min..=max` tokens.
    pub fn new(min: usize, max: usize) -> Self {
        Self {
            max,
            min,
            last_match: None,
        }
    }

    /// The continuation of the latest earlier match of the last n-gram (at most `n` tokens),
    /// with the size of the n-gram it matched.
    fn lookup(&self, seq: &[u32], n: usize) -> Option<(Vec<u32>, usize)> {
        for size in (self.min..=self.max).rev() {
            if seq.len() <= size {
                continue;
            }
            let pattern = &seq[seq.len() - size..];
            // Earlier occurrences only (the match must end before the pattern itself starts
            // or at least leave one token to continue with), latest first.
            for start in (0..seq.len() - size).rev() {
                if &seq[start..start + size] == pattern {
                    let from = start + size;
                    let to = (from + n).min(seq.len());
                    if from < to {
                        return Some((seq[from..to].to_vec(), size));
                    }
                }
            }
        }
        None
    }
}

impl DraftSource for NgramSource {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn fork(&self) -> Result<Option<Box<dyn DraftSource>>> {
        Ok(Some(Box::new(Self::new(self.min, self.max))))
    }

    fn draft(&mut self, _target: TargetView<'_>, sequence: &[u32], n: usize) -> Result<Draft> {
        let found = self.lookup(sequence, n);
        self.last_match = found.as_ref().map(|(_, size)| *size);
        Ok(Draft {
            tokens: found.map_or_else(Vec::new, |(tokens, _)| tokens),
            probs: None,
        })
    }

    fn proposal_group(&self) -> Option<usize> {
        self.last_match
    }

    fn commit(&mut self, _target: TargetView<'_>, _committed: usize) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_the_latest_longest_match() {
        let s = NgramSource::new(1, 3);
        let tokens = |seq: &[u32], n| s.lookup(seq, n).map(|(t, _)| t).unwrap_or_default();
        // "1 2 3 9 ... 1 2 3" → continue after the earlier "1 2 3" with "9 8".
        assert_eq!(tokens(&[1, 2, 3, 9, 8, 7, 1, 2, 3], 2), vec![9, 8]);
        assert_eq!(
            s.lookup(&[1, 2, 3, 9, 8, 7, 1, 2, 3], 2)
                .map(|(_, size)| size),
            Some(3)
        );
        // No earlier occurrence of any suffix → nothing.
        assert_eq!(tokens(&[1, 2, 3, 4], 3), Vec::<u32>::new());
        // Latest occurrence wins.
        assert_eq!(tokens(&[5, 1, 5, 2, 5], 1), vec![2]);
    }
}
