//! Host-side CPU kernels that replace an MLX op where MLX's own CPU kernel is far from the
//! memory roofline (`--perf-kernel on`, tier L3): the affine 4-bit (and 8-bit) mat-vec for
//! quantized linear layers in single-token (and small speculative-verify) steps.
//!
//! Also, at L1, the dense (f32/bf16/f16) products of steps, verify blocks and 16-bit prompts in
//! the summation order of MLX's own CPU matmul (`mlx_order`, MLX-facing in `dense`), the
//! products of 2- to 8-bit layers in the order of MLX's CPU `quantized_matmul` (`quant_order`,
//! MLX-facing in `qdense`), bf16
//! attention in the order of MLX's CPU SDPA (`attention`; `haswell_tiles` where OpenBLAS's Haswell
//! kernel sums a block's attention in two chains) and element-wise work
//! (`elementwise`): bit-identical, each checked against MLX before use.
//!
//! `affine` is the arithmetic (AVX-512, AVX2+FMA, scalar; `vnni` the int8-input AVX-512 VNNI
//! variant), `dispatch` picks a path at run time
//! and splits rows over threads, `host` moves arrays between MLX and host memory, `pages` holds
//! the weight copies the kernels stream (in huge pages where the system gives them), `vecops`, `step`
//! and `team` run a whole llama-style decode step on the host, `proj` holds its projections
//! (4-/8-bit, other widths, dense f32, with biases).

/// `$pass::<…, T>($p)` with the token count `T` a constant: `$n` from 1 to 14 (more runs as
/// 14, the most a register block of the kernels takes).
macro_rules! by_tokens {
    ($n:expr, $pass:ident::<$($g:tt),*>($p:expr)) => {
        seq_macro::seq!(T in 1..=13 {
            match $n {
                #(T => $pass::<$($g,)* T>($p),)*
                _ => $pass::<$($g,)* 14>($p),
            }
        })
    };
}

pub mod affine;
pub mod any_order;
pub mod attention;
pub mod dense;
pub mod dispatch;
pub mod elementwise;
pub mod haswell_tiles;
pub mod host;
pub mod mlx_order;
pub mod packed;
mod pages;
pub mod pair;
pub mod proj;
pub mod qdense;
pub mod quant_order;
pub mod rope_table;
pub mod step;
pub mod team;
pub mod vecops;
pub mod vnni;

pub use affine::{KernelPath, Prepared, QMatrix, BITS, MAX_M};
pub use dense::{dense_calls, refused_blocks, refused_shapes, HostDense, HostDenseCell};
pub use dispatch::{best_path, matmul, selection, Selection};
pub use host::{
    check_bits, host_calls, ready_bf16, ready_f32, reshaped_row, HostQuant, HostQuantCell,
};
pub use proj::{HostF32, HostForm, HostProj, ProjWeight};
pub use qdense::{qdense_calls, HostQDense, HostQDenseCell};
pub use rope_table::RopeTable;
pub use step::{
    exact_steps_here, host_steps, Bf16Numerics, HostDecoder, HostLayer, KvBuffers, Numerics,
    PastKv, StepOut, StepPlan,
};
pub use vecops::{HeadShape, HostRope};
pub use vnni::Int8Input;

/// A mutex guard even if a holder panicked: the kernels' mutexes guard values every holder
/// leaves consistent (one insert, one slice handed over), so a panic elsewhere must not make
/// the next product fail.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

thread_local! {
    /// Set while [`mlx_only`] runs: the L1 host kernels leave their work to MLX.
    static MLX_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the L1 host kernels (dense products, element-wise work) off on this thread, so
/// that its graph stays lazy on MLX. Same bits either way; used for the first token of a
/// generation, which then goes out without waiting for the host kernels' first-use checks
/// (they run at the next step instead).
pub fn mlx_only<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            MLX_ONLY.set(self.0);
        }
    }
    let _restore = Restore(MLX_ONLY.replace(true));
    f()
}

/// Whether the L1 host kernels may run on this thread now (see [`mlx_only`]).
pub fn host_allowed() -> bool {
    !MLX_ONLY.get()
}
