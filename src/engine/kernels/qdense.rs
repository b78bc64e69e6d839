//! The host path of an affine-quantized (2- to 8-bit) linear layer with f32 or bfloat16 scales at L1
//! (`--host-matvec on`): the packed weight is read in place from MLX's evaluated buffer (scales
//! and biases are kept widened to f32 beside it) and multiplied by [`super::quant_order`] in the
//! order MLX's CPU `quantized_matmul` sums them, so the result has MLX's bits.
//!
//! Checked, not assumed: the first time a layer shape is used with a given number of tokens (up
//! to [`MAX_TOKENS`]; longer products share one check at [`LONG_PROBE_TOKENS`], the order not
//! depending on the token count), the host product of two fixed inputs is compared bit for bit
//! with MLX's `quantized_matmul` on the real weight's first and last rows ([`probe_windows`]:
//! every output is its own sum, so the rows between take the same path; MLX's one-lane kernel
//! over a whole 150k-row vocabulary head would cost seconds per token count). A shape that
//! differs stays on MLX.

use super::dense::{probe_windows, LONG_PROBE_TOKENS};
use super::host::{check_bits, widened, HostSlice};
use super::lock;
use super::mlx_order::MAX_TOKENS;
use super::quant_order::{blocked, qmatmul, Path, QuantWeights};
use crate::engine::error::{EngineError, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array, Dtype};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// A 2-D 2- to 8-bit weight with f32 or bfloat16 scales and biases, pinned in host memory.
#[derive(Debug, Clone)]
pub struct HostQDense {
    arrays: [Array; 3],
    packed: HostSlice<u32>,
    /// The scales widened to f32 (exact), in the kernel's [`blocked`] layout.
    scales: Vec<f32>,
    /// The biases widened to f32 (exact), in the kernel's [`blocked`] layout.
    biases: Vec<f32>,
    /// The layer's dtype (that of its scales and of its inputs): f32 or bfloat16.
    dtype: Dtype,
    rows: usize,
    cols: usize,
    bits: usize,
    group: usize,
}

impl HostQDense {
    /// Pins the layer when its kind is one the host reproduces and its single-token product
    /// matched MLX's; `None` keeps it on MLX.
    pub fn new(
        weight: &Array,
        scales: &Array,
        biases: &Array,
        bits: i32,
        group: i32,
    ) -> Result<Option<Self>> {
        Ok(match Self::pinned(weight, scales, biases, bits, group)? {
            Some(me) if me.matches_mlx(1)? => Some(me),
            _ => None,
        })
    }

