//! A GGUF file: the container parser, the vocabulary builder, and the whole import (header
//! checks, hyper-parameters, tensor decoding) into a scratch directory.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxb::convert::gguf::{import_gguf, vocab, GgufHeader, ImportOptions};

fuzz_target!(init: mlxb_fuzz::deterministic(), |data: &[u8]| {
    let dir = mlxb_fuzz::fresh_dir("gguf");
    let src = dir.join("in.gguf");
    mlxb_fuzz::put(&dir, "in.gguf", data);
    let Ok(h) = GgufHeader::open(&src) else {
        return;
    };
    if let Ok(arch) = h.str("general.architecture") {
        let _ = vocab::build(&h, arch, None);
    }
    let _ = import_gguf(
        &src,
        &dir.join("out"),
        &ImportOptions::default(),
        &mut |_, _| {},
    );
});
