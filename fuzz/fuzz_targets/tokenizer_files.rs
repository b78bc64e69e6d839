//! A model's tokenizer files (tokenizer.json, tokenizer_config.json with its chat template,
//! config.json, generation_config.json, split on the separator), then encoding, decoding and
//! rendering a conversation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxb::engine::tokenizer::{ChatMessage, Tokenizer};

const FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
];

fuzz_target!(init: mlxb_fuzz::deterministic(), |data: &[u8]| {
    let dir = mlxb_fuzz::fresh_dir("tokenizer");
    for (name, bytes) in FILES.iter().zip(mlxb_fuzz::parts(data, FILES.len())) {
        if !bytes.is_empty() {
            mlxb_fuzz::put(&dir, name, bytes);
        }
    }
    let Ok(tok) = Tokenizer::load(&dir) else {
        return;
    };
    if let Ok(ids) = tok.encode("Hello, world! 123", true) {
        let _ = tok.decode(&ids);
    }
    let _ = tok.prompt_ids("What is the capital of France?", Some("Be brief."), true);
    let msgs = [
        ChatMessage::new("user", "hi"),
        ChatMessage::new("assistant", "hello"),
    ];
    let _ = tok.apply_chat_template(&msgs, false);
});
