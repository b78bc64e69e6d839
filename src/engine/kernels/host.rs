//! The explicit host path of a 4-bit (or 8-bit) linear layer: its packed weights are copied
//! once into huge-page memory ([`super::pages`]; past the copies' budget they are read in place
//! from MLX's evaluated buffers, kept alive), the input is evaluated and read, the kernel runs
//! on host memory and the result is wrapped as an MLX array.

use super::affine::{QMatrix, MAX_M};
use super::dispatch::{matmul, selection, Selection};
use super::pages::HostCopy;
use crate::engine::error::{EngineError, Result};
use crate::engine::weights::QuantSpec;
use mlx_rs::{Array, Dtype};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// A read-only view of an evaluated MLX buffer that its owner ([`HostQuant`],
/// [`super::dense::HostDense`]) keeps alive.
#[derive(Debug, Clone, Copy)]
pub(super) struct HostSlice<T> {
    ptr: *const T,
    len: usize,
}

// SAFETY: the pointer targets the data of an evaluated MLX array that the owning `HostQuant`
// holds a handle to; MLX never writes an evaluated array's buffer, and a held handle keeps
// the buffer from being donated to another op, so shared reads from any thread are sound.
unsafe impl<T> Send for HostSlice<T> {}
unsafe impl<T> Sync for HostSlice<T> {}

impl<T: mlx_rs::ArrayElement> HostSlice<T> {
    pub(super) fn of(a: &Array, what: &str) -> Result<Self> {
        let s = a.try_as_slice::<T>().map_err(|e| {
            EngineError::Runtime(format!("the quantized kernel cannot read the {what} ({e})"))
        })?;
        Ok(Self {
            ptr: s.as_ptr(),
            len: s.len(),
        })
    }

