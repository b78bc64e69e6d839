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
    // A temp file is created 0600; the result gets the replaced file's mode, or 0644 (less
    // the umask's usual effect) for a new file, as a plain `write` would give.
    let mode = std::fs::metadata(path)
        .map(|m| m.permissions())
        .unwrap_or_else(|_| std::os::unix::fs::PermissionsExt::from_mode(0o644));
    tmp.write_all(bytes)
        .and_then(|_| tmp.as_file().set_permissions(mode))
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

#[cfg(test)]
mod tests {
    use super::write_atomic;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &std::path::Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn new_files_are_0644_and_replaced_files_keep_their_mode() {
        let dir = tempfile::tempdir().unwrap();
        let new = dir.path().join("new.json");
        write_atomic(&new, b"{}").unwrap();
        assert_eq!(mode(&new), 0o644);
        let kept = dir.path().join("kept.json");
        std::fs::write(&kept, b"old").unwrap();
        std::fs::set_permissions(&kept, std::fs::Permissions::from_mode(0o640)).unwrap();
        write_atomic(&kept, b"new").unwrap();
        assert_eq!(mode(&kept), 0o640);
        assert_eq!(std::fs::read(&kept).unwrap(), b"new");
    }
}
