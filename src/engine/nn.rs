//! The layers mlx-lm's models are built from (Linear, Embedding, their affine-quantized
//! forms, RMSNorm), issuing exactly the MLX ops `mlx.nn` issues so results stay bit-identical.

use super::distributed::{all_sum, Group};
use super::error::Result;
use super::kernels::{elementwise, ready_bf16, ready_f32};
use super::kernels::{
    HostDense, HostDenseCell, HostQDense, HostQDenseCell, HostQuant, HostQuantCell,
};
use super::kernels::{HostF32, HostForm, HostProj, ProjWeight};
use super::weights::{QuantSpec, WeightStore};
use mlx_rs::{fast, ops, Array, Dtype};
use std::rc::Rc;
use std::sync::Arc;

/// A Python-style "weak" scalar: `v` rounded to f32, then to `like`'s dtype, as MLX does for
/// `x * 0.5` in Python (mlx-rs scalars would instead promote bf16 to f32).
pub fn weak_scalar(v: f64, like: &Array) -> Result<Array> {
    Ok(Array::from_f32(v as f32).as_dtype(like.dtype())?)
}

/// Weight storage of a linear map (or a stack of them, e.g. MoE experts): dense, or
/// affine-quantized.
#[derive(Debug, Clone)]
pub(crate) enum LinearWeight {
    Dense(Array),
    Quantized {
        weight: Array,
        scales: Array,
        biases: Array,
        spec: QuantSpec,
    },
}

impl LinearWeight {
    /// Rows `[n, in]` at `ids` `[n]`: the stored rows, or those rows dequantized.
    fn rows(&self, ids: &Array) -> Result<Array> {
        Ok(match self {
            LinearWeight::Dense(weight) => weight.take_axis(ids, 0)?,
            LinearWeight::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => ops::dequantize(
                weight.take_axis(ids, 0)?,
                scales.take_axis(ids, 0)?,
                &biases.take_axis(ids, 0)?,
                spec.group_size,
                spec.bits,
            )?,
        })
    }
}

fn load_linear_weight(
    w: &mut WeightStore,
    path: &str,
    out_dim: i32,
    in_dim: i32,
) -> Result<LinearWeight> {
    load_stacked_weight(w, path, &[], out_dim, in_dim)
}

/// Loads `{path}.weight` of shape `[..lead, out, in]` (+ `.scales`/`.biases`, packed along `in`,
/// when the checkpoint quantizes `path`).
pub(crate) fn load_stacked_weight(
    w: &mut WeightStore,
    path: &str,
    lead: &[i32],
    out_dim: i32,
    in_dim: i32,
) -> Result<LinearWeight> {
    let shape = |last: i32| [lead, &[out_dim, last]].concat();
    match w.quant_for(path) {
        None => Ok(LinearWeight::Dense(
            w.take(&format!("{path}.weight"), &shape(in_dim))?,
        )),
        Some(spec) => {
            if in_dim % spec.group_size != 0 {
                return Err(w.err(format!(
                    "`{path}` has input size {in_dim}, not a multiple of quantization group_size {}",
                    spec.group_size
                )));
            }
            let packed = in_dim * spec.bits / 32;
            let groups = in_dim / spec.group_size;
            Ok(LinearWeight::Quantized {
                weight: w.take(&format!("{path}.weight"), &shape(packed))?,
                scales: w.take(&format!("{path}.scales"), &shape(groups))?,
                biases: w.take(&format!("{path}.biases"), &shape(groups))?,
                spec,
            })
        }
    }
}

/// The host kernel a layer's small products may take: the affine 4-/8-bit mat-vec under
/// `--perf-kernel on`, or the dense product in MLX's own order under `--host-matvec on`. Each is
/// pinned on first use (the weights may still be lazy when a layer loads), and shared by the
/// layer's clones (`Rc`: MLX arrays are not `Sync`, so models stay on one thread anyway).
#[derive(Debug)]
enum HostCell {
    Quant(HostQuantCell),
    Dense(HostDenseCell),
    /// 2- to 8-bit with f32 or bf16 scales in MLX's own order (`--host-matvec on`, L1).
    QuantExact(HostQDenseCell),
}

