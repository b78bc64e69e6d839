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

/// The process-wide scratch directory (removed when the process exits normally).
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("cannot create a scratch directory"))
        .path()
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
