//! Crash-safe file writes: write a temp file next to the target, flush it to disk, then
//! rename over the target, so readers see the old or the new file, never a torn one.

use super::error::{EngineError, Result};
use std::io::Write;
use std::path::Path;

/// Replaces `path` with `bytes` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(|e| {
        EngineError::file(
            path,
            format!("cannot create a temporary file next to it ({e})"),
        )
    })?;
    tmp.write_all(bytes)
        .and_then(|_| tmp.as_file().sync_all())
        .map_err(|e| {
            EngineError::file(
                path,
                format!("cannot write ({e}); the previous file is untouched"),
            )
        })?;
    tmp.persist(path).map_err(|e| {
        EngineError::file(
            path,
            format!("cannot replace the file ({e}); the previous file is untouched"),
        )
    })?;
    Ok(())
}
