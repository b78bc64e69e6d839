//! Gemma 4's "assistant" drafter (multi-token prediction that borrows the target's KV cache):
//! a 4-layer Gemma 4 decoder with q-only attention over the target's donor layers' keys/values,
//! started from the target's last hidden state, drafting every token of a round at the same
//! position over the same frozen prefix. It needs no training and keeps no cache of its own.
//!
//! Files: `config` (the checkpoint's config, detection, the load checks against the target,
//! the draft length), `module` (the network, one drafted token per step, both head kinds),
//! `drafter` (the [`crate::spec::source::DraftSource`]). Spec:
//! `shared/reference/gemma4-assistant-spec.md`.

pub mod config;
pub mod drafter;
pub mod module;
