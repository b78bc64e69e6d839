//! A DSpark checkpoint config: the first byte picks mlxb's `dspark.json` or DeepSpec's
//! `config.json`, the rest is the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxb::spec::dspark::checkpoint::{is_artifact, read_config};

fuzz_target!(init: mlxb_fuzz::deterministic(), |data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    let dir = mlxb_fuzz::fresh_dir("dspark");
    let name = if which & 1 == 0 {
        "dspark.json"
    } else {
        "config.json"
    };
    mlxb_fuzz::put(&dir, name, bytes);
    let _ = is_artifact(&dir);
    if let Ok((config, _)) = read_config(&dir) {
        let _ = (config.num_taps(), config.confidence_input());
    }
});
