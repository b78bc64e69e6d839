//! Runtime selection of the quantized mat-vec kernel path (the best one this CPU runs, or the one
//! `MLXB_Q4_KERNEL` forces) and the row split over threads.
//!
//! `MLXB_Q4_KERNEL=avx512|avx2|scalar` forces a path for benchmarks; `MLXB_Q4_THREADS=N`
//! caps the threads one mat-vec uses (default: rayon's pool, i.e. one per core). Both are
//! read once per process.

use super::affine::{rows_into, KernelPath, Prepared, QMatrix};
use crate::engine::error::{EngineError, Result};
use rayon::prelude::*;
use std::sync::OnceLock;

/// Weights below which one thread does the whole mat-vec (a fork/join costs more).
const PARALLEL_MIN_WEIGHTS: usize = 1 << 17;

/// The path and thread cap in effect (from the environment, once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selection {
    /// The kernel path.
    pub path: KernelPath,
    /// Most threads one call splits its rows over.
    pub threads: usize,
}

/// The best path this CPU runs that computes on the exact input (f32): the VNNI path rounds
/// the input to int8, which changes greedy text within a few dozen tokens, so it runs only
/// when `MLXB_Q4_KERNEL=avx512vnni` asks for it.
pub fn best_path() -> KernelPath {
    KernelPath::ALL
        .into_iter()
        .find(|p| *p != KernelPath::Avx512Vnni && p.available())
        .unwrap_or(KernelPath::Scalar)
}

fn from_env() -> std::result::Result<Selection, String> {
    let path = match std::env::var("MLXB_Q4_KERNEL") {
        Err(_) => best_path(),
        Ok(v) if v.is_empty() => best_path(),
        Ok(v) => {
            let p = KernelPath::ALL
                .into_iter()
                .find(|p| p.name() == v.to_ascii_lowercase())
                .ok_or_else(|| {
                    format!("MLXB_Q4_KERNEL={v:?} is not a kernel path; use avx512vnni, avx512, avx2 or scalar, or unset it")
                })?;
            if !p.available() {
                return Err(format!(
                    "MLXB_Q4_KERNEL={v}: this CPU cannot run the {} kernel; use {} or unset it",
                    p.name(),
                    best_path().name()
                ));
            }
            p
        }
    };
    let threads = match std::env::var("MLXB_Q4_THREADS") {
        Err(_) => rayon::current_num_threads(),
        Ok(v) => v.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| {
            format!(
                "MLXB_Q4_THREADS={v:?} is not a positive integer; give a thread count or unset it"
            )
        })?,
    };
    Ok(Selection { path, threads })
}

/// The selection in effect; a bad `MLXB_Q4_KERNEL`/`MLXB_Q4_THREADS` is an input error.
pub fn selection() -> Result<Selection> {
    static SEL: OnceLock<std::result::Result<Selection, String>> = OnceLock::new();
    SEL.get_or_init(from_env)
        .clone()
        .map_err(EngineError::Input)
}

/// `y = x · Wᵀ` for `x` of `m` rows (`m × cols`), returned as `m × rows`, computed by
/// `sel.path` with the output features split over up to `sel.threads` threads.
pub fn matmul(sel: Selection, w: &QMatrix<'_>, x: &[f32], m: usize) -> Result<Vec<f32>> {
    let prepared =
        Prepared::for_path(x, m, w.cols(), w.bits(), sel.path).map_err(EngineError::Runtime)?;
    let rows = w.rows();
    let mut by_row = vec![0.0f32; rows * m];
    let threads = if rows * w.cols() < PARALLEL_MIN_WEIGHTS {
        1
    } else {
        sel.threads.max(1)
    };
    let run = |start: usize, out: &mut [f32]| {
        let range = start..start + out.len() / m;
        rows_into(sel.path, w, &prepared, range, out).map_err(EngineError::Runtime)
    };
    if threads == 1 {
        run(0, &mut by_row)?;
    } else {
        let per = rows.div_ceil(threads);
        by_row
            .par_chunks_mut(per * m)
            .enumerate()
            .try_for_each(|(i, out)| run(i * per, out))?;
    }
    let mut y = Vec::new();
    by_token(&by_row, m, &mut y);
    Ok(y)
}

/// A mat-vec output in the kernel's layout (`rows × m`, by output feature) turned token-major
/// (`m × rows`) into `out`.
pub(super) fn by_token(by_row: &[f32], m: usize, out: &mut Vec<f32>) {
    let rows = by_row.len() / m;
    out.resize(by_row.len(), 0.0);
    if m == 1 {
        out.copy_from_slice(by_row);
        return;
    }
    for (r, vals) in by_row.chunks_exact(m).enumerate() {
        for (j, v) in vals.iter().enumerate() {
            out[j * rows + r] = *v;
        }
    }
}
