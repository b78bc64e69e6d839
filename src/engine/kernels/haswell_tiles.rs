//! Which outputs OpenBLAS's `HASWELL` sgemm sums in two chains, for the products of an f32
//! attention block (MLX's CPU SDPA: `q · Kᵀ` and `P · V` per head, the block's queries being
//! the product's columns).
//!
//! OpenBLAS 0.3.21's Haswell kernel (`sgemm_kernel_8x4_haswell_2.c`) walks a call's columns in
//! tiles of 12, 8, 4, 2 and 1 and each tile's rows in tiles of 8, 4, 2 and 1. Every tile sums an
//! output as one fused multiply-add chain over the depth, except the 8-row × 4-column tile: it
//! accumulates the even and the odd depths of each whole group of eight in two sets of
//! registers (the depths past the last whole group into the first set) and adds the two sets
//! at the end. Which outputs land in such a tile follows from how the single-threaded GEMM
//! driver calls the kernel: the rows are cut into blocks of `GEMM_P` = 320 (a remainder between
//! one and two blocks halved and rounded up to a multiple of 8, as for the depth); the first
//! block's columns go to the kernel in pieces of 12, of 4 while more than 4 are left, then the
//! rest, and every later block's columns in one call. A decode step (one query, three with
//! grouped heads) never meets the 8×4 tile, which is why blocks of up to three tokens sum
//! alike everywhere and blocks of four to eight did not.
//!
//! Measured against MLX on an AMD EPYC (Zen 4) host whose OpenBLAS picks these kernels, for
//! 4-8 queries over 4 to 708 keys of width 64 (scores and values, bit for bit); the step checks
//! it against MLX again at its first block of each size (`cache_attention`).

use super::mlx_order::{driver_panels, Halving};

/// `GEMM_P`: the rows the driver hands the kernel per block.
const BLOCK_ROWS: usize = 320;
/// `SGEMM_DEFAULT_UNROLL_M` of the `HASWELL` kernels: the single-threaded driver rounds a halved
/// block of rows, or a halved depth, up to a multiple of it.
pub(super) const HASWELL_UNROLL_M: usize = 8;
/// Rows and columns of the two-chain kernel tile.
const PAIRED_ROWS: usize = 8;
const PAIRED_COLUMNS: usize = 4;

/// The outputs of one single-threaded product of `rows` (packed) rows and `columns` columns
/// that the 8×4 tile sums.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairedTiles {
    /// Row blocks: (first row, rows).
    blocks: Vec<(usize, usize)>,
    /// Per column: whether it lies in a 4-column tile in the first block, and in later ones.
    first: Vec<bool>,
    later: Vec<bool>,
}

impl PairedTiles {
    /// The tiles of a `rows × columns` product; `None` where a column falls in the kernel's
    /// 12-column tile (not modelled: blocks of twelve or more queries).
    pub fn new(rows: usize, columns: usize) -> Option<Self> {
        let pieces = first_block_pieces(columns);
        let first = paired_columns(&pieces)?;
        let later = paired_columns(&[columns])?;
        let halving = Halving::SingleThread {
            unroll: HASWELL_UNROLL_M,
        };
        let mut blocks = Vec::new();
        let mut start = 0;
        for len in driver_panels(rows, BLOCK_ROWS, halving) {
            blocks.push((start, len));
            start += len;
        }
        Some(Self {
            blocks,
            first,
            later,
        })
    }

    /// Whether any output of `column` is summed by the 8×4 tile.
    pub fn column_has_pairs(&self, column: usize) -> bool {
        self.blocks.iter().enumerate().any(|(b, &(_, len))| {
            len >= PAIRED_ROWS && self.columns(b).get(column).copied().unwrap_or(false)
        })
    }

    /// Whether output (`row`, `column`) is summed by the 8×4 tile.
    pub fn paired(&self, row: usize, column: usize) -> bool {
        self.blocks
            .iter()
            .enumerate()
            .find(|(_, &(start, len))| (start..start + len).contains(&row))
            .is_some_and(|(b, &(start, len))| {
                // The block's row tiles: eights first, then 4, 2, 1.
                row - start < len / PAIRED_ROWS * PAIRED_ROWS
                    && self.columns(b).get(column).copied().unwrap_or(false)
            })
    }

    fn columns(&self, block: usize) -> &[bool] {
        if block == 0 {
            &self.first
        } else {
            &self.later
        }
    }
}

/// The pieces the driver hands the kernel the first block's columns in.
fn first_block_pieces(columns: usize) -> Vec<usize> {
    let mut pieces = Vec::new();
    let mut left = columns;
    while left > 0 {
        let piece = if left >= 3 * PAIRED_COLUMNS {
            3 * PAIRED_COLUMNS
        } else if left > PAIRED_COLUMNS {
            PAIRED_COLUMNS
        } else {
            left
        };
        pieces.push(piece);
        left -= piece;
    }
    pieces
}

