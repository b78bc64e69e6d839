//! The projections a host decode step ([`super::step`]) multiplies by. Real checkpoints mix
//! weight kinds: a GGUF import keeps Q4_K/Q8_0 tensors as 4-/8-bit MLX layers, Q5_0 ones as
//! 5-bit, and dequantizes Q6_K ones to dense f32 (qwen2's `v_proj`/`down_proj` in half the
//! layers, the 1.5B's whole vocabulary head); qwen2 adds biases to q/k/v. So a projection is
//! one of three kinds, each with an optional f32 bias:
//! - 4-/8-bit on the affine kernel ([`super::affine`], the fast path `--perf-kernel` exists for);
//! - any other MLX width (2, 3, 5, 6 bits) on the MLX-order kernel ([`super::quant_order`]);
//! - dense f32, one dot product per output and token.
//!
//! Every kind computes each output of each token alone, in an order that does not depend on
//! how many tokens the block holds or how rows are shared out, so a verify block gives the
//! bits of single-token steps (what keeps speculative decoding lossless under the host step).

use super::affine::{row_fits, rows_into as affine_rows_into, Prepared, QMatrix};
use super::any_order::AnyWeights;
use super::dense::HostDense;
use super::dispatch::Selection;
use super::host::{widened, HostQuant, HostSlice};
use super::mlx_order::{block_rows, token_rows, F32Kernels, Order, Weights};
use super::packed::PackedRows;
use super::pages::HostCopy;
use super::qdense::HostQDense;
use super::quant_order::{self, Path, QuantWeights};
use super::vecops::{dot_lanes, rows_by_dot};
use crate::engine::error::{EngineError, Result};
use mlx_rs::{Array, Dtype};
use std::ops::Range;

/// A dense f32 weight (`rows × cols`) pinned in host memory.
#[derive(Debug, Clone)]
pub struct HostF32 {
    _keep: Array,
    data: HostSlice<f32>,
    rows: usize,
    cols: usize,
}

impl HostF32 {
    /// Pins a 2-D f32 weight; `None` for any other dtype or rank.
    pub fn new(weight: &Array) -> Result<Option<Self>> {
        let (&[rows, cols], Dtype::Float32) = (weight.shape(), weight.dtype()) else {
            return Ok(None);
        };
        weight.eval()?;
        Ok(Some(Self {
            data: HostSlice::of(weight, "f32 weight")?,
            _keep: weight.clone(),
            rows: rows as usize,
            cols: cols as usize,
        }))
    }
}

/// Which host step a layer is pinned for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostForm {
    /// `--perf-kernel on` (L3): quantized layers on the fast kernels, dense f32 ones beside them.
    Fast,
    /// `--host-step on` (L1): unbiased dense f32 layers whose host product matched MLX's.
    Exact,
}

/// The weight of a [`HostProj`].
#[derive(Debug, Clone)]
pub enum ProjWeight {
    /// 4- or 8-bit, on the affine kernel.
    Affine(HostQuant),
    /// Another MLX width, on the MLX-order kernel (computed in f32 whatever the scales' dtype).
    Packed(HostQDense),
    /// Dense f32.
    Dense(HostF32),
    /// Dense f32 summed in MLX's own order ([`super::mlx_order`]): the L1 host step's products.
    Exact(HostDense),
    /// A bfloat16 copy summed in the fastest order here ([`super::any_order`]): products whose
    /// bits need match nothing (a drafter's).
    AnyOrder(AnyOrderWeight),
}

/// A dense weight for [`ProjWeight::AnyOrder`]: as bfloat16 bits where every value is one
/// (half the bytes the product streams every call; in huge pages where the system gives them
/// and the copy budget allows, else on the heap), else the f32 weight itself.
#[derive(Debug, Clone)]
pub struct AnyOrderWeight(AnyRepr);

#[derive(Debug, Clone)]
enum AnyRepr {
    F32(HostF32),
    Bf16 {
        bits: std::sync::Arc<Bits>,
        rows: usize,
        cols: usize,
    },
}

/// A bfloat16 copy's memory.
#[derive(Debug)]
enum Bits {
    Paged(HostCopy<u16>),
    Heap(Vec<u16>),
}

