//! mlx-lm's compiled element-wise functions (`activations.py`, `nn.gelu_approx`, gemma's
//! `clip_residual`/`logit_softcap`, qwen3_next's `precise_swiglu`, ...). Each is compiled once
//! per model with the same `shapeless` boundary as mlx-lm's `@mx.compile`, and reused on every
//! call; [`CompiledOp`] is the one wrapper they share.

use crate::engine::error::{EngineError, Result};
use crate::engine::forks::Forks;
use crate::engine::kernels::{self, elementwise};
use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array, Dtype};
use std::rc::Rc;
use std::sync::OnceLock;

/// A graph over arrays, as mlx-lm writes the body of a compiled function.
pub type Graph = dyn Fn(&[Array]) -> std::result::Result<Vec<Array>, Exception>;
type CompiledFn = Box<dyn FnMut(&[Array]) -> std::result::Result<Vec<Array>, Exception>>;

/// One `mx.compile`d function: compiled once, reused every call; or run eagerly when the
/// `compiled_activations` fork is off (same bits on CPU).
pub struct CompiledOp {
    compiled: CompiledFn,
    graph: Rc<Graph>,
    eager: bool,
}

impl CompiledOp {
    /// Compiles `graph` (`shapeless` as in mlx-lm's decorator); `compiled == false` keeps it eager.
    pub fn new<G>(graph: G, shapeless: bool, compiled: bool) -> Self
    where
        G: Fn(&[Array]) -> std::result::Result<Vec<Array>, Exception> + Clone + 'static,
    {
        Self {
            compiled: Box::new(compile(graph.clone(), shapeless)),
            graph: Rc::new(graph),
            eager: !compiled,
        }
    }

    /// Runs the function on `args`, returning all outputs.
    pub fn call(&mut self, args: &[Array]) -> Result<Vec<Array>> {
        if self.eager {
            return Ok((self.graph)(args)?);
        }
        Ok((self.compiled)(args)?)
    }

    /// Runs a function with a single output.
    pub fn call1(&mut self, args: &[Array]) -> Result<Array> {
        let mut out = self.call(args)?;
        Ok(out.swap_remove(0))
    }
}

/// `nn.silu(x) = x * sigmoid(x)`.
pub fn silu_graph(x: &Array) -> std::result::Result<Array, Exception> {
    x.multiply(ops::sigmoid(x)?)
}

/// mlx's `nn.gelu_approx`, op for op with Python's weak scalars (each constant takes `x`'s
/// dtype; `sqrt(2 / pi)` is folded in f64 first, as Python does).
pub fn gelu_approx_graph(x: &Array) -> std::result::Result<Array, Exception> {
    let weak = |v: f64| Array::from_f32(v as f32).as_dtype(x.dtype());
    let inner =
        x.add(weak(0.044715)?.multiply(ops::power(x, Array::from_int(3).as_dtype(x.dtype())?)?)?)?;
    let t = ops::tanh(weak((2.0 / std::f64::consts::PI).sqrt())?.multiply(&inner)?)?;
    weak(0.5)?
        .multiply(x)?
        .multiply(Array::from_int(1).as_dtype(x.dtype())?.add(&t)?)
}

/// `nn.silu`, compiled shapeless.
pub fn silu(compiled: bool) -> CompiledOp {
    CompiledOp::new(|a: &[Array]| Ok(vec![silu_graph(&a[0])?]), true, compiled)
}

/// `nn.gelu_approx`, compiled shapeless (mlx-rs' `gelu_approximate` uses f32 constants and is
/// not bit-identical).
pub fn gelu_approx(compiled: bool) -> CompiledOp {
    CompiledOp::new(
        |a: &[Array]| Ok(vec![gelu_approx_graph(&a[0])?]),
        true,
        compiled,
    )
}

/// `swiglu(gate, x) = silu(gate) * x`, compiled shapeless.
pub fn swiglu(compiled: bool) -> CompiledOp {
    CompiledOp::new(
        |a: &[Array]| Ok(vec![silu_graph(&a[0])?.multiply(&a[1])?]),
        true,
        compiled,
    )
}

/// `geglu(gate, x) = gelu_approx(gate) * x` (gemma4), compiled shapeless.
pub fn geglu(compiled: bool) -> CompiledOp {
    CompiledOp::new(
        |a: &[Array]| Ok(vec![gelu_approx_graph(&a[0])?.multiply(&a[1])?]),
        true,
        compiled,
    )
}

/// `precise_swiglu(h, gate, x) = (silu(f32(gate)) * f32(x)).astype(h.dtype)`, compiled shapeless.
pub fn precise_swiglu(compiled: bool) -> CompiledOp {
    CompiledOp::new(
        |a: &[Array]| {
            let gate = silu_graph(&a[1].as_dtype(Dtype::Float32)?)?;
            let x = a[2].as_dtype(Dtype::Float32)?;
            Ok(vec![gate.multiply(&x)?.as_dtype(a[0].dtype())?])
        },
        true,
        compiled,
    )
}