impl HostCell {
    /// An empty cell of the same kind (for a layer fused from layers with this one).
    fn fresh_like(&self) -> Self {
        match self {
            HostCell::Quant(_) => HostCell::Quant(HostQuantCell::default()),
            HostCell::Dense(_) => HostCell::Dense(HostDenseCell::default()),
            HostCell::QuantExact(_) => HostCell::QuantExact(HostQDenseCell::default()),
        }
    }
}

/// The host kernel cell for a layer, or `None` to keep it on MLX's own kernels: 2-D 4-/8-bit
/// weights under `--perf-kernel on`; 2-D f32/bf16/f16 weights, and 2- to 8-bit ones with f32 or
/// bf16 scales, under `--host-matvec on`.
fn host_cell(w: &WeightStore, weight: &LinearWeight) -> Option<Rc<HostCell>> {
    match weight {
        LinearWeight::Quantized { weight, spec, .. }
            if w.host_kernel()
                && super::kernels::BITS.contains(&(spec.bits as usize))
                && weight.ndim() == 2 =>
        {
            Some(Rc::new(HostCell::Quant(HostQuantCell::default())))
        }
        LinearWeight::Quantized { weight, scales, .. }
            if w.host_matvec()
                && [Dtype::Float32, Dtype::Bfloat16].contains(&scales.dtype())
                && weight.ndim() == 2 =>
        {
            Some(Rc::new(HostCell::QuantExact(HostQDenseCell::default())))
        }
        LinearWeight::Dense(weight)
            if w.host_matvec()
                && [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16].contains(&weight.dtype())
                && weight.ndim() == 2 =>
        {
            Some(Rc::new(HostCell::Dense(HostDenseCell::default())))
        }
        _ => None,
    }
}

/// The pinned host weight of a quantized layer that has a host kernel cell.
fn pinned<'a>(w: &LinearWeight, host: Option<&'a HostCell>) -> Result<Option<&'a HostQuant>> {
    match (host, w) {
        (
            Some(HostCell::Quant(cell)),
            LinearWeight::Quantized {
                weight,
                scales,
                biases,
                spec,
            },
        ) => Ok(Some(cell.get(weight, scales, biases, *spec)?)),
        _ => Ok(None),
    }
}

/// A 2-D weight, plus `bias`, as the host decode step takes it: 4-/8-bit layers on their pinned
/// affine kernel, other widths on the MLX-order kernel, dense f32 as it is; `None` for anything
/// else (bf16/f16 dense layers, stacked experts).
fn host_proj(
    w: &LinearWeight,
    host: Option<&HostCell>,
    bias: Option<&Array>,
    form: HostForm,
) -> Result<Option<HostProj>> {
    if form == HostForm::Exact {
        return exact_proj(w, host, bias);
    }
    let weight = match (pinned(w, host)?, w) {
        (Some(h), _) => Some(ProjWeight::Affine(h.clone())),
        (
            None,
            LinearWeight::Quantized {
                weight,
                scales,
                biases,
                spec,
            },
        ) => HostQDense::pinned(weight, scales, biases, spec.bits, spec.group_size)?
            .map(ProjWeight::Packed),
        (None, LinearWeight::Dense(weight)) => HostF32::new(weight)?.map(ProjWeight::Dense),
    };
    weight.map(|w| HostProj::new(w, bias)).transpose()
}

/// An unbiased dense f32 or bfloat16 weight for the L1 host step: its pinned host product, once
/// the product of one token matched MLX's (`None` for anything else, and where it differed).
fn exact_proj(
    w: &LinearWeight,
    host: Option<&HostCell>,
    bias: Option<&Array>,
) -> Result<Option<HostProj>> {
    let (Some(HostCell::Dense(cell)), LinearWeight::Dense(weight), None) = (host, w, bias) else {
        return Ok(None);
    };
    if !matches!(weight.dtype(), Dtype::Float32 | Dtype::Bfloat16) {
        return Ok(None);
    }
    match cell.get(weight)? {
        Some(dense) if dense.accepts(1)? => {
            HostProj::new(ProjWeight::Exact(dense.clone()), None).map(Some)
        }
        _ => Ok(None),
    }
}

