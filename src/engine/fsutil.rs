//! Crash-safe file writes: write a temp file next to the target, flush it to disk, then
//! rename over the target, so readers see the old or the new file, never a torn one. Temp files
//! are named `.NAME.tmp-PID-XXXXXX`, so the next write into the directory can remove those a
//! killed process left behind.

use super::error::{EngineError, Result};
use std::io::Write;
use std::path::Path;

/// The part of a temp file's name between the target's name and the writer's PID.
const TEMP_MARK: &str = ".tmp-";

/// Replaces `path` with `bytes` atomically, first removing temp files of dead writers in its
/// directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    remove_dead_temps(dir);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let prefix = format!(".{name}{TEMP_MARK}{}-", std::process::id());
    let mut tmp = tempfile::Builder::new()
        .prefix(&prefix)
        .tempfile_in(dir)
        .map_err(|e| {
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

/// The PID in `name` when it is a temp file of [`write_atomic`] (`.NAME.tmp-PID-XXXXXX`).
fn temp_owner(name: &str) -> Option<libc::pid_t> {
    let rest = name.strip_prefix('.')?;
    let (_, after) = rest.rsplit_once(TEMP_MARK)?;
    let (pid, random) = after.split_once('-')?;
    (!random.is_empty() && !random.contains('.')).then_some(())?;
    pid.parse().ok()
}

/// Removes the temp files in `dir` whose writer is gone (a killed write); live writers' temps
/// stay. Best effort: an entry that cannot be removed is left alone.
fn remove_dead_temps(dir: &Path) {
    remove_dead_entries(dir, temp_owner);
}

/// Removes the entries of `dir` (files or whole directories) for which `owner` names a PID
/// that no longer runs: the leftovers of killed writers, found by their name.
pub fn remove_dead_entries(dir: &Path, owner: impl Fn(&str) -> Option<libc::pid_t>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let pid = e.file_name().to_str().and_then(&owner);
        if pid.is_some_and(|p| p > 0 && !process_alive(p)) {
            let p = e.path();
            let _ = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
}

/// Fails with one clear sentence when the file system holding `dir` has less than `needed`
/// bytes free, so a large write stops before it starts instead of dying half-way with the
/// writer's own "unable to write" (and a partial file left to clean up). `what` names the write.
pub fn ensure_free_space(dir: &Path, needed: u64, what: &str) -> Result<()> {
    // An unknown amount (an exotic file system) is not a reason to refuse.
    let Ok(free) = fs4::available_space(dir) else {
        return Ok(());
    };
    if free >= needed {
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    Err(EngineError::file(
        dir,
        format!(
            "has {:.2} GB free but {what} needs {:.2} GB; free some space on that disk, or put \
             the output on another one",
            gb(free),
            gb(needed)
        ),
    ))
}

/// Whether process `pid` exists (signal 0 only checks; EPERM means it exists under another user).
pub fn process_alive(pid: libc::pid_t) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only reports whether the pid exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::{ensure_free_space, temp_owner, write_atomic};
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

    /// A PID that ran and is gone (a finished child; reuse within the test is unlikely).
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn temps_are_named_for_their_writer() {
        assert_eq!(temp_owner(".dspark.json.tmp-123-aB3xYz"), Some(123));
        assert_eq!(temp_owner(".a.tmp-b.tmp-9-xyz012"), Some(9));
        for other in [
            "dspark.json",
            ".tmp123",
            ".x.tmp-12",
            ".x.tmp-12-",
            ".x.tmp-ab-xyz012",
        ] {
            assert_eq!(temp_owner(other), None, "{other}");
        }
    }

    #[test]
    fn a_write_removes_temps_of_dead_writers_and_leaves_its_own_none() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir
            .path()
            .join(format!(".manifest.json.tmp-{}-Ab12Cd", dead_pid()));
        let live = dir
            .path()
            .join(format!(".other.json.tmp-{}-Zz99Yy", std::process::id()));
        let user = dir.path().join("notes.tmp");
        for p in [&stale, &live, &user] {
            std::fs::write(p, b"x").unwrap();
        }
        write_atomic(&dir.path().join("cache.json"), b"{}").unwrap();
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let live_name = live.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(names, [live_name.as_str(), "cache.json", "notes.tmp"]);
    }

    #[test]
    fn a_write_larger_than_the_free_space_is_refused_with_both_sizes() {
        let dir = tempfile::tempdir().unwrap();
        ensure_free_space(dir.path(), 0, "nothing").unwrap();
        let e = ensure_free_space(dir.path(), u64::MAX, "model.safetensors").unwrap_err();
        let msg = e.to_string();
        assert!(e.is_user_error(), "{msg}");
        assert!(msg.contains("GB free but model.safetensors needs"), "{msg}");
    }
}