impl Bits {
    fn get(&self) -> &[u16] {
        match self {
            Bits::Paged(copy) => copy,
            Bits::Heap(bits) => bits,
        }
    }
}

impl AnyOrderWeight {
    /// `h` as bfloat16 bits when every value is a bfloat16 or `round` asks for the nearest
    /// ones, else as it is.
    fn of(h: HostF32, round: bool) -> Self {
        let values = h.data.get();
        if !round && !values.iter().all(|v| v.to_bits() & 0xffff == 0) {
            return AnyOrderWeight(AnyRepr::F32(h));
        }
        let bits: Vec<u16> = values
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        let bits = match HostCopy::paged(&bits) {
            Some(copy) => Bits::Paged(copy),
            None => Bits::Heap(bits),
        };
        AnyOrderWeight(AnyRepr::Bf16 {
            bits: std::sync::Arc::new(bits),
            rows: h.rows,
            cols: h.cols,
        })
    }

    fn view(&self) -> (AnyWeights<'_>, usize, usize) {
        match &self.0 {
            AnyRepr::F32(h) => (AnyWeights::F32(h.data.get()), h.rows, h.cols),
            AnyRepr::Bf16 { bits, rows, cols } => (AnyWeights::Bf16(bits.get()), *rows, *cols),
        }
    }
}

impl ProjWeight {
    /// Whether the weight is quantized (a host step made of dense layers only is not what
    /// `--perf-kernel` is for: such a model stays on its L1 path).
    pub fn quantized(&self) -> bool {
        !matches!(
            self,
            ProjWeight::Dense(_) | ProjWeight::Exact(_) | ProjWeight::AnyOrder(_)
        )
    }
}

/// One projection of a host step: `x · Wᵀ (+ b)`.
#[derive(Debug, Clone)]
pub struct HostProj {
    weight: ProjWeight,
    bias: Option<Vec<f32>>,
}

impl HostProj {
    /// The projection of `weight` plus `bias` (an f32, bf16 or f16 vector of one value per
    /// output, widened exactly).
    pub fn new(weight: ProjWeight, bias: Option<&Array>) -> Result<Self> {
        let me = Self {
            weight,
            bias: bias.map(widened).transpose()?,
        };
        let rows = me.view()?.rows;
        if let Some(b) = &me.bias {
            if b.len() != rows {
                return Err(EngineError::Runtime(format!(
                    "host step: a bias of {} values for {rows} outputs",
                    b.len()
                )));
            }
        }
        Ok(me)
    }

    /// The weight.
    pub fn weight(&self) -> &ProjWeight {
        &self.weight
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.view().map_or(0, |v| v.rows)
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.view().map_or(0, |v| v.cols)
    }

    /// The same product summed in the fastest order here ([`ProjWeight::AnyOrder`]) where the
    /// weight is dense f32: for products whose bits need match nothing (a drafter's). With
    /// `round`, every weight is rounded to the nearest bfloat16 (half the bytes to stream).
    /// Unchanged otherwise.
    pub fn in_any_order(self, round: bool) -> Self {
        let weight = match self.weight {
            ProjWeight::Dense(h) => ProjWeight::AnyOrder(AnyOrderWeight::of(h, round)),
            weight => weight,
        };
        Self {
            weight,
            bias: self.bias,
        }
    }

    /// `x · Wᵀ (+ b)` for `m` tokens (`x`: `m × cols`), token-major, on the calling thread:
    /// products of a few rows outside a step (a drafter's context rows).
    pub fn forward(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        let view = self.view()?;
        if x.len() != m * view.cols {
            return Err(EngineError::Runtime(format!(
                "{} input values for {m} tokens of {}",
                x.len(),
                view.cols
            )));
        }
        let sel = super::dispatch::selection()?;
        let mut y = Vec::with_capacity(m * view.rows);
        let (mut by_row, mut part) = (Vec::new(), Vec::new());
        // In blocks of at most eight tokens, the most every kind's kernel takes.
        for block in x.chunks(8 * view.cols.max(1)) {
            let n = block.len() / view.cols.max(1);
            let inputs =
                Inputs::new(sel, block, n, view.cols, &[&view]).map_err(EngineError::Runtime)?;
            by_row.resize(view.rows * n, 0.0);
            let prepared = inputs.for_matrix(&view);
            view.rows_into(sel, block, prepared, n, 0..view.rows, &mut by_row)
                .map_err(EngineError::Runtime)?;
            super::dispatch::by_token(&by_row, n, &mut part);
            y.extend_from_slice(&part);
        }
        view.add_bias(&mut y);
        Ok(y)
    }

