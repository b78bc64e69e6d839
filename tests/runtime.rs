//! The binary finds its MLX runtime by itself, and mlxb and the oracle share one libmlx + BLAS.

mod common;

use std::process::Command;

#[test]
fn binary_runs_without_environment_from_any_directory() {
    let (code, text, err) = common::run(
        common::mlxb_command(&["--version"])
            .env_clear()
            .current_dir("/"),
        &[],
    );
    assert_eq!(
        code, 0,
        "mlxb --version failed with no environment (would it need LD_LIBRARY_PATH?): {err}"
    );
    assert!(
        text.contains("MLX 0.32.4"),
        "unexpected version report: {text}"
    );
    assert!(text.contains("backend cpu"), "unexpected backend: {text}");
}

#[test]
fn mlxb_and_oracle_load_the_same_libmlx_and_openblas() {
    let (_, report, _) = common::run_mlxb(&["--version"]);
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

/// Copies `mlxb` and `mlxb-engine` into `dir` with every embedded copy of the runtime lib dir
/// (the launcher's probe path and the engine's RUNPATH) replaced by `fake`, a path of the
/// same length: the binaries of an install whose MLX runtime is gone or broken.
fn relocated_binaries(dir: &std::path::Path, fake: &str) -> std::path::PathBuf {
    let real = std::fs::canonicalize(common::root().join(".venv"))
        .unwrap()
        .join("lib/python3.11/site-packages/mlx/lib");
    let real = real.to_string_lossy().into_owned();
    assert_eq!(
        real.len(),
        fake.len(),
        "the fake runtime path must keep the length"
    );
    let launcher = common::mlxb();
    for bin in [launcher.clone(), launcher.with_file_name("mlxb-engine")] {
        let mut bytes = std::fs::read(&bin).unwrap();
        let mut hits = 0;
        let mut i = 0;
        while let Some(at) = bytes[i..]
            .windows(real.len())
            .position(|w| w == real.as_bytes())
        {
            bytes[i + at..i + at + real.len()].copy_from_slice(fake.as_bytes());
            i += at + real.len();
            hits += 1;
        }
        assert!(hits > 0, "{} does not embed {real}", bin.display());
        let out = dir.join(bin.file_name().unwrap());
        std::fs::write(&out, bytes).unwrap();
        std::fs::set_permissions(&out, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
    }
    dir.join("mlxb")
}

/// A fake runtime dir of exactly `len` bytes under `base` (created, empty).
fn fake_runtime_dir(base: &std::path::Path, len: usize) -> String {
    let prefix = format!("{}/rt", base.display());
    assert!(
        prefix.len() + 2 <= len,
        "temp dir path too long for the test"
    );
    let fake = format!("{prefix}{}", "x".repeat(len - prefix.len()));
    std::fs::create_dir_all(&fake).unwrap();
    fake
}

fn run_relocated(mlxb: &std::path::Path) -> (i32, String) {
    let (code, _, err) = common::run(Command::new(mlxb).args(["generate", "--prompt", "hi"]), &[]);
    (code, err)
}

#[test]
fn missing_runtime_is_one_sentence_not_a_loader_crash() {
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let real_len = std::fs::canonicalize(common::root().join(".venv"))
        .unwrap()
        .join("lib/python3.11/site-packages/mlx/lib")
        .to_string_lossy()
        .len();
    let fake = fake_runtime_dir(tmp.path(), real_len);
    let bins = tmp.path().join("bin");
    std::fs::create_dir(&bins).unwrap();
    let mlxb = relocated_binaries(&bins, &fake);

    // No libmlx at all.
    let (code, err) = run_relocated(&mlxb);
    common::assert_refused("no libmlx", code, &err, &["libmlx.so", "scripts/setup.sh"]);
    assert!(
        err.starts_with("mlxb: error: the MLX runtime"),
        "unexpected message: {err}"
    );

    // libmlx present but its BLAS/LAPACK (found through its $ORIGIN rpath) missing.
    std::os::unix::fs::symlink(
        std::fs::canonicalize(
            common::root().join(".venv/lib/python3.11/site-packages/mlx/lib/libmlx.so"),
        )
        .unwrap(),
        std::path::Path::new(&fake).join("libmlx.so"),
    )
    .unwrap();
    let (code, err) = run_relocated(&mlxb);
    assert_eq!(code, 2, "stderr: {err}");
    assert!(
        err.contains("cannot be loaded") && (err.contains("blas") || err.contains("lapack")),
        "the missing BLAS/LAPACK is not named: {err}"
    );
}
