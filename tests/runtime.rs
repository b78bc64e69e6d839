//! The binary finds its MLX runtime by itself, and mlxb and the oracle share one libmlx + BLAS.

mod common;

use std::process::Command;

#[test]
fn binary_runs_without_environment_from_any_directory() {
    let out = Command::new(common::mlxb())
        .arg("--version")
        .env_clear()
        .current_dir("/")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "mlxb --version failed with no environment (would it need LD_LIBRARY_PATH?): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("MLX 0.32.4"),
        "unexpected version report: {text}"
    );
    assert!(text.contains("backend cpu"), "unexpected backend: {text}");
}

#[test]
fn mlxb_and_oracle_load_the_same_libmlx_and_openblas() {
    let report = Command::new(common::mlxb())
        .arg("--version")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&report.stdout);
    assert!(
        report.contains("BLAS OpenBLAS"),
        "mlxb is not on OpenBLAS: {report}"
    );

    let script = "import mlx.core as mx, os\n\
                  mx.eval(mx.ones((2, 2)) @ mx.ones((2, 2)))\n\
                  maps = open('/proc/self/maps').read()\n\
                  libs = sorted({l.split()[-1] for l in maps.splitlines() if 'libmlx.so' in l or 'blas' in l})\n\
                  print('\\n'.join(os.path.realpath(p) for p in libs))";
    let out = Command::new(common::python())
        .args(["-c", script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let py_libs = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        py_libs.contains("openblas"),
        "oracle is not on OpenBLAS: {py_libs}"
    );

    let elf = std::fs::read(common::mlxb()).unwrap();
    let runpath = common::root().join(".venv");
    let runpath = std::fs::canonicalize(runpath).unwrap();
    let needle = runpath.to_string_lossy().into_owned();
    assert!(
        elf.windows(needle.len()).any(|w| w == needle.as_bytes()),
        "mlxb's rpath does not point into the oracle env {needle}"
    );
    let py_mlx = py_libs.lines().find(|l| l.ends_with("libmlx.so")).unwrap();
    assert!(
        py_mlx.starts_with(&needle),
        "oracle libmlx {py_mlx} is not in {needle}"
    );
}
