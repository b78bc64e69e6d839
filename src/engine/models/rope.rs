//! Rotary position embeddings as mlx-lm's `initialize_rope` builds them: plain/linear
//! (`nn.RoPE`) and llama3 (frequency array built with the same MLX ops and dtypes).

use crate::engine::error::{EngineError, Result};
use crate::engine::kernels::{HostRope, RopeTable};
use mlx_rs::{fast, ops, Array};
use serde_json::Value;

/// One attention layer's rotary embedding.
#[derive(Debug, Clone)]
pub enum Rope {
    /// `mx.fast.rope(x, dims, traditional, base, scale, offset)`.
    Plain {
        dims: i32,
        traditional: bool,
        base: f32,
        scale: f32,
    },
    /// `mx.fast.rope(..., base=None, scale=1.0, freqs=freqs)`.
    Freqs {
        dims: i32,
        traditional: bool,
        freqs: Array,
    },
}

fn num(cfg: &Value, key: &str, default: f64) -> f64 {
    cfg.get(key).and_then(Value::as_f64).unwrap_or(default)
}

impl Rope {
    /// Builds the rope from `rope_theta`, `rope_traditional` and `rope_scaling` (config.json).
    pub fn from_config(
        dims: i32,
        base: f64,
        traditional: bool,
        scaling: Option<&Value>,
    ) -> Result<Self> {
        let scaling = scaling.filter(|v| !v.is_null());
        // Python: `cfg.get("type") or cfg.get("rope_type", "default")` (null/"" fall through).
        let field = |k: &str| {
            scaling
                .and_then(|s| s.get(k))
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
        };
        let rope_type = field("type")
            .or_else(|| field("rope_type"))
            .unwrap_or("default");
        match rope_type {
            "default" | "linear" => {
                let scale = if rope_type == "linear" {
                    let factor = scaling.and_then(|s| s.get("factor")).and_then(Value::as_f64).ok_or_else(|| {
                        EngineError::Input("config.json: `rope_scaling.factor` is required for linear rope scaling".into())
                    })?;
                    (1.0 / factor) as f32
                } else {
                    1.0
                };
                Ok(Rope::Plain { dims, traditional, base: base as f32, scale })
            }
            "llama3" => {
                let cfg = scaling.unwrap_or(&Value::Null);
                let factor = cfg.get("factor").and_then(Value::as_f64).ok_or_else(|| {
                    EngineError::Input("config.json: `rope_scaling.factor` is required for llama3 rope scaling".into())
                })?;
                Ok(Rope::Freqs { dims, traditional, freqs: llama3_freqs(dims, base, factor, cfg)? })
            }
            "mrope" => {
                // Text-only: mlx-lm builds a plain `nn.RoPE` after checking the sections.
                let sections = scaling.and_then(|s| s.get("mrope_section")).and_then(Value::as_array);
                if sections.map(Vec::len) != Some(3) {
                    return Err(EngineError::Input(
                        "config.json: `mrope_section` must list 3 sections for mrope".into(),
                    ));
                }
                Ok(Rope::Plain { dims, traditional, base: base as f32, scale: 1.0 })
            }
            "proportional" => {
                let cfg = scaling.unwrap_or(&Value::Null);
                let rotated = (dims as f64 * num(cfg, "partial_rotary_factor", 1.0)) as i32;
                if rotated > dims || rotated < 0 {
                    return Err(EngineError::Input(format!(
                        "config.json: `partial_rotary_factor` gives {rotated} rotated dims of {dims}; it must be between 0 and 1"
                    )));
                }
                let freqs = proportional_freqs(dims, rotated, base, num(cfg, "factor", 1.0))?;
                Ok(Rope::Freqs { dims, traditional, freqs })
            }
            other => Err(EngineError::Input(format!(
                "config.json: rope_scaling type \"{other}\" is not supported yet (supported: default, linear, llama3, mrope, proportional)"
            ))),
        }
    }

    /// The same rotation for the host decode step (`--perf-kernel on`).
    pub fn host(&self) -> Result<HostRope> {
        Ok(match self {
            Rope::Plain {
                dims,
                traditional,
                base,
                scale,
            } => HostRope::from_base(*dims as usize, *traditional, *base, *scale),
            Rope::Freqs {
                dims,
                traditional,
                freqs,
            } => {
                let f = freqs.as_dtype(mlx_rs::Dtype::Float32)?;
                let f = f.try_as_slice::<f32>().map_err(|e| {
                    EngineError::Runtime(format!("cannot read the rope frequencies ({e})"))
                })?;
                HostRope::from_freqs(*dims as usize, *traditional, f)
            }
        })
    }