/// The host product of `x @ W.T` when this layer's host kernel takes `x`; `None` leaves it
/// to MLX.
fn host_matmul(x: &Array, w: &LinearWeight, host: Option<&HostCell>) -> Result<Option<Array>> {
    match (host, w) {
        (Some(HostCell::Quant(_)), _) if HostQuant::takes(x) => match pinned(w, host)? {
            Some(h) => Ok(Some(h.forward(x)?)),
            None => Ok(None),
        },
        (
            Some(HostCell::QuantExact(cell)),
            LinearWeight::Quantized {
                weight,
                scales,
                biases,
                spec,
            },
        ) if super::kernels::host_allowed() => {
            match cell.get(weight, scales, biases, spec.bits, spec.group_size)? {
                Some(h) => h.forward(x),
                None => Ok(None),
            }
        }
        (Some(HostCell::Dense(_)), LinearWeight::Dense(weight)) => {
            match host_dense(x, weight, host)? {
                Some(h) => h.forward(x),
                None => Ok(None),
            }
        }
        _ => Ok(None),
    }
}

/// The pinned dense host product of this layer when it may take `x`; `None` leaves `x` to MLX.
fn host_dense<'a>(
    x: &Array,
    weight: &Array,
    host: Option<&'a HostCell>,
) -> Result<Option<&'a HostDense>> {
    match host {
        Some(HostCell::Dense(cell)) if HostDense::takes(x) && super::kernels::host_allowed() => {
            cell.get(weight)
        }
        _ => Ok(None),
    }
}

/// `b + x @ W.T` on the host when this layer's dense host product takes `x` and reproduces
/// MLX's `addmm` ([`HostDense::forward_biased`]); `None` leaves it to MLX.
fn host_addmm(
    x: &Array,
    weight: &Array,
    bias: &Array,
    host: Option<&HostCell>,
) -> Result<Option<Array>> {
    match host_dense(x, weight, host)? {
        Some(h) => h.forward_biased(x, bias),
        None => Ok(None),
    }
}

fn matmul_transposed(x: &Array, w: &LinearWeight, host: Option<&HostCell>) -> Result<Array> {
    if let Some(y) = host_matmul(x, w, host)? {
        return Ok(y);
    }
    Ok(match w {
        LinearWeight::Dense(weight) => ops::matmul(x, weight.t())?,
        LinearWeight::Quantized {
            weight,
            scales,
            biases,
            spec,
        } => ops::quantized_matmul(x, weight, scales, biases, true, spec.group_size, spec.bits)?,
    })
}

/// `nn.Linear` / `nn.QuantizedLinear`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: LinearWeight,
    bias: Option<Array>,
    host: Option<Rc<HostCell>>,
    /// A tensor-parallel "sharded-to-all" layer: its product is summed over these ranks
    /// before the bias is added (mlx's `ShardedToAllLinear`).
    all_sum: Option<Arc<Group>>,
}

impl Linear {
    /// Loads `{path}.weight` (+ `.scales`/`.biases` when quantized, `.bias` when `bias`).
    pub fn load(
        w: &mut WeightStore,
        path: &str,
        in_dim: i32,
        out_dim: i32,
        bias: bool,
    ) -> Result<Self> {
        let weight = load_linear_weight(w, path, out_dim, in_dim)?;
        let bias = if bias {
            Some(w.take(&format!("{path}.bias"), &[out_dim])?)
        } else {
            None
        };
        let host = host_cell(w, &weight);
        Ok(Self {
            weight,
            bias,
            host,
            all_sum: w.all_sum_group(path),
        })
    }

    /// An unbiased dense layer over an existing `[out, in]` weight (e.g. a head copied from the
    /// embedding table by a `sanitize`).
    pub fn dense(weight: Array) -> Self {
        Self {
            weight: LinearWeight::Dense(weight),
            bias: None,
            host: None,
            all_sum: None,
        }
    }

    /// [`Linear::dense`] whose products take the host path (`--host-matvec`) when `host_matvec`
    /// is on, on the same terms as a loaded layer's (checked against MLX per shape).
    pub fn dense_host(weight: Array, host_matvec: bool) -> Self {
        let host = (host_matvec
            && [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16].contains(&weight.dtype())
            && weight.ndim() == 2)
            .then(|| Rc::new(HostCell::Dense(HostDenseCell::default())));
        Self {
            weight: LinearWeight::Dense(weight),
            bias: None,
            host,
            all_sum: None,
        }
    }

