//! mlx-lm's `QuantizedKVCache` (cache.py): keys and values stored affine-quantized
//! (`mx.quantize` per update) in buffers that grow by 256 positions, read by the quantized
//! attention (`base.quantized_scaled_dot_product_attention`) without ever being dequantized.

use super::{KvCache, STEP};
use crate::engine::cache_attention::AttentionPlan;
use crate::engine::error::{EngineError, Result};
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, TryIndexMutOp};
use mlx_rs::{ops, Array, Dtype};

/// One affine-quantized tensor as `mx.quantize` returns it: packed data, scales, biases.
#[derive(Debug, Clone)]
pub struct QuantizedKv {
    /// Packed uint32 values `[B, H, S, D * bits / 32]`.
    pub data: Array,
    /// Per-group scales `[B, H, S, D / group_size]`.
    pub scales: Array,
    /// Per-group biases, same shape as `scales`.
    pub biases: Array,
}

impl QuantizedKv {
    fn quantize(x: &Array, group_size: i32, bits: i32) -> Result<Self> {
        let dim = x.shape()[x.ndim() - 1];
        if dim % group_size != 0 {
            return Err(EngineError::Input(format!(
                "--kv-group-size {group_size} does not divide this model's head dim {dim}; pick a group size that does (32, 64 or 128)"
            )));
        }
        let (data, scales, biases) = ops::quantize(x, group_size, bits)?;
        Ok(Self {
            data,
            scales,
            biases,
        })
    }

    fn map(&self, f: impl Fn(&Array) -> Result<Array>) -> Result<Self> {
        Ok(Self {
            data: f(&self.data)?,
            scales: f(&self.scales)?,
            biases: f(&self.biases)?,
        })
    }

    fn arrays(&self) -> [&Array; 3] {
        [&self.data, &self.scales, &self.biases]
    }

    /// Positions held (the buffer length, axis 2).
    pub fn len(&self) -> i32 {
        self.data.shape()[2]
    }

    /// Whether the buffer holds no positions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` positions (views).
    pub fn prefix(&self, n: i32) -> Self {
        let p = |a: &Array| a.index((Ellipsis, ..n, ..));
        Self {
            data: p(&self.data),
            scales: p(&self.scales),
            biases: p(&self.biases),
        }
    }

    /// Positions `start..end` (views).
    pub fn range(&self, start: i32, end: i32) -> Self {
        let p = |a: &Array| a.index((Ellipsis, start..end, ..));
        Self {
            data: p(&self.data),
            scales: p(&self.scales),
            biases: p(&self.biases),
        }
    }
}

/// `QuantizedKVCache(group_size, bits)`; `trim` only lowers the offset.
#[derive(Clone)]
pub struct QuantizedCache {
    keys: Option<QuantizedKv>,
    values: Option<QuantizedKv>,
    offset: i32,
    group_size: i32,
    bits: i32,
    plan: AttentionPlan,
}

/// Bit widths MLX's affine quantization supports.
pub const KV_BITS: &[i32] = &[2, 3, 4, 5, 6, 8];

fn check_params(group_size: i32, bits: i32) -> Result<()> {
    if !KV_BITS.contains(&bits) || ![32, 64, 128].contains(&group_size) {
        return Err(EngineError::Input(format!(
            "KV cache quantization with {bits} bits and group size {group_size} is not supported (bits {KV_BITS:?}, group size 32, 64 or 128)"
        )));
    }
    Ok(())
}

impl QuantizedCache {
    /// An empty cache (mlx-lm `QuantizedKVCache(group_size, bits)`).
    pub fn new(group_size: i32, bits: i32) -> Result<Self> {
        check_params(group_size, bits)?;
        Ok(Self {
            keys: None,
            values: None,
            offset: 0,
            group_size,
            bits,
            plan: AttentionPlan::default(),
        })
    }

    /// `KVCache.to_quantized`: quantizes the whole full-precision buffers (step padding
    /// included, so later updates land at the same positions).
    pub fn from_full(
        kv: Option<(&Array, &Array)>,
        offset: i32,
        group_size: i32,
        bits: i32,
        plan: AttentionPlan,
    ) -> Result<Self> {
        let mut c = Self::new(group_size, bits)?;
        c.offset = offset;
        c.plan = plan;
        if let Some((k, v)) = kv {
            c.keys = Some(QuantizedKv::quantize(k, group_size, bits)?);
            c.values = Some(QuantizedKv::quantize(v, group_size, bits)?);
        }
        Ok(c)
    }

