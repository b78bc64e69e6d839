//! Facts about the MLX runtime this process actually loaded: MLX version, backend and BLAS.
//! `mlxb --version` prints them, and start-up refuses a runtime of another MLX version than
//! the one mlxb was built against (mlx-c's ABI drifts between patch releases).

use super::error::{EngineError, Result};
use std::ffi::CStr;

/// MLX version the binary was compiled against (from mlx-sys build metadata).
pub const BUILT_MLX_VERSION: &str = env!("MLXB_BUILT_MLX_VERSION");

/// Which compute backend the default device runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// MLX's CPU backend (Linux wheels, or `--device cpu`).
    Cpu,
    /// Apple GPU through Metal.
    Metal,
    /// NVIDIA GPU through CUDA (the `mlx-cuda-*` wheels).
    Cuda,
}

impl Backend {
    /// Lower-case name as printed by `--version` and `--json`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Metal => "metal",
            Backend::Cuda => "cuda",
        }
    }
}

/// MLX version of the loaded libmlx, as reported by the library itself.
pub fn mlx_version() -> Result<String> {
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let rc = mlx_sys::mlx_version(&mut s);
        let out = if rc == 0 {
            let p = mlx_sys::mlx_string_data(s);
            Ok(CStr::from_ptr(p).to_string_lossy().into_owned())
        } else {
            Err(EngineError::Runtime(
                "libmlx did not report its version".into(),
            ))
        };
        mlx_sys::mlx_string_free(s);
        out
    }
}

/// Backend of MLX's default device.
pub fn backend() -> Backend {
    let mut metal = false;
    let mut cuda = false;
    unsafe {
        mlx_sys::mlx_metal_is_available(&mut metal);
        mlx_sys::mlx_cuda_is_available(&mut cuda);
    }
    let gpu_default = matches!(
        mlx_rs::Device::try_default().and_then(|d| d.get_type()),
        Ok(mlx_rs::DeviceType::Gpu)
    );
    match (gpu_default, metal, cuda) {
        (true, true, _) => Backend::Metal,
        (true, _, true) => Backend::Cuda,
        _ => Backend::Cpu,
    }
}

/// The BLAS that MLX's CPU matmul calls, identified from the symbols the process exports
/// (OpenBLAS with its version and kernel set, Apple Accelerate, or the slow netlib reference
/// BLAS the CPU wheel ships).
pub fn blas() -> String {
    if let Some(cfg) = openblas_string(c"openblas_get_config") {
        let name = cfg.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
        // The kernel set matters as much as the version: it decides f32 summation order.
        return match blas_core() {
            Some(core) => format!("{name} ({core})"),
            None => name,
        };
    }
    if cfg!(target_os = "macos") {
        return "Accelerate".to_owned();
    }
    // SAFETY: looks up a symbol by a NUL-terminated name; nothing is called.
    if !unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cblas_sgemm".as_ptr()) }.is_null() {
        return "reference BLAS (netlib; slow, run scripts/setup.sh to use OpenBLAS)".to_owned();
    }
    "none found".to_owned()
}

/// The CPU kernel set OpenBLAS picked at start-up (`"SkylakeX"`, `"Haswell"`, ...), or `None`
/// when MLX's BLAS is not OpenBLAS. It decides the order MLX's f32 matmul sums in, which
/// `--host-matvec` must reproduce (`kernels::mlx_order`), so it explains a refused host path.
pub fn blas_core() -> Option<String> {
    openblas_string(c"openblas_get_corename").map(|name| name.trim().to_owned())
}

/// The string an OpenBLAS query function without arguments returns (`openblas_get_config`,
/// `openblas_get_corename`), or `None` when the process has no such symbol.
fn openblas_string(symbol: &CStr) -> Option<String> {
    type QueryFn = unsafe extern "C" fn() -> *const libc::c_char;
    // SAFETY: looks up a symbol by a NUL-terminated name; the OpenBLAS functions passed here
    // take no arguments and return a static NUL-terminated string.
    unsafe {
        let sym = libc::dlsym(libc::RTLD_DEFAULT, symbol.as_ptr());
        if sym.is_null() {
            return None;
        }
        let f: QueryFn = std::mem::transmute(sym);
        let s = f();
        (!s.is_null()).then(|| CStr::from_ptr(s).to_string_lossy().into_owned())
    }
}

/// Fails with one clear sentence when the loaded libmlx is not the version mlxb was built for.
pub fn check() -> Result<()> {
    let loaded = mlx_version()?;
    if !BUILT_MLX_VERSION.is_empty() && loaded != BUILT_MLX_VERSION {
        return Err(EngineError::Runtime(format!(
            "loaded libmlx is {loaded} but mlxb was built against {BUILT_MLX_VERSION}; rerun scripts/setup.sh and rebuild"
        )));
    }
    Ok(())
}

/// Waits until everything queued on this thread's default stream has run. The decode loop
/// queues one step ahead, so a generation ends with work still in flight; a process that
/// exits meanwhile frees MLX's allocator under that work (a heap-corruption abort).
pub fn synchronize() -> Result<()> {
    // SAFETY: a plain FFI call without arguments; it only blocks this thread.
    let rc = unsafe { mlx_sys::mlx_synchronize_default() };
    if rc == 0 {
        Ok(())
    } else {
        Err(EngineError::Runtime(
            "MLX could not synchronize its default stream".into(),
        ))
    }
}

/// The multi-line text of `mlxb --version`.
pub fn version_report() -> String {
    let mlx = mlx_version().unwrap_or_else(|e| format!("unknown ({e})"));
    format!(
        "mlxb {}\nMLX {} (built against {})\nbackend {}\nBLAS {}",
        env!("CARGO_PKG_VERSION"),
        mlx,
        if BUILT_MLX_VERSION.is_empty() {
            "unknown"
        } else {
            BUILT_MLX_VERSION
        },
        backend().name(),
        blas()
    )
}
