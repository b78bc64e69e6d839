//! `mlxb models`: the supported `model_type`s, or whether one model directory is supported
//! (config.json, its fields and the checkpoint's tensors checked exactly as loading does).

use crate::engine::error::EngineError;
use crate::engine::forks::Forks;
use crate::engine::models;
use clap::Args;
use std::path::PathBuf;

/// Flags of `mlxb models`.
#[derive(Debug, Args)]
pub struct ModelsArgs {
    /// An MLX-format model directory to check instead of listing the supported types.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Lists the supported model types, or checks `--model DIR` (unsupported: the reason, exit 2).
pub fn run(a: ModelsArgs) -> anyhow::Result<()> {
    let Some(dir) = a.model else {
        let types = models::supported_types();
        if a.json {
            println!("{}", serde_json::json!({ "model_types": types }));
        } else {
            println!("supported model_type values (as in config.json):");
            for t in types {
                println!("  {t}");
            }
        }
        return Ok(());
    };
    if !dir.is_dir() {
        return Err(EngineError::file(
            &dir,
            "is not a directory; pass an MLX-format model directory",
        )
        .into());
    }
    match models::load(&dir, Forks::default()) {
        Ok(loaded) => {
            let quantized = loaded.config.get("quantization").is_some();
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"supported": true, "model_type": loaded.model_type,
                        "quantized": quantized, "model": dir})
                );
            } else {
                println!(
                    "{}: supported (model_type \"{}\"{})",
                    dir.display(),
                    loaded.model_type,
                    if quantized { ", quantized" } else { "" }
                );
            }
            Ok(())
        }
        Err(e) => {
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"supported": false, "reason": e.to_string(), "model": dir})
                );
            }
            Err(anyhow::Error::new(e).context(format!("{} is not supported", dir.display())))
        }
    }
}
