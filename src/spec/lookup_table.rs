//! A lookup table of what a target tends to say next: for every n-gram (1 to 4 tokens) that its
//! own regenerated replies ([`crate::train::sequences`]) contain often enough, the token that
//! most often followed it. Drafting from it continues the sequence's longest n-gram found in the
//! table, token by token, as llama.cpp's static n-gram cache (`llama-lookup-create`) does from a
//! corpus. It proposes phrasings the target uses across conversations ("Here's a", "I hope this
//! helps") that a lookup in the prompt alone cannot find; the target still verifies every token.
//!
//! Stored as safetensors of u32 tensors `order1`..`order4` (`[keys, n + 1]`: the n-gram, then
//! its continuation, [`NO_TOKEN`] where none is frequent enough), with what it was built from
//! as one JSON object in the metadata key `mlxb_lookup_table` (one key, so that the same table
//! is the same bytes).

use crate::engine::error::{EngineError, Result};
use crate::engine::fsutil::write_atomic;
use crate::train::sequences::Sequence;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;

/// Longest n-gram a table holds.
pub const MAX_ORDER: usize = 4;

/// The continuation stored for an n-gram that is frequent but has no continuation frequent
/// enough: drafting stops there rather than fall back to a shorter n-gram.
pub const NO_TOKEN: u32 = u32::MAX;

/// The metadata key that marks the file as a table and holds what it was built from.
const FORMAT_KEY: &str = "mlxb_lookup_table";

/// How a table is built from replies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableSettings {
    /// An n-gram is kept when it occurs at least this often in the replies.
    pub min_count: u32,
    /// Its continuation is kept when it is this share of the n-gram's occurrences or more.
    pub min_share: f64,
}

impl Default for TableSettings {
    fn default() -> Self {
        Self {
            min_count: 4,
            min_share: 0.2,
        }
    }
}

/// What [`LookupTable::build`] read and kept.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BuildSummary {
    /// Sequences read.
    pub sequences: usize,
    /// Reply tokens they hold (each is the continuation of one n-gram per order).
    pub reply_tokens: usize,
    /// N-grams kept, by order (1 to 4).
    pub kept: Vec<usize>,
}

/// N-grams of 1 to [`MAX_ORDER`] tokens and what follows each.
#[derive(Debug, Clone, Default)]
pub struct LookupTable {
    /// `orders[n - 1]`: an n-gram's [`key`] → its continuation (or [`NO_TOKEN`]).
    orders: Vec<HashMap<u128, u32>>,
}

/// One n-gram (at most [`MAX_ORDER`] tokens) as a map key: its ids side by side.
fn key(tokens: &[u32]) -> u128 {
    tokens.iter().fold(0u128, |k, &t| (k << 32) | u128::from(t))
}

/// The `n` ids of an n-gram's [`key`], in order.
fn ids_of(k: u128, n: usize) -> impl Iterator<Item = u32> {
    (0..n).rev().map(move |j| (k >> (32 * j)) as u32)
}

impl LookupTable {
    /// The table of the reply tokens of `sequences`: each reply token is the continuation of
    /// the 1..=4 tokens before it (which may reach back into the prompt).
    pub fn build(sequences: &[Sequence], settings: TableSettings) -> (Self, BuildSummary) {
        let mut summary = BuildSummary {
            sequences: sequences.len(),
            reply_tokens: sequences
                .iter()
                .map(|s| s.ids.len().saturating_sub(s.reply_from))
                .sum(),
            kept: Vec::new(),
        };
        let orders = (1..=MAX_ORDER)
            .map(|n| {
                let mut seen: Vec<(u128, u32)> = sequences
                    .iter()
                    .flat_map(|s| {
                        (s.reply_from.max(n)..s.ids.len())
                            .map(move |i| (key(&s.ids[i - n..i]), s.ids[i]))
                    })
                    .collect();
                seen.sort_unstable();
                let order = continuations(&seen, settings);
                summary.kept.push(order.len());
                order
            })
            .collect();
        (Self { orders }, summary)
    }

