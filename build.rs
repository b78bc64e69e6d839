//! Gives the binary an rpath to the MLX runtime's lib dir, so `mlxb` runs with no
//! environment variables from any directory (Cargo does not forward a dependency's link
//! args, so mlx-sys only publishes the dir as `DEP_MLX_LIB_DIR`).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
    println!("cargo:rerun-if-env-changed=DEP_MLX_VERSION");
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        println!("cargo:rustc-env=MLXB_RUNTIME_LIB_DIR={dir}");
    }
    // The commit being built, for benchmark result files (rows of different builds differ).
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=10", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=MLXB_GIT_COMMIT={commit}");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
    let version = std::env::var("DEP_MLX_VERSION").unwrap_or_default();
    println!("cargo:rustc-env=MLXB_BUILT_MLX_VERSION={version}");
}
