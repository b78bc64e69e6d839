//! Runs third-party parsing code that can panic on malformed input, turning the panic into an
//! error instead of a crash. The tokenizers crate `expect`s on some deserialization paths
//! (a `tokenizer.json` decoder with invalid UTF-8 in a key, a `Precompiled` normalizer with a
//! bad charsmap, both found by fuzzing); mlxb must answer those with one sentence and exit
//! code 2 like any other bad file.

use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

thread_local! {
    /// Whether a panic on this thread is being contained (its message is not printed).
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`; a panic inside it becomes `Err(its message)` and prints nothing. Panics
/// elsewhere keep the process's hook (message, and abort under a fuzzer).
pub fn contain<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    result.map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_its_message_and_values_pass_through() {
        assert_eq!(contain(|| 7), Ok(7));
        let e = contain(|| -> i32 { panic!("bad charsmap {}", 3) }).unwrap_err();
        assert_eq!(e, "bad charsmap 3");
        let e = contain(|| -> i32 { std::panic::panic_any(5u8) }).unwrap_err();
        assert_eq!(e, "a panic without a message");
        // The flag is restored: a later contained call still works.
        assert_eq!(contain(|| "ok"), Ok("ok"));
    }
}
