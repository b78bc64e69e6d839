//! `mlxb`: the command users run. It checks that the MLX runtime (libmlx plus the BLAS and
//! LAPACK it links) can be loaded, then replaces itself with `mlxb-engine`, which links
//! libmlx directly. Without this step a missing or broken runtime would stop the program in
//! the dynamic loader, before `main`, with a loader message and exit code 127 instead of
//! one sentence that names the file and the fix.

// A panic is never the answer to user input (issue #13): outside tests, every `unwrap`/`expect`
// must become an error that names the file or field.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use std::ffi::{CStr, CString, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitCode};

/// The engine binary, installed beside this one.
const ENGINE: &str = "mlxb-engine";

/// File name of the MLX runtime library on this platform.
#[cfg(target_os = "macos")]
const RUNTIME_LIB: &str = "libmlx.dylib";
#[cfg(not(target_os = "macos"))]
const RUNTIME_LIB: &str = "libmlx.so";

/// Loads `lib` with everything it needs, as the engine's start will; `Err` carries the
/// loader's own reason (which names the missing file).
fn probe(lib: &Path) -> Result<(), String> {
    let path = CString::new(lib.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen/dlerror/dlclose with a valid NUL-terminated path; the handle is
    // closed before the process image is replaced.
    unsafe {
        let handle = libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            let why = libc::dlerror();
            return Err(if why.is_null() {
                "unknown loader error".to_owned()
            } else {
                CStr::from_ptr(why).to_string_lossy().into_owned()
            });
        }
        libc::dlclose(handle);
    }
    Ok(())
}

fn main() -> ExitCode {
    if let Some(dir) = option_env!("MLXB_RUNTIME_LIB_DIR") {
        let lib = Path::new(dir).join(RUNTIME_LIB);
        if let Err(why) = probe(&lib) {
            eprintln!(
                "mlxb: error: the MLX runtime {} cannot be loaded ({why}); run scripts/setup.sh to reinstall mlx-cpu and its OpenBLAS link, then rebuild mlxb",
                lib.display()
            );
            return ExitCode::from(2);
        }
    }
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| OsString::from("mlxb"));
    let engine = match std::env::current_exe() {
        Ok(me) => me.with_file_name(ENGINE),
        Err(e) => {
            eprintln!(
                "mlxb: error: cannot locate the mlxb executable ({e}); run mlxb-engine directly"
            );
            return ExitCode::from(2);
        }
    };
    // `exec` only returns on failure.
    let err = Command::new(&engine).arg0(arg0).args(args).exec();
    eprintln!(
        "mlxb: error: cannot start {} ({err}); mlxb runs the mlxb-engine beside it, so build both with `cargo build --release` (`cargo run` builds only mlxb) or install both with `cargo install --path .`",
        engine.display()
    );
    ExitCode::from(2)
}
