//! An OpenAI request body: the first byte picks `/v1/chat/completions` or `/v1/completions`, the
//! rest is the body given to the server's parser and validator.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxb::server::request::{parse, Endpoint, Limits};

fuzz_target!(init: mlxb_fuzz::deterministic(), |data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let endpoint = if which & 1 == 0 {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let limits = Limits {
        default_max_tokens: 16,
        max_tokens_limit: 4096,
        max_prompt_tokens: 8192,
        has_drafter: which & 2 != 0,
        ..Limits::new(vec!["default".into(), "smollm2".into()], 384)
    };
    let _ = parse(endpoint, body, &limits);
});
