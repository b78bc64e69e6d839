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
/// cache stays full precision; every layer uses `--kv-group-size`.
pub const KV_CONFIG_KEY: &str = "kv_quantization";

/// mlx-optiq's per-layer KV allocation, as `optiq kv-cache` writes it beside a model:
/// `[{"layer_idx": 0, "bits": 4, "group_size": 64}, ...]`, absent layers at full precision,
/// `group_size` 64 when left out. It wins over config.json's `kv_quantization`.
pub const OPTIQ_KV_CONFIG: &str = "kv_config.json";

/// How the warning of `--kv-quant config` without per-layer settings ends.
const NO_KV_SETTINGS: &str = "so every KV cache stays full precision";

/// One layer's KV cache quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayerQuant {
    /// Bits per element.
    pub bits: i32,
    /// Elements per scale/bias group.
    pub group_size: i32,
}

/// The resolved forks applied to one model.
#[derive(Debug, Clone)]
pub struct ForkPlan {
    /// The forks themselves.
    pub forks: Forks,
    /// Per-layer KV quantization (`None` = full precision); empty when it is off.
    pub kv_bits: Vec<Option<KvLayerQuant>>,
    /// Where `--kv-quant config` found the per-layer settings (a file and its format).
    pub kv_source: Option<String>,
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
            kv_source: None,
            attention: AttentionPlan {
                reference_sdpa: !forks.fused_sdpa,
                compiled_decode: forks.compiled_decode,
                fused_qkv: forks.fused_decode,
                online_f32: forks.perf_kernel,
                host_bf16: forks.host_matvec,
            },
            warnings: Vec::new(),
        }
    }

    /// Resolves `forks` for a model with `layers` caches and this config.json (and optiq's
    /// `kv_config.json` beside it, if any).
    pub fn new(forks: Forks, config_path: &Path, config: &Value, layers: usize) -> Result<Self> {
        let mut plan = Self::without_model(forks);
        let uniform = KvLayerQuant {
            bits: 0,
            group_size: forks.kv_group_size,
        };
        plan.kv_bits = match forks.kv_quant {
            KvQuant::Off => Vec::new(),
            KvQuant::Bits(bits) => vec![Some(KvLayerQuant { bits, ..uniform }); layers],
            KvQuant::Config => {
                let optiq = config_path.with_file_name(OPTIQ_KV_CONFIG);
                let in_config = config.get(KV_CONFIG_KEY).filter(|v| !v.is_null());
                if optiq.is_file() {
                    if in_config.is_some() {
                        plan.warnings.push(format!(
                            "--kv-quant config: {} wins over `{KV_CONFIG_KEY}` in {}",
                            optiq.display(),
                            config_path.display()
                        ));
                    }
                    return plan.with_optiq_kv_config(&optiq, layers, config);
                }
                match in_config {
                    None => {
                        plan.warnings.push(format!(
                            "--kv-quant config: {} has no `{KV_CONFIG_KEY}.layer_bits` and there is no {OPTIQ_KV_CONFIG} beside it, {NO_KV_SETTINGS}",
                            config_path.display()
                        ));
                        Vec::new()
                    }
                    Some(v) => {
                        plan.kv_source = Some(format!(
                            "{} `{KV_CONFIG_KEY}.layer_bits` (group size {})",
                            config_path.display(),
                            forks.kv_group_size
                        ));
                        layer_bits(config_path, v, layers)?
                            .into_iter()
                            .map(|b| b.map(|bits| KvLayerQuant { bits, ..uniform }))
                            .collect()
                    }
                }
            }
        };
        plan.finish(config);
        Ok(plan)
    }

    /// The plan with per-layer KV settings from an optiq `kv_config.json` at `path` (beside
    /// the model, or given with `--kv-config`), for a model with `layers` caches.
    pub fn with_optiq_kv_config(
        mut self,
        path: &Path,
        layers: usize,
        config: &Value,
    ) -> Result<Self> {
        if self.forks.kv_quant != KvQuant::Config {
            return Err(EngineError::Input(format!(
                "{} gives per-layer KV bits, which only --kv-quant config (or --l2) uses; add one of them",
                path.display()
            )));
        }
        self.kv_bits = optiq_kv_config(path, layers)?;
        let count = |bits: i32| {
            self.kv_bits
                .iter()
                .filter(|q| q.map(|q| q.bits) == Some(bits))
                .count()
        };
        let mut mix: Vec<String> = KV_BITS
            .iter()
            .filter(|&&b| count(b) > 0)
            .map(|&b| format!("{} at {b} bits", count(b)))
            .collect();
        let full = self.kv_bits.iter().filter(|q| q.is_none()).count();
        if full > 0 {
            mix.push(format!("{full} at full precision"));
        }
        self.kv_source = Some(format!(
            "{} (mlx-optiq's format; {} layers: {})",
            path.display(),
            layers,
            mix.join(", ")
        ));
        self.warnings.retain(|w| !w.ends_with(NO_KV_SETTINGS));
        self.finish(config);
        Ok(self)
    }

    /// Whether `--kv-quant config` quantizes at least one layer's KV cache (the runs the L2
    /// oracle checks; otherwise the output is L1's).
    pub fn per_layer_kv(&self) -> bool {
        self.forks.kv_quant == KvQuant::Config && self.kv_bits.iter().any(Option::is_some)
    }

    /// Warnings that depend on the final KV settings.
    fn finish(&mut self, config: &Value) {
        let quantized = config.get("quantization").is_some();
        let perf_warning = "--perf-kernel on has no effect";
        self.warnings.retain(|w| !w.starts_with(perf_warning));
        if self.forks.perf_kernel && self.kv_bits.iter().all(Option::is_none) && !quantized {
            self.warnings.push(format!(
                "{perf_warning}: the model has no quantized layers and no layer gets a quantized KV cache"
            ));
        }
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
            let Some(q) = *bits else { continue };
            if (slot.offset() as usize) < start {
                continue;
            }
            if let Some(q) = slot.to_quantized(q.group_size, q.bits)? {
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

/// Reads optiq's `kv_config.json`: a list of `{layer_idx, bits, group_size?}`; every layer it
/// names must exist once, with bits and a group size mlxb's KV caches take.
fn optiq_kv_config(path: &Path, layers: usize) -> Result<Vec<Option<KvLayerQuant>>> {
    let err = |what: String| EngineError::file(path, what);
    let text = std::fs::read_to_string(path)
        .map_err(|e| err(format!("cannot read the KV allocation ({e})")))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| {
        err(format!(
            "is not JSON ({e}); write optiq's list of {{\"layer_idx\", \"bits\", \"group_size\"}}"
        ))
    })?;
    let list = value.as_array().ok_or_else(|| {
        err("must be a JSON list of {\"layer_idx\", \"bits\", \"group_size\"} objects, as optiq writes it".into())
    })?;
    let mut out = vec![None; layers];
    for (i, entry) in list.iter().enumerate() {
        let int = |key: &str| entry.get(key).and_then(Value::as_i64);
        let layer =
            int("layer_idx").ok_or_else(|| err(format!("entry {i} has no integer `layer_idx`")))?;
        let bits = int("bits").ok_or_else(|| err(format!("entry {i} has no integer `bits`")))?;
        let group_size = match entry.get("group_size") {
            None | Some(Value::Null) => 64,
            Some(_) => int("group_size")
                .ok_or_else(|| err(format!("entry {i}: `group_size` must be an integer")))?,
        };
        let slot = usize::try_from(layer)
            .ok()
            .and_then(|l| out.get_mut(l))
            .ok_or_else(|| {
                err(format!(
                    "entry {i} names layer {layer}, but the model has layers 0..{}",
                    layers.saturating_sub(1)
                ))
            })?;
        if slot.is_some() {
            return Err(err(format!(
                "layer {layer} is listed twice; keep one entry"
            )));
        }
        if !KV_BITS.contains(&(bits as i32)) || ![32, 64, 128].contains(&group_size) {
            return Err(err(format!(
                "layer {layer} asks for {bits} bits in groups of {group_size}; mlxb's KV caches take {KV_BITS:?} bits in groups of 32, 64 or 128"
            )));
        }
        *slot = Some(KvLayerQuant {
            bits: bits as i32,
            group_size: group_size as i32,
        });
    }
    Ok(out)
}
