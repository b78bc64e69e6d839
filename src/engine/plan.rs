//! What the resolved forks mean for one loaded model: which layers' KV caches get quantized
//! (and when), and how attention computes over every cache. The generation loop applies it;
//! the models only read the per-cache [`AttentionPlan`].

use super::cache::KV_BITS;
use super::cache_attention::AttentionPlan;
use super::error::{EngineError, Result};
use super::forks::{Forks, KvQuant};
use super::models::Caches;
use serde_json::Value;
use std::path::Path;

/// The config.json key of `--kv-quant config`: `{"kv_quantization": {"layer_bits": [...]}}`,
/// one entry per layer (per cache), each 2, 3, 4, 5, 6 or 8 bits, or 0/null for a layer whose
/// cache stays full precision.
pub const KV_CONFIG_KEY: &str = "kv_quantization";

/// The resolved forks applied to one model.
#[derive(Debug, Clone)]
pub struct ForkPlan {
    /// The forks themselves.
    pub forks: Forks,
    /// Per-layer KV bits (`None` = full precision); empty when KV quantization is off.
    pub kv_bits: Vec<Option<i32>>,
    /// How attention computes over every cache.
    pub attention: AttentionPlan,
    /// Documented warnings about this model (a fork with nothing to act on).
    pub warnings: Vec<String>,
}

impl Default for ForkPlan {
    fn default() -> Self {
        Self::without_model(Forks::default())
    }
}

impl ForkPlan {
    /// The plan for forks that need nothing from the model (KV quantization off or uniform
    /// bits for `layers` layers).
    fn without_model(forks: Forks) -> Self {
        Self {
            forks,
            kv_bits: Vec::new(),
            attention: AttentionPlan {
                reference_sdpa: !forks.fused_sdpa,
                compiled_decode: forks.compiled_decode,
                fused_qkv: forks.fused_decode,
                online_f32: forks.perf_kernel,
            },
            warnings: Vec::new(),
        }
    }

    /// Resolves `forks` for a model with `layers` caches and this config.json.
    pub fn new(forks: Forks, config_path: &Path, config: &Value, layers: usize) -> Result<Self> {
        let mut plan = Self::without_model(forks);
        plan.kv_bits = match forks.kv_quant {
            KvQuant::Off => Vec::new(),
            KvQuant::Bits(b) => vec![Some(b); layers],
            KvQuant::Config => match config.get(KV_CONFIG_KEY) {
                None | Some(Value::Null) => {
                    plan.warnings.push(format!(
                        "--kv-quant config: {} has no `{KV_CONFIG_KEY}.layer_bits`, so every KV cache stays full precision",
                        config_path.display()
                    ));
                    Vec::new()
                }
                Some(v) => layer_bits(config_path, v, layers)?,
            },
        };
        let quantized = config.get("quantization").is_some();
        if forks.perf_kernel && plan.kv_bits.iter().all(Option::is_none) && !quantized {
            plan.warnings.push(
                "--perf-kernel on has no effect: the model has no quantized layers and no layer gets a quantized KV cache"
                    .into(),
            );
        }
        Ok(plan)
    }

    /// Sets the attention plan on fresh caches.
    pub fn prepare(&self, caches: &mut Caches) {
        for c in caches.iter_mut() {
            c.set_plan(self.attention);
        }
    }

    /// mlx-lm's `maybe_quantize_kv_cache`: every layer with bits whose cache holds at least
    /// `quantized_kv_start` tokens is replaced by its quantized copy (kinds mlx-lm leaves alone
    /// stay; a rotating cache is an error, as in mlx-lm).
    pub fn quantize(&self, caches: &mut Caches) -> Result<()> {
        let start = self.forks.quantized_kv_start;
        for (slot, bits) in caches.iter_mut().zip(&self.kv_bits) {
            let Some(bits) = *bits else { continue };
            if (slot.offset() as usize) < start {
                continue;
            }
            if let Some(q) = slot.to_quantized(self.forks.kv_group_size, bits)? {
                *slot = q;
            }
        }
        Ok(())
    }

    /// The most tokens a speculative verify block starting at cache position `position` may
    /// draft so that it does not straddle the switch to quantized caches: vanilla decoding
    /// computes position `p` with quantized attention iff `p >= quantized_kv_start`.
    pub fn max_draft(&self, position: usize) -> Option<usize> {
        let start = self.forks.quantized_kv_start;
        if self.kv_bits.iter().all(Option::is_none) || position >= start {
            return None;
        }
        Some(start - 1 - position)
    }
}

fn layer_bits(config_path: &Path, v: &Value, layers: usize) -> Result<Vec<Option<i32>>> {
    let err = |what: String| EngineError::file(config_path, format!("`{KV_CONFIG_KEY}` {what}"));
    let list = v
        .get("layer_bits")
        .and_then(Value::as_array)
        .ok_or_else(|| err("must be an object with a `layer_bits` list".into()))?;
    if list.len() != layers {
        return Err(err(format!(
            "has {} layer_bits entries but the model has {layers} layers",
            list.len()
        )));
    }
    list.iter()
        .enumerate()
        .map(|(i, b)| match b {
            Value::Null => Ok(None),
            b => match b.as_i64() {
                Some(0) => Ok(None),
                Some(n) if KV_BITS.contains(&(n as i32)) => Ok(Some(n as i32)),
                _ => Err(err(format!(
                    "layer_bits[{i}] is {b}; use one of {KV_BITS:?}, or 0/null for full precision"
                ))),
            },
        })
        .collect()
}