    /// Up to `n` tokens continuing `sequence`, each the table's continuation of the longest
    /// n-gram it holds that ends the sequence so far (drafts included), and the length of the
    /// n-gram the first one continued; nothing (and 0) where no n-gram ending the sequence is
    /// in the table.
    pub fn continue_from(&self, sequence: &[u32], n: usize) -> (Vec<u32>, usize) {
        let mut tail: Vec<u32> = sequence[sequence.len().saturating_sub(MAX_ORDER)..].to_vec();
        let mut drafted = Vec::new();
        let mut first_order = 0;
        while drafted.len() < n {
            let Some((order, next)) = self.longest(&tail) else {
                break;
            };
            if drafted.is_empty() {
                first_order = order;
            }
            if next == NO_TOKEN {
                break;
            }
            drafted.push(next);
            tail.push(next);
            tail.remove(0);
        }
        (drafted, first_order)
    }

    /// The longest n-gram ending `tail` that the table holds: its length and continuation.
    fn longest(&self, tail: &[u32]) -> Option<(usize, u32)> {
        (1..=self.orders.len().min(tail.len())).rev().find_map(|n| {
            self.orders[n - 1]
                .get(&key(&tail[tail.len() - n..]))
                .map(|&next| (n, next))
        })
    }

    /// The largest token id the table holds (`None` when it is empty).
    pub fn largest_id(&self) -> Option<u32> {
        self.orders
            .iter()
            .enumerate()
            .flat_map(|(i, order)| {
                order.iter().flat_map(move |(&k, &next)| {
                    ids_of(k, i + 1).chain((next != NO_TOKEN).then_some(next))
                })
            })
            .max()
    }

    /// N-grams held, by order.
    pub fn sizes(&self) -> Vec<usize> {
        self.orders.iter().map(HashMap::len).collect()
    }