    pub(super) fn get(&self) -> &[T] {
        // SAFETY: see the `Send`/`Sync` note: the buffer outlives `self`'s owner.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// The values of `a` when it is an array of `T` whose data already exists in row-major order
/// (evaluated, e.g. a host product's result); `None` otherwise. Never evaluates: host paths that
/// use it save MLX a synchronisation rather than adding one.
fn ready<T: mlx_rs::ArrayElement>(a: &Array) -> Option<&[T]> {
    if a.dtype() != T::DTYPE {
        return None;
    }
    let mut available = false;
    // SAFETY: reads a flag of a live array handle.
    let status = unsafe { mlx_sys::_mlx_array_is_available(&mut available, a.as_ptr()) };
    if status != 0 || !available {
        return None;
    }
    a.try_as_slice::<T>().ok()
}

/// [`ready`] for an f32 array.
pub fn ready_f32(a: &Array) -> Option<&[f32]> {
    ready(a)
}

/// [`ready`] for a bfloat16 array.
pub fn ready_bf16(a: &Array) -> Option<&[half::bf16]> {
    ready(a)
}

/// `a` with its leading axis of one dropped (`[1, n]` → `[n]`) or added (`[n]` → `[1, n]`,
/// `add`): a host copy when its values already exist (f32, bfloat16, uint32 or int32; an MLX
/// reshape would be one more operation for the next synchronisation to wait on), MLX's
/// reshape otherwise.
pub fn reshaped_row(a: &Array, add: bool) -> Result<Array> {
    let shape: Vec<i32> = if add {
        [&[1], a.shape()].concat()
    } else if a.shape().first() == Some(&1) {
        a.shape()[1..].to_vec()
    } else {
        return Err(EngineError::Runtime(format!(
            "a row of shape {:?} has no leading axis of one",
            a.shape()
        )));
    };
    let copied = match a.dtype() {
        Dtype::Float32 => ready::<f32>(a).map(|v| Array::from_slice(v, &shape)),
        Dtype::Bfloat16 => ready::<half::bf16>(a).map(|v| Array::from_slice(v, &shape)),
        Dtype::Uint32 => ready::<u32>(a).map(|v| Array::from_slice(v, &shape)),
        Dtype::Int32 => ready::<i32>(a).map(|v| Array::from_slice(v, &shape)),
        _ => None,
    };
    Ok(match copied {
        Some(c) => c,
        None if add => a.expand_dims(0)?,
        None => a.squeeze_axes(&[0])?,
    })
}

/// An array's values widened to f32 (exact for every float dtype here), as bit patterns: what
/// the host kernels' one-time checks compare with MLX's result.
pub fn check_bits(a: &Array) -> Result<Vec<u32>> {
    let wide = a.as_dtype(Dtype::Float32)?;
    let s = wide.try_as_slice::<f32>().map_err(|e| {
        EngineError::Runtime(format!("cannot read MLX's result for a host check ({e})"))
    })?;
    Ok(s.iter().map(|v| v.to_bits()).collect())
}

/// An evaluated f32, bfloat16 or f16 array's values as f32 (exact), read on the host with no
/// MLX operation.
pub fn widened(a: &Array) -> Result<Vec<f32>> {
    fn read<T: mlx_rs::ArrayElement + Copy>(a: &Array) -> Result<Vec<f32>>
    where
        f32: From<T>,
    {
        let s = a
            .try_as_slice::<T>()
            .map_err(|e| EngineError::Runtime(format!("a host path cannot read an input ({e})")))?;
        Ok(s.iter().map(|&v| f32::from(v)).collect())
    }
    match a.dtype() {
        Dtype::Bfloat16 => read::<half::bf16>(a),
        Dtype::Float16 => read::<half::f16>(a),
        _ => read::<f32>(a),
    }
}

/// Values a host kernel reads: its own [`HostCopy`] in huge-page memory, or the buffer of an
/// MLX array it holds (past the copies' budget, or where the system gives no huge pages and a
/// copy would gain nothing). Cloning shares them.
#[derive(Debug, Clone)]
enum Held<T: bytemuck::Pod + mlx_rs::ArrayElement> {
    Copied(Arc<HostCopy<T>>),
    /// A view of the buffer of `_array` (held so that the buffer stays alive).
    Pinned {
        view: HostSlice<T>,
        _array: Array,
    },
}

impl<T: bytemuck::Pod + mlx_rs::ArrayElement> Held<T> {
    /// The values of `a` (evaluated), copied where huge pages and the budget allow.
    fn of(a: &Array, what: &str) -> Result<Self> {
        let view = HostSlice::of(a, what)?;
        Ok(match HostCopy::paged(view.get()) {
            Some(copy) => Self::Copied(Arc::new(copy)),
            None => Self::Pinned {
                view,
                _array: a.clone(),
            },
        })
    }

    fn get(&self) -> &[T] {
        match self {
            Self::Copied(c) => c,
            Self::Pinned { view, .. } => view.get(),
        }
    }
}

/// A 2-D affine-quantized weight (`[rows, cols * bits / 32]` uint32, f32 `[rows, cols/group]`
/// scales and biases) pinned in host memory for the kernel. Cloning shares the pinned buffers.
#[derive(Debug, Clone)]
pub struct HostQuant {
    packed: Held<u32>,
    scales: Held<f32>,
    biases: Held<f32>,
    bits: usize,
    rows: usize,
    cols: usize,
    group: usize,
}

impl HostQuant {
    /// Pins a quantized weight: evaluates it, converts non-f32 scales/biases to f32 once.
    pub fn new(weight: &Array, scales: &Array, biases: &Array, spec: QuantSpec) -> Result<Self> {
        let shape = weight.shape();
        if shape.len() != 2 || weight.dtype() != Dtype::Uint32 {
            return Err(EngineError::Runtime(format!(
                "the quantized kernel takes a 2-D uint32 weight, not {shape:?} {:?}",
                weight.dtype()
            )));
        }
        let bits = spec.bits as usize;
        let (rows, cols) = (shape[0] as usize, shape[1] as usize * 32 / bits);
        let f32_of = |a: &Array| -> Result<Array> {
            let a = a.as_dtype(Dtype::Float32)?;
            a.eval()?;
            Ok(a)
        };
        let (scales, biases) = (f32_of(scales)?, f32_of(biases)?);
        weight.eval()?;
        let me = Self {
            packed: Held::of(weight, "packed weight")?,
            scales: Held::of(&scales, "scales")?,
            biases: Held::of(&biases, "biases")?,
            bits,
            rows,
            cols,
            group: spec.group_size as usize,
        };
        me.matrix()?;
        Ok(me)
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The pinned weight as the kernels take it.
    pub fn matrix(&self) -> Result<QMatrix<'_>> {
        QMatrix::new(
            self.bits,
            self.packed.get(),
            self.scales.get(),
            self.biases.get(),
            self.rows,
            self.cols,
            self.group,
        )
        .map_err(|e| EngineError::Runtime(format!("quantized kernel: {e}")))
    }

    /// Whether `x` (`[..., cols]`) is small enough for the kernel (at most [`MAX_M`] rows).
    pub fn takes(x: &Array) -> bool {
        let last = x.shape().last().copied().unwrap_or(0).max(1) as usize;
        x.size() / last <= MAX_M
    }

    /// `x · Wᵀ` for `x` of shape `[..., cols]` with at most [`MAX_M`] rows, in `x`'s dtype,
    /// with the kernel path and threads of the environment ([`selection`]).
    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.forward_with(x, selection()?)
    }

    /// [`HostQuant::forward`] with an explicit path and thread cap (tests, benchmarks).
    pub fn forward_with(&self, x: &Array, sel: Selection) -> Result<Array> {
        let dtype = x.dtype();
        let xf = if dtype == Dtype::Float32 {
            x.clone()
        } else {
            x.as_dtype(Dtype::Float32)?
        };
        let host = xf.try_as_slice::<f32>().map_err(|e| {
            EngineError::Runtime(format!("the quantized kernel cannot read its input ({e})"))
        })?;
        let m = host.len() / self.cols;
        let y = matmul(sel, &self.matrix()?, host, m)?;
        count_calls(1);
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.rows as i32;
        }
        let out = Array::from_slice(&y, &shape);
        Ok(if dtype == Dtype::Float32 {
            out
        } else {
            out.as_dtype(dtype)?
        })
    }
}

