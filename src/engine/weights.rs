//! Loading a checkpoint's tensors (`model*.safetensors`, sharded or not) and handing them to
//! model constructors by name, with the strictness of mlx-lm's `load_weights(strict=True)`:
//! a missing, mis-shaped or left-over tensor is an error naming the file and the tensor.

use super::distributed::Group;
use super::error::{EngineError, Result};
use super::loader;
use super::shard::RankShare;
use mlx_rs::{Array, Dtype};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Affine quantization parameters of one layer (mlx-lm's `quantization` config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    /// Elements sharing one scale/bias.
    pub group_size: i32,
    /// Bits per weight.
    pub bits: i32,
}

/// The checkpoint's `quantization` section: a default plus per-layer overrides.
#[derive(Debug, Clone, Default)]
pub struct QuantConfig {
    default: Option<QuantSpec>,
    overrides: HashMap<String, Option<QuantSpec>>,
}

const VALID_BITS: [i32; 6] = [2, 3, 4, 5, 6, 8];
const VALID_GROUPS: [i32; 3] = [32, 64, 128];

fn parse_spec(config: &Path, field: &str, v: &serde_json::Value) -> Result<QuantSpec> {
    let get = |k: &str| {
        v.get(k).and_then(|x| x.as_i64()).ok_or_else(|| {
            EngineError::file(
                config,
                format!("`{field}.{k}` is missing or not an integer; mlxb needs group_size and bits for quantized layers"),
            )
        })
    };
    let spec = QuantSpec {
        group_size: get("group_size")? as i32,
        bits: get("bits")? as i32,
    };
    if !VALID_BITS.contains(&spec.bits) {
        return Err(EngineError::file(
            config,
            format!(
                "`{field}.bits` is {}; MLX affine quantization supports bits 2, 3, 4, 5, 6 or 8",
                spec.bits
            ),
        ));
    }
    if !VALID_GROUPS.contains(&spec.group_size) {
        return Err(EngineError::file(
            config,
            format!(
                "`{field}.group_size` is {}; MLX affine quantization supports 32, 64 or 128",
                spec.group_size
            ),
        ));
    }
    if let Some(mode) = v.get("mode").and_then(|m| m.as_str()) {
        if mode != "affine" {
            return Err(EngineError::file(
                config,
                format!("`{field}.mode` is \"{mode}\"; mlxb supports only affine quantization"),
            ));
        }
    }
    Ok(spec)
}

impl QuantConfig {
    /// Parses `config["quantization"]` (absent → unquantized).
    pub fn from_config(config_path: &Path, config: &serde_json::Value) -> Result<Self> {
        let Some(q) = config.get("quantization") else {
            return Ok(Self::default());
        };
        let Some(obj) = q.as_object() else {
            return Err(EngineError::file(
                config_path,
                "`quantization` must be an object with group_size and bits",
            ));
        };
        let default = Some(parse_spec(config_path, "quantization", q)?);
        let mut overrides = HashMap::new();
        for (k, v) in obj {
            match v {
                serde_json::Value::Object(_) => {
                    overrides.insert(
                        k.clone(),
                        Some(parse_spec(config_path, &format!("quantization.{k}"), v)?),
                    );
                }
                serde_json::Value::Bool(false) => {
                    overrides.insert(k.clone(), None);
                }
                _ => {}
            }
        }
        Ok(Self { default, overrides })
    }

    /// Whether the checkpoint is quantized at all.
    pub fn is_quantized(&self) -> bool {
        self.default.is_some()
    }
}

/// Tensors of a checkpoint, taken by name as the model is built; what is never taken is
/// reported by [`WeightStore::finish`].
pub struct WeightStore {
    dir: PathBuf,
    tensors: HashMap<String, Array>,
    quant: QuantConfig,
    host_kernel: bool,
    host_matvec: bool,
    host_elementwise: bool,
    host_step: bool,
    share: Option<RankShare>,
}

