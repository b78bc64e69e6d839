//! The fast safetensors loader (`engine::loader`) against MLX's own `load_safetensors` on the
//! same files: same names, dtypes, shapes and bytes, whichever way the loader lays the data
//! out (page-cache mapping, copying, many segments), plus its errors for corrupt headers.

mod common;

use mlx_rs::{Array, Dtype};
use mlxb::engine::loader::{load_with, pad_header, LoadOptions};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;

/// Every layout the loader can choose: mapped and copied, one segment and many.
fn layouts() -> Vec<LoadOptions> {
    let d = LoadOptions::default();
    vec![
        d,
        LoadOptions { map_min: 0, ..d },
        LoadOptions {
            map_min: u64::MAX,
            ..d
        },
        LoadOptions {
            map_min: 0,
            segment_max: 10_000,
        },
        LoadOptions {
            map_min: u64::MAX,
            segment_max: 1,
        },
    ]
}

/// The array's bytes as stored (row-major), whatever its dtype.
fn raw_bytes(a: &Array) -> Vec<u8> {
    if a.size() == 0 {
        return Vec::new();
    }
    let flat = a.flatten(None, None).unwrap();
    let bytes = flat.view_dtype(Dtype::Uint8).unwrap();
    bytes.eval().unwrap();
    bytes.as_slice::<u8>().to_vec()
}

/// Loads `path` with MLX's loader and with ours under every layout, and compares; returns the
/// tensor count and, per layout, (bytes mapped, tensors given buffers of their own).
fn assert_same_as_mlx(path: &Path) -> (usize, Vec<(u64, usize)>) {
    let want = Array::load_safetensors(path).unwrap();
    assert!(!want.is_empty(), "{}: no tensors", path.display());
    let mut layout = Vec::new();
    for opts in layouts() {
        let loaded = load_with(path, opts).unwrap();
        layout.push((loaded.mapped_bytes, loaded.own_buffers));
        let got = loaded.tensors;
        let mut names: Vec<&String> = got.keys().collect();
        names.sort();
        let mut want_names: Vec<&String> = want.keys().collect();
        want_names.sort();
        assert_eq!(names, want_names, "{}: {opts:?}", path.display());
        for (name, w) in &want {
            let g = &got[name];
            let what = format!("{}: `{name}` with {opts:?}", path.display());
            assert_eq!(g.dtype(), w.dtype(), "{what}: dtype");
            assert_eq!(g.shape(), w.shape(), "{what}: shape");
            assert!(raw_bytes(g) == raw_bytes(w), "{what}: bytes differ");
        }
    }
    (want.len(), layout)
}

/// Writes a safetensors file by hand, tensors in the given order without padding, so that
/// offsets can be misaligned for their dtype, and the header padded to 8 bytes plus
/// `header_extra` (MLX's own writer leaves header lengths unpadded, often odd).
fn write_safetensors(
    path: &Path,
    tensors: &[(&str, &str, Vec<u64>, Vec<u8>)],
    header_extra: usize,
) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "mlx"}));
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            (*name).into(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    text.extend(std::iter::repeat_n(' ', header_extra));
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(text.as_bytes());
    file.extend_from_slice(&data);
    std::fs::write(path, file).unwrap();
}

/// Deterministic bytes that are valid values for every dtype used here.
fn bytes(n: usize, salt: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2654435761) ^ salt) >> 7) as u8 & 0x3f)
        .collect()
}

/// Tensors of every dtype the tiny models use, in an order that keeps each aligned.
fn aligned_tensors() -> Vec<(&'static str, &'static str, Vec<u64>, Vec<u8>)> {
    vec![
        ("big_f32", "F32", vec![256, 300], bytes(256 * 300 * 4, 1)),
        ("packed_u32", "U32", vec![64, 8], bytes(64 * 8 * 4, 2)),
        ("scales_f32", "F32", vec![64, 2], bytes(64 * 2 * 4, 3)),
        ("scales_bf16", "BF16", vec![64, 2], bytes(256, 4)),
        ("f16", "F16", vec![3, 5], bytes(30, 5)),
        ("empty", "F32", vec![0, 3], Vec::new()),
        ("u8", "U8", vec![9], bytes(9, 6)),
    ]
}

#[test]
fn aligned_and_odd_header_files_load_like_mlx_in_every_layout() {
    let dir = tempfile::tempdir().unwrap();
    for extra in [0, 1, 3, 8] {
        let path = dir.path().join(format!("h{extra}.safetensors"));
        write_safetensors(&path, &aligned_tensors(), extra);
        let (n, layout) = assert_same_as_mlx(&path);
        assert_eq!(n, 7);
        // Every tensor stays aligned (within the data section); only a header of a multiple
        // of 8 bytes lets the file be mapped (layouts 1 and 3 map whatever they can).
        assert!(
            layout.iter().all(|&(_, own)| own == 0),
            "{extra}: {layout:?}"
        );
        let mapped = extra.is_multiple_of(8);
        assert_eq!(layout[1].0 > 0, mapped, "{extra}: {layout:?}");
        assert_eq!(layout[3].0 > 0, mapped, "{extra}: {layout:?}");
        assert_eq!(layout[2].0, 0, "{extra}: {layout:?}");
    }
}

