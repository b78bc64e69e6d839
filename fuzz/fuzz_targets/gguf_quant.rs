//! GGUF tensor decoders: the first byte picks the ggml type id, the rest is the tensor data.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlxb::convert::gguf::quant::{decode, Decoded, GgmlType};

fuzz_target!(init: mlxb_fuzz::deterministic(), |data: &[u8]| {
    let Some((&id, bytes)) = data.split_first() else {
        return;
    };
    let Some(ty) = GgmlType::from_id(id as u32) else {
        return;
    };
    let (block, block_bytes) = ty.block();
    let n = bytes.len() as u64 / block_bytes.max(1) * block;
    if let Ok(Decoded::Affine(a)) = decode(ty, bytes, n as usize) {
        let _ = a.pack();
    }
});
