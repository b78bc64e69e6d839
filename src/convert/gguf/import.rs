//! GGUF → MLX-format model directory: config.json, generation_config.json, tokenizer files and
//! model.safetensors, written into a temporary directory next to the destination and renamed
//! into place only when complete. This file drives the import; `config` writes the configs,
//! `tensors` names and decodes the tensors, `staging` holds the directory being written.

use super::quant;
use super::{vocab, GgufHeader, TensorInfo};
use crate::engine::error::{EngineError, Result};
use crate::progress::Progress;
use mlx_rs::io::GgufFile;
use mlx_rs::{Array, Dtype};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::config::{
    generation_config, hparams, model_config, quantization_section, Arch, Hparams,
};
use super::staging::{write_weights, Staging};
use super::tensors::{hf_name, quantizable, unpermute_rows, Loaded, Source};

/// Version of the importer's output; the model registry re-imports cached models written by an
/// older one.
pub const IMPORTER_VERSION: u32 = 2;

/// Name of the provenance file written next to the weights.
pub const PROVENANCE_FILE: &str = "mlxb-import.json";

/// Element type of the dense tensors (and of scales/biases) in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutDtype {
    /// float32: exact dequantized values (the fastest exact configuration on CPU).
    F32,
    /// float16.
    F16,
    /// bfloat16: the dequantized values rounded; half the memory, and on CPU faster decoding than f32.
    BF16,
}

impl OutDtype {
    /// The MLX dtype.
    pub fn dtype(self) -> Dtype {
        match self {
            OutDtype::F32 => Dtype::Float32,
            OutDtype::F16 => Dtype::Float16,
            OutDtype::BF16 => Dtype::Bfloat16,
        }
    }

    /// Short name (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            OutDtype::F32 => "f32",
            OutDtype::F16 => "f16",
            OutDtype::BF16 => "bf16",
        }
    }
}

/// How to import.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// Dtype of dense weights and of quantization scales/biases.
    pub dtype: OutDtype,
    /// Keep block-quantized linear/embedding weights as MLX affine quantization where the
    /// layout maps losslessly (groups of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K).
    pub keep_quant: bool,
    /// Files (licence terms, notices) copied into the model directory as (source, name), before
    /// it is renamed into place, so a finished import never lacks them; a source that does not
    /// exist is skipped.
    pub extra_files: Vec<(PathBuf, String)>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self {
            dtype: OutDtype::F32,
            keep_quant: false,
            extra_files: Vec::new(),
        }
    }
}

/// What an import produced.
#[derive(Debug, Clone)]
pub struct ImportSummary {
    /// The output directory.
    pub out: PathBuf,
    /// The `model_type` written to config.json.
    pub model_type: String,
    /// Tensors written (a quantized weight counts once).
    pub tensors: usize,
    /// Weights kept quantized.
    pub quantized: usize,
    /// Whether MLX's own GGUF reader supplied the tensor data.
    pub mlx_reader: bool,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Size of model.safetensors in bytes.
    pub weight_bytes: u64,
}

/// Imports the GGUF at `src` into a new MLX-format directory `out` (which must not exist).
/// `progress(done, total)` is called as tensors are converted.
pub fn import_gguf(
    src: &Path,
    out: &Path,
    opts: &ImportOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ImportSummary> {
    let start = Instant::now();
    if out.exists() {
        return Err(EngineError::file(
            out,
            "already exists; mlxb writes a new directory and never overwrites one",
        ));
    }
    let h = GgufHeader::open(src)?;
    let hp = hparams(&h)?;
    let plan = plan_tensors(src, &h, &hp)?;
    let tied = !plan.iter().any(|(_, hf)| hf == "lm_head.weight");
    let tok = vocab::build(&h, &hp.prefix, hp.context)?;
    let mut config = model_config(&h, &hp, &tok, tied)?;

    let use_mlx = src.extension().is_some_and(|e| e == "gguf")
        && h.tensors.iter().all(|t| t.ggml_type.mlx_reads());
    let source = if use_mlx {
        Source::Mlx(
            GgufFile::load(src)
                .map_err(|e| EngineError::file(src, format!("MLX cannot read it ({e})")))?,
        )
    } else {
        Source::Own
    };

    let total = plan.len();
    let mut converted = Converted::default();
    for (i, (t, hf)) in plan.iter().enumerate() {
        let want_quant = opts.keep_quant && quantizable(hf, t);
        let loaded = load_tensor(src, &h, &hp, &source, t, want_quant)?;
        converted.insert(hf, loaded, opts.dtype.dtype())?;
        progress(i + 1, total);
    }
    let Converted { arrays, quant_bits } = converted;

    if let Some(q) = quantization_section(&quant_bits) {
        config.insert("quantization".into(), q);
    }
    let staging = Staging::new(out)?;
    staging.write_json("config.json", &Value::Object(config), true)?;
    staging.write_json("generation_config.json", &generation_config(&tok), true)?;
    staging.write_json("tokenizer.json", &tok.tokenizer_json, false)?;
    staging.write_json("tokenizer_config.json", &tok.tokenizer_config, true)?;
    let weight_bytes = write_weights(&staging, arrays)?;
    staging.write_json(
        PROVENANCE_FILE,
        &json!({
            "importer_version": IMPORTER_VERSION,
            "source": src.file_name().map(|n| n.to_string_lossy().into_owned()),
            "dtype": opts.dtype.name(),
            "keep_quant": opts.keep_quant,
            "mlx_reader": use_mlx,
        }),
        true,
    )?;
    staging.copy_extra(&opts.extra_files)?;
    staging.commit(out)?;
    Ok(ImportSummary {
        out: out.to_path_buf(),
        model_type: hp.arch.model_type().into(),
        tensors: total,
        quantized: quant_bits.len(),
        mlx_reader: use_mlx,
        seconds: start.elapsed().as_secs_f64(),
        weight_bytes,
    })
}

/// Pairs every tensor with its Hugging Face name, checking all of them before any is converted
/// so unknown names and types fail fast.
fn plan_tensors<'h>(
    src: &Path,
    h: &'h GgufHeader,
    hp: &Hparams,
) -> Result<Vec<(&'h TensorInfo, String)>> {
    let mut plan: Vec<(&TensorInfo, String)> = Vec::with_capacity(h.tensors.len());
    for t in &h.tensors {
        if t.name == "rope_freqs.weight" {
            return Err(EngineError::file(src, "carries llama3-style rope frequency factors (`rope_freqs.weight`), which mlxb cannot import"));
        }
        let hf = hf_name(hp.arch, &t.name).ok_or_else(|| {
            EngineError::file(
                src,
                format!(
                    "has tensor `{}`, which mlxb does not know for architecture {}",
                    t.name, hp.prefix
                ),
            )
        })?;
        if !t.ggml_type.is_supported() {
            let names: Vec<&str> = quant::SUPPORTED.iter().map(|t| t.name()).collect();
            return Err(EngineError::file(
                src,
                format!(
                    "has tensor `{}` of type {}, which mlxb cannot decode (supported: {})",
                    t.name,
                    t.ggml_type.name(),
                    names.join(", ")
                ),
            ));
        }
        plan.push((t, hf));
    }
    Ok(plan)
}

