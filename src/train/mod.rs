//! Making, training, calibrating and measuring DSpark drafters (`dspark-init`, `train-dspark`,
//! `calibrate`, `measure`): tools that drive the engine and the drafter of [`crate::spec`],
//! never used at inference time.
//!
//! Files: `prompts` (prompt files), `data` (target-regenerated training data and its hidden-state
//! cache), `init` (randomly initialised drafters), `trainer` (training forward, loss, optimizer,
//! resumable state), `calibrate` (STS and per-position thresholds), `measure` (vanilla vs
//! speculative over a prompt file).

pub mod calibrate;
pub mod data;
pub mod init;
pub mod measure;
pub mod prompts;
pub mod trainer;
