//! A `train-dspark --prompts` JSONL file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxb::train::data::read_prompts;

fuzz_target!(init: mlxb_fuzz::deterministic(), |data: &[u8]| {
    let dir = mlxb_fuzz::fresh_dir("prompts");
    mlxb_fuzz::put(&dir, "prompts.jsonl", data);
    let _ = read_prompts(&dir.join("prompts.jsonl"));
});
