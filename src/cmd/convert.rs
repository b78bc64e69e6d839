//! `mlxb convert`: import a GGUF file (llama.cpp) into an MLX-format model directory.

use crate::convert::gguf::{self, ImportOptions, OutDtype};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// Output dtype choices of `--dtype`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    /// float32: exact dequantized values (the fastest exact configuration on CPU).
    F32,
    /// float16.
    F16,
    /// bfloat16: the dequantized values rounded; half the memory, and on CPU faster decoding than f32.
    Bf16,
}

/// Flags of `mlxb convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The GGUF file to import (llama, qwen2 or gemma3 architecture).
    #[arg(long)]
    pub gguf: PathBuf,
    /// The new model directory (must not exist; written atomically).
    #[arg(long)]
    pub out: PathBuf,
    /// Dtype of dense weights and of quantization scales/biases.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
    /// Keep Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K weights as MLX affine quantization (lossless);
    /// other types are dequantized. The kept model is a fifth to two fifths of the f32 import's size
    /// and decodes with mlx-lm's exact tokens (on CPU through mlxb's host kernels).
    #[arg(long)]
    pub keep_quant: bool,
}

/// Entry point of `mlxb convert`.
pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let dtype = match args.dtype {
        DtypeArg::F32 => OutDtype::F32,
        DtypeArg::F16 => OutDtype::F16,
        DtypeArg::Bf16 => OutDtype::BF16,
    };
    let opts = ImportOptions {
        dtype,
        keep_quant: args.keep_quant,
        ..ImportOptions::default()
    };
    let s = gguf::import_reporting(
        &args.gguf,
        &args.out,
        &opts,
        &super::progress::Terminal::default(),
    )?;
    eprintln!(
        "mlxb: wrote {} ({}, {} tensors, {} kept quantized, {:.1} MB of weights) in {:.1} s",
        s.out.display(),
        s.model_type,
        s.tensors,
        s.quantized,
        s.weight_bytes as f64 / 1e6,
        s.seconds
    );
    Ok(())
}
