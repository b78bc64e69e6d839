"""Oracle side of the op-level bit-exactness test: Python MLX computes each op on the same
deterministic inputs as tests/ops_bitexact.rs and saves the results to a safetensors file."""
import os
import sys

import mlx.core as mx
import numpy as np


def pattern(shape, salt):
    """k/64 with |k| <= 48: exact in f32 and bf16; the Rust side builds the same values."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64)
    k = (i * 37 + salt * 11) % 97 - 48
    return mx.array((k / 64.0).astype(np.float32).reshape(shape))


def main(out):
    res = {}
    a, b = pattern((64, 96), 1), pattern((96, 80), 2)
    x3 = pattern((4, 16, 128), 3)
    w1 = pattern((128,), 4)
    q, k, v = pattern((1, 4, 16, 64), 5), pattern((1, 2, 16, 64), 6), pattern((1, 2, 16, 64), 7)
    s = pattern((8, 128), 8)
    for name, dt in (("f32", mx.float32), ("bf16", mx.bfloat16)):
        res[f"matmul_{name}"] = a.astype(dt) @ b.astype(dt)
        res[f"softmax_{name}"] = mx.softmax(s.astype(dt), axis=-1, precise=True)
        res[f"rms_norm_{name}"] = mx.fast.rms_norm(x3.astype(dt), w1.astype(dt), 1e-5)
        res[f"rope_{name}"] = mx.fast.rope(
            q.astype(dt), 64, traditional=False, base=10000.0, scale=1.0, offset=3
        )
        res[f"sdpa_{name}"] = mx.fast.scaled_dot_product_attention(
            q.astype(dt), k.astype(dt), v.astype(dt), scale=0.125, mask="causal"
        )
        wq, sc, bi = mx.quantize(pattern((128, 128), 9).astype(dt), group_size=64, bits=4)
        res[f"quant_w_{name}"], res[f"quant_scales_{name}"], res[f"quant_biases_{name}"] = wq, sc, bi
        res[f"qmm_{name}"] = mx.quantized_matmul(
            pattern((8, 128), 10).astype(dt), wq, sc, bi, transpose=True, group_size=64, bits=4
        )

    def chain(x, y):
        return mx.tanh(x * y + x) * mx.sigmoid(y) - mx.exp(-mx.abs(x))

    x, y = pattern((32, 64), 11), pattern((32, 64), 12)
    res["chain_eager"] = chain(x, y)
    res["chain_compiled"] = mx.compile(chain)(x, y)

    X, W, Y = pattern((16, 96), 13), pattern((96, 8), 14), pattern((16, 8), 15)

    def loss(w):
        return mx.mean(mx.square(X @ w - Y))

    val, grad = mx.value_and_grad(loss)(W)
    res["vg_loss"], res["vg_grad"] = val, grad
    mx.eval(res)
    mx.save_safetensors(out, res)


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
