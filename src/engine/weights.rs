//! Loading a checkpoint's tensors (`model*.safetensors`, sharded or not) and handing them to
//! model constructors by name, with the strictness of mlx-lm's `load_weights(strict=True)`:
//! a missing, mis-shaped or left-over tensor is an error naming the file and the tensor.

use super::error::{EngineError, Result};
use mlx_rs::{Array, Dtype};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

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
}

impl WeightStore {
    /// Loads every `model*.safetensors` in `dir` (the index file is not needed: mlx-lm globs too).
    pub fn load(dir: &Path, quant: QuantConfig) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| EngineError::file(dir, format!("cannot read the model directory ({e})")))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                name.starts_with("model") && name.ends_with(".safetensors")
            })
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(EngineError::file(
                dir,
                "no model*.safetensors files found; is this an MLX-format model directory?",
            ));
        }
        let mut tensors = HashMap::new();
        for f in &files {
            check_safetensors_header(f)?;
            let loaded = Array::load_safetensors(f).map_err(|e| {
                EngineError::file(
                    f,
                    format!("cannot load safetensors ({e}); the file is corrupt or truncated"),
                )
            })?;
            tensors.extend(loaded);
        }
        // Read every tensor now, as mlx-lm evaluates a model's parameters at load: the read
        // then overlaps the tokenizer parse in `Session::open` instead of the first forward.
        mlx_rs::transforms::eval(tensors.values())
            .map_err(|e| EngineError::file(dir, format!("cannot read the weights ({e})")))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            tensors,
            quant,
            host_kernel: false,
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

    /// Builds a store from tensors already in memory (tests, importers).
    pub fn from_tensors(dir: &Path, tensors: HashMap<String, Array>, quant: QuantConfig) -> Self {
        Self {
            dir: dir.to_path_buf(),
            tensors,
            quant,
            host_kernel: false,
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
        self.tensors.remove(name).ok_or_else(|| {
            self.err(format!(
                "tensor `{name}` is missing; the checkpoint does not match config.json"
            ))
        })
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

/// Validates a safetensors header before handing the file to MLX, so that a corrupt or
/// truncated file is a clear error instead of whatever the C++ loader throws.
fn check_safetensors_header(path: &Path) -> Result<()> {
    use std::io::Read;
    let bad = |why: &str| EngineError::file(path, format!("corrupt safetensors file: {why}"));
    let mut f = std::fs::File::open(path)
        .map_err(|e| EngineError::file(path, format!("cannot open ({e})")))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad("shorter than its 8-byte header length"))?;
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 || 8 + n > len {
        return Err(bad("header length points past the end of the file"));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|_| bad("header is truncated"))?;
    let json: serde_json::Value =
        serde_json::from_slice(&header).map_err(|_| bad("header is not valid JSON"))?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad("header is not a JSON object"))?;
    let data_len = len - 8 - n;
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let end = info
            .get("data_offsets")
            .and_then(|o| o.get(1))
            .and_then(|e| e.as_u64())
            .ok_or_else(|| bad(&format!("tensor `{name}` has no data_offsets")))?;
        if end > data_len {
            return Err(bad(&format!(
                "tensor `{name}` extends past the end of the file (truncated download?)"
            )));
        }
    }
    Ok(())
}

/// Weight bytes and parameter count of the checkpoint in `dir`, read from the safetensors
/// headers (quantized weights count `32 / bits` parameters per packed u32; scales and biases
/// of quantized layers are not parameters). Used by `mlxb bench`'s size/params columns.
pub fn checkpoint_size(dir: &Path, quant_bits: Option<i32>) -> Result<(u64, u64)> {
    use std::io::Read;
    let mut bytes = 0u64;
    let mut params = 0u64;
    let entries =
        std::fs::read_dir(dir).map_err(|e| EngineError::file(dir, format!("cannot read ({e})")))?;
    for entry in entries.filter_map(|e| e.ok()) {
        let path = entry.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !(name.starts_with("model") && name.ends_with(".safetensors")) {
            continue;
        }
        check_safetensors_header(&path)?;
        let mut f = std::fs::File::open(&path)
            .map_err(|e| EngineError::file(&path, format!("cannot open ({e})")))?;
        let mut n = [0u8; 8];
        f.read_exact(&mut n)
            .map_err(|e| EngineError::file(&path, format!("cannot read ({e})")))?;
        let mut header = vec![0u8; u64::from_le_bytes(n) as usize];
        f.read_exact(&mut header)
            .map_err(|e| EngineError::file(&path, format!("cannot read ({e})")))?;
        let json: serde_json::Value = serde_json::from_slice(&header)
            .map_err(|e| EngineError::file(&path, format!("bad header ({e})")))?;
        for (tensor, info) in json.as_object().into_iter().flatten() {
            let Some(off) = info.get("data_offsets").and_then(|o| o.as_array()) else {
                continue;
            };
            let (a, b) = (off[0].as_u64().unwrap_or(0), off[1].as_u64().unwrap_or(0));
            bytes += b.saturating_sub(a);
            let elems: u64 = info["shape"]
                .as_array()
                .map(|s| s.iter().filter_map(|d| d.as_u64()).product())
                .unwrap_or(0);
            let quantized_aux = quant_bits.is_some()
                && (tensor.ends_with(".scales") || tensor.ends_with(".biases"));
            params += match (info["dtype"].as_str(), quant_bits) {
                _ if quantized_aux => 0,
                (Some("U32"), Some(bits)) => elems * 32 / bits.max(1) as u64,
                _ => elems,
            };
        }
    }
    Ok((bytes, params))
}