/// `logit_softcap(cap, x) = tanh(x / cap) * cap` with `cap` a weak Python scalar, compiled
/// shapeless; one compiled function per cap value, as `mx.compile` keys on the constant.
pub fn logit_softcap(cap: f64, compiled: bool) -> CompiledOp {
    CompiledOp::new(
        move |a: &[Array]| Ok(vec![softcap_graph(&a[0], cap)?]),
        true,
        compiled,
    )
}

/// `tanh(x / cap) * cap` with weak scalars (also gemma2's eager logit/attention softcap).
pub fn softcap_graph(x: &Array, cap: f64) -> std::result::Result<Array, Exception> {
    let c = Array::from_f32(cap as f32).as_dtype(x.dtype())?;
    ops::tanh(x.divide(&c)?)?.multiply(&c)
}

/// The SwiGLU activation object mlx-lm's llama-family MLPs use. Under `--host-elementwise on`
/// f32 and bfloat16 inputs take the host kernel ([`crate::engine::kernels::elementwise`]) once
/// it has matched MLX's own kernel in this process.
pub struct SwiGlu {
    op: CompiledOp,
    host: bool,
}

impl SwiGlu {
    /// The activation as `forks` ask: compiled like mlx-lm or eager (same bits on CPU), on the
    /// host for f32 and bfloat16 where [`Forks::host_elem`] allows.
    pub fn new(forks: &Forks) -> Self {
        Self {
            op: swiglu(forks.compiled_activations),
            host: forks.host_elem(),
        }
    }

    /// Applies `silu(gate) * x`.
    pub fn apply(&mut self, gate: &Array, x: &Array) -> Result<Array> {
        if self.host && kernels::host_allowed() {
            if let Some(y) = self.host_apply(gate, x)? {
                return Ok(y);
            }
        }
        self.op.call1(&[gate.clone(), x.clone()])
    }

    /// Whether the L1 host step may compute this activation on the host: the host form is on
    /// and its f32 kernel matched MLX's (checked now if it has not been yet).
    pub fn host_exact(&self) -> Result<bool> {
        match self.host_probe() {
            Some(mut probe) => probe.host_matches_mlx(),
            None => Ok(false),
        }
    }