/// Per column of kernel calls of `pieces` columns each: whether it lies in a 4-column tile;
/// `None` if any lies in a 12-column one.
fn paired_columns(pieces: &[usize]) -> Option<Vec<bool>> {
    let mut out = Vec::new();
    for &piece in pieces {
        let mut left = piece;
        if left >= 12 {
            return None;
        }
        for (width, paired) in [(8, false), (4, true), (2, false), (1, false)] {
            while left >= width {
                out.extend(std::iter::repeat_n(paired, width));
                left -= width;
            }
        }
    }
    Some(out)
}

/// The sum of `terms` (in depth order) as the 8×4 tile forms it: the even and the odd depths
/// of each whole group of eight in two fused multiply-add chains from zero, the depths past the
/// last whole group continuing the first, the two added at the end. `term(k, acc)` returns
/// `fma(a_k, b_k, acc)`.
#[inline(always)]
pub fn paired_sum(depth: usize, mut term: impl FnMut(usize, f32) -> f32) -> f32 {
    paired_sums(depth, |k, [acc]: [f32; 1]| [term(k, acc)])[0]
}

/// [`paired_sum`] of `N` outputs at once, each in its own two chains: `term(k, acc)` returns
/// the `N` accumulators after depth `k`.
#[inline(always)]
pub fn paired_sums<const N: usize>(
    depth: usize,
    mut term: impl FnMut(usize, [f32; N]) -> [f32; N],
) -> [f32; N] {
    let main = depth / PAIRED_ROWS * PAIRED_ROWS;
    let (mut even, mut odd) = ([0.0f32; N], [0.0f32; N]);
    for k in (0..main).step_by(2) {
        even = term(k, even);
        odd = term(k + 1, odd);
    }
    for k in main..depth {
        even = term(k, even);
    }
    std::array::from_fn(|i| even[i] + odd[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_block_pairs_pieces_of_four_and_later_blocks_a_whole_call() {
        // Eight queries: pieces 4 + 4 in the first block (both paired), one call of 8 in later
        // blocks (the 8-column tile: one chain).
        let t = PairedTiles::new(700, 8).unwrap();
        assert_eq!(t.first, vec![true; 8]);
        assert_eq!(t.later, vec![false; 8]);
        // 700 rows: blocks 320, then the 380 left halved to 192 (a multiple of 8), then 188.
        assert_eq!(t.blocks, vec![(0, 320), (320, 192), (512, 188)]);
        assert!(t.paired(0, 3) && t.paired(319, 7));
        assert!(!t.paired(320, 0), "a later block's 8-column tile");
        // Six queries: 4 paired, then a 2-column tile; a block's last rows past its eights are
        // one chain.
        let t = PairedTiles::new(44, 6).unwrap();
        assert_eq!(t.first, vec![true, true, true, true, false, false]);
        assert!(t.paired(39, 0) && !t.paired(40, 0) && !t.paired(0, 4));
        assert!(t.column_has_pairs(3) && !t.column_has_pairs(5));
        // Up to three queries never pair; four keys give no 8-row tile.
        assert!(!(0..3).any(|c| PairedTiles::new(500, 3).unwrap().column_has_pairs(c)));
        assert!(!PairedTiles::new(4, 4).unwrap().column_has_pairs(0));
        assert_eq!(PairedTiles::new(100, 12), None);
    }

    #[test]
    fn a_paired_sum_splits_the_whole_groups_of_eight_by_parity() {
        // Eleven terms that round: eight split by parity, the last three continue the even
        // chain.
        let xs: Vec<f32> = (0..11).map(|k| 1.0 + k as f32 * 1e-7).collect();
        let term = |k: usize, acc: f32| xs[k].mul_add(1.0 + 3e-7 * k as f32, acc);
        let paired = paired_sum(11, term);
        let mut even = 0.0f32;
        let mut odd = 0.0f32;
        for k in 0..8 {
            if k % 2 == 0 {
                even = term(k, even);
            } else {
                odd = term(k, odd);
            }
        }
        for k in 8..11 {
            even = term(k, even);
        }
        assert_eq!(paired.to_bits(), (even + odd).to_bits());
        let chain = (0..11).fold(0.0f32, |acc, k| term(k, acc));
        assert_ne!(
            paired.to_bits(),
            chain.to_bits(),
            "the terms do not tell the forms apart"
        );
        // Fewer than eight terms: one chain.
        let one = paired_sum(5, term);
        let chain = (0..5).fold(0.0f32, |acc, k| term(k, acc));
        assert_eq!(one.to_bits(), chain.to_bits());
    }
}
