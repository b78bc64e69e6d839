//! Speculative decoding: one seam ([`source::DraftSource`]) every drafter plugs into, and one
//! executor ([`executor`]) that drafts, verifies the block in one target forward, accepts,
//! rolls every cache back exactly and emits — driven by the engine's single generation loop.
//!
//! Roles are split by file: `source` (the seam: what a drafter is, proposes and sees),
//! `factory` (drafter options and the one function that opens any drafter), `executor` (the
//! round driver), `verify` (acceptance policies), `metrics`
//! (vLLM-style acceptance counters), `trace` (per-round JSONL traces), `slots` (one drafter per
//! sequence of the batched engine), `policy` (how wide a batched step's verify blocks are),
//! `draft_gate` (whether a single stream drafts its next round), and one file per drafter
//! (`dspark/` and `assistant/` are directories); `lookup_first` puts a prompt lookup in front of a
//! model drafter.

pub mod assistant;
pub mod autoregressive;
pub mod draft_gate;
pub mod dspark;
pub mod early_exit;
pub mod executor;
pub mod factory;
pub mod lookup_first;
pub mod lookup_table;
pub mod metrics;
pub mod ngram;
pub mod policy;
pub mod slots;
pub mod source;
pub mod trace;
pub mod two_model;
pub mod verify;
