//! Progress of long steps in the layers below the front ends (fetching and importing a model,
//! caching training data): those layers report through [`Progress`], and only the front ends
//! (`cmd`, `server`, `bench`) draw or print it.

/// Receives progress reports. Implementations must tolerate any order of calls.
pub trait Progress {
    /// A one-line notice, e.g. what is fetched on first use.
    fn notice(&self, text: &str);
    /// A counted step begins: `label`, `total` units named `unit`.
    fn begin(&self, label: &str, total: u64, unit: &str);
    /// `done` units of the current step are finished (not an increment).
    fn set(&self, done: u64);
    /// The current step's label changes (e.g. to its last phase).
    fn relabel(&self, label: &str);
    /// The current step ended.
    fn end(&self);
}

/// Reports nothing: for tests and callers with no one to tell.
pub struct Silent;

impl Progress for Silent {
    fn notice(&self, _: &str) {}
    fn begin(&self, _: &str, _: u64, _: &str) {}
    fn set(&self, _: u64) {}
    fn relabel(&self, _: &str) {}
    fn end(&self) {}
}
