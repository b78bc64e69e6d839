//! DSpark (DeepSeek's DeepSpec): a DFlash-style parallel block drafter conditioned on the
//! target's hidden states, with a lightweight sequential head and a confidence head that
//! prunes each block's draft length.
//!
//! Files: `checkpoint` (config, the two on-disk formats, the one loader and its checks),
//! `module` (the network), `host_block` (its greedy block on the host
//! kernels), `host_sampler` (greedy sequential sampling on the host), `vocab` (a
//! reduced draft vocabulary), `drafter` (the [`crate::spec::source::DraftSource`] and the
//! drafting loop), `shipped` (where `--drafter default` points). Making, training and
//! calibrating drafters is not inference and lives in [`crate::train`].

pub mod checkpoint;
pub mod drafter;
pub mod host_block;
pub mod host_sampler;
pub mod module;
pub mod shipped;
pub mod vocab;