    /// Pins the layer when its kind is one the host kernel reads, without comparing with MLX
    /// (the L3 host step, which has no oracle); `None` for any other layer.
    pub fn pinned(
        weight: &Array,
        scales: &Array,
        biases: &Array,
        bits: i32,
        group: i32,
    ) -> Result<Option<Self>> {
        let (&[rows, packed_cols], &[_, groups]) = (weight.shape(), scales.shape()) else {
            return Ok(None);
        };
        if Path::best() == Path::Scalar
            || !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8)
            || !matches!(group, 32 | 64 | 128)
            || rows <= 0
            || weight.dtype() != Dtype::Uint32
            || ![Dtype::Float32, Dtype::Bfloat16].contains(&scales.dtype())
            || biases.dtype() != scales.dtype()
            || groups * group != packed_cols * 32 / bits
        {
            return Ok(None);
        }
        for a in [weight, scales, biases] {
            a.eval()?;
        }
        let me = Self {
            arrays: [weight.clone(), scales.clone(), biases.clone()],
            packed: HostSlice::of(weight, "packed weight")?,
            scales: blocked(&widened(scales)?, rows as usize, groups as usize),
            biases: blocked(&widened(biases)?, rows as usize, groups as usize),
            dtype: scales.dtype(),
            rows: rows as usize,
            cols: (packed_cols * 32 / bits) as usize,
            bits: bits as usize,
            group: group as usize,
        };
        Ok(Some(me))
    }

    /// The weight as the kernel reads it.
    pub(super) fn weights(&self) -> QuantWeights<'_> {
        QuantWeights {
            packed: self.packed.get(),
            scales: &self.scales,
            biases: &self.biases,
            rows: self.rows,
            cols: self.cols,
            bits: self.bits,
            group: self.group,
            bf16: self.dtype == Dtype::Bfloat16,
        }
    }

    /// `x · Wᵀ` for tokens of the layer's dtype (`[..., cols]`); `None` when `x` is not such an
    /// input in a buffer the host can read, or when MLX sums this product otherwise (the caller
    /// then asks MLX).
    pub fn forward(&self, x: &Array) -> Result<Option<Array>> {
        if x.dtype() != self.dtype || x.size() == 0 || !x.size().is_multiple_of(self.cols) {
            return Ok(None);
        }
        let tokens = x.size() / self.cols;
        let checked = if tokens > MAX_TOKENS {
            LONG_PROBE_TOKENS
        } else {
            tokens
        };
        if !self.matches_mlx(checked)? {
            return Ok(None);
        }
        self.product(x, tokens)
    }

    fn product(&self, x: &Array, tokens: usize) -> Result<Option<Array>> {
        let y = self.rows_product(0..self.rows, x, tokens)?;
        CALLS.fetch_add(1, Ordering::Relaxed);
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.rows as i32;
        }
        Ok(Some(y.reshape(&shape)?))
    }

    /// Outputs `rows` of `x · Wᵀ` as a `tokens × rows.len()` array of the layer's dtype.
    fn rows_product(
        &self,
        rows: std::ops::Range<usize>,
        x: &Array,
        tokens: usize,
    ) -> Result<Array> {
        let all = self.weights();
        let (words, groups) = (all.packed.len() / self.rows, all.scales.len() / self.rows);
        let part = QuantWeights {
            packed: &all.packed[rows.start * words..rows.end * words],
            scales: &all.scales[rows.start * groups..rows.end * groups],
            biases: &all.biases[rows.start * groups..rows.end * groups],
            rows: rows.len(),
            ..all
        };
        let host = widened(&x.contiguous()?)?;
        let y = qmatmul(&part, &host, tokens, rayon::current_num_threads())
            .map_err(|e| EngineError::Runtime(format!("host quantized product: {e}")))?;
        let shape = [tokens as i32, rows.len() as i32];
        // A bfloat16 layer's sums are bfloat16 values already (MLX rounds each step).
        Ok(if self.dtype == Dtype::Bfloat16 {
            let y: Vec<half::bf16> = y.into_iter().map(half::bf16::from_f32).collect();
            Array::from_slice(&y, &shape)
        } else {
            Array::from_slice(&y, &shape)
        })
    }

    /// Compares the host product of `tokens` tokens with MLX's on two fixed inputs, once per
    /// layer shape, bits, group size and token count.
    fn matches_mlx(&self, tokens: usize) -> Result<bool> {
        let key = (
            self.rows, self.cols, self.bits, self.group, self.dtype, tokens,
        );
        if let Some(v) = lock(verdicts()).get(&key) {
            return Ok(*v);
        }
        let mut same = true;
        for seed in [0x2545_f491_u64, 0x9e37_79b9] {
            let x = super::elementwise::probe_values(tokens * self.cols, seed)
                .into_iter()
                .map(|v| v.clamp(-8.0, 8.0))
                .collect::<Vec<f32>>();
            let x =
                Array::from_slice(&x, &[tokens as i32, self.cols as i32]).as_dtype(self.dtype)?;
            for rows in probe_windows(self.rows) {
                let ours = self.rows_product(rows.clone(), &x, tokens)?;
                let window = rows.start as i32..rows.end as i32;
                let [w, s, b] = self.arrays.each_ref().map(|a| a.index(window.clone()));
                let (group, bits) = (self.group as i32, self.bits as i32);
                let theirs = ops::quantized_matmul(&x, &w, &s, &b, true, group, bits)?;
                same &= check_bits(&ours)? == check_bits(&theirs)?;
            }
        }
        lock(verdicts()).insert(key, same);
        Ok(same)
    }
}

/// What one check decides: (rows, cols, bits, group size, dtype, tokens).
type Verdicts = Mutex<HashMap<(usize, usize, usize, usize, Dtype, usize), bool>>;

/// The check's verdicts for this process.
fn verdicts() -> &'static Verdicts {
    static V: OnceLock<Verdicts> = OnceLock::new();
    V.get_or_init(Default::default)
}

static CALLS: AtomicUsize = AtomicUsize::new(0);

/// How many products the quantized host path computed in this process.
pub fn qdense_calls() -> usize {
    CALLS.load(Ordering::Relaxed)
}

/// A layer's [`HostQDense`], decided on first use (the weights may still be lazy at load).
#[derive(Debug, Default)]
pub struct HostQDenseCell(OnceLock<Option<HostQDense>>);

impl HostQDenseCell {
    /// The pinned layer, or `None` when it stays on MLX.
    pub fn get(
        &self,
        weight: &Array,
        scales: &Array,
        biases: &Array,
        bits: i32,
        group: i32,
    ) -> Result<Option<&HostQDense>> {
        if let Some(h) = self.0.get() {
            return Ok(h.as_ref());
        }
        let h = HostQDense::new(weight, scales, biases, bits, group)?;
        Ok(self.0.get_or_init(|| h).as_ref())
    }
}
