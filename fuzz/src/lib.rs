//! Helpers shared by the fuzz targets: most mlxb parsers read files from a directory, so each
//! input is written into one scratch directory that lives for the whole fuzzing process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Makes rayon run on the fuzzing thread alone (every target's `init`). Parsers that split work
/// with rayon (the GGUF decoders, the tokenizers crate) otherwise reach different scheduler code
/// from one execution of the same input to the next (work stealing, waking sleeping workers);
/// libFuzzer counts that as new coverage, so a target's figures never settle. Replaying the same
/// `gguf_quant` corpus three times gave 1038 to 1074 edges and 3992 to 4351 features before this.
pub fn deterministic() {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .use_current_thread()
        .build_global()
        .expect("rayon's global pool was built before the fuzz target's init");
}

/// Scratch directories are `$TMPDIR/mlxb-fuzz-PID`, the PID zero-padded to ten digits.
const SCRATCH_PREFIX: &str = "mlxb-fuzz-";

/// The process-wide scratch directory. Its name has the same length and kind of characters in
/// every process: the random name `tempfile` gave before ended up in paths and error messages,
/// and the string code handling it covered a little differently in each process, which libFuzzer
/// counts as new coverage. Removed when the process exits (an `atexit` hook: a static is never
/// dropped, and 246 directories had piled up in /tmp); those of fuzz processes that were killed
/// or crashed are removed by the next process to start.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        remove_stale_scratch();
        let dir = own_scratch();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("cannot create a scratch directory");
        // SAFETY: registers a plain function that captures nothing.
        unsafe { libc::atexit(remove_own_scratch) };
        dir
    })
}

/// This process's scratch directory (the same path every time it is asked).
fn own_scratch() -> PathBuf {
    std::env::temp_dir().join(format!("{SCRATCH_PREFIX}{:010}", std::process::id()))
}

/// Runs at exit: removes this process's scratch directory.
extern "C" fn remove_own_scratch() {
    let _ = std::fs::remove_dir_all(own_scratch());
}

/// Removes the scratch directories whose process no longer exists.
fn remove_stale_scratch() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.strip_prefix(SCRATCH_PREFIX))
            .and_then(|p| p.parse::<libc::pid_t>().ok());
        let Some(pid) = pid else { continue };
        // SAFETY: signal 0 sends nothing; it only asks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Empties `scratch()/name` and returns it, so no file of an earlier input leaks into this one.
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = scratch().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("cannot create a scratch subdirectory");
    dir
}

/// Writes `bytes` to `dir/name`.
pub fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).expect("cannot write a scratch file");
}

/// The separator the multi-file targets split their input on (seeds use it too).
pub const SEPARATOR: &[u8] = b"\n\x00MLXB-FUZZ-FILE\x00\n";

/// Splits `data` on [`SEPARATOR`] into at most `n` parts (missing parts are empty).
pub fn parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut out = Vec::with_capacity(n);
    let mut rest = data;
    while out.len() + 1 < n {
        match rest.windows(SEPARATOR.len()).position(|w| w == SEPARATOR) {
            Some(i) => {
                out.push(&rest[..i]);
                rest = &rest[i + SEPARATOR.len()..];
            }
            None => break,
        }
    }
    out.push(rest);
    out.resize(n, &[]);
    out
}