    /// The projection as borrowed host memory (what the step's threads share).
    pub(super) fn view(&self) -> Result<ProjView<'_>> {
        let bias = self.bias.as_deref();
        Ok(match &self.weight {
            ProjWeight::Affine(h) => {
                let m = h.matrix()?;
                ProjView {
                    rows: m.rows(),
                    cols: m.cols(),
                    kind: Kind::Affine(m),
                    bias,
                }
            }
            ProjWeight::Packed(h) => {
                let w = QuantWeights {
                    bf16: false,
                    ..h.weights()
                };
                ProjView {
                    rows: w.rows,
                    cols: w.cols,
                    kind: Kind::Packed(w),
                    bias,
                }
            }
            ProjWeight::Dense(h) => ProjView {
                rows: h.rows,
                cols: h.cols,
                kind: Kind::Dense(h.data.get()),
                bias,
            },
            ProjWeight::AnyOrder(h) => {
                let (w, rows, cols) = h.view();
                ProjView {
                    rows,
                    cols,
                    kind: Kind::AnyOrder(w),
                    bias,
                }
            }
            ProjWeight::Exact(h) => match (h.f32_weight(), h.bf16_weight()) {
                (Some((w, rows, cols)), _) => ProjView {
                    rows,
                    cols,
                    kind: Kind::Exact(w, h.step_copy()?),
                    bias,
                },
                (None, Some((w, rows, cols))) => ProjView {
                    rows,
                    cols,
                    kind: Kind::ExactBf16(w, h.step_copy()?),
                    bias,
                },
                (None, None) => {
                    return Err(EngineError::Runtime(
                        "host step: an exact product over an f16 weight".into(),
                    ))
                }
            },
        })
    }
}

