//! Making, training, calibrating and measuring DSpark drafters (`dspark-init`, `train-dspark`,
//! `dspark-vocab`, `calibrate`, `measure`): tools that drive the engine and the drafter of
//! [`crate::spec`], never used at inference time.
//!
//! Files: `prompts` (prompt files), `data` (target-regenerated training data and its hidden-state
//! cache), `sequences` (the regenerated sequences file), `draft_vocab` (a reduced draft
//! vocabulary from those sequences), `init` (randomly initialised drafters), `example` (training examples, anchors and the
//! seeded stream), `forward` (trainable parameters and the differentiable drafter forward), `loss`
//! (DeepSpec's loss), `optim` (training options, learning-rate schedule, AdamW with clipping),
//! `state` (resumable training state), `trainer` (the training step and run), `calibrate` (STS
//! and per-position thresholds), `measure` (vanilla vs speculative over a prompt file, one stream at a time),
//! `measure_batch` (the same in the batched engine, every sequence drafting for itself).

pub mod calibrate;
pub mod data;
pub mod draft_vocab;
pub mod example;
pub mod forward;
pub mod init;
pub mod loss;
pub mod measure;
pub mod measure_batch;
pub mod optim;
pub mod prompts;
pub mod sequences;
pub mod state;
pub mod trainer;
