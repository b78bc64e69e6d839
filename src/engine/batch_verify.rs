//! Verifying drafted blocks in a decoding batch: each row feeds `[anchor, d1..dk]` (its own
//! k, 0 = a plain decode row), right-padded to the widest block; one forward scores every
//! row; each row keeps its anchor and the drafts its own sampled tokens confirm; then each
//! row's cache drops exactly its rejected positions. Drafting itself lives above the engine
//! (`spec::slots`); the engine only takes the proposed ids.
//!
//! Rolling back rows by different amounts in one left-padded cache: the positions every row
//! rejects are trimmed off the end, and each row's remaining rejected positions stay in the
//! buffer, hidden from later queries by the mask and taken out of the row's RoPE position
//! (`BatchKvCache::hide_tail`; moving every row's keys instead would copy the whole cache each
//! step). A row's RoPE positions and visible keys are then exactly those of its kept tokens.
//!
//! Sliding-window rings and recurrent state cannot hide a tail (a ring may have overwritten the
//! positions a rejected draft evicted; a recurrent state has no positions at all), so models
//! with such layers roll back the way a single stream does when it cannot trim: the caches as
//! they were before the verify forward are put back and each row's kept tokens (its anchor and
//! kept drafts) are run again, right-padded to the longest as in a batched prefill: rings and
//! recurrent state take the padding as a prefill's (`prepare`/`finalize`: masked out of the
//! state, rolled to the left of the ring), full-attention layers hide it. That second forward
//! is the price of drafting on such models; the draft-length policy sees it in the step's wall
//! time.

use super::cache::{BatchKvCache, CacheSnapshot};
use super::error::{EngineError, Result};
use super::models::{Caches, LanguageModel};
use mlx_rs::Array;

/// What one row's block became: how many drafts it proposed and how many were kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verified {
    /// The sequence ([`super::batch::BatchGenerator::insert`]'s id).
    pub uid: usize,
    /// Drafted tokens fed after its anchor.
    pub proposed: usize,
    /// Of those, how many its own sampled tokens confirmed.
    pub accepted: usize,
}

/// Whether every layer's batched cache is a full-attention one, the kind whose rows can drop
/// different numbers of positions in place (others restore and replay).
pub fn rows_can_rewind(caches: &mut Caches) -> bool {
    caches.iter_mut().all(|c| {
        c.as_batch_mut()
            .is_some_and(|b| b.as_any_mut().is::<BatchKvCache>())
    })
}

/// A row's verify input: its anchor, then at most `room - 1` of its drafts (a round emits at
/// most one token more than it keeps drafts, and never past the row's budget `room`).
pub fn block(anchor: u32, drafts: &[u32], room: usize) -> Vec<u32> {
    let mut block = vec![anchor];
    block.extend(drafts.iter().take(room.saturating_sub(1)));
    block
}

/// How many of `drafts` the row's sampled tokens `picks` (one per block position) confirm:
/// the leading positions where the token sampled after a prefix equals the next draft.
pub fn confirmed(drafts: &[u32], picks: &[u32]) -> usize {
    drafts.iter().zip(picks).take_while(|(d, p)| d == p).count()
}

/// Blocks of ids right-padded (with each block's first id) to the longest, as `[rows, width]`,
/// and that width.
pub fn padded_input(blocks: &[Vec<u32>]) -> (Array, usize) {
    let width = blocks.iter().map(Vec::len).max().unwrap_or(1);
    let ids: Vec<i32> = blocks
        .iter()
        .flat_map(|b| {
            b.iter()
                .map(|&t| t as i32)
                .chain(std::iter::repeat_n(b[0] as i32, width - b.len()))
        })
        .collect();
    let input = Array::from_slice(&ids, &[blocks.len() as i32, width as i32]);
    (input, width)
}

/// Every cache's state before a verify forward, for models whose rows cannot drop positions in
/// place.
pub fn checkpoint(caches: &Caches) -> Vec<CacheSnapshot> {
    caches.iter().map(|c| c.snapshot()).collect()
}

/// Puts back the caches saved by [`checkpoint`] (all the rows the verify forward ran).
pub fn restore(caches: &mut Caches, saved: Vec<CacheSnapshot>) -> Result<()> {
    for (c, s) in caches.iter_mut().zip(saved) {
        c.restore(s)?;
    }
    Ok(())
}

/// Runs each row's `kept` tokens (its anchor and kept drafts) through restored caches, padded
/// as the module docs say; the logits are not needed (the verify forward gave them).
pub fn replay_kept(
    model: &mut dyn LanguageModel,
    caches: &mut Caches,
    kept: &[Vec<u32>],
) -> Result<()> {
    let (input, width) = padded_input(kept);
    let lengths: Vec<i32> = kept.iter().map(|b| b.len() as i32).collect();
    let padding: Vec<i32> = lengths.iter().map(|&n| width as i32 - n).collect();
    let padded = padding.iter().any(|&p| p > 0);
    if padded {
        for c in caches.iter_mut() {
            if let Some(b) = c.as_batch_mut() {
                if !b.as_any_mut().is::<BatchKvCache>() {
                    b.prepare(&lengths, &padding);
                }
            }
        }
    }
    model.forward(&input, caches)?;
    if padded {
        for c in caches.iter_mut() {
            let Some(b) = c.as_batch_mut() else {
                continue;
            };
            match b.as_any_mut().downcast_mut::<BatchKvCache>() {
                Some(full) => full.hide_tail(&padding)?,
                None => b.finalize()?,
            }
        }
    }
    Ok(())
}

/// Drops the last `drop[i]` positions of row `i` from every layer's cache after a verify
/// forward (see the module docs).
pub fn rewind_rows(caches: &mut Caches, drop: &[i32]) -> Result<()> {
    let Some(&common) = drop.iter().min() else {
        return Ok(());
    };
    let rest: Vec<i32> = drop.iter().map(|d| d - common).collect();
    for cache in caches.iter_mut() {
        if common > 0 {
            cache.trim(common);
        }
        cache
            .as_batch_mut()
            .and_then(|b| b.as_any_mut().downcast_mut::<BatchKvCache>())
            .ok_or_else(|| {
                EngineError::Runtime(
                    "a verified batch met a cache that is not full attention".into(),
                )
            })?
            .hide_tail(&rest)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_are_confirmed_up_to_the_first_disagreement() {
        assert_eq!(confirmed(&[5, 6, 7], &[5, 6, 9, 1]), 2);
        assert_eq!(confirmed(&[5, 6, 7], &[4, 6, 7, 1]), 0);
        assert_eq!(confirmed(&[5, 6, 7], &[5, 6, 7, 1]), 3);
        assert_eq!(confirmed(&[], &[3]), 0);
    }

    #[test]
    fn a_block_never_outgrows_the_rows_budget() {
        let d = [1, 2, 3, 4];
        assert_eq!(block(9, &d, 3), vec![9, 1, 2]);
        assert_eq!(block(9, &d, 1), vec![9]);
        assert_eq!(block(9, &[], 8), vec![9]);
        assert_eq!(block(9, &d, 10), vec![9, 1, 2, 3, 4]);
    }
}
