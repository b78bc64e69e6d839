//! The import's staging directory beside the destination: written in full, renamed into place
//! only when complete, removed if the import fails.

use crate::engine::error::{EngineError, Result};
use mlx_rs::Array;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A directory removed on drop unless [`Staging::commit`] renamed it into place.
pub(super) struct Staging {
    pub(super) path: PathBuf,
    pub(super) done: bool,
}

impl Staging {
    pub(super) fn new(out: &Path) -> Result<Self> {
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

    pub(super) fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let p = self.path.join(name);
        std::fs::write(&p, bytes)
            .map_err(|e| EngineError::file(&p, format!("cannot be written ({e})")))
    }

    /// Copies the files of [`ImportOptions::extra_files`] whose source exists.
    pub(super) fn copy_extra(&self, files: &[(PathBuf, String)]) -> Result<()> {
        for (src, name) in files.iter().filter(|(src, _)| src.is_file()) {
            let p = self.path.join(name);
            std::fs::copy(src, &p).map_err(|e| {
                EngineError::file(&p, format!("cannot be copied from {} ({e})", src.display()))
            })?;
        }
        Ok(())
    }

    pub(super) fn write_json(&self, name: &str, v: &Value, pretty: bool) -> Result<()> {
        let text = if pretty {
            serde_json::to_string_pretty(v)
        } else {
            serde_json::to_string(v)
        }
        .map_err(|e| EngineError::Input(format!("cannot serialize {name} ({e})")))?;
        self.write(name, text.as_bytes())
    }

    pub(super) fn commit(mut self, out: &Path) -> Result<()> {
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
pub(super) fn remove_dead_staging(parent: &Path, name: &str) {
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

/// Writes `model.safetensors` into the staging directory and frees the arrays; returns its
/// size in bytes.
pub(super) fn write_weights(staging: &Staging, arrays: HashMap<String, Array>) -> Result<u64> {
    let weights = staging.path.join("model.safetensors");
    let meta = HashMap::from([("format".to_owned(), "mlx".to_owned())]);
    let bytes: u64 = arrays.values().map(|a| a.nbytes() as u64).sum();
    // Headroom for the safetensors header and its padding.
    crate::engine::fsutil::ensure_free_space(
        &staging.path,
        bytes + (16 << 20),
        "model.safetensors",
    )?;
    Array::save_safetensors(&arrays, &meta, &weights)
        .map_err(|e| EngineError::file(&weights, format!("cannot be written ({e})")))?;
    drop(arrays);
    // Padded header: the loader then maps the weights from the page cache instead of copying.
    crate::engine::loader::pad_header(&weights)?;
    Ok(std::fs::metadata(&weights).map(|m| m.len()).unwrap_or(0))
}