static CALLS: AtomicUsize = AtomicUsize::new(0);

/// Records `n` mat-vecs computed on the host.
pub(crate) fn count_calls(n: usize) {
    CALLS.fetch_add(n, Ordering::Relaxed);
}

/// How many mat-vecs the host kernel has computed in this process (lets tests and benchmarks
/// check that `--perf-kernel on` really took the host path).
pub fn host_calls() -> usize {
    CALLS.load(Ordering::Relaxed)
}

/// A [`HostQuant`] built on first use (the weights may still be lazy when a layer is loaded).
#[derive(Debug, Default)]
pub struct HostQuantCell(OnceLock<HostQuant>);

impl HostQuantCell {
    /// The pinned weight, pinning it on the first call.
    pub fn get(
        &self,
        weight: &Array,
        scales: &Array,
        biases: &Array,
        spec: QuantSpec,
    ) -> Result<&HostQuant> {
        if let Some(h) = self.0.get() {
            return Ok(h);
        }
        let h = HostQuant::new(weight, scales, biases, spec)?;
        Ok(self.0.get_or_init(|| h))
    }
}

#[cfg(test)]
mod tests {
    use super::super::pages::huge_pages;
    use super::*;
    use mlx_rs::ops;

    /// A row whose values exist is reshaped by a host copy with the same values, dtype and
    /// shape as MLX's reshape; a lazy one by MLX's reshape; a row with no axis of one to drop
    /// is an error.
    #[test]
    fn rows_are_reshaped_like_mlx() {
        let f = Array::from_slice(&[1.5f32, -2.0, 3.25], &[1, 3]);
        let bf = f.as_dtype(Dtype::Bfloat16).unwrap();
        bf.eval().unwrap();
        let ids = Array::from_slice(&[7u32, 9], &[2]);
        let lazy = f.multiply(Array::from_f32(2.0)).unwrap();
        let available = |a: &Array| {
            let mut yes = false;
            // SAFETY: reads a flag of a live array handle.
            unsafe { mlx_sys::_mlx_array_is_available(&mut yes, a.as_ptr()) };
            yes
        };
        for (a, add, ready) in [
            (&f, false, true),
            (&bf, false, true),
            (&ids, true, true),
            (&lazy, false, false),
        ] {
            let ours = reshaped_row(a, add).unwrap();
            assert_eq!(available(&ours), ready, "{:?}", a.shape());
            let theirs = if add {
                a.expand_dims(0).unwrap()
            } else {
                a.squeeze_axes(&[0]).unwrap()
            };
            assert_eq!(ours.shape(), theirs.shape());
            assert_eq!(ours.dtype(), theirs.dtype());
            assert_eq!(check_bits(&ours).unwrap(), check_bits(&theirs).unwrap());
        }
        assert!(reshaped_row(&Array::from_slice(&[1.0f32; 6], &[2, 3]), false).is_err());
    }

    /// Where the system gives huge pages, the kernel reads its own copy of a quantized weight
    /// (in huge-page memory), holding the weight's values; elsewhere MLX's buffers. Either way
    /// it gives MLX's product.
    #[test]
    fn a_quantized_weight_is_read_from_its_own_copy() {
        let w = mlx_rs::random::normal::<f32>(&[64, 256], None, None, None).unwrap();
        let (q, s, b) = ops::quantize(&w, 64, 4).unwrap();
        let spec = QuantSpec {
            group_size: 64,
            bits: 4,
        };
        let h = HostQuant::new(&q, &s, &b, spec).unwrap();
        let mlx_codes = q.as_slice::<u32>();
        match &h.packed {
            Held::Copied(c) => {
                assert!(huge_pages(), "copied without huge pages");
                assert_eq!(&c[..], mlx_codes);
                assert_ne!(c.as_ptr(), mlx_codes.as_ptr());
            }
            Held::Pinned { view: v, .. } => {
                assert!(!huge_pages(), "the codes were not copied");
                assert_eq!(v.get().as_ptr(), mlx_codes.as_ptr());
            }
        }
        let copied = |held: &Held<f32>| matches!(held, Held::Copied(_));
        assert_eq!(copied(&h.scales), huge_pages());
        assert_eq!(copied(&h.biases), huge_pages());
        assert_eq!(h.scales.get(), s.as_slice::<f32>());
        assert_eq!(h.biases.get(), b.as_slice::<f32>());
        let x = mlx_rs::random::normal::<f32>(&[1, 256], None, None, None).unwrap();
        let want = ops::quantized_matmul(&x, &q, &s, &b, true, 64, 4).unwrap();
        let got = h.forward(&x).unwrap();
        let diff = ops::abs(ops::subtract(&got, &want).unwrap()).unwrap();
        assert!(diff.max(None).unwrap().item_cast::<f32>() < 1e-3);
    }
}
