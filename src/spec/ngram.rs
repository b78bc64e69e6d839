//! Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n-gram
//! (longest first) and propose what followed it. With a [`LookupTable`] of the target's own
//! replies beside it, the table's continuation is proposed instead where the table holds a
//! longer n-gram ending the sequence than the prompt and output do (or they hold none). No
//! model; the only state is what the latest proposal matched (a longer match is kept more
//! often, which a batch's policy learns).

use super::lookup_table::LookupTable;
use super::source::{Draft, DraftSource, TargetView};
use crate::engine::error::Result;
use std::sync::Arc;

/// Proposal groups of the sequence's own matches are their n-gram sizes, up to this; the
/// table's are this plus the size of the n-gram it continued.
const TABLE_GROUPS: usize = 8;

/// The `ngram` drafter.
#[derive(Debug, Clone)]
pub struct NgramSource {
    max: usize,
    min: usize,
    /// The latest proposal's group (`None`: it found no match): the size of the n-gram it
    /// continued, plus [`TABLE_GROUPS`] for the table's.
    last_match: Option<usize>,
    /// The target's replies' n-grams, consulted beside the sequence's own.
    table: Option<Arc<LookupTable>>,
}

impl NgramSource {
    /// Matches n-grams of `min..=max` tokens.
    pub fn new(min: usize, max: usize) -> Self {
        Self {
            max,
            min,
            last_match: None,
            table: None,
        }
    }

    /// The same drafter with `table` beside the sequence's own n-grams.
    pub fn with_table(self, table: Option<Arc<LookupTable>>) -> Self {
        Self { table, ..self }
    }

    /// Up to `n` tokens following `seq`: the table's continuation where its n-gram is longer
    /// than the sequence's own match, else the sequence's; with the proposal's group.
    fn propose(&self, seq: &[u32], n: usize) -> Option<(Vec<u32>, usize)> {
        let own = self.lookup(seq, n);
        let own_size = own.as_ref().map_or(0, |(_, size)| *size);
        if let Some(table) = &self.table {
            let (tokens, order) = table.continue_from(seq, n);
            if !tokens.is_empty() && order > own_size {
                return Some((tokens, TABLE_GROUPS + order));
            }
        }
        own.map(|(tokens, size)| (tokens, size.min(TABLE_GROUPS)))
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
        Ok(Some(Box::new(
            Self::new(self.min, self.max).with_table(self.table.clone()),
        )))
    }

    fn draft(&mut self, _target: TargetView<'_>, sequence: &[u32], n: usize) -> Result<Draft> {
        let found = self.propose(sequence, n);
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

    #[test]
    fn the_table_proposes_where_its_ngram_is_longer() {
        use crate::spec::lookup_table::TableSettings;
        use crate::train::sequences::Sequence;
        // The target's replies say "7 8 9" after "3 7".
        let replies = vec![Sequence::new(&[0], &[3, 7, 8, 9]); 4];
        let (table, _) = LookupTable::build(&replies, TableSettings::default());
        let s = NgramSource::new(1, 3).with_table(Some(Arc::new(table)));
        // The sequence's own 1-gram "7" would continue with 1; the table's 2-gram wins.
        assert_eq!(
            s.propose(&[7, 1, 3, 7], 3),
            Some((vec![8, 9], TABLE_GROUPS + 2))
        );
        // Its own 2-gram "3 7" ties the table's and is kept: the sequence's own copy.
        assert_eq!(s.propose(&[3, 7, 5, 3, 7], 2), Some((vec![5, 3], 2)));
        // Nothing in the table: the sequence's own match.
        assert_eq!(s.propose(&[4, 6, 4], 2), Some((vec![6, 4], 1)));
    }
}
