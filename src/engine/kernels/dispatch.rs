//! Runtime selection of the quantized mat-vec kernel path (the best one this CPU runs, or the one
//! `MLXB_Q4_KERNEL` forces) and the row split over threads.
//!
//! `MLXB_Q4_KERNEL=avx512|avx2|scalar` forces a path for benchmarks; `MLXB_Q4_THREADS=N`
//! caps the threads one mat-vec uses (default: rayon's pool, i.e. one per core). Both are
//! read once per process.

use super::affine::{rows_into, KernelPath, Prepared, QMatrix};
use crate::engine::error::{EngineError, Result};
use rayon::prelude::*;
use std::ops::Range;
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
    let mut by_row = vec![0.0f32; w.rows() * m];
    matvecs(
        sel,
        vec![MatVec {
            w: *w,
            x: &prepared,
            out: &mut by_row,
        }],
    )?;
    if m == 1 {
        return Ok(by_row);
    }
    let mut y = vec![0.0f32; w.rows() * m];
    for (r, vals) in by_row.chunks_exact(m).enumerate() {
        for (mi, v) in vals.iter().enumerate() {
            y[mi * w.rows() + r] = *v;
        }
    }
    Ok(y)
}

/// One mat-vec of a batch for [`matvecs`]: `out = x · Wᵀ` in the kernel's layout (`rows × m`,
/// by output feature).
pub struct MatVec<'a> {
    /// The weight.
    pub w: QMatrix<'a>,
    /// The input, prepared for `w`'s bit width.
    pub x: &'a Prepared,
    /// `w.rows() × x.m()` outputs.
    pub out: &'a mut [f32],
}

/// A piece of one [`MatVec`]: the rows one thread computes.
type Part<'a> = (QMatrix<'a>, &'a Prepared, Range<usize>, &'a mut [f32]);

/// Runs independent mat-vecs (e.g. a layer's q/k/v projections) in one fork/join: every
/// job's rows are split over up to `sel.threads` threads, so the threads share each matrix
/// rather than each other's queue, and one small job does not leave a core idle.
pub fn matvecs(sel: Selection, jobs: Vec<MatVec<'_>>) -> Result<()> {
    let weights: usize = jobs.iter().map(|j| j.w.rows() * j.w.cols()).sum();
    let threads = if weights < PARALLEL_MIN_WEIGHTS {
        1
    } else {
        sel.threads.max(1)
    };
    let mut parts: Vec<Vec<Part<'_>>> = (0..threads).map(|_| Vec::new()).collect();
    for job in jobs {
        let (m, rows) = (job.x.m(), job.w.rows());
        let per = rows.div_ceil(threads).max(1);
        for (t, out) in job.out.chunks_mut(per * m).enumerate() {
            let start = t * per;
            parts[t].push((job.w, job.x, start..start + out.len() / m, out));
        }
    }
    let run = |part: Vec<Part<'_>>| -> Result<()> {
        for (w, x, rows, out) in part {
            rows_into(sel.path, &w, x, rows, out).map_err(EngineError::Runtime)?;
        }
        Ok(())
    };
    if threads == 1 {
        return parts.into_iter().try_for_each(run);
    }
    parts.into_par_iter().try_for_each(run)
}
