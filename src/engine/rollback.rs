//! Exact cache rewind after a verify block. Trim where every cache trims exactly (full
//! caches, rotating caches that have not wrapped); otherwise restore the snapshot taken
//! before the block and replay the accepted tokens. This stays exact when a sliding window
//! wraps or a block straddles its edge (where mlx-lm's trim silently does nothing) and for
//! recurrent state that cannot be trimmed at all.

use super::cache::CacheSnapshot;
use super::error::Result;
use super::models::Caches;

/// The caches' state before a block, at a known number of positions.
pub struct Checkpoint {
    /// Per cache, its saved state; `None` for a cache that trims exactly whatever the block
    /// does to it ([`super::cache::KvCache::trims_exactly_always`]).
    snapshots: Vec<Option<CacheSnapshot>>,
    positions: usize,
}

impl Checkpoint {
    /// Saves every cache that a trim may not take back exactly (cheap: arrays are shared). The
    /// others are not held, so the block can append to their buffers in place instead of
    /// copying them.
    pub fn take(caches: &Caches, positions: usize) -> Self {
        Self {
            snapshots: caches
                .iter()
                .map(|c| (!c.trims_exactly_always()).then(|| c.snapshot()))
                .collect(),
            positions,
        }
    }

    /// Positions the caches held when the checkpoint was taken.
    pub fn positions(&self) -> usize {
        self.positions
    }
}

/// How a rewind was done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rewind {
    /// Nothing to drop.
    None,
    /// Trimmed in place.
    Trimmed,
    /// Restored the checkpoint and replayed the kept tokens.
    Replayed,
}

/// Rewinds `caches` from `current` positions to `keep`. `tokens` are the ids of positions
/// `checkpoint.positions()..keep` (what a replay feeds through `replay`).
pub fn rewind(
    caches: &mut Caches,
    checkpoint: Checkpoint,
    current: usize,
    keep: usize,
    tokens: &[u32],
    replay: impl FnOnce(&[u32], &mut Caches) -> Result<()>,
) -> Result<Rewind> {
    if keep >= current {
        return Ok(Rewind::None);
    }
    let drop = (current - keep) as i32;
    if caches.iter().all(|c| c.is_trimmable()) {
        for c in caches.iter_mut() {
            c.trim(drop);
        }
        return Ok(Rewind::Trimmed);
    }
    let back = (current - checkpoint.positions) as i32;
    for (c, s) in caches.iter_mut().zip(checkpoint.snapshots) {
        match s {
            Some(s) => c.restore(s)?,
            None => {
                c.trim(back);
            }
        }
    }
    if !tokens.is_empty() {
        replay(tokens, caches)?;
    }
    Ok(Rewind::Replayed)
}
