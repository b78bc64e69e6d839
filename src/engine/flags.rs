//! Resolved per-fork switches passed down explicitly to models and the generation loop.
//! (The tier table, `--l1/--l2/--l3` aliases and `mlxb flags` build on this.)

/// The value of every fork for one run. `Default` is tier L1 (bit-identical to mlx-lm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forks {
    /// Compile activations with MLX like mlx-lm does (same bits either way on CPU).
    pub compiled_activations: bool,
}

impl Default for Forks {
    fn default() -> Self {
        Self {
            compiled_activations: true,
        }
    }
}