    /// Quantization group size.
    pub fn group_size(&self) -> i32 {
        self.group_size
    }

    /// Bits per quantized value.
    pub fn bits(&self) -> i32 {
        self.bits
    }

    fn zeros(&self, b: i32, h: i32, n: i32, dim: i32, dtype: Dtype) -> Result<QuantizedKv> {
        Ok(QuantizedKv {
            data: ops::zeros_dtype(&[b, h, n, dim * self.bits / 32], Dtype::Uint32)?,
            scales: ops::zeros_dtype(&[b, h, n, dim / self.group_size], dtype)?,
            biases: ops::zeros_dtype(&[b, h, n, dim / self.group_size], dtype)?,
        })
    }

    /// Quantizes and stores new keys/values (`[B, H, S, D]`) and returns the quantized
    /// keys/values attention should see (mlx-lm's `update_and_fetch`).
    pub fn update_and_fetch_quantized(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<(QuantizedKv, QuantizedKv)> {
        let (b, h, s, dk) = (
            keys.shape()[0],
            keys.shape()[1],
            keys.shape()[2],
            keys.shape()[3],
        );
        let dv = values.shape()[3];
        let prev = self.offset;
        let grow = match &self.keys {
            None => true,
            Some(k) => prev + s > k.len(),
        };
        if grow {
            let n = (STEP + s - 1) / STEP * STEP;
            match (self.keys.take(), self.values.take()) {
                (Some(mut k), Some(mut v)) => {
                    if prev % STEP != 0 {
                        k = k.prefix(prev);
                        v = v.prefix(prev);
                    }
                    let expand = |x: &QuantizedKv| {
                        x.map(|a| {
                            let sh = a.shape();
                            let z = ops::zeros_dtype(&[sh[0], sh[1], n, sh[3]], a.dtype())?;
                            Ok(ops::concatenate(&[a.clone(), z], -2)?)
                        })
                    };
                    self.keys = Some(expand(&k)?);
                    self.values = Some(expand(&v)?);
                }
                _ => {
                    self.keys = Some(self.zeros(b, h, n, dk, keys.dtype())?);
                    self.values = Some(self.zeros(b, h, n, dv, keys.dtype())?);
                }
            }
        }
        self.offset += s;
        let new_k = QuantizedKv::quantize(keys, self.group_size, self.bits)?;
        let new_v = QuantizedKv::quantize(values, self.group_size, self.bits)?;
        let (Some(k), Some(v)) = (self.keys.as_mut(), self.values.as_mut()) else {
            return Err(EngineError::Runtime(
                "quantized KV buffers missing after allocation".into(),
            ));
        };
        let end = self.offset;
        for (dst, src) in [
            (&mut k.data, &new_k.data),
            (&mut k.scales, &new_k.scales),
            (&mut k.biases, &new_k.biases),
            (&mut v.data, &new_v.data),
            (&mut v.scales, &new_v.scales),
            (&mut v.biases, &new_v.biases),
        ] {
            dst.try_index_mut((Ellipsis, prev..end, ..), src)?;
        }
        if self.offset == k.len() {
            Ok((k.clone(), v.clone()))
        } else {
            Ok((k.prefix(self.offset), v.prefix(self.offset)))
        }
    }
}

impl KvCache for QuantizedCache {
    fn offset(&self) -> i32 {
        self.offset
    }

    fn update_and_fetch(&mut self, _keys: &Array, _values: &Array) -> Result<(Array, Array)> {
        Err(EngineError::Input(
            "this model's attention reads full-precision keys/values and cannot use a quantized KV cache (mlx-lm cannot either); use --kv-quant off".into(),
        ))
    }

    offset_semantics!();

    fn state(&self) -> Vec<Array> {
        self.keys
            .iter()
            .chain(self.values.iter())
            .flat_map(|q| q.arrays().map(Array::clone))
            .collect()
    }

    clone_state!();

    fn as_quantized_mut(&mut self) -> Option<&mut QuantizedCache> {
        Some(self)
    }

    plan!();
}