    /// One layer computing `layers`' outputs side by side: weights (and biases) concatenated
    /// along the output axis, so `x @ W.T` is one matmul whose column blocks are the layers'
    /// outputs. All layers must be dense, or quantized with the same spec, and all biased or
    /// none.
    pub fn concat_out(layers: &[&Linear]) -> Result<Self> {
        if layers.iter().any(|l| l.all_sum.is_some()) {
            return Err(super::error::EngineError::Runtime(
                "cannot fuse projections whose outputs are summed over ranks".into(),
            ));
        }
        let cat = |parts: Vec<&Array>| -> Result<Array> {
            let owned: Vec<Array> = parts.into_iter().cloned().collect();
            Ok(ops::concatenate(&owned, 0)?)
        };
        let mismatch = || {
            super::error::EngineError::Runtime(
                "cannot fuse projections of different storage (dense/quantized/bias)".into(),
            )
        };
        let weight = match layers.first().map(|l| &l.weight) {
            Some(LinearWeight::Dense(_)) => {
                let ws: Option<Vec<&Array>> = layers
                    .iter()
                    .map(|l| match &l.weight {
                        LinearWeight::Dense(w) => Some(w),
                        LinearWeight::Quantized { .. } => None,
                    })
                    .collect();
                LinearWeight::Dense(cat(ws.ok_or_else(mismatch)?)?)
            }
            Some(LinearWeight::Quantized { spec, .. }) => {
                let spec = *spec;
                let mut parts: [Vec<&Array>; 3] = [Vec::new(), Vec::new(), Vec::new()];
                for l in layers {
                    match &l.weight {
                        LinearWeight::Quantized {
                            weight,
                            scales,
                            biases,
                            spec: s,
                        } if *s == spec => {
                            parts[0].push(weight);
                            parts[1].push(scales);
                            parts[2].push(biases);
                        }
                        _ => return Err(mismatch()),
                    }
                }
                let [w, s, b] = parts;
                LinearWeight::Quantized {
                    weight: cat(w)?,
                    scales: cat(s)?,
                    biases: cat(b)?,
                    spec,
                }
            }
            None => return Err(mismatch()),
        };
        let biases: Vec<&Array> = layers.iter().filter_map(|l| l.bias.as_ref()).collect();
        let bias = match biases.len() {
            0 => None,
            n if n == layers.len() => Some(cat(biases)?),
            _ => return Err(mismatch()),
        };
        let host = match layers.first().and_then(|l| l.host.as_deref()) {
            Some(first)
                if layers.iter().all(|l| {
                    l.host.as_deref().map(std::mem::discriminant)
                        == Some(std::mem::discriminant(first))
                }) =>
            {
                Some(Rc::new(first.fresh_like()))
            }
            _ => None,
        };
        Ok(Self {
            weight,
            bias,
            host,
            all_sum: None,
        })
    }

    fn matmul(&self, x: &Array) -> Result<Array> {
        matmul_transposed(x, &self.weight, self.host.as_deref())
    }

    /// The layer pinned for a host decode step of `form`, bias included, when its weight is one
    /// that step multiplies by ([`HostProj`]); `None` otherwise.
    pub fn host_proj(&self, form: HostForm) -> Result<Option<HostProj>> {
        if self.all_sum.is_some() || self.bias.as_ref().is_some_and(|b| b.ndim() != 1) {
            return Ok(None);
        }
        host_proj(&self.weight, self.host.as_deref(), self.bias.as_ref(), form)
    }

    /// The weight's rows `[n, in]` for output ids `[n]` (dequantized when quantized), or `None`
    /// for a biased layer or one split over ranks' inputs, whose map the rows alone do not give.
    pub fn weight_rows(&self, ids: &Array) -> Result<Option<Array>> {
        if self.bias.is_some() || self.all_sum.is_some() {
            return Ok(None);
        }
        self.weight.rows(ids).map(Some)
    }

    /// The dense weight `[out, in]` and bias, for a layer neither quantized nor split over
    /// ranks (host code that reads the weights itself); `None` otherwise.
    pub fn dense_parts(&self) -> Option<(&Array, Option<&Array>)> {
        match (&self.weight, &self.all_sum) {
            (LinearWeight::Dense(w), None) => Some((w, self.bias.as_ref())),
            _ => None,
        }
    }

