//! GGUF → MLX-format model directory: config.json, generation_config.json, tokenizer files and
//! model.safetensors, written into a temporary directory next to the destination and renamed
//! into place only when complete.

use super::quant::{self, Decoded, GgmlType};
use super::{vocab, GgufHeader, TensorInfo};
use crate::engine::error::{EngineError, Result};
use crate::progress::Progress;
use mlx_rs::io::GgufFile;
use mlx_rs::{Array, Dtype};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

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
    /// bfloat16.
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

/// The architectures mlxb imports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Gemma3,
}

/// Hyperparameters read from `{arch}.*` metadata.
struct Hparams {
    arch: Arch,
    prefix: String,
    n_layer: u64,
    hidden: u64,
    ffn: u64,
    n_head: u64,
    n_head_kv: u64,
    head_dim: u64,
    eps: f64,
    rope_theta: Option<f64>,
    context: Option<u64>,
}

fn hparams(h: &GgufHeader) -> Result<Hparams> {
    let prefix = h.str("general.architecture")?.to_owned();
    let arch = match prefix.as_str() {
        "llama" => Arch::Llama,
        "gemma3" => Arch::Gemma3,
        other => {
            return Err(EngineError::file(
                &h.path,
                format!("has architecture `{other}`, which mlxb cannot import (it imports llama and gemma3)"),
            ))
        }
    };
    let k = |s: &str| format!("{prefix}.{s}");
    let hidden = h.uint(&k("embedding_length"))?;
    let n_head = h.uint(&k("attention.head_count"))?;
    if n_head == 0 || hidden == 0 {
        return Err(h.missing(&k("attention.head_count"), "a positive integer"));
    }
    let n_head_kv = h.uint_opt(&k("attention.head_count_kv"))?.unwrap_or(n_head);
    let head_dim = h
        .uint_opt(&k("attention.key_length"))?
        .unwrap_or(hidden / n_head);
    if n_head_kv == 0 || n_head % n_head_kv != 0 || head_dim == 0 || head_dim % 2 != 0 {
        return Err(EngineError::file(
            &h.path,
            format!("has inconsistent attention metadata ({n_head} heads, {n_head_kv} key/value heads, head size {head_dim})"),
        ));
    }
    if let Some(v) = h.uint_opt(&k("attention.value_length"))? {
        if v != head_dim {
            return Err(EngineError::file(
                &h.path,
                "has different key and value head sizes, which mlxb cannot import",
            ));
        }
    }
    if let Some(r) = h.uint_opt(&k("rope.dimension_count"))? {
        if r != head_dim {
            return Err(EngineError::file(
                &h.path,
                format!("applies rotary embeddings to {r} of {head_dim} head dimensions (partial rotary), which mlxb cannot import"),
            ));
        }
    }
    if let Some(t) = h.get(&k("rope.scaling.type")).and_then(|v| v.as_str()) {
        if t != "none" && !(t == "linear" && arch == Arch::Gemma3) {
            return Err(EngineError::file(
                &h.path,
                format!("uses `{t}` rope scaling, which mlxb cannot import"),
            ));
        }
    }
    Ok(Hparams {
        arch,
        n_layer: h.uint(&k("block_count"))?,
        hidden,
        ffn: h.uint(&k("feed_forward_length"))?,
        n_head,
        n_head_kv,
        head_dim,
        eps: h
            .float_opt(&k("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| h.missing(&k("attention.layer_norm_rms_epsilon"), "a number"))?,
        rope_theta: h.float_opt(&k("rope.freq_base"))?,
        context: h.uint_opt(&k("context_length"))?,
        prefix,
    })
}

/// An f32 metadata value as JSON, written with its shortest decimal form (1e-05, not
/// 9.999999747378752e-06), as Hugging Face configs write it.
fn f32_json(v: f64) -> Value {
    let short: f64 = format!("{}", v as f32).parse().unwrap_or(v);
    json!(short)
}

fn one_or_many(ids: &[u32]) -> Value {
    match ids {
        [one] => json!(one),
        many => json!(many),
    }
}

fn model_config(
    h: &GgufHeader,
    hp: &Hparams,
    tok: &vocab::TokenizerFiles,
    tied: bool,
) -> Result<Map<String, Value>> {
    let k = |s: &str| format!("{}.{s}", hp.prefix);
    // The embedding's row count is what the weights hold (vocabularies may be padded).
    let embedding_rows = h
        .tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .and_then(|t| t.dims.get(1).copied());
    let vocab_size = match embedding_rows {
        Some(rows) => rows,
        None => h
            .uint_opt(&k("vocab_size"))?
            .unwrap_or(tok.vocab_len as u64),
    };
    let mut c = Map::new();
    let mut set = |key: &str, v: Value| {
        c.insert(key.to_owned(), v);
    };
    set("hidden_size", json!(hp.hidden));
    set("num_hidden_layers", json!(hp.n_layer));
    set("intermediate_size", json!(hp.ffn));
    set("num_attention_heads", json!(hp.n_head));
    set("num_key_value_heads", json!(hp.n_head_kv));
    set("head_dim", json!(hp.head_dim));
    set("rms_norm_eps", f32_json(hp.eps));
    set("vocab_size", json!(vocab_size));
    set("tie_word_embeddings", json!(tied));
    if let Some(ctx) = hp.context {
        set("max_position_embeddings", json!(ctx));
    }
    if let Some(b) = tok.bos_id {
        set("bos_token_id", json!(b));
    }
    if !tok.eos_ids.is_empty() {
        set("eos_token_id", one_or_many(&tok.eos_ids));
    }
    if let Some(p) = tok.pad_id {
        set("pad_token_id", json!(p));
    }
    match hp.arch {
        Arch::Llama => {
            set("architectures", json!(["LlamaForCausalLM"]));
            set("model_type", json!("llama"));
            set("hidden_act", json!("silu"));
            set("attention_bias", json!(false));
            set("mlp_bias", json!(false));
            set("rope_theta", f32_json(hp.rope_theta.unwrap_or(10_000.0)));
            set("rope_scaling", Value::Null);
        }
        Arch::Gemma3 => {
            // llama.cpp fixes what the GGUF does not store: every 6th layer is global, local
            // layers use rope base 10000, and queries are scaled by head_dim (hidden/heads for 27B).
            let pattern = h
                .uint_opt(&k("attention.sliding_window_pattern"))?
                .unwrap_or(6)
                .max(1);
            let layer_types: Vec<&str> = (0..hp.n_layer)
                .map(|i| {
                    if (i + 1) % pattern == 0 {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    }
                })
                .collect();
            let scalar = if hp.n_layer == 62 {
                hp.hidden / hp.n_head
            } else {
                hp.head_dim
            };
            let rope_scaling = match h.float_opt(&k("rope.scaling.factor"))? {
                Some(f)
                    if h.get(&k("rope.scaling.type")).and_then(|v| v.as_str())
                        == Some("linear") =>
                {
                    json!({"rope_type": "linear", "factor": f32_json(f)})
                }
                _ => Value::Null,
            };
            set("architectures", json!(["Gemma3ForCausalLM"]));
            set("model_type", json!("gemma3_text"));
            set("hidden_activation", json!("gelu_pytorch_tanh"));
            set("rope_theta", f32_json(hp.rope_theta.unwrap_or(1_000_000.0)));
            set("rope_local_base_freq", json!(10_000.0));
            set("rope_scaling", rope_scaling);
            set("query_pre_attn_scalar", json!(scalar));
            set(
                "sliding_window",
                json!(h.uint_opt(&k("attention.sliding_window"))?.unwrap_or(512)),
            );
            set("sliding_window_pattern", json!(pattern));
            set("layer_types", json!(layer_types));
            set("final_logit_softcapping", Value::Null);
            set("attn_logit_softcapping", Value::Null);
        }
    }
    Ok(c)
}

/// llama.cpp tensor name → the Hugging Face / mlx-lm name, or `None` if unknown.
fn hf_name(arch: Arch, name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: u32 = layer.parse().ok()?;
    let base = rest.strip_suffix(".weight")?;
    let mapped = match (base, arch) {
        ("attn_norm", _) => "input_layernorm",
        ("attn_q", _) => "self_attn.q_proj",
        ("attn_k", _) => "self_attn.k_proj",
        ("attn_v", _) => "self_attn.v_proj",
        ("attn_output", _) => "self_attn.o_proj",
        ("ffn_gate", _) => "mlp.gate_proj",
        ("ffn_up", _) => "mlp.up_proj",
        ("ffn_down", _) => "mlp.down_proj",
        ("ffn_norm", Arch::Llama) => "post_attention_layernorm",
        ("ffn_norm", Arch::Gemma3) => "pre_feedforward_layernorm",
        ("post_attention_norm", Arch::Gemma3) => "post_attention_layernorm",
        ("post_ffw_norm", Arch::Gemma3) => "post_feedforward_layernorm",
        ("attn_q_norm", Arch::Gemma3) => "self_attn.q_norm",
        ("attn_k_norm", Arch::Gemma3) => "self_attn.k_norm",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{mapped}.weight"))
}

/// Whether the weight belongs to a module MLX can quantize (linear layers and the embedding).
fn quantizable(hf: &str, t: &TensorInfo) -> bool {
    t.dims.len() == 2
        && (hf.ends_with("_proj.weight")
            || hf == "model.embed_tokens.weight"
            || hf == "lm_head.weight")
}

/// A tensor on its way to the output.
enum Loaded {
    /// float32 values.
    Dense(Array),
    /// MLX affine quantization with group size 32.
    Quant {
        w: Array,
        scales: Array,
        biases: Array,
        bits: i32,
    },
}

impl Loaded {
    fn map(self, f: impl Fn(&Array) -> Result<Array>) -> Result<Loaded> {
        Ok(match self {
            Loaded::Dense(a) => Loaded::Dense(f(&a)?),
            Loaded::Quant {
                w,
                scales,
                biases,
                bits,
            } => Loaded::Quant {
                w: f(&w)?,
                scales: f(&scales)?,
                biases: f(&biases)?,
                bits,
            },
        })
    }

    fn dense(self) -> Result<Array> {
        Ok(match self {
            Loaded::Dense(a) => a,
            Loaded::Quant {
                w,
                scales,
                biases,
                bits,
            } => mlx_rs::ops::dequantize(&w, &scales, &biases, 32, bits)?,
        })
    }
}

/// Where tensor data comes from.
enum Source {
    /// MLX's reader: every tensor type is one it decodes exactly.
    Mlx(GgufFile),
    /// mlxb's decoders.
    Own,
}

impl Source {
    fn load(&self, h: &GgufHeader, t: &TensorInfo, want_quant: bool) -> Result<Loaded> {
        let shape = t.mlx_shape();
        match self {
            Source::Mlx(file) => {
                let get = |key: &str| -> Result<Array> {
                    file.get_array(key)
                        .map_err(|e| {
                            EngineError::file(
                                &h.path,
                                format!("MLX cannot read tensor `{key}` ({e})"),
                            )
                        })?
                        .ok_or_else(|| {
                            EngineError::file(
                                &h.path,
                                format!("MLX's reader has no tensor `{key}`"),
                            )
                        })
                };
                let w = get(&t.name)?;
                let bits = match t.ggml_type {
                    GgmlType::Q4_0 | GgmlType::Q4_1 => 4,
                    GgmlType::Q8_0 => 8,
                    _ => {
                        let w = w.as_dtype(Dtype::Float32)?;
                        return Ok(Loaded::Dense(w.reshape(&shape)?));
                    }
                };
                let base = t.name.strip_suffix(".weight").unwrap_or(&t.name);
                let scales = get(&format!("{base}.scales"))?.as_dtype(Dtype::Float32)?;
                let biases = get(&format!("{base}.biases"))?.as_dtype(Dtype::Float32)?;
                let mut packed_shape = shape.clone();
                if let Some(last) = packed_shape.last_mut() {
                    *last = *last * bits / 32;
                }
                if w.shape() != packed_shape.as_slice() {
                    return Err(EngineError::file(
                        &h.path,
                        format!(
                            "MLX read tensor `{}` with shape {:?}, expected {packed_shape:?}",
                            t.name,
                            w.shape()
                        ),
                    ));
                }
                let q = Loaded::Quant {
                    w,
                    scales,
                    biases,
                    bits,
                };
                if want_quant {
                    Ok(q)
                } else {
                    Ok(Loaded::Dense(q.dense()?))
                }
            }
            Source::Own => {
                let bytes = h.read_tensor(t)?;
                let decoded = quant::decode(t.ggml_type, &bytes, t.n_elements() as usize)
                    .map_err(|e| EngineError::file(&h.path, format!("tensor `{}`: {e}", t.name)))?;
                drop(bytes);
                match decoded {
                    Decoded::Affine(a) if want_quant && a.group == 32 => {
                        // `quantizable` only admits matrices.
                        let (rows, cols) = (shape[0], shape[1]);
                        let words = a.pack();
                        let w = Array::from_slice(&words, &[rows, cols * a.bits as i32 / 32]);
                        let scales = Array::from_slice(&a.scales, &[rows, cols / 32]);
                        let biases = Array::from_slice(&a.biases, &[rows, cols / 32]);
                        Ok(Loaded::Quant {
                            w,
                            scales,
                            biases,
                            bits: a.bits as i32,
                        })
                    }
                    d => Ok(Loaded::Dense(Array::from_slice(&d.into_dense(), &shape))),
                }
            }
        }
    }
}

/// Undoes llama.cpp's Q/K row permutation (its converter interleaves the two rotary halves of
/// each head for GPT-J-style rope): rows `[h][j][2]` back to `[h][2][j]`.
fn unpermute_rows(a: &Array, n_head: i32) -> Result<Array> {
    let shape = a.shape().to_vec();
    let rows = shape[0];
    let half = rows / n_head / 2;
    let mut split = vec![n_head, half, 2];
    split.extend_from_slice(&shape[1..]);
    Ok(a.reshape(&split)?.swap_axes(1, 2)?.reshape(&shape)?)
}

/// A directory removed on drop unless [`Staging::commit`] renamed it into place.
struct Staging {
    path: PathBuf,
    done: bool,
}

impl Staging {
    fn new(out: &Path) -> Result<Self> {
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(|e| {
            EngineError::file(
                &parent,
                format!("cannot create the output's parent directory ({e})"),
            )
        })?;
        let name = out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        remove_dead_staging(&parent, &name);
        let path = parent.join(format!(".{name}.partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir(&path).map_err(|e| {
            EngineError::file(&path, format!("cannot create a staging directory ({e})"))
        })?;
        Ok(Self { path, done: false })
    }

    fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let p = self.path.join(name);
        std::fs::write(&p, bytes)
            .map_err(|e| EngineError::file(&p, format!("cannot be written ({e})")))
    }

    /// Copies the files of [`ImportOptions::extra_files`] whose source exists.
    fn copy_extra(&self, files: &[(PathBuf, String)]) -> Result<()> {
        for (src, name) in files.iter().filter(|(src, _)| src.is_file()) {
            let p = self.path.join(name);
            std::fs::copy(src, &p).map_err(|e| {
                EngineError::file(&p, format!("cannot be copied from {} ({e})", src.display()))
            })?;
        }
        Ok(())
    }

    fn write_json(&self, name: &str, v: &Value, pretty: bool) -> Result<()> {
        let text = if pretty {
            serde_json::to_string_pretty(v)
        } else {
            serde_json::to_string(v)
        }
        .map_err(|e| EngineError::Input(format!("cannot serialize {name} ({e})")))?;
        self.write(name, text.as_bytes())
    }

    fn commit(mut self, out: &Path) -> Result<()> {
        std::fs::rename(&self.path, out).map_err(|e| {
            EngineError::file(
                out,
                format!("cannot move the finished import into place ({e}); does it already exist?"),
            )
        })?;
        self.done = true;
        Ok(())
    }
}

/// Removes staging directories for `name` left by imports that were killed (their process is
/// gone), so a crash does not leave hundreds of megabytes behind; live imports keep theirs.
fn remove_dead_staging(parent: &Path, name: &str) {
    let prefix = format!(".{name}.partial-");
    crate::engine::fsutil::remove_dead_entries(parent, |n| n.strip_prefix(&prefix)?.parse().ok());
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
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
        model_type: match hp.arch {
            Arch::Llama => "llama".into(),
            Arch::Gemma3 => "gemma3_text".into(),
        },
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

/// `generation_config.json`: the BOS, EOS and padding ids the vocabulary names.
fn generation_config(tok: &vocab::TokenizerFiles) -> Value {
    let mut gen = Map::new();
    if let Some(b) = tok.bos_id {
        gen.insert("bos_token_id".into(), json!(b));
    }
    if !tok.eos_ids.is_empty() {
        gen.insert("eos_token_id".into(), one_or_many(&tok.eos_ids));
    }
    if let Some(p) = tok.pad_id {
        gen.insert("pad_token_id".into(), json!(p));
    }
    Value::Object(gen)
}

/// Writes `model.safetensors` into the staging directory and frees the arrays; returns its
/// size in bytes.
fn write_weights(staging: &Staging, arrays: HashMap<String, Array>) -> Result<u64> {
    let weights = staging.path.join("model.safetensors");
    let meta = HashMap::from([("format".to_owned(), "mlx".to_owned())]);
    Array::save_safetensors(&arrays, &meta, &weights)
        .map_err(|e| EngineError::file(&weights, format!("cannot be written ({e})")))?;
    drop(arrays);
    // Padded header: the loader then maps the weights from the page cache instead of copying.
    crate::engine::loader::pad_header(&weights)?;
    Ok(std::fs::metadata(&weights).map(|m| m.len()).unwrap_or(0))
}

/// mlx-lm's `quantization` section: the most common bit width as the default, per-module
/// overrides for the others.
fn quantization_section(bits: &BTreeMap<String, i32>) -> Option<Value> {
    let mut counts: BTreeMap<i32, usize> = BTreeMap::new();
    for &b in bits.values() {
        *counts.entry(b).or_default() += 1;
    }
    let default = counts
        .iter()
        .max_by_key(|(b, n)| (**n, -**b))
        .map(|(b, _)| *b)?;
    let mut q = Map::new();
    q.insert("group_size".into(), json!(32));
    q.insert("bits".into(), json!(default));
    q.insert("mode".into(), json!("affine"));
    for (module, &b) in bits {
        if b != default {
            q.insert(module.clone(), json!({"group_size": 32, "bits": b}));
        }
    }
    Some(Value::Object(q))
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