/// Reads one tensor and undoes llama.cpp's layout changes: the Q/K row permutation of Llama
/// and the `+ 1` of Gemma's norm weights.
fn load_tensor(
    src: &Path,
    h: &GgufHeader,
    hp: &Hparams,
    source: &Source,
    t: &TensorInfo,
    want_quant: bool,
) -> Result<Loaded> {
    let mut loaded = source.load(h, t, want_quant)?;
    if hp.arch == Arch::Llama {
        let heads = match t.name.rsplit('.').nth(1) {
            Some("attn_q") => Some(hp.n_head),
            Some("attn_k") => Some(hp.n_head_kv),
            _ => None,
        };
        if let Some(n) = heads {
            let rows = t.mlx_shape()[0] as u64;
            if rows != n * hp.head_dim {
                return Err(EngineError::file(
                    src,
                    format!(
                        "tensor `{}` has {rows} rows, expected {}",
                        t.name,
                        n * hp.head_dim
                    ),
                ));
            }
            loaded = loaded.map(|a| unpermute_rows(a, n as i32))?;
        }
    }
    if hp.arch == Arch::Gemma3 && t.name.ends_with("norm.weight") {
        // llama.cpp stores Gemma's RMSNorm weights as w + 1; mlx-lm adds the 1 itself.
        let w = loaded.dense()?;
        loaded = Loaded::Dense(w.subtract(Array::from_f32(1.0))?);
    }
    Ok(loaded)
}

/// The converted tensors by output name, and the bit width of every quantized module.
#[derive(Default)]
struct Converted {
    arrays: HashMap<String, Array>,
    quant_bits: BTreeMap<String, i32>,
}

impl Converted {
    /// Adds the tensor named `hf`: dense as `dtype`, quantized as weight, scales and biases
    /// (scales and biases as `dtype`), each evaluated.
    fn insert(&mut self, hf: &str, loaded: Loaded, dtype: Dtype) -> Result<()> {
        match loaded {
            Loaded::Dense(a) => {
                let a = a.as_dtype(dtype)?;
                a.eval()?;
                self.arrays.insert(hf.to_owned(), a);
            }
            Loaded::Quant {
                w,
                scales,
                biases,
                bits,
            } => {
                let module = hf.strip_suffix(".weight").unwrap_or(hf).to_owned();
                let (scales, biases) = (scales.as_dtype(dtype)?, biases.as_dtype(dtype)?);
                for a in [&w, &scales, &biases] {
                    a.eval()?;
                }
                self.arrays.insert(format!("{module}.weight"), w);
                self.arrays.insert(format!("{module}.scales"), scales);
                self.arrays.insert(format!("{module}.biases"), biases);
                self.quant_bits.insert(module, bits);
            }
        }
        Ok(())
    }
}

/// [`import_gguf`] reporting the converted tensors to `progress`.
pub fn import_reporting(
    src: &Path,
    out: &Path,
    opts: &ImportOptions,
    progress: &dyn Progress,
) -> Result<ImportSummary> {
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut begun = false;
    let result = import_gguf(src, out, opts, &mut |done, total| {
        if !begun {
            progress.begin(&format!("importing {name}"), total as u64, "tensors");
            begun = true;
        }
        progress.set(done as u64);
        if done == total {
            progress.relabel("writing model.safetensors");
        }
    });
    progress.end();
    result
}
