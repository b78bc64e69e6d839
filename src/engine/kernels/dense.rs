//! The host path of an f32 dense linear layer for single-token steps (`--host-sgemm on`, L1):
//! the weight is read in place from MLX's evaluated buffer and multiplied by
//! [`super::blas_order`] in OpenBLAS's own summation order, so the result has MLX's bits.
//!
//! "Has MLX's bits" is checked, not assumed: the first time a weight shape is used, the host
//! product of two fixed inputs is compared bit for bit with MLX's `x @ W.T` on the real
//! weight. A shape that differs (another BLAS, CPU or library version) stays on MLX for the
//! rest of the process; only speed is lost.

use super::blas_order::{self, Order};
use super::host::HostSlice;
use crate::engine::error::{EngineError, Result};
use mlx_rs::{ops, Array, Dtype};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// A 2-D f32 weight pinned in host memory, of a shape whose host product matched MLX's.
#[derive(Debug, Clone)]
pub struct HostDense {
    array: Array,
    weight: HostSlice<f32>,
    rows: usize,
    cols: usize,
    order: Order,
}

impl HostDense {
    /// Pins `weight` (`[rows, cols]` f32) when the host product of its shape matches MLX's;
    /// `None` keeps the layer on MLX.
    pub fn new(weight: &Array) -> Result<Option<Self>> {
        let shape = weight.shape();
        let order = match shape {
            [rows, cols] => blas_order::order(*rows as usize, *cols as usize),
            _ => return Ok(None),
        };
        Self::with_order(weight, order)
    }

    /// [`HostDense::new`] summing in `order` instead of the one OpenBLAS uses for this shape
    /// (tests: a wrong order must be caught by the check against MLX).
    pub fn with_order(weight: &Array, order: Order) -> Result<Option<Self>> {
        let shape = weight.shape();
        if shape.len() != 2 || weight.dtype() != Dtype::Float32 || !blas_order::available() {
            return Ok(None);
        }
        let (rows, cols) = (shape[0] as usize, shape[1] as usize);
        weight.eval()?;
        let me = Self {
            weight: HostSlice::of(weight, "f32 weight")?,
            array: weight.clone(),
            rows,
            cols,
            order,
        };
        Ok(me.matches_mlx()?.then_some(me))
    }

    /// Whether `x` is a single f32 token (`[..., cols]` with one row), the only case the host
    /// path reproduces.
    pub fn takes(x: &Array) -> bool {
        let last = x.shape().last().copied().unwrap_or(0).max(1) as usize;
        x.dtype() == Dtype::Float32 && x.size() == last
    }

    /// `x · Wᵀ` for one token; `None` when `x` is not a contiguous buffer the host can read
    /// (the caller then asks MLX).
    pub fn forward(&self, x: &Array) -> Result<Option<Array>> {
        let Ok(host) = x.try_as_slice::<f32>() else {
            return Ok(None);
        };
        let y = self.product(host)?;
        CALLS.fetch_add(1, Ordering::Relaxed);
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.rows as i32;
        }
        Ok(Some(Array::from_slice(&y, &shape)))
    }

    fn product(&self, x: &[f32]) -> Result<Vec<f32>> {
        blas_order::matvec(
            self.weight.get(),
            self.rows,
            self.cols,
            x,
            &self.order,
            rayon::current_num_threads(),
        )
        .map_err(|e| EngineError::Runtime(format!("f32 host product: {e}")))
    }

    /// Compares the host product with MLX's on two fixed inputs, once per weight shape (and
    /// order).
    fn matches_mlx(&self) -> Result<bool> {
        type Verdicts = Mutex<HashMap<(usize, usize, Order), bool>>;
        static VERDICTS: OnceLock<Verdicts> = OnceLock::new();
        let verdicts = VERDICTS.get_or_init(Default::default);
        let key = (self.rows, self.cols, self.order.clone());
        if let Some(v) = lock(verdicts).get(&key) {
            return Ok(*v);
        }
        let mut same = true;
        for seed in [0x9e37_79b9_u64, 0x2545_f491] {
            let x = probe(self.cols, seed);
            let ours = self.product(&x)?;
            let x_mlx = Array::from_slice(&x, &[1, self.cols as i32]);
            let theirs = ops::matmul(&x_mlx, self.array.t())?;
            let theirs = theirs.try_as_slice::<f32>().map_err(|e| {
                EngineError::Runtime(format!(
                    "cannot read MLX's product for the host check ({e})"
                ))
            })?;
            same &= ours
                .iter()
                .zip(theirs)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        }
        if !same {
            lock(refused()).push((self.rows, self.cols));
        }
        lock(verdicts).insert(key, same);
        Ok(same)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn refused() -> &'static Mutex<Vec<(usize, usize)>> {
    static REFUSED: OnceLock<Mutex<Vec<(usize, usize)>>> = OnceLock::new();
    REFUSED.get_or_init(Default::default)
}

/// `(rows, cols)` weight shapes whose host product differed from MLX's in this process (they
/// run on MLX); empty where the BLAS sums as [`blas_order`] expects.
pub fn refused_shapes() -> Vec<(usize, usize)> {
    lock(refused()).clone()
}

/// A fixed input with a wide spread of magnitudes and signs (so rounding differences show).
fn probe(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let mant = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let exp = ((s >> 8) % 9) as i32 - 4;
            mant * 2f32.powi(exp)
        })
        .collect()
}

static CALLS: AtomicUsize = AtomicUsize::new(0);

/// How many single-token f32 products the host path computed in this process (lets tests and
/// benchmarks check that `--host-sgemm on` really took it).
pub fn dense_calls() -> usize {
    CALLS.load(Ordering::Relaxed)
}

/// A [`HostDense`] decided on first use (the weight may still be lazy when a layer loads).
#[derive(Debug, Default)]
pub struct HostDenseCell(OnceLock<Option<HostDense>>);

impl HostDenseCell {
    /// The pinned weight, or `None` when its shape stays on MLX; decided on the first call.
    pub fn get(&self, weight: &Array) -> Result<Option<&HostDense>> {
        if let Some(h) = self.0.get() {
            return Ok(h.as_ref());
        }
        let h = HostDense::new(weight)?;
        Ok(self.0.get_or_init(|| h).as_ref())
    }
}
