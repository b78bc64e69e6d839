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

/// Runs a fallible `f` contained: its error and a panic inside it both become one message,
/// a panic's prefixed with `on_panic` (so callers need not flatten the two layers each time).
pub fn contain_fallible<T, E: std::fmt::Display>(
    on_panic: &str,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, String> {
    contain(f)
        .map_err(|panic| format!("{on_panic}: {panic}"))
        .and_then(|r| r.map_err(|e| e.to_string()))
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

    #[test]
    fn a_fallible_call_gives_its_error_or_its_panic_prefixed() {
        assert_eq!(contain_fallible("failed", || Ok::<_, String>(3)), Ok(3));
        let e = contain_fallible("failed", || Err::<i32, _>("bad key")).unwrap_err();
        assert_eq!(e, "bad key");
        let e = contain_fallible("failed", || -> Result<i32, String> { panic!("boom") });
        assert_eq!(e.unwrap_err(), "failed: boom");
    }
}
