//! GGUF tensors as MLX arrays: Hugging Face names for llama.cpp's, which tensors may stay
//! quantized, and decoding through MLX's reader or mlxb's own decoders.

use super::config::Arch;
use super::quant::{self, Decoded, GgmlType};
use super::{GgufHeader, TensorInfo};
use crate::engine::error::{EngineError, Result};
use mlx_rs::io::GgufFile;
use mlx_rs::{Array, Dtype};

/// llama.cpp tensor name → the Hugging Face / mlx-lm name, or `None` if unknown.
pub(super) fn hf_name(arch: Arch, name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: u32 = layer.parse().ok()?;
    if let Some(base) = rest.strip_suffix(".bias") {
        // Qwen2's attention biases (llama.cpp keeps them in the Hugging Face order).
        let mapped = match (base, arch) {
            ("attn_q", Arch::Qwen2) => "self_attn.q_proj",
            ("attn_k", Arch::Qwen2) => "self_attn.k_proj",
            ("attn_v", Arch::Qwen2) => "self_attn.v_proj",
            _ => return None,
        };
        return Some(format!("model.layers.{layer}.{mapped}.bias"));
    }
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
        ("ffn_norm", Arch::Llama | Arch::Qwen2) => "post_attention_layernorm",
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
pub(super) fn quantizable(hf: &str, t: &TensorInfo) -> bool {
    t.dims.len() == 2
        && (hf.ends_with("_proj.weight")
            || hf == "model.embed_tokens.weight"
            || hf == "lm_head.weight")
}

/// A tensor on its way to the output.
pub(super) enum Loaded {
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
    pub(super) fn map(self, f: impl Fn(&Array) -> Result<Array>) -> Result<Loaded> {
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

    pub(super) fn dense(self) -> Result<Array> {
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
pub(super) enum Source {
    /// MLX's reader: every tensor type is one it decodes exactly.
    Mlx(GgufFile),
    /// mlxb's decoders.
    Own,
}

impl Source {
    pub(super) fn load(&self, h: &GgufHeader, t: &TensorInfo, want_quant: bool) -> Result<Loaded> {
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
pub(super) fn unpermute_rows(a: &Array, n_head: i32) -> Result<Array> {
    let shape = a.shape().to_vec();
    let rows = shape[0];
    let half = rows / n_head / 2;
    let mut split = vec![n_head, half, 2];
    split.extend_from_slice(&shape[1..]);
    Ok(a.reshape(&split)?.swap_axes(1, 2)?.reshape(&shape)?)
}