#[test]
fn misaligned_tensors_load_like_mlx_in_every_layout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_safetensors(
        &path,
        &[
            ("odd_bf16", "BF16", vec![3], bytes(6, 1)),
            ("misaligned_f32", "F32", vec![5, 7], bytes(140, 2)),
            ("f16", "F16", vec![4, 6], bytes(48, 3)),
            ("empty", "F32", vec![0, 3], Vec::new()),
            ("big_f32", "F32", vec![256, 300], bytes(256 * 300 * 4, 4)),
            ("packed_u32", "U32", vec![64, 8], bytes(64 * 8 * 4, 5)),
            ("scales_bf16", "BF16", vec![64, 2], bytes(256, 6)),
            ("u8", "U8", vec![9], bytes(9, 7)),
            ("i32", "I32", vec![2, 2], bytes(16, 8)),
        ],
        0,
    );
    let (n, layout) = assert_same_as_mlx(&path);
    assert_eq!(n, 9);
    assert!(layout.iter().all(|&(_, own)| own >= 1), "{layout:?}");
}

#[test]
fn mlx_lm_models_load_like_mlx_in_every_layout() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::tiny_llama(json!({}));
    for (name, dtype, bits) in [
        ("f32", "f32", None),
        ("bf16", "bf16", None),
        ("f16", "f16", None),
        ("q4", "f32", Some(4)),
        ("q4_bf16", "bf16", Some(4)),
    ] {
        let model = dir.path().join(name);
        common::make_model_with(&model, &cfg, dtype, bits, &["--no-tokenizer"]);
        let (n, _) = assert_same_as_mlx(&model.join("model.safetensors"));
        assert!(n > 5, "{name}: only {n} tensors");
    }
}

#[test]
fn corrupt_headers_are_one_sentence_naming_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, serde_json::Value, usize, &str)> = vec![
        (
            "dtype",
            json!({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}),
            8,
            "tensor `w` has unsupported dtype Q7",
        ),
        (
            "f64",
            json!({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}),
            8,
            "tensor `w` has unsupported dtype F64",
        ),
        (
            "offsets",
            json!({"w": {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 8]}}),
            8,
            "tensor `w` has invalid data offsets (0, 8)",
        ),
        (
            "past_end",
            json!({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}),
            8,
            "tensor `w` extends past the end of the file",
        ),
        (
            "no_shape",
            json!({"w": {"dtype": "F32", "data_offsets": [0, 8]}}),
            8,
            "tensor `w` has no valid shape",
        ),
    ];
    for (name, header, data, needle) in cases {
        let path = dir.path().join(format!("{name}.safetensors"));
        let text = header.to_string();
        let mut file = (text.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(text.as_bytes());
        file.extend(std::iter::repeat_n(0u8, data));
        std::fs::write(&path, file).unwrap();
        let err = load_with(&path, LoadOptions::default())
            .err()
            .unwrap_or_else(|| panic!("{name}: loaded"))
            .to_string();
        assert!(err.contains(needle), "{name}: {err}");
        assert!(
            err.contains(path.to_str().unwrap()),
            "{name}: no path: {err}"
        );
        assert!(
            !err.contains(".cpp") && !err.contains('\n'),
            "{name}: {err}"
        );
    }
}

#[test]
fn mapped_weights_outlive_other_views_and_compute_like_copies() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let a: Vec<f32> = (0..128 * 96)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect();
    let b: Vec<f32> = (0..96 * 80)
        .map(|i| ((i * 53 % 89) as f32 - 44.0) / 32.0)
        .collect();
    let as_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    write_safetensors(
        &path,
        &[
            ("a", "F32", vec![128, 96], as_bytes(&a)),
            ("b", "F32", vec![96, 80], as_bytes(&b)),
        ],
        0,
    );
    let want = Array::from_slice(&a, &[128, 96])
        .matmul(Array::from_slice(&b, &[96, 80]))
        .unwrap();
    for opts in layouts() {
        let mut got: HashMap<String, Array> = load_with(&path, opts).unwrap().tensors;
        let ga = got.remove("a").unwrap();
        drop(got);
        // `b` is gone; `a` alone keeps the shared buffer alive.
        let gb = load_with(&path, opts).unwrap().tensors.remove("b").unwrap();
        let prod = ga.matmul(&gb).unwrap();
        assert_eq!(common::bits(&prod), common::bits(&want), "{opts:?}");
    }
}

#[test]
fn padding_an_odd_header_keeps_every_tensor_and_makes_the_file_mappable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_safetensors(&path, &aligned_tensors(), 3);
    let before = Array::load_safetensors(&path).unwrap();
    let mapped = |p: &Path| {
        load_with(
            p,
            LoadOptions {
                map_min: 0,
                ..LoadOptions::default()
            },
        )
        .unwrap()
        .mapped_bytes
    };
    assert_eq!(mapped(&path), 0);
    assert!(pad_header(&path).unwrap());
    assert!(!pad_header(&path).unwrap(), "padding twice");
    let after = Array::load_safetensors(&path).unwrap();
    assert_eq!(before.len(), after.len());
    for (name, a) in &before {
        assert!(raw_bytes(a) == raw_bytes(&after[name]), "`{name}` changed");
    }
    assert!(mapped(&path) > 0);
    assert_same_as_mlx(&path);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "temp file left behind");
}
