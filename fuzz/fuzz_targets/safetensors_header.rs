//! A `model.safetensors` file: mlxb's header check and size reader, then mlxb's loader (its own
//! header parse, then page mapping or a threaded read into MLX-allocated blocks).
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxb::engine::weights::{checkpoint_size, QuantConfig, WeightStore};

fuzz_target!(init: mlxb_fuzz::deterministic(), |data: &[u8]| {
    let dir = mlxb_fuzz::fresh_dir("safetensors");
    mlxb_fuzz::put(&dir, "model.safetensors", data);
    let _ = checkpoint_size(&dir, None);
    let _ = checkpoint_size(&dir, Some(4));
    if let Ok(store) = WeightStore::load(&dir, QuantConfig::default()) {
        let _ = store.float_dtype();
    }
});