    /// `x @ W.T (+ b)`, with `addmm` for the dense biased case as mlx does.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        if let Some(group) = &self.all_sum {
            let y = all_sum(&self.matmul(x)?, group)?;
            return match &self.bias {
                Some(b) => Ok(y.add(b)?),
                None => Ok(y),
            };
        }
        match (&self.weight, &self.bias) {
            (LinearWeight::Dense(weight), Some(b)) => {
                if let Some(y) = host_addmm(x, weight, b, self.host.as_deref())? {
                    return Ok(y);
                }
                Ok(ops::addmm(b, x, weight.t(), None, None)?)
            }
            (_, Some(b)) => Ok(self.matmul(x)?.add(b)?),
            (_, None) => self.matmul(x),
        }
    }
}

/// Every layer's [`Linear::host_proj`], or `None` when any one has none.
pub fn host_projs<const N: usize>(
    layers: [&Linear; N],
    form: HostForm,
) -> Result<Option<[HostProj; N]>> {
    let mut pinned = Vec::with_capacity(N);
    for l in layers {
        match l.host_proj(form)? {
            Some(h) => pinned.push(h),
            None => return Ok(None),
        }
    }
    Ok(pinned.try_into().ok())
}

/// `nn.Embedding` / `nn.QuantizedEmbedding`, usable as the tied output projection.
#[derive(Debug, Clone)]
pub struct Embedding {
    weight: LinearWeight,
    host: Option<Rc<HostCell>>,
}

impl Embedding {
    /// Loads `{path}.weight` of shape [vocab, dim] (quantized when the checkpoint says so).
    pub fn load(w: &mut WeightStore, path: &str, vocab: i32, dim: i32) -> Result<Self> {
        let weight = load_linear_weight(w, path, vocab, dim)?;
        let host = host_cell(w, &weight);
        Ok(Self { weight, host })
    }

    /// Looks up rows: `weight[ids]`, or the dequantized rows for a quantized table.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        self.weight.rows(ids)
    }

    /// The table pinned for a host decode step of `form` when its weight is one that step reads
    /// ([`HostProj`]); `None` otherwise.
    pub fn host_proj(&self, form: HostForm) -> Result<Option<HostProj>> {
        host_proj(&self.weight, self.host.as_deref(), None, form)
    }

    /// The tied LM head: `x @ weight.T`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        matmul_transposed(x, &self.weight, self.host.as_deref())
    }

    /// The table itself when it is not quantized.
    pub fn dense_weight(&self) -> Option<&Array> {
        match &self.weight {
            LinearWeight::Dense(w) => Some(w),
            LinearWeight::Quantized { .. } => None,
        }
    }

    /// Dtype activations take after the lookup (the table's dtype, or its scales' when quantized).
    pub fn dtype(&self) -> Dtype {
        match &self.weight {
            LinearWeight::Dense(w) => w.dtype(),
            LinearWeight::Quantized { scales, .. } => scales.dtype(),
        }
    }
}