#[derive(Clone, Copy)]
enum Kind<'a> {
    Affine(QMatrix<'a>),
    Packed(QuantWeights<'a>),
    Dense(&'a [f32]),
    /// Summed in any order.
    AnyOrder(AnyWeights<'a>),
    /// f32 summed in OpenBLAS's order, and its packed copy when there is one.
    Exact(&'a [f32], Option<&'a PackedRows>),
    /// bfloat16 bits, summed in MLX's 16-bit order, and their packed copy when there is one.
    ExactBf16(&'a [u16], Option<&'a PackedRows>),
}

/// `x` (`m × cols`) prepared once per bit width among `mats` (the affine kernel's input form).
pub(super) struct Inputs {
    four: Option<Prepared>,
    eight: Option<Prepared>,
}

impl Inputs {
    pub(super) fn new(
        sel: Selection,
        x: &[f32],
        m: usize,
        cols: usize,
        mats: &[&ProjView<'_>],
    ) -> std::result::Result<Self, String> {
        let make = |bits: usize| -> std::result::Result<Option<Prepared>, String> {
            if mats.iter().any(|w| w.affine_bits() == Some(bits)) {
                Prepared::for_path(x, m, cols, bits, sel.path).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Self {
            four: make(4)?,
            eight: make(8)?,
        })
    }

    /// The input prepared for `w` (`None` for a weight that reads it as it is).
    pub(super) fn for_matrix(&self, w: &ProjView<'_>) -> Option<&Prepared> {
        match w.affine_bits() {
            Some(4) => self.four.as_ref(),
            Some(_) => self.eight.as_ref(),
            None => None,
        }
    }
}

/// A [`HostProj`] as borrowed host memory.
#[derive(Clone, Copy)]
pub(super) struct ProjView<'a> {
    kind: Kind<'a>,
    pub(super) rows: usize,
    pub(super) cols: usize,
    bias: Option<&'a [f32]>,
}

impl ProjView<'_> {
    /// The width the affine kernel needs its input prepared for; `None` for the other kinds,
    /// which read the input as it is.
    pub(super) fn affine_bits(&self) -> Option<usize> {
        match &self.kind {
            Kind::Affine(m) => Some(m.bits()),
            _ => None,
        }
    }

    /// Row `r` of the weight, dequantized (an embedding lookup).
    pub(super) fn row(&self, r: usize, out: &mut [f32]) -> std::result::Result<(), String> {
        row_fits(r, self.rows, self.cols, out.len())?;
        match &self.kind {
            Kind::Affine(m) => m.dequantize_row(r, out),
            Kind::Packed(w) => {
                w.dequantize_row(r, out);
                Ok(())
            }
            Kind::Dense(w) | Kind::Exact(w, _) => {
                out.copy_from_slice(&w[r * self.cols..(r + 1) * self.cols]);
                Ok(())
            }
            Kind::AnyOrder(AnyWeights::F32(w)) => {
                out.copy_from_slice(&w[r * self.cols..(r + 1) * self.cols]);
                Ok(())
            }
            Kind::ExactBf16(w, _) | Kind::AnyOrder(AnyWeights::Bf16(w)) => {
                let row = &w[r * self.cols..(r + 1) * self.cols];
                for (o, b) in out.iter_mut().zip(row) {
                    *o = f32::from_bits(u32::from(*b) << 16);
                }
                Ok(())
            }
        }
    }

    /// Outputs `rows` of `x · Wᵀ` (`x`: `m × cols`) into `out` (`rows.len() × m`, by output
    /// feature); `prepared` is `x` prepared for this view's [`Self::affine_bits`].
    pub(super) fn rows_into(
        &self,
        sel: Selection,
        x: &[f32],
        prepared: Option<&Prepared>,
        m: usize,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> std::result::Result<(), String> {
        if rows.end > self.rows || x.len() != m * self.cols || out.len() != rows.len() * m {
            return Err(format!(
                "rows {rows:?} of a {}x{} projection for {m} tokens of {} values into {}",
                self.rows,
                self.cols,
                x.len(),
                out.len()
            ));
        }
        match &self.kind {
            Kind::Affine(w) => {
                let p = prepared.ok_or("no input prepared for the affine kernel")?;
                affine_rows_into(sel.path, w, p, rows, out)
            }
            // One token: the kernel's token-major output is already by output feature.
            Kind::Packed(w) if m == 1 => {
                quant_order::rows_into(Path::best(), w, x, m, rows, out);
                Ok(())
            }
            Kind::Packed(w) => {
                let mut by_token = vec![0.0f32; m * rows.len()];
                quant_order::rows_into(Path::best(), w, x, m, rows, &mut by_token);
                by_feature(&by_token, m, out);
                Ok(())
            }
            Kind::Dense(w) => {
                dense_rows(w, self.cols, x, m, rows, out);
                Ok(())
            }
            Kind::AnyOrder(w) => {
                super::any_order::rows_into(*w, self.cols, x, m, rows, out);
                Ok(())
            }
            Kind::Exact(w, packed) => {
                let order = F32Kernels::here().block_order(self.rows, self.cols, m);
                let packed = packed.filter(|p| p.takes(&order, m));
                with_packed(packed, x, m, rows, out, |part, into| {
                    if m == 1 {
                        token_rows(w, 0, self.rows, self.cols, x, (0, 1), &order, part, into)
                    } else {
                        let f32 = Weights::F32(w);
                        block_rows(f32, self.rows, self.cols, x, m, &order, part, into)
                    }
                })
            }
            Kind::ExactBf16(w, packed) => {
                let order = Order::Sequential;
                let packed = packed.filter(|p| p.takes(&order, m));
                with_packed(packed, x, m, rows, out, |part, into| {
                    let bf16 = Weights::Bf16(w);
                    block_rows(bf16, self.rows, self.cols, x, m, &order, part, into)
                })
            }
        }
    }

    /// Adds the bias to each token's outputs (`x`: `m × rows`, token-major).
    pub(super) fn add_bias(&self, x: &mut [f32]) {
        if let Some(b) = self.bias {
            for row in x.chunks_exact_mut(self.rows) {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
    }
}

/// Outputs `rows` of a product of `m` tokens `x` into `out` (`rows.len() × m`, by output
/// feature): the whole groups of `packed` there are from the packed copy, the rows around them
/// from `row_major(part, into)` (token-major outputs of rows `part`, in the same order).
fn with_packed(
    packed: Option<&PackedRows>,
    x: &[f32],
    m: usize,
    rows: Range<usize>,
    out: &mut [f32],
    row_major: impl Fn(Range<usize>, &mut [f32]) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    let inner = match packed {
        Some(p) => p.groups_within(&rows),
        None => rows.end..rows.end,
    };
    let parts = [rows.start..inner.start, inner.clone(), inner.end..rows.end];
    for part in parts.into_iter().filter(|p| !p.is_empty()) {
        let at = (part.start - rows.start) * m..(part.end - rows.start) * m;
        let mut by_token = vec![0.0f32; if m == 1 { 0 } else { m * part.len() }];
        let into = if m == 1 {
            &mut out[at.clone()]
        } else {
            &mut by_token[..]
        };
        match packed {
            Some(p) if part == inner => p.rows_into(x, m, part, into)?,
            _ => row_major(part, into)?,
        }
        if m > 1 {
            by_feature(&by_token, m, &mut out[at]);
        }
    }
    Ok(())
}

/// A kernel's token-major outputs (`m × rows`) laid out by output feature (`rows × m`), as the
/// step's buffers hold them.
fn by_feature(by_token: &[f32], m: usize, out: &mut [f32]) {
    let len = by_token.len() / m.max(1);
    for (t, vals) in by_token.chunks_exact(len.max(1)).enumerate() {
        for (r, v) in vals.iter().enumerate() {
            out[r * m + t] = *v;
        }
    }
}

/// Dense `rows` of `x · Wᵀ` by output feature; each weight row is read once for all tokens.
/// The AVX2 build of the same loop sums in the same lanes and order as the baseline build (no
/// fused multiply-add either way), so the bits do not depend on the CPU's path.
fn dense_rows(w: &[f32], cols: usize, x: &[f32], m: usize, rows: Range<usize>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { dense_rows_avx2(w, cols, x, m, rows, out) };
        return;
    }
    dense_rows_plain(w, cols, x, m, rows, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dense_rows_avx2(
    w: &[f32],
    cols: usize,
    x: &[f32],
    m: usize,
    rows: Range<usize>,
    out: &mut [f32],
) {
    dense_rows_plain(w, cols, x, m, rows, out);
}

#[inline(always)]
fn dense_rows_plain(
    w: &[f32],
    cols: usize,
    x: &[f32],
    m: usize,
    rows: Range<usize>,
    out: &mut [f32],
) {
    rows_by_dot(w, cols, x, m, rows, out, dot_lanes::<32>);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_rows_sum_each_output_alone_whatever_the_block() {
        let (rows, cols) = (37, 75);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
            .collect();
        let x: Vec<f32> = (0..3 * cols)
            .map(|i| ((i * 104_729) % 997) as f32 / 89.0 - 5.5)
            .collect();
        let mut block = vec![0.0f32; rows * 3];
        dense_rows(&w, cols, &x, 3, 0..rows, &mut block);
        for t in 0..3 {
            let xt = &x[t * cols..(t + 1) * cols];
            let mut single = vec![0.0f32; 10];
            dense_rows(&w, cols, xt, 1, 20..30, &mut single);
            for r in 0..rows {
                let f64_sum: f64 = (0..cols)
                    .map(|k| w[r * cols + k] as f64 * xt[k] as f64)
                    .sum();
                let got = block[r * 3 + t];
                assert!((got as f64 - f64_sum).abs() < 1e-3, "row {r} token {t}");
                if (20..30).contains(&r) {
                    assert_eq!(got.to_bits(), single[r - 20].to_bits(), "row {r} token {t}");
                }
            }
            let mut plain = vec![0.0f32; rows];
            dense_rows_plain(&w, cols, xt, 1, 0..rows, &mut plain);
            for r in 0..rows {
                assert_eq!(plain[r].to_bits(), block[r * 3 + t].to_bits());
            }
        }
    }
}
