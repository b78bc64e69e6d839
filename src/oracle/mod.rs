//! What mlxb's output is checked against: runs of the mlx-lm oracle in `.venv` (`parity`,
//! `bench --baseline mlx-lm`), of the mlx-optiq oracle in `.venv-optiq` (`parity` at L2) and
//! the KL divergence of a fork combination to L1 (`bench --matrix`).

pub mod compare;
pub mod divergence;
pub mod mlx_lm;
pub mod optiq;
