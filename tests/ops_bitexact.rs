//! Op-level bit-exactness: Rust (mlx-rs → mlx-c → libmlx) against Python MLX on the same
//! libmlx and BLAS, identical deterministic inputs, max |diff| exactly 0 (compared as bits).

mod common;

use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops;
use mlx_rs::transforms::compile::compile;
use mlx_rs::transforms::value_and_grad;
use mlx_rs::{Array, Dtype};
use mlxb::engine::bits::same_bits;
use std::collections::HashMap;

/// Same values as `pattern` in tests/oracle/ops.py.
fn pattern(shape: &[i32], salt: i64) -> Array {
    let n: i64 = shape.iter().map(|&d| d as i64).product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i * 37 + salt * 11) % 97 - 48) as f64 / 64.0) as f32)
        .collect();
    Array::from_slice(&v, shape)
}

fn rust_results() -> HashMap<String, Array> {
    let mut res = HashMap::new();
    let (a, b) = (pattern(&[64, 96], 1), pattern(&[96, 80], 2));
    let x3 = pattern(&[4, 16, 128], 3);
    let w1 = pattern(&[128], 4);
    let (q, k, v) = (
        pattern(&[1, 4, 16, 64], 5),
        pattern(&[1, 2, 16, 64], 6),
        pattern(&[1, 2, 16, 64], 7),
    );
    let s = pattern(&[8, 128], 8);
    for (name, dt) in [("f32", Dtype::Float32), ("bf16", Dtype::Bfloat16)] {
        let c = |x: &Array| x.as_dtype(dt).unwrap();
        res.insert(format!("matmul_{name}"), ops::matmul(c(&a), c(&b)).unwrap());
        res.insert(
            format!("softmax_{name}"),
            ops::softmax_axis(c(&s), -1, true).unwrap(),
        );
        res.insert(
            format!("rms_norm_{name}"),
            fast::rms_norm(c(&x3), Some(&c(&w1)), 1e-5).unwrap(),
        );
        res.insert(
            format!("rope_{name}"),
            fast::rope(c(&q), 64, false, 10000.0, 1.0, 3, None).unwrap(),
        );
        res.insert(
            format!("sdpa_{name}"),
            fast::scaled_dot_product_attention(
                c(&q),
                c(&k),
                c(&v),
                0.125,
                ScaledDotProductAttentionMask::Causal,
                None,
            )
            .unwrap(),
        );
        let (wq, sc, bi) = ops::quantize(c(&pattern(&[128, 128], 9)), 64, 4).unwrap();
        let qmm =
            ops::quantized_matmul(c(&pattern(&[8, 128], 10)), &wq, &sc, &bi, true, 64, 4).unwrap();
        res.insert(format!("qmm_{name}"), qmm);
        res.insert(format!("quant_w_{name}"), wq);
        res.insert(format!("quant_scales_{name}"), sc);
        res.insert(format!("quant_biases_{name}"), bi);
    }

    let chain = |(x, y): (&Array, &Array)| -> Result<Array, mlx_rs::error::Exception> {
        let t = ops::tanh(&(x * y + x))?;
        let g = ops::sigmoid(y)?;
        let e = ops::exp(&ops::negative(&ops::abs(x)?)?)?;
        Ok(t * g - e)
    };
    let (x, y) = (pattern(&[32, 64], 11), pattern(&[32, 64], 12));
    res.insert("chain_eager".into(), chain((&x, &y)).unwrap());
    let mut compiled = compile(chain, false);
    res.insert("chain_compiled".into(), compiled((&x, &y)).unwrap());

    let (xm, w, ym) = (
        pattern(&[16, 96], 13),
        pattern(&[96, 8], 14),
        pattern(&[16, 8], 15),
    );
    let loss = move |args: &[Array]| -> Result<Vec<Array>, mlx_rs::error::Exception> {
        let d = ops::matmul(&xm, &args[0])? - &ym;
        Ok(vec![ops::mean(&ops::square(&d)?, None)?])
    };
    let (val, grad) = value_and_grad(loss)(&[w]).unwrap();
    res.insert("vg_loss".into(), val[0].clone());
    res.insert("vg_grad".into(), grad[0].clone());
    res
}

#[test]
fn ops_are_bit_identical_to_python_mlx() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("py.safetensors");
    common::run_python(
        &common::root().join("tests/oracle/ops.py"),
        &[out.to_str().unwrap()],
    );
    let py = Array::load_safetensors(&out).unwrap();
    let rs = rust_results();
    assert_eq!(
        py.len(),
        rs.len(),
        "oracle and Rust computed different op sets"
    );
    let mut failures = vec![];
    let mut names: Vec<_> = rs.keys().cloned().collect();
    names.sort();
    for name in names {
        let r = &rs[&name];
        let p = py
            .get(&name)
            .unwrap_or_else(|| panic!("oracle lacks {name}"));
        let same = same_bits(r, p).unwrap();
        println!(
            "{name:<22} {:?} {:?} bit-identical: {same}",
            r.dtype(),
            r.shape()
        );
        if !same {
            failures.push(name);
        }
    }
    assert!(failures.is_empty(), "not bit-identical: {failures:?}");
}
