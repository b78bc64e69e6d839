//! The host path of a dense (f32, bf16 or f16) linear layer (`--host-matvec on`, L1) for decode
//! steps and speculative verify blocks of up to [`MAX_TOKENS`] tokens, and for prompts of any
//! length through 16-bit weights: the weight is read in place from MLX's evaluated buffer and
//! multiplied by [`super::mlx_order`] in the order MLX's CPU matmul sums it, so the result has
//! MLX's bits.
//!
//! "Has MLX's bits" is checked, not assumed: the first time a weight shape and dtype is used
//! with a given number of tokens, the host product of two fixed inputs is compared bit for bit
//! with MLX's `x @ W.T` on the real weight. A shape that differs (another BLAS, CPU or library
//! version) stays on MLX for that token count for the rest of the process (a shape refused for
//! one token is never pinned); only speed is lost. Products longer than [`MAX_TOKENS`] (16-bit
//! only, where the order does not depend on the token count) share one check, made with
//! [`LONG_PROBE_TOKENS`] tokens. A 16-bit check runs through the rows of [`probe_windows`] only:
//! MLX's `simd_gemm` sums each output alone, in an order that does not depend on which rows sit
//! beside it, and over a whole vocabulary head it is slow (each new verify-block width of a bf16
//! model cost up to a second). An f32 check keeps every row: OpenBLAS picks its kernels by the
//! matrix's size.

use super::elementwise::{bf16_mlx, bits_of, round_bf16};
use super::host::{check_bits, widened, HostSlice};
use super::lock;
use super::mlx_order::{self, Order, Weights, MAX_TOKENS};
use super::packed::PackedRows;
use crate::engine::error::{EngineError, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array, Dtype};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// A pinned weight buffer in one of the dtypes the kernels read.
#[derive(Debug, Clone, Copy)]
enum Pinned {
    F32(HostSlice<f32>),
    Bf16(HostSlice<half::bf16>),
    F16(HostSlice<half::f16>),
}