    /// MLX's own rotation as a host table for positions `0..positions` of heads `head_dim`
    /// wide (the L1 host step): the cosines and sines read back from this rope applied to unit
    /// vectors, then the host rotation of `dtype` (f32 or bfloat16) compared with this rope's
    /// on random heads of that dtype at positions across the table. `None` where they differ
    /// (the step is then not used).
    pub fn host_table(
        &self,
        head_dim: usize,
        positions: usize,
        dtype: mlx_rs::Dtype,
    ) -> Result<Option<RopeTable>> {
        let bf16 = match dtype {
            mlx_rs::Dtype::Float32 => false,
            mlx_rs::Dtype::Bfloat16 => true,
            _ => return Ok(None),
        };
        let (dims, traditional) = match self {
            Rope::Plain {
                dims, traditional, ..
            }
            | Rope::Freqs {
                dims, traditional, ..
            } => (*dims as usize, *traditional),
        };
        if dims > head_dim || dims % 2 != 0 || positions == 0 {
            return Ok(None);
        }
        let units = RopeTable::unit_input(dims, head_dim, traditional, positions);
        let shape = [1, 1, positions as i32, head_dim as i32];
        let rotated = self.apply(&Array::from_slice(&units, &shape), 0)?;
        let table =
            RopeTable::from_rotated_units(dims, head_dim, traditional, &read_f32(&rotated)?);
        let heads = 3;
        let key = mlx_rs::random::key(0x2f6b_1c3d)?;
        let dims4 = [1, heads, 1, head_dim as i32];
        let x = mlx_rs::random::normal::<f32>(&dims4[..], 0.0, 4.0, &key)?.as_dtype(dtype)?;
        let probe = read_f32(&x)?;
        for pos in [0, 1, 2, 37, 1000, 4097, positions - 1] {
            let pos = pos.min(positions - 1);
            let mut ours = probe.clone();
            if bf16 {
                table.apply_bf16(&mut ours, head_dim, pos)
            } else {
                table.apply(&mut ours, head_dim, pos)
            }
            .map_err(EngineError::Runtime)?;
            let theirs = read_f32(&self.apply(&x, pos as i32)?)?;
            let same = ours
                .iter()
                .map(|v| v.to_bits())
                .eq(theirs.iter().map(|v| v.to_bits()));
            if !same {
                return Ok(None);
            }
        }
        Ok(Some(table))
    }

    /// Like [`Rope::apply`] with the offset as an MLX array (`offset=mx.array(cache.offset)`).
    pub fn apply_dynamic(&self, x: &Array, offset: &Array) -> Result<Array> {
        self.rotate(x, Offset::Array(offset))
    }

    /// Rotates `x` ([B, H, L, D]) for positions starting at `offset`.
    pub fn apply(&self, x: &Array, offset: i32) -> Result<Array> {
        self.rotate(x, Offset::Int(offset))
    }

    /// `mx.fast.rope` with this rope's parameters (`base` and `scale`, or `freqs`).
    fn rotate(&self, x: &Array, offset: Offset<'_>) -> Result<Array> {
        let (dims, traditional, base, scale, freqs) = match self {
            Rope::Plain {
                dims,
                traditional,
                base,
                scale,
            } => (*dims, *traditional, Some(*base), *scale, None),
            Rope::Freqs {
                dims,
                traditional,
                freqs,
            } => (*dims, *traditional, None, 1.0, Some(freqs)),
        };
        Ok(match offset {
            Offset::Int(o) => fast::rope(x, dims, traditional, base, scale, o, freqs)?,
            Offset::Array(o) => fast::rope_dynamic(x, dims, traditional, base, scale, o, freqs)?,
        })
    }
}

/// A RoPE position offset: a Python int, or an `mx.array`.
#[derive(Clone, Copy)]
enum Offset<'a> {
    Int(i32),
    Array(&'a Array),
}

/// `ProportionalRoPE._freqs`: `factor * base ** (arange(0, rotated, 2, f32) / dims)`, then `inf`
/// (no rotation) for the remaining pairs.
fn proportional_freqs(dims: i32, rotated: i32, base: f64, factor: f64) -> Result<Array> {
    let f = |v: f64| Array::from_f32(v as f32);
    let exponents = ops::arange::<_, f32>(0, rotated, 2)?.divide(f(dims as f64))?;
    let freqs = f(factor).multiply(ops::power(f(base), &exponents)?)?;
    let rest = ops::full::<f32>(&[(dims - rotated) / 2], f(f64::INFINITY))?;
    Ok(ops::concatenate(&[freqs, rest], 0)?)
}

/// `Llama3RoPE._freqs`, op for op (all f32, weak scalars become f32).
fn llama3_freqs(dims: i32, base: f64, factor: f64, cfg: &Value) -> Result<Array> {
    let low_freq_factor = num(cfg, "low_freq_factor", 1.0);
    let high_freq_factor = num(cfg, "high_freq_factor", 4.0);
    let old_context_len = num(cfg, "original_max_position_embeddings", 8192.0);
    let low_freq_wavelen = old_context_len / low_freq_factor;
    let high_freq_wavelen = old_context_len / high_freq_factor;
    let f = |v: f64| Array::from_f32(v as f32);

    let exponents = ops::arange::<_, i32>(0, dims, 2)?.divide(Array::from_int(dims))?;
    let freqs = ops::power(f(base), &exponents)?;
    let wavelens = f(2.0 * std::f64::consts::PI).multiply(&freqs)?;
    let freqs = ops::select(
        &wavelens.gt(f(low_freq_wavelen))?,
        &freqs.multiply(f(factor))?,
        &freqs,
    )?;
    let is_medium = wavelens
        .gt(f(high_freq_wavelen))?
        .logical_and(&wavelens.lt(f(low_freq_wavelen))?)?;
    let smooth = f(old_context_len)
        .divide(&wavelens)?
        .subtract(f(low_freq_factor))?
        .divide(f(high_freq_factor - low_freq_factor))?;
    let denom = f(1.0).subtract(&smooth)?.divide(f(factor))?.add(&smooth)?;
    let smooth_freqs = freqs.divide(&denom)?;
    Ok(ops::select(&is_medium, &smooth_freqs, &freqs)?)
}

/// An f32 array's values, evaluated and in row order.
fn read_f32(a: &Array) -> Result<Vec<f32>> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32)?.contiguous()?;
    a.eval()?;
    a.try_as_slice::<f32>()
        .map(<[f32]>::to_vec)
        .map_err(|e| EngineError::Runtime(format!("cannot read a rope result ({e})")))
}
