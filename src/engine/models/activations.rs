//! mlx-lm's compiled activations (`activations.py`). Each is compiled once per model, with the
//! same `shapeless=True` boundary as mlx-lm's `@mx.compile`, and reused every call.

use crate::engine::error::Result;
use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{ops, Array};

type Binary =
    Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> std::result::Result<Array, Exception>>;

/// `swiglu(gate, x) = silu(gate) * x`, compiled shapeless.
pub struct SwiGlu {
    compiled: Binary,
    eager: bool,
}

fn swiglu_graph((gate, x): (&Array, &Array)) -> std::result::Result<Array, Exception> {
    let silu = gate.multiply(ops::sigmoid(gate)?)?;
    silu.multiply(x)
}

impl SwiGlu {
    /// Compiles the activation (or keeps it eager when `compiled` is false; same bits on CPU).
    pub fn new(compiled: bool) -> Self {
        Self {
            compiled: Box::new(compile(swiglu_graph, true)),
            eager: !compiled,
        }
    }

    /// Applies `silu(gate) * x`.
    pub fn apply(&mut self, gate: &Array, x: &Array) -> Result<Array> {
        if self.eager {
            return Ok(swiglu_graph((gate, x))?);
        }
        Ok((self.compiled)((gate, x))?)
    }
}

type Unary = Box<dyn for<'a> FnMut(&'a Array) -> std::result::Result<Array, Exception>>;

/// mlx's `nn.gelu_approx`, op for op with Python's weak scalars (each constant takes `x`'s dtype;
/// `sqrt(2 / pi)` is folded in f64 first, as Python does).
fn gelu_approx_graph(x: &Array) -> std::result::Result<Array, Exception> {
    let weak = |v: f64| Array::from_f32(v as f32).as_dtype(x.dtype());
    let inner =
        x.add(weak(0.044715)?.multiply(ops::power(x, Array::from_int(3).as_dtype(x.dtype())?)?)?)?;
    let t = ops::tanh(weak((2.0 / std::f64::consts::PI).sqrt())?.multiply(&inner)?)?;
    weak(0.5)?
        .multiply(x)?
        .multiply(Array::from_int(1).as_dtype(x.dtype())?.add(&t)?)
}

/// `nn.gelu_approx`, compiled shapeless as mlx does (mlx-rs' `gelu_approximate` uses f32
/// constants and is not bit-identical).
pub struct GeluApprox {
    compiled: Unary,
    eager: bool,
}

impl GeluApprox {
    /// Compiles the activation (or keeps it eager when `compiled` is false).
    pub fn new(compiled: bool) -> Self {
        Self {
            compiled: Box::new(compile(gelu_approx_graph, true)),
            eager: !compiled,
        }
    }

    /// Applies `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`.
    pub fn apply(&mut self, x: &Array) -> Result<Array> {
        if self.eager {
            return Ok(gelu_approx_graph(x)?);
        }
        Ok((self.compiled)(x)?)
    }
}