    /// Writes the table to `path` atomically, with `about` (what it was built from) in its
    /// metadata.
    pub fn save(&self, path: &Path, about: &serde_json::Value) -> Result<()> {
        let rows: Vec<(String, Vec<u8>, usize)> = self
            .orders
            .iter()
            .enumerate()
            .map(|(i, order)| {
                let n = i + 1;
                let mut entries: Vec<(&u128, &u32)> = order.iter().collect();
                entries.sort_unstable();
                let mut bytes = Vec::with_capacity(entries.len() * (n + 1) * 4);
                for (&k, &next) in entries {
                    for id in ids_of(k, n).chain([next]) {
                        bytes.extend_from_slice(&id.to_le_bytes());
                    }
                }
                (format!("order{n}"), bytes, order.len())
            })
            .collect();
        let views = rows
            .iter()
            .enumerate()
            .map(|(i, (name, bytes, len))| {
                TensorView::new(Dtype::U32, vec![*len, i + 2], bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| EngineError::Runtime(format!("lookup table tensor: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let metadata = HashMap::from([(FORMAT_KEY.to_string(), about.to_string())]);
        let bytes = safetensors::serialize(views, Some(metadata))
            .map_err(|e| EngineError::Runtime(format!("lookup table: {e}")))?;
        write_atomic(path, &bytes)
    }

    /// Reads a table [`Self::save`] wrote.
    pub fn load(path: &Path) -> Result<Self> {
        let bad = |why: String| EngineError::file(path, why);
        let bytes = std::fs::read(path).map_err(|e| bad(format!("cannot read it ({e})")))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
            bad(format!(
                "is not a safetensors file ({e}); make it with `mlxb lookup-table`"
            ))
        })?;
        if !meta
            .metadata()
            .as_ref()
            .is_some_and(|m| m.contains_key(FORMAT_KEY))
        {
            return Err(bad(
                "is not an mlxb lookup table; make one with `mlxb lookup-table`".into(),
            ));
        }
        let tensors = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("is damaged ({e}); make it again")))?;
        let mut orders = Vec::new();
        for n in 1..=MAX_ORDER {
            let Ok(view) = tensors.tensor(&format!("order{n}")) else {
                break;
            };
            if view.dtype() != Dtype::U32 || view.shape().len() != 2 || view.shape()[1] != n + 1 {
                return Err(bad(format!(
                    "tensor order{n} is not u32 [keys, {}]; make the table again",
                    n + 1
                )));
            }
            let ids: Vec<u32> = view
                .data()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            orders.push(
                ids.chunks_exact(n + 1)
                    .map(|row| (key(&row[..n]), row[n]))
                    .collect(),
            );
        }
        if orders.is_empty() {
            return Err(bad(
                "holds no n-grams (tensor order1 is missing); make the table again".into(),
            ));
        }
        Ok(Self { orders })
    }
}

/// From sorted (n-gram, next token) pairs: each n-gram seen at least `min_count` times, with its
/// most frequent continuation (ties to the lower id) where that is at least `min_share` of its
/// occurrences, else [`NO_TOKEN`].
fn continuations(seen: &[(u128, u32)], settings: TableSettings) -> HashMap<u128, u32> {
    let mut kept = HashMap::new();
    for group in seen.chunk_by(|a, b| a.0 == b.0) {
        let total = group.len();
        if (total as u64) < u64::from(settings.min_count) {
            continue;
        }
        // Runs of one next token, in ascending token order: the longest, first on ties.
        let (next, count) = group
            .chunk_by(|a, b| a.1 == b.1)
            .map(|run| (run[0].1, run.len()))
            .fold((NO_TOKEN, 0), |best, c| if c.1 > best.1 { c } else { best });
        let confident = count as f64 >= settings.min_share * total as f64;
        kept.insert(group[0].0, if confident { next } else { NO_TOKEN });
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(prompt: &[u32], reply: &[u32]) -> Sequence {
        Sequence::new(prompt, reply)
    }

    #[test]
    fn keeps_frequent_ngrams_with_their_most_frequent_continuation() {
        // "5 6" is followed by 7 three times and by 8 once; "9" by 1, 2, 3 (no majority).
        let seqs = vec![
            seq(&[1], &[5, 6, 7, 9, 1]),
            seq(&[2], &[5, 6, 7, 9, 2]),
            seq(&[3], &[5, 6, 7, 9, 3]),
            seq(&[4], &[5, 6, 8]),
        ];
        let settings = TableSettings {
            min_count: 3,
            min_share: 0.5,
        };
        let (table, summary) = LookupTable::build(&seqs, settings);
        assert_eq!(summary.reply_tokens, 18);
        // Continuing "... 5 6": the 2-gram gives 7; then "5 6 7" gives 9; then "5 6 7 9" is
        // frequent but split three ways, so drafting stops.
        assert_eq!(table.continue_from(&[4, 5, 6], 5), (vec![7, 9], 2));
        // Never seen: nothing.
        assert_eq!(table.continue_from(&[42], 5), (vec![], 0));
        // At most n tokens.
        assert_eq!(table.continue_from(&[5, 6], 1), (vec![7], 2));
        // "1" comes before a reply token only once: not kept.
        assert!(!table.orders[0].contains_key(&key(&[1])));
    }

    #[test]
    fn a_longer_ngram_wins_over_a_shorter_one() {
        // After "3 5" comes 6; after any other "5" comes 7.
        let mut seqs = vec![seq(&[0], &[3, 5, 6]); 4];
        seqs.extend(vec![seq(&[0], &[4, 5, 7]); 6]);
        let (table, _) = LookupTable::build(
            &seqs,
            TableSettings {
                min_count: 2,
                min_share: 0.5,
            },
        );
        assert_eq!(table.continue_from(&[3, 5], 1), (vec![6], 2));
        assert_eq!(table.continue_from(&[9, 5], 1), (vec![7], 1));
    }

    #[test]
    fn round_trips_through_a_file() {
        let seqs = vec![seq(&[1], &[70_000, 2, 3, 4, 5, 6]); 3];
        let (table, _) = LookupTable::build(&seqs, TableSettings::default().with_count(2));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lookup.safetensors");
        table.save(&path, &serde_json::json!({})).unwrap();
        let back = LookupTable::load(&path).unwrap();
        assert_eq!(back.orders, table.orders);
        assert_eq!(back.sizes(), vec![6, 5, 4, 3]);
        assert_eq!(back.largest_id(), Some(70_000));
        assert_eq!(
            back.continue_from(&[1, 70_000], 9),
            (vec![2, 3, 4, 5, 6], 2)
        );
        // Anything else is refused with the file's name.
        std::fs::write(&path, b"not a table").unwrap();
        let err = LookupTable::load(&path).unwrap_err().to_string();
        assert!(err.contains("lookup.safetensors"), "{err}");
    }

    impl TableSettings {
        fn with_count(self, min_count: u32) -> Self {
            Self { min_count, ..self }
        }
    }
}