/// A 2-D dense weight pinned in host memory, of a shape whose single-token host product
/// matched MLX's.
#[derive(Debug, Clone)]
pub struct HostDense {
    array: Array,
    pinned: Pinned,
    rows: usize,
    cols: usize,
    /// The single-token order to use instead of MLX's (tests of the check).
    forced: Option<Order>,
    /// The copy for the host decode step, made at the step's first use ([`HostDense::packed`]);
    /// shared by the clones the step holds.
    packed: std::sync::Arc<OnceLock<Option<PackedRows>>>,
    /// The copy for the step's verify blocks of an f32 weight that has no single-token copy
    /// (its one-token product takes OpenBLAS's small-matrix kernel, a block of a few tokens
    /// its GEMM driver's panels): made when the host step asks for it once such blocks recur
    /// ([`HostDense::check_packed`]), so only speculative decoding pays its memory.
    block_packed: std::sync::Arc<OnceLock<Option<PackedRows>>>,
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
        let me = Self {
            array: weight.clone(),
            pinned,
            rows: rows as usize,
            cols: cols as usize,
            forced: order,
            packed: Default::default(),
            block_packed: Default::default(),
        };
        // A one-token product this CPU's kernels cannot sum in MLX's order (the small-matrix
        // order on the AVX2 path) stays on MLX.
        if !mlx_order::takes_tokens(&me.order(1), 1) {
            return Ok(None);
        }
        Ok(me.matches_mlx(1, None)?.then_some(me))
    }

    /// The order of a product of `tokens` tokens.
    fn order(&self, tokens: usize) -> Order {
        match &self.forced {
            Some(order) if tokens == 1 => order.clone(),
            _ => self
                .weights(0..self.rows)
                .order(self.rows, self.cols, tokens),
        }
    }

    /// The first `rows` rows of the weight.
    fn weights(&self, rows: Range<usize>) -> Weights<'_> {
        let n = rows.start * self.cols..rows.end * self.cols;
        match &self.pinned {
            Pinned::F32(s) => Weights::F32(&s.get()[n]),
            // SAFETY: `half::bf16` and `half::f16` are `repr(transparent)` over `u16`.
            Pinned::Bf16(s) => Weights::Bf16(unsafe { &bits_of(s.get())[n] }),
            Pinned::F16(s) => Weights::F16(unsafe { &bits_of(s.get())[n] }),
        }
    }

    /// The pinned f32 weight (`rows × cols`, row-major) and its shape, for the host decode
    /// step; `None` for a 16-bit weight.
    pub fn f32_weight(&self) -> Option<(&[f32], usize, usize)> {
        match &self.pinned {
            Pinned::F32(s) => Some((s.get(), self.rows, self.cols)),
            _ => None,
        }
    }

    /// The weight's dtype.
    pub fn dtype(&self) -> Dtype {
        self.array.dtype()
    }

    /// The pinned bfloat16 weight's bits (`rows × cols`, row-major) and its shape, for the
    /// host decode step; `None` for another dtype.
    pub fn bf16_weight(&self) -> Option<(&[u16], usize, usize)> {
        match &self.pinned {
            // SAFETY: `half::bf16` is `repr(transparent)` over `u16`.
            Pinned::Bf16(s) => Some((unsafe { bits_of(s.get()) }, self.rows, self.cols)),
            _ => None,
        }
    }

    /// The weight re-laid for the host decode step's products ([`PackedRows`]): a bfloat16
    /// weight, or an f32 one whose single-token product OpenBLAS sums in panels (its GEMM
    /// driver). Made at the first call and kept when its single-token product matched MLX's;
    /// it computes the products of the token counts [`HostDense::check_packed`] has found to
    /// match too. `None` for f16, an f32 weight on the small-matrix kernel, a shape it does
    /// not take, or a single-token product that differed.
    pub fn packed(&self) -> Result<Option<&PackedRows>> {
        if let Some(p) = self.packed.get() {
            return Ok(p.as_ref());
        }
        let packed = match (&self.pinned, self.order(1)) {
            (Pinned::Bf16(_), _) => self
                .bf16_weight()
                .and_then(|(w, rows, cols)| PackedRows::bf16(w, rows, cols)),
            (Pinned::F32(w), Order::Panels(panels)) if self.forced.is_none() => {
                PackedRows::f32(w.get(), self.rows, self.cols, &panels)
            }
            _ => None,
        };
        let packed = match packed {
            Some(p) if self.packed_matches_mlx(&p, 1)? => {
                p.set_checked(1);
                Some(p)
            }
            _ => None,
        };
        Ok(self.packed.get_or_init(|| packed).as_ref())
    }

    /// Lets the packed copy (made now if it was not) compute products of `tokens` tokens when
    /// they are summed in its order and matched MLX's (bfloat16 on the rows of
    /// [`probe_windows`], f32 on every row; checked once per shape, dtype and token count: the
    /// packed sums do not depend on the values). Run where MLX may run (the step's caller), at
    /// the first block of each size.
    /// `make_block_copy`: whether a weight without a single-token copy may get its verify
    /// blocks' copy now (see [`HostDense::step_copy`]); without it only a copy made earlier is
    /// checked.
    pub fn check_packed(&self, tokens: usize, make_block_copy: bool) -> Result<()> {
        let order = self.order(tokens);
        let copy = match self.step_copy()? {
            None if make_block_copy => self.block_packed(&order),
            copy => copy,
        };
        if let Some(p) = copy {
            if p.sums_in(&order) && self.packed_matches_mlx(p, tokens)? {
                p.set_checked(tokens);
            }
        }
        Ok(())
    }

    /// The verify blocks' copy (the `block_packed` field), made now when a block in `order` is
    /// the first to sum an f32 weight without a single-token copy in panels. Writing it costs
    /// about as much as a hundred verify rounds save (0.4 s for SmolLM2's 212 MB on a 2-core
    /// VM), so the host step asks for it only once blocks of a size recur
    /// ([`crate::engine::models::host_step`]).
    fn block_packed(&self, order: &Order) -> Option<&PackedRows> {
        if let Some(p) = self.block_packed.get() {
            return p.as_ref();
        }
        let copy = match (&self.pinned, order) {
            (Pinned::F32(w), Order::Panels(panels)) if self.forced.is_none() => {
                PackedRows::f32(w.get(), self.rows, self.cols, panels)
            }
            // Undecided: a longer block may still sum in panels.
            _ => return None,
        };
        self.block_packed.get_or_init(|| copy).as_ref()
    }

    /// The packed copy the host step's products read where it takes their token count
    /// ([`PackedRows::takes`]): the single-token copy, else the verify blocks' one once made.
    pub fn step_copy(&self) -> Result<Option<&PackedRows>> {
        Ok(match self.packed()? {
            Some(p) => Some(p),
            None => self.block_packed.get().and_then(Option::as_ref),
        })
    }

    /// Whether the packed product of `tokens` tokens matches MLX's (decided once per shape,
    /// dtype and token count).
    fn packed_matches_mlx(&self, packed: &PackedRows, tokens: usize) -> Result<bool> {
        type Verdicts = Mutex<HashMap<(usize, usize, Dtype, usize), bool>>;
        static VERDICTS: OnceLock<Verdicts> = OnceLock::new();
        let verdicts = VERDICTS.get_or_init(Default::default);
        let key = (self.rows, self.cols, self.array.dtype(), tokens);
        if let Some(v) = lock(verdicts).get(&key) {
            return Ok(*v);
        }
        let same = self.packed_products_match_mlx(packed, tokens)?;
        lock(verdicts).insert(key, same);
        Ok(same)
    }

    fn packed_products_match_mlx(&self, packed: &PackedRows, tokens: usize) -> Result<bool> {
        let dtype = self.array.dtype();
        let windows = if dtype == Dtype::Float32 {
            std::iter::once(0..self.rows).collect()
        } else {
            probe_windows(self.rows)
        };
        let x = Array::from_slice(
            &probe(tokens * self.cols, 0x6a09_e667 + tokens as u64),
            &[tokens as i32, self.cols as i32],
        )
        .as_dtype(dtype)?;
        let wide = x.as_dtype(Dtype::Float32)?;
        let wide = wide.try_as_slice::<f32>().map_err(|e| {
            EngineError::Runtime(format!("cannot read a packed product's check input ({e})"))
        })?;
        for window in &windows {
            let rows = packed.groups_within(window);
            if rows.is_empty() {
                continue;
            }
            let mut ours = vec![0.0f32; tokens * rows.len()];
            packed
                .check_rows_into(wide, tokens, rows.clone(), &mut ours)
                .map_err(|e| EngineError::Runtime(format!("packed host product: {e}")))?;
            if dtype == Dtype::Bfloat16 {
                round_bf16(&mut ours);
            }
            // MLX's product over the whole window (for f32 every row: OpenBLAS picks its
            // kernels by the product's size), of which the packed rows are a part.
            let weight = self.array.index(window.start as i32..window.end as i32);
            let theirs = check_bits(&ops::matmul(&x, weight.t())?)?;
            let width = window.len();
            let same = (0..tokens).all(|t| {
                let mine = &ours[t * rows.len()..(t + 1) * rows.len()];
                let at = t * width + rows.start - window.start;
                mine.iter()
                    .map(|v| v.to_bits())
                    .eq(theirs[at..at + rows.len()].iter().copied())
            });
            if !same {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether a product of `tokens` tokens through this weight is summed on the host in MLX's
    /// order on this CPU and matched MLX's own (checked once per shape and token count).
    pub fn accepts(&self, tokens: usize) -> Result<bool> {
        Ok(mlx_order::takes_tokens(&self.order(tokens), tokens)
            && self.matches_mlx(checked_tokens(tokens), None)?)
    }

    /// Whether `x` (`[..., cols]`) is a product the host path may reproduce: 16-bit tokens of
    /// any number, f32 up to [`MAX_TOKENS`] (checked before a weight is pinned, so long f32
    /// prompts never pin).
    pub fn takes(x: &Array) -> bool {
        let last = x.shape().last().copied().unwrap_or(0).max(1) as usize;
        x.dtype() != Dtype::Float32 || x.size() <= MAX_TOKENS * last
    }

    /// `x · Wᵀ` for a product of the weight's dtype the host path reproduces
    /// ([`mlx_order::takes_tokens`]); `None` when `x` is not such a product in a buffer the host
    /// can read, or when MLX sums it otherwise (the caller then asks MLX).
    pub fn forward(&self, x: &Array) -> Result<Option<Array>> {
        self.forward_with(x, None)
    }

    /// `bias + x · Wᵀ` as MLX's `addmm` computes it for a 16-bit layer (`simd_gemm` adds the
    /// widened bias to each output's f32 sum and rounds once): qwen2's q/k/v projections.
    /// `None` leaves it to MLX: f32 layers (OpenBLAS adds the bias its own way), a bias of
    /// another dtype or shape, or an order that differs.
    pub fn forward_biased(&self, x: &Array, bias: &Array) -> Result<Option<Array>> {
        if self.array.dtype() == Dtype::Float32
            || bias.dtype() != self.array.dtype()
            || bias.shape() != [self.rows as i32]
        {
            return Ok(None);
        }
        self.forward_with(x, Some(bias))
    }

    fn forward_with(&self, x: &Array, bias: Option<&Array>) -> Result<Option<Array>> {
        if x.dtype() != self.array.dtype() || !x.size().is_multiple_of(self.cols) {
            return Ok(None);
        }
        let tokens = x.size() / self.cols;
        if !mlx_order::takes_tokens(&self.order(tokens), tokens)
            || !self.matches_mlx(checked_tokens(tokens), bias)?
        {
            return Ok(None);
        }
        let bias = bias.map(widened).transpose()?;
        let y = self.product_rows(x, tokens, 0..self.rows, bias.as_deref())?;
        if y.is_some() && self.packed_for(tokens)?.is_some() {
            PACKED_CALLS.fetch_add(1, Ordering::Relaxed);
        }
        Ok(y)
    }

    /// [`HostDense::product`] through the weight's first `rows` rows only (the outputs of the
    /// others are summed alone and in the same order, so the check needs no more).
    fn product_rows(
        &self,
        x: &Array,
        tokens: usize,
        rows: Range<usize>,
        bias: Option<&[f32]>,
    ) -> Result<Option<Array>> {
        // A 16-bit token widens to f32 exactly (MLX's `simd_gemm` does the same); bfloat16 is
        // widened here, so a host-resident input (a host product's or host SwiGLU's result)
        // costs MLX no operation.
        // A strided view (a prompt's attention output, transposed back to token-major) is
        // copied into row order first; a contiguous array is shared as it is.
        let contiguous;
        let x = if is_row_contiguous(x)? {
            x
        } else {
            contiguous = x.contiguous()?;
            &contiguous
        };
        // A prompt's buffers are reused from product to product: fresh ones cost zero-filling
        // and page faults at every call.
        let mut fresh = Scratch::default();
        let mut kept =
            SCRATCH.with(|s| s.try_borrow_mut().ok().map(|mut s| std::mem::take(&mut *s)));
        let scratch = kept.as_mut().unwrap_or(&mut fresh);
        let wide_array: Array;
        let host: &[f32] = match x.dtype() {
            Dtype::Float32 => match x.try_as_slice::<f32>() {
                Ok(s) => s,
                Err(_) => return Ok(None),
            },
            Dtype::Bfloat16 => match x.try_as_slice::<half::bf16>() {
                Ok(s) => {
                    scratch.input.clear();
                    scratch.input.extend(s.iter().map(|v| v.to_f32()));
                    &scratch.input
                }
                Err(_) => return Ok(None),
            },
            _ => {
                wide_array = x.as_dtype(Dtype::Float32)?;
                match wide_array.try_as_slice::<f32>() {
                    Ok(s) => s,
                    Err(_) => return Ok(None),
                }
            }
        };
        let n = tokens * rows.len();
        let row_major;
        let y: &mut [f32] = match self.packed_for(tokens)? {
            Some(packed) => {
                if scratch.output.len() < n {
                    scratch.output.resize(n, 0.0);
                }
                let y = &mut scratch.output[..n];
                self.packed_product(packed, host, tokens, rows.clone(), y)
                    .map_err(|e| EngineError::Runtime(format!("host product: {e}")))?;
                y
            }
            None => {
                row_major = self
                    .row_major_product(host, tokens, rows.clone())
                    .map_err(|e| EngineError::Runtime(format!("host product: {e}")))?;
                scratch.output = row_major;
                &mut scratch.output[..n]
            }
        };
        if let Some(bias) = bias {
            for out in y.chunks_exact_mut(rows.len()) {
                for (o, b) in out.iter_mut().zip(&bias[rows.clone()]) {
                    *o += b;
                }
            }
        }
        CALLS.fetch_add(1, Ordering::Relaxed);
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = rows.len() as i32;
        }
        // MLX rounds a 16-bit product's f32 sum to the dtype: bfloat16 here with MLX's
        // rounding, f16 by MLX's own cast.
        let out = match x.dtype() {
            Dtype::Float32 => Array::from_slice(y, &shape),
            Dtype::Bfloat16 => {
                scratch.narrow.clear();
                scratch.narrow.extend(y.iter().map(|v| bf16_mlx(*v)));
                Array::from_slice(&scratch.narrow, &shape)
            }
            dtype => Array::from_slice(y, &shape).as_dtype(dtype)?,
        };
        if let Some(kept) = kept.filter(|k| k.output.capacity() <= SCRATCH_KEPT_VALUES) {
            SCRATCH.with(|s| {
                if let Ok(mut s) = s.try_borrow_mut() {
                    *s = kept;
                }
            });
        }
        Ok(Some(out))
    }

    /// The packed copy a product of `tokens` tokens through [`HostDense::product_rows`] reads
    /// (made at the first such product, see [`HostDense::packed`]): a bfloat16 weight's for
    /// any number of tokens (one chain per output whatever the count, so prompts take it too),
    /// an f32 one's for a single token summed in panels (OpenBLAS's GEMM driver), as the host
    /// step's products read them. `None` for other products, or where no copy matched MLX.
    fn packed_for(&self, tokens: usize) -> Result<Option<&PackedRows>> {
        let order = self.order(tokens);
        let packs = match order {
            Order::Sequential => true,
            Order::Panels(_) => tokens == 1,
            Order::Lanes => false,
        };
        if !packs {
            return Ok(None);
        }
        Ok(self.packed()?.filter(|p| p.sums_in(&order)))
    }

    /// `x · Wᵀ` through rows `rows` on the row-major kernels (`tokens × rows.len()`).
    fn row_major_product(
        &self,
        x: &[f32],
        tokens: usize,
        rows: Range<usize>,
    ) -> std::result::Result<Vec<f32>, String> {
        mlx_order::matmul(
            self.weights(rows.clone()),
            rows.len(),
            self.cols,
            x,
            tokens,
            &self.order(tokens),
            rayon::current_num_threads(),
        )
    }

    /// [`HostDense::row_major_product`] with the whole groups of `rows` read from the packed
    /// copy instead, written in place; the rows before and after them (off the groups, or past
    /// the copy) on the row-major kernels. The same sums: only the layout read differs.
    fn packed_product(
        &self,
        packed: &PackedRows,
        x: &[f32],
        tokens: usize,
        rows: Range<usize>,
        y: &mut [f32],
    ) -> std::result::Result<(), String> {
        let inner = packed.groups_within(&rows);
        let width = rows.len();
        let at = inner.start - rows.start;
        if !inner.is_empty() {
            packed.rows_into_shared(x, tokens, inner.clone(), &mut y[at..], width)?;
        }
        for part in [rows.start..inner.start, inner.end..rows.end] {
            if part.is_empty() {
                continue;
            }
            let at = part.start - rows.start;
            let part_y = self.row_major_product(x, tokens, part.clone())?;
            for (t, values) in part_y.chunks_exact(part.len()).enumerate() {
                y[t * width + at..][..part.len()].copy_from_slice(values);
            }
        }
        Ok(())
    }

    /// Compares the host product of `tokens` tokens with MLX's on two fixed inputs, once per
    /// weight shape, dtype, order and token count.
    fn matches_mlx(&self, tokens: usize, bias: Option<&Array>) -> Result<bool> {
        let dtype = self.array.dtype();
        let key = Verdict {
            rows: self.rows,
            cols: self.cols,
            dtype,
            order: self.order(tokens),
            tokens,
            biased: bias.is_some(),
            packed: self.packed_for(tokens)?.is_some(),
        };
        if let Some(v) = lock(verdicts()).get(&key) {
            return Ok(*v);
        }
        // A 16-bit check runs on a few rows only (see the module's documentation).
        let windows = if dtype == Dtype::Float32 {
            std::iter::once(0..self.rows).collect()
        } else {
            probe_windows(self.rows)
        };
        let mut same = true;
        for seed in [0x9e37_79b9_u64, 0x2545_f491] {
            let shape = [tokens as i32, self.cols as i32];
            let x = Array::from_slice(&probe(tokens * self.cols, seed), &shape).as_dtype(dtype)?;
            let widened = bias.map(widened).transpose()?;
            for rows in &windows {
                let ours = self.product_rows(&x, tokens, rows.clone(), widened.as_deref())?;
                let Some(ours) = ours else {
                    return Err(EngineError::Runtime(
                        "the host product refused its own check input".into(),
                    ));
                };
                let window = rows.start as i32..rows.end as i32;
                let weight = self.array.index(window.clone());
                let theirs = match bias {
                    Some(b) => ops::addmm(b.index(window), &x, weight.t(), None, None)?,
                    None => ops::matmul(&x, weight.t())?,
                };
                same &= check_bits(&ours)? == check_bits(&theirs)?;
            }
        }
        lock(verdicts()).insert(key, same);
        Ok(same)
    }
}

/// Whether `x`'s data, once evaluated, is in row-major order (what the host reads).
fn is_row_contiguous(x: &Array) -> Result<bool> {
    x.eval()?;
    let mut contiguous = false;
    // SAFETY: reads a flag of a live, evaluated array handle.
    let status = unsafe { mlx_sys::_mlx_array_is_row_contiguous(&mut contiguous, x.as_ptr()) };
    Ok(status == 0 && contiguous)
}

/// Tokens the check of products longer than [`MAX_TOKENS`] uses: past one of `simd_gemm`'s
/// 16-token tiles into the next, and past the host kernel's switch to packed weights.
pub const LONG_PROBE_TOKENS: usize = 2 * MAX_TOKENS + 3;

/// Rows a check compares on a large layer: all of a small one; else the first 64 (four of the
/// kernels' 16-row groups, and of `simd_gemm`'s 16-column tiles) and the last 48 to 63 (the last
/// whole groups of sixteen and the rows past them, which the kernels' tail code takes), each
/// window starting on a multiple of sixteen as the products' own chunks do.
pub(super) fn probe_windows(rows: usize) -> Vec<Range<usize>> {
    const HEAD: usize = 64;
    if rows <= 2 * HEAD {
        return std::iter::once(0..rows).collect();
    }
    let tail_start = (rows / 16 * 16).saturating_sub(48);
    vec![0..HEAD, tail_start..rows]
}

/// The token count whose check decides a product of `tokens` tokens: its own up to
/// [`MAX_TOKENS`], [`LONG_PROBE_TOKENS`] past it (only the 16-bit order goes there, and its
/// sums do not depend on the token count).
fn checked_tokens(tokens: usize) -> usize {
    if tokens > MAX_TOKENS {
        LONG_PROBE_TOKENS
    } else {
        tokens
    }
}

/// What one check decides: a weight shape and dtype summed in one order for a token count.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Verdict {
    rows: usize,
    cols: usize,
    dtype: Dtype,
    order: Order,
    tokens: usize,
    /// `addmm` with a bias, not a plain product.
    biased: bool,
    /// Read from the packed copy ([`HostDense::packed_for`]), not the row-major weight.
    packed: bool,
}

