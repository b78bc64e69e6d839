//! config.json of every supported family: quantization section, the architecture's args and
//! checks (each builder runs against an empty weight store, so it stops at the first tensor),
//! and the per-layer KV plan.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxb::engine::forks::{Forks, KvQuant};
use mlxb::engine::models::{ModelSpec, REGISTRY};
use mlxb::engine::plan::ForkPlan;
use mlxb::engine::weights::{QuantConfig, WeightStore};
use std::collections::HashMap;

fuzz_target!(init: mlxb_fuzz::deterministic(), |data: &[u8]| {
    let Ok(config) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let dir = mlxb_fuzz::fresh_dir("config");
    let config_path = dir.join("config.json");
    let Ok(quant) = QuantConfig::from_config(&config_path, &config) else {
        return;
    };
    let model_type = config.get("model_type").and_then(|v| v.as_str());
    let forks = Forks {
        kv_quant: KvQuant::Config,
        ..Forks::default()
    };
    let _ = ForkPlan::new(forks, &config_path, &config, 4);
    let Some((_, build)) = REGISTRY.iter().find(|(t, _)| Some(*t) == model_type) else {
        return;
    };
    let spec = ModelSpec {
        config_path,
        config,
        forks,
    };
    // As `models::load`: the sizes are checked before a builder sees them.
    if spec.check_sizes().is_err() {
        return;
    }
    let mut store = WeightStore::from_tensors(&dir, HashMap::new(), quant);
    let _ = build(&spec, &mut store);
});
