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
    let version = std::env::var("DEP_MLX_VERSION").unwrap_or_default();
    println!("cargo:rustc-env=MLXB_BUILT_MLX_VERSION={version}");
}
