//! Getting models into mlxb's format: the GGUF importer (`mlxb convert`) and the built-in
//! models that are fetched from PyPI packages and imported on first use.

pub mod gguf;
pub mod registry;
