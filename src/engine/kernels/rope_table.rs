//! MLX's rotary embedding on the host, bit for bit (the L1 host step, [`super::step`]).
//!
//! On the CPU MLX runs `fast::rope` as a graph of plain ops: the angles `position · scale ·
//! inv_freq` (or `/ freq`), their cosines and sines, then `x1·cos − x2·sin` and `x1·sin + x2·cos`,
//! each product and sum rounded on its own. The cosines and sines are taken from MLX itself:
//! rotating unit vectors (`x1 = 1`, `x2 = 0`) gives `cos` and `sin` exactly, one MLX call for a
//! table of positions, so the host never has to reproduce a libm or MLX's angle arithmetic. The
//! products and sums are then the host's, in MLX's order; the caller compares the result with
//! MLX's rope before using it.

use super::elementwise::bf16_mlx;

/// Cosines and sines of every rotated pair for positions `0..positions`.
#[derive(Debug, Clone)]
pub struct RopeTable {
    /// Leading dimensions of each head that rotate (the rest pass through).
    dims: usize,
    /// Pairs are adjacent (`2i, 2i+1`) rather than split halves (`i, i + dims/2`).
    traditional: bool,
    /// `positions × dims/2` cosines.
    cos: Vec<f32>,
    /// `positions × dims/2` sines.
    sin: Vec<f32>,
}

impl RopeTable {
    /// The unit vectors (`positions` heads of `width ≥ dims` values) whose rotation by MLX's rope
    /// is the table: one in the first element of every pair, zero elsewhere.
    pub fn unit_input(dims: usize, width: usize, traditional: bool, positions: usize) -> Vec<f32> {
        let mut x = vec![0.0f32; positions * width];
        for row in x.chunks_exact_mut(width.max(1)) {
            for i in 0..dims / 2 {
                row[first(i, traditional)] = 1.0;
            }
        }
        x
    }

    /// The table from MLX's rotation of [`RopeTable::unit_input`] (`positions` heads of
    /// `width` values, position `p` rotated by `p`).
    pub fn from_rotated_units(
        dims: usize,
        width: usize,
        traditional: bool,
        rotated: &[f32],
    ) -> Self {
        let half = dims / 2;
        let positions = rotated.len() / width.max(1);
        let (mut cos, mut sin) = (Vec::with_capacity(positions * half), Vec::new());
        sin.reserve(positions * half);
        for row in rotated.chunks_exact(width.max(1)) {
            for i in 0..half {
                cos.push(row[first(i, traditional)]);
                sin.push(row[second(i, dims, traditional)]);
            }
        }
        Self {
            dims,
            traditional,
            cos,
            sin,
        }
    }

    /// Positions the table covers.
    pub fn positions(&self) -> usize {
        self.cos.len() / (self.dims / 2).max(1)
    }

    /// Rotates every head (`head_dim` values each) of `x` for position `pos`, as MLX does.
    /// Errors for a position past the table.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) -> Result<(), String> {
        let half = self.dims / 2;
        self.fits(head_dim, pos)?;
        let (cos, sin) = (
            &self.cos[pos * half..(pos + 1) * half],
            &self.sin[pos * half..(pos + 1) * half],
        );
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = (
                    first(i, self.traditional),
                    second(i, self.dims, self.traditional),
                );
                let (x1, x2, c, s) = (head[a], head[b], cos[i], sin[i]);
                // Two products, then their difference or sum: each rounded on its own (Rust
                // never fuses them), as MLX's separate multiply and subtract/add ops.
                head[a] = x1 * c - x2 * s;
                head[b] = x1 * s + x2 * c;
            }
        }
        Ok(())
    }

    /// [`RopeTable::apply`] for bfloat16 heads (`x` holds bfloat16 values, widened), as MLX's
    /// `fast::rope` computes that dtype: the same f32 cosines and sines rounded to bfloat16,
    /// then every product and every sum rounded to bfloat16 on its own.
    pub fn apply_bf16(&self, x: &mut [f32], head_dim: usize, pos: usize) -> Result<(), String> {
        let half = self.dims / 2;
        self.fits(head_dim, pos)?;
        let round = |v: f32| bf16_mlx(v).to_f32();
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = (
                    first(i, self.traditional),
                    second(i, self.dims, self.traditional),
                );
                let (c, s) = (
                    round(self.cos[pos * half + i]),
                    round(self.sin[pos * half + i]),
                );
                let (x1, x2) = (head[a], head[b]);
                head[a] = round(round(x1 * c) - round(x2 * s));
                head[b] = round(round(x1 * s) + round(x2 * c));
            }
        }
        Ok(())
    }

    /// Errors for a position past the table or a head narrower than the rotated dimensions.
    fn fits(&self, head_dim: usize, pos: usize) -> Result<(), String> {
        if pos >= self.positions() || self.dims > head_dim {
            return Err(format!(
                "position {pos} of a rope table of {} (dims {} of {head_dim})",
                self.positions(),
                self.dims
            ));
        }
        Ok(())
    }
}

/// Index of pair `i`'s first element.
fn first(i: usize, traditional: bool) -> usize {
    if traditional {
        2 * i
    } else {
        i
    }
}

/// Index of pair `i`'s second element.
fn second(i: usize, dims: usize, traditional: bool) -> usize {
    if traditional {
        2 * i + 1
    } else {
        i + dims / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_of_exact_rotations_rotates_each_pair() {
        for traditional in [false, true] {
            let dims = 4;
            // Rotate the unit vectors by hand: pair i at position p by angle p·(i+1).
            let mut rotated = RopeTable::unit_input(dims, 5, traditional, 3);
            for (p, row) in rotated.chunks_exact_mut(5).enumerate() {
                for i in 0..2 {
                    let t = p as f32 * (i + 1) as f32;
                    row[first(i, traditional)] = t.cos();
                    row[second(i, dims, traditional)] = t.sin();
                }
            }
            let table = RopeTable::from_rotated_units(dims, 5, traditional, &rotated);
            assert_eq!(table.positions(), 3);
            let mut x = vec![0.5f32, -1.0, 2.0, 3.0, 7.0];
            let before = x.clone();
            table.apply(&mut x, 5, 2).unwrap();
            for i in 0..2 {
                let (a, b) = (first(i, traditional), second(i, dims, traditional));
                let t = 2.0 * (i + 1) as f32;
                let (c, s) = (t.cos(), t.sin());
                assert_eq!(x[a], before[a] * c - before[b] * s);
                assert_eq!(x[b], before[a] * s + before[b] * c);
            }
            assert_eq!(x[4], 7.0);
            assert!(table.apply(&mut x, 5, 3).is_err());
        }
    }
}