thread_local! {
    static HOST_NORM_CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many RMSNorms the host path computed on this thread (lets tests check that
/// `--host-elementwise on` really took it; per thread, so tests running side by side in one
/// process do not count each other's).
pub fn host_norm_calls() -> usize {
    HOST_NORM_CALLS.with(std::cell::Cell::get)
}

/// `nn.RMSNorm`: `fast.rms_norm(x, weight, eps)`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Array,
    eps: f32,
    /// `--host-elementwise`: f32 inputs already on the host are normalized there.
    host: bool,
}

impl RmsNorm {
    /// Loads `{path}.weight` of shape `[dim]`.
    pub fn load(w: &mut WeightStore, path: &str, dim: i32, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: w.take(&format!("{path}.weight"), &[dim])?,
            eps: eps as f32,
            host: w.host_elementwise(),
        })
    }

    /// The weight's dtype.
    pub fn dtype(&self) -> Dtype {
        self.weight.dtype()
    }

    /// The weight (widened to f32) and epsilon on the host, for a host decode step of `form`;
    /// `None` unless the weight is f32, or bfloat16 for the exact step (the fast one computes in
    /// f32 only), and, for the exact step, the host norm matched MLX's.
    pub fn host_weight(&self, form: HostForm) -> Result<Option<(Vec<f32>, f32)>> {
        let widened = match (self.weight.dtype(), form) {
            (Dtype::Float32, _) => self.weight.try_as_slice::<f32>().map(<[f32]>::to_vec),
            (Dtype::Bfloat16, HostForm::Exact) => self
                .weight
                .try_as_slice::<half::bf16>()
                .map(|w| w.iter().map(|v| v.to_f32()).collect()),
            _ => return Ok(None),
        }
        .map_err(|e| {
            super::error::EngineError::Runtime(format!("cannot read an RMSNorm weight ({e})"))
        })?;
        if form == HostForm::Exact && !self.host_matches_mlx()? {
            return Ok(None);
        }
        Ok(Some((widened, self.eps)))
    }

    /// Applies the norm with the stored weight.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        if self.host {
            if let Some(y) = self.host_forward(x)? {
                return Ok(y);
            }
        }
        Ok(fast::rms_norm(x, Some(&self.weight), self.eps)?)
    }

    /// The host norm of an f32 or bfloat16 `x` already on the host, once the host form
    /// matched MLX's in this process for this dtype, width and epsilon; `None` leaves it to
    /// MLX.
    fn host_forward(&self, x: &Array) -> Result<Option<Array>> {
        if !super::kernels::host_allowed()
            || x.shape().last().copied() != Some(self.weight.size() as i32)
        {
            return Ok(None);
        }
        if let (Some(xs), Some(ws)) = (ready_f32(x), ready_f32(&self.weight)) {
            if !self.host_matches_mlx()? {
                return Ok(None);
            }
            let mut out = vec![0.0; xs.len()];
            elementwise::rms_norm(xs, ws, self.eps, &mut out);
            HOST_NORM_CALLS.with(|c| c.set(c.get() + 1));
            return Ok(Some(Array::from_slice(&out, x.shape())));
        }
        if let (Some(xs), Some(ws)) = (ready_bf16(x), ready_bf16(&self.weight)) {
            if !self.host_matches_mlx()? {
                return Ok(None);
            }
            let mut out = vec![half::bf16::ZERO; xs.len()];
            elementwise::rms_norm_bf16(xs, ws, self.eps, &mut out);
            HOST_NORM_CALLS.with(|c| c.set(c.get() + 1));
            return Ok(Some(Array::from_slice(&out, x.shape())));
        }
        Ok(None)
    }

    /// Whether the host norm gives MLX's bits on a fixed probe with this weight; decided once
    /// per process for each weight dtype (f32 or bfloat16), width and epsilon.
    fn host_matches_mlx(&self) -> Result<bool> {
        type Verdicts = std::sync::Mutex<std::collections::HashMap<(Dtype, usize, u32), bool>>;
        static VERDICTS: std::sync::OnceLock<Verdicts> = std::sync::OnceLock::new();
        let dtype = self.weight.dtype();
        let width = self.weight.size();
        let key = (dtype, width, self.eps.to_bits());
        let verdicts = VERDICTS.get_or_init(Default::default);
        if let Some(v) = super::kernels::lock(verdicts).get(&key) {
            return Ok(*v);
        }
        let rows = 8;
        let probe = elementwise::probe_values(rows * width, 0x5851_f42d_4c95_7f2d);
        let shape = [rows as i32, width as i32];
        let (ours, x): (Vec<u32>, Array) = match (ready_f32(&self.weight), ready_bf16(&self.weight))
        {
            (Some(w), _) => {
                let mut out = vec![0.0; probe.len()];
                elementwise::rms_norm(&probe, w, self.eps, &mut out);
                let bits = out.iter().map(|v| v.to_bits()).collect();
                (bits, Array::from_slice(&probe, &shape))
            }
            (None, Some(w)) => {
                let probe: Vec<half::bf16> = probe.into_iter().map(elementwise::bf16_mlx).collect();
                let mut out = vec![half::bf16::ZERO; probe.len()];
                elementwise::rms_norm_bf16(&probe, w, self.eps, &mut out);
                let bits = out.iter().map(|v| v.to_f32().to_bits()).collect();
                (bits, Array::from_slice(&probe, &shape))
            }
            (None, None) => return Ok(false),
        };
        let theirs = fast::rms_norm(&x, Some(&self.weight), self.eps)?;
        let same = ours == super::kernels::check_bits(&theirs)?;
        super::kernels::lock(verdicts).insert(key, same);
        Ok(same)
    }

    /// Gemma's variant: the weight is stored as w and applied as `1.0 + w` (computed per call
    /// in the weight's dtype, as mlx-lm's gemma RMSNorm does).
    pub fn forward_one_plus(&self, x: &Array) -> Result<Array> {
        let w = weak_scalar(1.0, &self.weight)?.add(&self.weight)?;
        Ok(fast::rms_norm(x, Some(&w), self.eps)?)
    }
}