    /// MLX's bfloat16 `silu` of every bfloat16 value, for the bfloat16 L1 host step: `None`
    /// unless the host form is on and the SwiGLU built on the table matched MLX's kernel.
    pub fn host_exact_bf16(&self) -> Result<Option<&'static [half::bf16]>> {
        match self.host_probe() {
            Some(mut probe) => probe.silu_table_bf16(),
            None => Ok(None),
        }
    }

    /// An eager host SwiGLU to run the one-time checks on, when the host form is on.
    fn host_probe(&self) -> Option<SwiGlu> {
        self.host.then(|| SwiGlu {
            op: swiglu(false),
            host: true,
        })
    }

    /// The host kernel's result, or `None` for inputs it does not take (not f32 or bfloat16,
    /// different shapes, not contiguous) or when it differed from MLX's kernel in this process.
    fn host_apply(&mut self, gate: &Array, x: &Array) -> Result<Option<Array>> {
        if gate.dtype() != x.dtype() || gate.shape() != x.shape() {
            return Ok(None);
        }
        match gate.dtype() {
            Dtype::Float32 if self.host_matches_mlx()? => {}
            Dtype::Bfloat16 => return self.host_apply_bf16(gate, x),
            _ => return Ok(None),
        }
        eval([gate, x])?;
        let (Ok(g), Ok(u)) = (gate.try_as_slice::<f32>(), x.try_as_slice::<f32>()) else {
            return Ok(None);
        };
        let mut out = vec![0.0; g.len()];
        elementwise::swiglu(g, u, &mut out);
        HOST_SWIGLU_CALLS.with(|c| c.set(c.get() + 1));
        Ok(Some(Array::from_slice(&out, gate.shape())))
    }

    /// [`SwiGlu::host_apply`] for bfloat16: MLX's kernel rounds every intermediate to
    /// bfloat16, so `silu(gate)` is a function of the gate's 16 bits, tabulated once by MLX's
    /// own kernel ([`SwiGlu::silu_table_bf16`]); the host then does the last multiply.
    fn host_apply_bf16(&mut self, gate: &Array, x: &Array) -> Result<Option<Array>> {
        let Some(table) = self.silu_table_bf16()? else {
            return Ok(None);
        };
        eval([gate, x])?;
        let (Ok(g), Ok(u)) = (
            gate.try_as_slice::<half::bf16>(),
            x.try_as_slice::<half::bf16>(),
        ) else {
            return Ok(None);
        };
        let mut out = vec![half::bf16::ZERO; g.len()];
        elementwise::swiglu_bf16(g, u, table, &mut out);
        HOST_SWIGLU_CALLS.with(|c| c.set(c.get() + 1));
        Ok(Some(Array::from_slice(&out, gate.shape())))
    }

    /// MLX's bfloat16 `silu` of every bfloat16 value (`swiglu(g, 1)`: multiplying by one is
    /// exact), once per process, kept only when the host SwiGLU built on it then gives MLX's
    /// bits on a fixed probe; `None` leaves bfloat16 SwiGLUs to MLX.
    fn silu_table_bf16(&mut self) -> Result<Option<&'static [half::bf16]>> {
        static TABLE: OnceLock<Option<Vec<half::bf16>>> = OnceLock::new();
        if let Some(t) = TABLE.get() {
            return Ok(t.as_deref());
        }
        let every: Vec<half::bf16> = (0..=u16::MAX).map(half::bf16::from_bits).collect();
        let n = every.len() as i32;
        let ones = vec![half::bf16::ONE; every.len()];
        let silu = self.op.call1(&[
            Array::from_slice(&every, &[n]),
            Array::from_slice(&ones, &[n]),
        ])?;
        let table: Vec<half::bf16> = silu
            .try_as_slice::<half::bf16>()
            .map_err(|e| EngineError::Runtime(format!("cannot read MLX's bfloat16 silu ({e})")))?
            .to_vec();
        let (gate, up) = swiglu_probe();
        let gate: Vec<half::bf16> = gate.into_iter().map(elementwise::bf16_mlx).collect();
        let up: Vec<half::bf16> = up.into_iter().map(elementwise::bf16_mlx).collect();
        let mut ours = vec![half::bf16::ZERO; gate.len()];
        elementwise::swiglu_bf16(&gate, &up, &table, &mut ours);
        let same = self.same_as_mlx(
            &Array::from_slice(&gate, &[gate.len() as i32]),
            &Array::from_slice(&up, &[up.len() as i32]),
            ours.iter().map(|v| f32::from(*v).to_bits()),
        )?;
        Ok(TABLE.get_or_init(|| same.then_some(table)).as_deref())
    }

    /// Whether `ours` (bit patterns of f32-widened values) is MLX's kernel's result for
    /// `gate` and `up`.
    fn same_as_mlx(
        &mut self,
        gate: &Array,
        up: &Array,
        ours: impl Iterator<Item = u32>,
    ) -> Result<bool> {
        let theirs = self.op.call1(&[gate.clone(), up.clone()])?;
        Ok(ours.eq(kernels::check_bits(&theirs)?))
    }

    /// Whether the host kernel gives MLX's bits on a fixed probe (values over every magnitude
    /// an activation meets, both signs, the saturation points); decided once per process.
    fn host_matches_mlx(&mut self) -> Result<bool> {
        static VERDICT: OnceLock<bool> = OnceLock::new();
        if let Some(v) = VERDICT.get() {
            return Ok(*v);
        }
        let (gate, up) = swiglu_probe();
        let mut ours = vec![0.0; gate.len()];
        elementwise::swiglu(&gate, &up, &mut ours);
        let n = gate.len() as i32;
        let same = self.same_as_mlx(
            &Array::from_slice(&gate, &[n]),
            &Array::from_slice(&up, &[n]),
            ours.iter().map(|v| v.to_bits()),
        )?;
        Ok(*VERDICT.get_or_init(|| same))
    }
}

/// The host check's input: values over every magnitude (see [`elementwise::probe_values`])
/// and the exp's saturation points.
fn swiglu_probe() -> (Vec<f32>, Vec<f32>) {
    let mut gate = elementwise::probe_values(4096, 0x853c_49e6_748f_ea9b);
    gate.extend([0.0, -0.0, 88.0, -88.0, 61.0, -61.0, 0.5, -0.5]);
    let up = elementwise::probe_values(gate.len(), 0x2545_f491_4f6c_dd1d);
    (gate, up)
}

thread_local! {
    static HOST_SWIGLU_CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many SwiGLUs the host kernel computed on this thread (lets tests check that
/// `--host-elementwise on` really took it; per thread, so tests running side by side in one
/// process do not count each other's).
pub fn host_swiglu_calls() -> usize {
    HOST_SWIGLU_CALLS.with(std::cell::Cell::get)
}

/// `nn.gelu_approx` as a reusable object.
pub struct GeluApprox(CompiledOp);

impl GeluApprox {
    /// Compiles the activation (or keeps it eager when `compiled` is false).
    pub fn new(compiled: bool) -> Self {
        Self(gelu_approx(compiled))
    }

    /// Applies `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`.
    pub fn apply(&mut self, x: &Array) -> Result<Array> {
        self.0.call1(std::slice::from_ref(x))
    }
}
