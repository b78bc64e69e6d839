//! DSpark (DeepSeek's DeepSpec): a DFlash-style parallel block drafter conditioned on the
//! target's hidden states, with a lightweight sequential head and a confidence head that
//! prunes each block's draft length.
//!
//! Files: `checkpoint` (config, the two on-disk formats, the one loader and its checks),
//! `module` (the network), `drafter` (the [`crate::spec::source::DraftSource`] and the
//! drafting loop), `init` (randomly initialised drafters for `mlxb dspark-init`), `train` (the training
//! forward, loss, optimizer and resumable state), `calibrate` (STS and per-position thresholds), `shipped` (where `--drafter default` points).

pub mod calibrate;
pub mod checkpoint;
pub mod data;
pub mod drafter;
pub mod init;
pub mod module;
pub mod shipped;
pub mod train;