impl WeightStore {
    /// Loads every `model*.safetensors` in `dir` (the index file is not needed: mlx-lm globs
    /// too), read into memory now, as mlx-lm evaluates a model's parameters at load: the read
    /// then overlaps the tokenizer parse in `Session::open` instead of the first forward.
    pub fn load(dir: &Path, quant: QuantConfig) -> Result<Self> {
        Self::load_on_ranks(dir, quant, None)
    }

    /// [`WeightStore::load`] of one rank's share of the checkpoint (see [`RankShare`]): only
    /// what the rank holds is read.
    pub fn load_on_ranks(dir: &Path, quant: QuantConfig, share: Option<RankShare>) -> Result<Self> {
        let files = loader::model_files(dir)?;
        if files.is_empty() {
            return Err(EngineError::file(
                dir,
                "no model*.safetensors files found; is this an MLX-format model directory?",
            ));
        }
        let mut tensors = HashMap::new();
        let mut share = share;
        for f in &files {
            match &mut share {
                None => tensors.extend(loader::load(f)?),
                Some(share) => tensors.extend(share.load(f)?),
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            tensors,
            quant,
            host_kernel: false,
            host_matvec: false,
            host_elementwise: false,
            host_step: false,
            share,
        })
    }

    /// Makes 4-bit linear layers loaded from here run single-token steps on the host kernel
    /// (`--perf-kernel on`, see [`crate::engine::kernels`]).
    pub fn set_host_kernel(&mut self, on: bool) {
        self.host_kernel = on;
    }

    /// Whether 4-bit linear layers get the host kernel.
    pub fn host_kernel(&self) -> bool {
        self.host_kernel
    }

    /// Makes dense (f32/bf16/f16) layers loaded from here run single-token products on the
    /// host in MLX's own summation order (`--host-matvec on`, see
    /// [`crate::engine::kernels::dense`]).
    pub fn set_host_matvec(&mut self, on: bool) {
        self.host_matvec = on;
    }

    /// Whether dense layers get the host product.
    pub fn host_matvec(&self) -> bool {
        self.host_matvec
    }

    /// Makes RMSNorms and residual adds loaded from here run on the host for f32 data that is
    /// already on the host (`--host-elementwise on`, see [`crate::engine::kernels::elementwise`]).
    pub fn set_host_elementwise(&mut self, on: bool) {
        self.host_elementwise = on;
    }

    /// Whether RMSNorms and residual adds get the host path.
    pub fn host_elementwise(&self) -> bool {
        self.host_elementwise
    }

    /// Makes models loaded from here run dense f32 decode steps whole on the host in MLX's
    /// order (`--host-step on`, see [`crate::engine::kernels::step`]).
    pub fn set_host_step(&mut self, on: bool) {
        self.host_step = on;
    }

    /// Whether dense f32 decode steps run whole on the host.
    pub fn host_step(&self) -> bool {
        self.host_step
    }

    /// Number of ranks each layer is split over (1 without tensor parallelism).
    pub fn tensor_ranks(&self) -> usize {
        self.share.as_ref().map_or(1, RankShare::tensor_ranks)
    }

    /// The layers this rank runs of a pipeline-parallel job, and its group.
    pub fn pipeline(&self) -> Option<(std::ops::Range<usize>, Arc<Group>)> {
        self.share.as_ref()?.pipeline()
    }

    /// The group whose ranks' outputs of the layer at `module` must be summed (an input-split
    /// layer), if any.
    pub fn all_sum_group(&self, module: &str) -> Option<Arc<Group>> {
        self.share.as_ref()?.all_sum_group(module)
    }

    /// This rank's slice of tensor `name` when its module is split and the loader has not
    /// already read only that; the tensor itself otherwise.
    fn shard(&self, name: &str, a: Array) -> Result<Array> {
        match &self.share {
            Some(share) => share.cut(name, a).map_err(|e| self.err(e.to_string())),
            None => Ok(a),
        }
    }

    /// Builds a store from tensors already in memory (tests, importers).
    pub fn from_tensors(dir: &Path, tensors: HashMap<String, Array>, quant: QuantConfig) -> Self {
        Self {
            dir: dir.to_path_buf(),
            tensors,
            quant,
            host_kernel: false,
            host_matvec: false,
            host_elementwise: false,
            host_step: false,
            share: None,
        }
    }

