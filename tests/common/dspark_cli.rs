//! A tiny target with a random DSpark drafter and prompt files, for the CLI tests of
//! `mlxb measure` and `mlxb calibrate` (included with `#[path]`).
#![allow(dead_code)]

use super::common;
use serde_json::json;
use std::path::{Path, PathBuf};

/// Draft block size of the fixture drafter.
pub const GAMMA: usize = 4;

/// A temporary directory holding `target/` (tiny f32 llama, vocabulary 384) and `drafter/`
/// (random mlxb-format DSpark drafter with a Markov head and a confidence head).
pub struct Fixture {
    pub tmp: tempfile::TempDir,
    pub target: PathBuf,
    pub drafter: PathBuf,
}

impl Fixture {
    pub fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        common::make_model(&target, &common::tiny_llama(json!({})), "f32", None);
        let drafter = tmp.path().join("drafter");
        let gamma = GAMMA.to_string();
        let (code, _, err) = common::run_mlxb(&[
            "dspark-init",
            "--model",
            s(&target),
            "--out",
            s(&drafter),
            "--layers",
            "1",
            "--gamma",
            &gamma,
            "--markov-rank",
            "16",
            "--tap-layers",
            "0,2",
            "--seq-head",
            "markov",
        ]);
        assert_eq!(code, 0, "{err}");
        Self {
            tmp,
            target,
            drafter,
        }
    }

    /// `CMD --model TARGET --data DATA --max-tokens N`, to extend with more flags.
    pub fn args<'a>(&'a self, cmd: &'a str, data: &'a Path, max_tokens: &'a str) -> Vec<&'a str> {
        vec![
            cmd,
            "--model",
            s(&self.target),
            "--data",
            s(data),
            "--max-tokens",
            max_tokens,
        ]
    }

    /// Writes `text` as a prompt file named `name` and returns its path.
    pub fn prompts(&self, name: &str, text: &str) -> PathBuf {
        let p = self.tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

/// A path as a CLI argument.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// One prompt of each kind: a `prompt` string, a `messages` list and `prompt_ids`.
pub const MIXED: &str = "{\"prompt\": \"the quick brown fox\"}\n\
{\"messages\": [{\"role\": \"user\", \"content\": \"a b c\"}]}\n\
\n\
{\"prompt_ids\": [5, 17, 99, 250, 17, 99]}\n";
