//! The host path of a dense (f32, bf16 or f16) linear layer for single-token steps
//! (`--host-matvec on`, L1): the weight is read in place from MLX's evaluated buffer and
//! multiplied by [`super::mlx_order`] in the order MLX's CPU matmul sums it, so the result has
//! MLX's bits.
//!
//! "Has MLX's bits" is checked, not assumed: the first time a weight shape and dtype is used,
//! the host product of two fixed inputs is compared bit for bit with MLX's `x @ W.T` on the
//! real weight. A shape that differs (another BLAS, CPU or library version) stays on MLX for
//! the rest of the process; only speed is lost.

use super::host::{check_bits, HostSlice};
use super::lock;
use super::mlx_order::{self, Order, Weights};
use crate::engine::error::{EngineError, Result};
use mlx_rs::{ops, Array, Dtype};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// A pinned weight buffer in one of the dtypes the kernels read.
#[derive(Debug, Clone, Copy)]
enum Pinned {
    F32(HostSlice<f32>),
    Bf16(HostSlice<half::bf16>),
    F16(HostSlice<half::f16>),
}

/// A 2-D dense weight pinned in host memory, of a shape whose host product matched MLX's.
#[derive(Debug, Clone)]
pub struct HostDense {
    array: Array,
    pinned: Pinned,
    rows: usize,
    cols: usize,
    order: Order,
}

impl HostDense {
    /// Pins `weight` (`[rows, cols]` f32, bf16 or f16) when the host product of its shape
    /// matches MLX's; `None` keeps the layer on MLX.
    pub fn new(weight: &Array) -> Result<Option<Self>> {
        Self::pin(weight, None)
    }

    /// [`HostDense::new`] summing in `order` instead of the one MLX uses for this shape
    /// (tests: a wrong order must be caught by the check against MLX).
    pub fn with_order(weight: &Array, order: Order) -> Result<Option<Self>> {
        Self::pin(weight, Some(order))
    }

    fn pin(weight: &Array, order: Option<Order>) -> Result<Option<Self>> {
        let [rows, cols] = *weight.shape() else {
            return Ok(None);
        };
        if !mlx_order::available() || rows <= 0 || cols <= 0 {
            return Ok(None);
        }
        weight.eval()?;
        let pinned = match weight.dtype() {
            Dtype::Float32 => Pinned::F32(HostSlice::of(weight, "f32 weight")?),
            Dtype::Bfloat16 => Pinned::Bf16(HostSlice::of(weight, "bf16 weight")?),
            Dtype::Float16 => Pinned::F16(HostSlice::of(weight, "f16 weight")?),
            _ => return Ok(None),
        };
        let (rows, cols) = (rows as usize, cols as usize);
        let mut me = Self {
            array: weight.clone(),
            pinned,
            rows,
            cols,
            order: Order::Sequential,
        };
        me.order = order.unwrap_or_else(|| me.weights().order(rows, cols));
        Ok(me.matches_mlx()?.then_some(me))
    }

    fn weights(&self) -> Weights<'_> {
        match &self.pinned {
            Pinned::F32(s) => Weights::F32(s.get()),
            // SAFETY: `half::bf16` and `half::f16` are `repr(transparent)` over `u16`.
            Pinned::Bf16(s) => Weights::Bf16(unsafe { bits_of(s.get()) }),
            Pinned::F16(s) => Weights::F16(unsafe { bits_of(s.get()) }),
        }
    }

    /// Whether `x` is a single token (`[..., cols]` with one row), the only case the host path
    /// reproduces (checked before a weight is pinned, so prompts never pin).
    pub fn takes(x: &Array) -> bool {
        let last = x.shape().last().copied().unwrap_or(0).max(1) as usize;
        x.size() == last
    }

    /// `x · Wᵀ` for one token of the weight's dtype; `None` when `x` is not such a token in a
    /// buffer the host can read (the caller then asks MLX).
    pub fn forward(&self, x: &Array) -> Result<Option<Array>> {
        if x.dtype() != self.array.dtype() || x.size() != self.cols {
            return Ok(None);
        }
        // A 16-bit token widens to f32 exactly (MLX's `simd_gemm` does the same).
        let wide = match x.dtype() {
            Dtype::Float32 => x.clone(),
            _ => x.as_dtype(Dtype::Float32)?,
        };
        let Ok(host) = wide.try_as_slice::<f32>() else {
            return Ok(None);
        };
        let y = mlx_order::matvec(
            self.weights(),
            self.rows,
            self.cols,
            host,
            &self.order,
            rayon::current_num_threads(),
        )
        .map_err(|e| EngineError::Runtime(format!("host product: {e}")))?;
        CALLS.fetch_add(1, Ordering::Relaxed);
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.rows as i32;
        }
        let y = Array::from_slice(&y, &shape);
        // MLX rounds a 16-bit product's f32 sum to the dtype; its own cast rounds the same way.
        Ok(Some(match x.dtype() {
            Dtype::Float32 => y,
            dtype => y.as_dtype(dtype)?,
        }))
    }

    /// Compares the host product with MLX's on two fixed inputs, once per weight shape, dtype
    /// and order.
    fn matches_mlx(&self) -> Result<bool> {
        let dtype = self.array.dtype();
        let key = (self.rows, self.cols, dtype, self.order.clone());
        if let Some(v) = lock(verdicts()).get(&key) {
            return Ok(*v);
        }
        let mut same = true;
        for seed in [0x9e37_79b9_u64, 0x2545_f491] {
            let x = Array::from_slice(&probe(self.cols, seed), &[1, self.cols as i32])
                .as_dtype(dtype)?;
            let Some(ours) = self.forward(&x)? else {
                return Err(EngineError::Runtime(
                    "the host product refused its own check input".into(),
                ));
            };
            let theirs = ops::matmul(&x, self.array.t())?;
            same &= check_bits(&ours)? == check_bits(&theirs)?;
        }
        lock(verdicts()).insert(key, same);
        Ok(same)
    }
}

/// The bits of a 16-bit float slice.
///
/// # Safety
/// `T` must be a `repr(transparent)` wrapper of `u16`.
unsafe fn bits_of<T>(s: &[T]) -> &[u16] {
    std::slice::from_raw_parts(s.as_ptr().cast(), s.len())
}

/// The check's verdict per `(rows, cols, dtype, order)`, for this process.
type Verdicts = Mutex<HashMap<(usize, usize, Dtype, Order), bool>>;

fn verdicts() -> &'static Verdicts {
    static VERDICTS: OnceLock<Verdicts> = OnceLock::new();
    VERDICTS.get_or_init(Default::default)
}

/// `(rows, cols)` weight shapes whose host product differed from MLX's in this process (they
/// run on MLX); empty where MLX sums as [`mlx_order`] expects.
pub fn refused_shapes() -> Vec<(usize, usize)> {
    let mut shapes: Vec<_> = lock(verdicts())
        .iter()
        .filter(|(_, same)| !**same)
        .map(|((rows, cols, ..), _)| (*rows, *cols))
        .collect();
    shapes.sort_unstable();
    shapes.dedup();
    shapes
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

/// How many single-token products the host path computed in this process (lets tests and
/// benchmarks check that `--host-matvec on` really took it).
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