    /// Whether a tensor of this name exists (and has not been taken yet).
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Adds (or replaces) a tensor, e.g. one rebuilt by a `sanitize` step.
    pub fn insert(&mut self, name: &str, a: Array) {
        self.tensors.insert(name.to_owned(), a);
    }

    /// Names of the tensors not taken yet, sorted (for `sanitize` steps that rename or reshape).
    pub fn names(&self) -> Vec<String> {
        let mut n: Vec<String> = self.tensors.keys().cloned().collect();
        n.sort();
        n
    }

    /// Drops a tensor the model does not use (mlx-lm's `sanitize`).
    pub fn discard(&mut self, name: &str) {
        self.tensors.remove(name);
    }

    /// Drops every tensor whose name contains `fragment` (e.g. rotary `inv_freq` buffers).
    pub fn discard_matching(&mut self, fragment: &str) {
        self.tensors.retain(|k, _| !k.contains(fragment));
    }

    /// Takes a required tensor and checks its shape.
    pub fn take(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let a = self.take_any(name)?;
        if a.shape() != shape {
            return Err(self.err(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                a.shape()
            )));
        }
        Ok(a)
    }

    /// Takes a required tensor of any shape.
    pub fn take_any(&mut self, name: &str) -> Result<Array> {
        let a = self.tensors.remove(name).ok_or_else(|| {
            self.err(format!(
                "tensor `{name}` is missing; the checkpoint does not match config.json"
            ))
        })?;
        self.shard(name, a)
    }

    /// Takes an optional tensor and checks its shape if present.
    pub fn take_opt(&mut self, name: &str, shape: &[i32]) -> Result<Option<Array>> {
        if self.contains(name) {
            self.take(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Quantization of the module at `path`, following mlx-lm's class predicate: a per-layer
    /// override wins; otherwise the module is quantized iff `{path}.scales` exists.
    pub fn quant_for(&self, path: &str) -> Option<QuantSpec> {
        if let Some(o) = self.quant.overrides.get(path) {
            return *o;
        }
        let default = self.quant.default?;
        self.contains(&format!("{path}.scales")).then_some(default)
    }

    /// Errors on tensors the model never took (mlx-lm's strict loading).
    pub fn finish(self) -> Result<()> {
        let left: BTreeSet<&String> = self.tensors.keys().collect();
        if let Some(first) = left.iter().next() {
            return Err(EngineError::file(
                &self.dir,
                format!(
                    "{} unexpected tensor(s) such as `{first}`; the checkpoint does not match config.json",
                    left.len()
                ),
            ));
        }
        Ok(())
    }

    /// An error about this checkpoint directory.
    pub fn err(&self, reason: String) -> EngineError {
        EngineError::file(&self.dir, reason)
    }

    /// Dtype of the first floating tensor, used as the model's activation dtype.
    pub fn float_dtype(&self) -> Option<Dtype> {
        self.tensors
            .values()
            .map(|a| a.dtype())
            .find(|d| matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16))
    }
}

/// Weight bytes and parameter count of the checkpoint in `dir`, read from the safetensors
/// headers (quantized weights count `32 / bits` parameters per packed u32; scales and biases
/// of quantized layers are not parameters). Used by `mlxb bench`'s size/params columns.
pub fn checkpoint_size(dir: &Path, quant_bits: Option<i32>) -> Result<(u64, u64)> {
    let mut bytes = 0u64;
    let mut params = 0u64;
    for path in loader::model_files(dir)? {
        for t in loader::read_header(&path)?.tensors {
            bytes += t.end - t.start;
            let elems: u64 = t.shape.iter().product();
            let quantized_aux = quant_bits.is_some()
                && (t.name.ends_with(".scales") || t.name.ends_with(".biases"));
            params += match (t.dtype.as_str(), quant_bits) {
                _ if quantized_aux => 0,
                ("U32", Some(bits)) => elems * 32 / bits.max(1) as u64,
                _ => elems,
            };
        }
    }
    Ok((bytes, params))
}
