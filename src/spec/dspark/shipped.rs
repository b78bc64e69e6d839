//! The drafter shipped with mlxb for the default model: `--drafter default` names it, so
//! `mlxb generate --drafter default` and `mlxb measure --drafter default` work out of the box
//! once it is trained and placed under `assets/drafters/`.

use std::path::PathBuf;

/// The keyword that selects the shipped drafter.
pub const DEFAULT_KEYWORD: &str = "default";

/// Where the shipped drafter for SmolLM2-135M-Instruct (the default model) lives.
pub const DEFAULT_DRAFTER_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/assets/drafters/smollm2-135m-instruct"
);

/// Parses a `--drafter` value: `default` becomes the shipped drafter's directory (an error,
/// shown by clap with exit code 2, while it does not exist); anything else is a path.
pub fn parse_drafter_arg(value: &str) -> Result<PathBuf, String> {
    if value != DEFAULT_KEYWORD {
        return Ok(PathBuf::from(value));
    }
    let dir = PathBuf::from(DEFAULT_DRAFTER_DIR);
    if dir.is_dir() {
        Ok(dir)
    } else {
        Err(format!(
            "the shipped drafter ({}) is not there yet; train one with `mlxb train-dspark` and pass its directory",
            dir.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names_the_assets_directory_and_paths_pass_through() {
        assert_eq!(parse_drafter_arg("some/dir"), Ok(PathBuf::from("some/dir")));
        match parse_drafter_arg(DEFAULT_KEYWORD) {
            Ok(p) => assert!(p.is_dir() && p.ends_with("assets/drafters/smollm2-135m-instruct")),
            Err(e) => assert!(e.contains("assets/drafters/smollm2-135m-instruct"), "{e}"),
        }
    }
}
