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

use super::cache::BatchKvCache;
use super::error::{EngineError, Result};
use super::models::Caches;

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
/// different numbers of positions (sliding-window and recurrent caches cannot yet).
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