/// The check's verdicts, for this process.
type Verdicts = Mutex<HashMap<Verdict, bool>>;

fn verdicts() -> &'static Verdicts {
    static VERDICTS: OnceLock<Verdicts> = OnceLock::new();
    VERDICTS.get_or_init(Default::default)
}

/// `(rows, cols)` weight shapes whose single-token host product differed from MLX's in this
/// process (they run on MLX); empty where MLX sums as [`mlx_order`] expects.
pub fn refused_shapes() -> Vec<(usize, usize)> {
    refused(|v| v.tokens == 1)
        .into_iter()
        .map(|(rows, cols, _)| (rows, cols))
        .collect()
}

/// `(rows, cols, tokens)` blocks of more than one token whose host product differed from
/// MLX's in this process (those block sizes run on MLX for that shape).
pub fn refused_blocks() -> Vec<(usize, usize, usize)> {
    refused(|v| v.tokens > 1)
}

fn refused(keep: impl Fn(&Verdict) -> bool) -> Vec<(usize, usize, usize)> {
    let mut shapes: Vec<_> = lock(verdicts())
        .iter()
        .filter(|(v, same)| !**same && keep(v))
        .map(|(v, _)| (v.rows, v.cols, v.tokens))
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

/// A thread's buffers for [`HostDense::product_rows`]: the widened input, the f32 outputs and
/// their bfloat16 narrowing.
#[derive(Default)]
struct Scratch {
    input: Vec<f32>,
    output: Vec<f32>,
    narrow: Vec<half::bf16>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Outputs past which a product's buffers are not kept for the next (16 MiB of f32): a long
/// prompt through a wide layer does not hold its buffers for the process's life.
const SCRATCH_KEPT_VALUES: usize = 4 << 20;

/// How many products (single tokens and blocks) the host path computed in this process (lets
/// tests and benchmarks check that `--host-matvec on` really took it).
pub fn dense_calls() -> usize {
    CALLS.load(Ordering::Relaxed)
}

static PACKED_CALLS: AtomicUsize = AtomicUsize::new(0);

/// How many of those products read a packed copy ([`HostDense::packed_for`]), the one-time
/// checks not counted.
pub fn dense_packed_calls() -> usize {
    PACKED_CALLS.load(Ordering::Relaxed)
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

#[cfg(test)]
mod tests {
    use super::probe_windows;

    /// Small layers are checked whole; larger ones on their first 64 rows and on windows that
    /// start on a group of sixteen and reach the last row.
    #[test]
    fn probe_windows_cover_both_ends_on_group_boundaries() {
        assert_eq!(probe_windows(37), vec![0..37]);
        assert_eq!(probe_windows(128), vec![0..128]);
        assert_eq!(probe_windows(151_936), vec![0..64, 151_888..151_936]);
        assert_eq!(probe_windows(4_870), vec![0..64, 4_816..4_870]);
        for rows in 129..400 {
            let w = probe_windows(rows);
            assert_eq!(w[1].start % 16, 0);
            assert_eq!(w[1].end, rows);
            assert!(w[1].len() >= 48 && w[1].len() < 64, "{rows}: {:?}", w[1]);
        }
    }
}
