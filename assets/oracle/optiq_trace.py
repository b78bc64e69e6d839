"""mlx-optiq side of `mlxb parity --l2` (and the L2 tests): the `optiq eval` code path of
mlx-optiq 0.7.7 with a per-layer KV allocation: its `install_mixed_kv(configs, 0)` and its
eval kv-kwargs patch, then mlx-lm's greedy `stream_generate` on the given prompt ids. Saves every
step's token id and full-vocabulary logprobs. Runs in the optiq env (`.venv-optiq`).

usage: python optiq_trace.py REQUEST.json OUT.safetensors
REQUEST: {"model": dir, "kv_config": path, "prompt_ids": [...], "max_tokens": n,
          "prefill_step_size": 2048}
The end-of-sequence tokens are cleared so that every step runs, as `mlxb parity` runs them.
Prints one JSON line with timings.
"""
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load
from optiq import cli as optiq_cli
from optiq.serve import _load_kv_config, install_mixed_kv


def main(request_path, out_path):
    req = json.load(open(request_path))
    t0 = time.perf_counter()
    model, tokenizer = load(Path(req["model"]))
    load_s = time.perf_counter() - t0
    # What `optiq eval --kv-config FILE` does before generating.
    configs = _load_kv_config(req["kv_config"])
    install_mixed_kv(kv_configs=configs, quantized_kv_start=0)
    optiq_cli._install_eval_kv_kwargs(max(c.bits for c in configs), 64)
    import mlx_lm.generate  # noqa: F401

    stream_generate = sys.modules["mlx_lm.generate"].stream_generate
    tokenizer.eos_token_ids = []
    ids, logprobs = [], []
    t1 = time.perf_counter()
    first = None
    for resp in stream_generate(
        model,
        tokenizer,
        prompt=req["prompt_ids"],
        max_tokens=req.get("max_tokens", 32),
        sampler=make_sampler(temp=0.0),
        prefill_step_size=req.get("prefill_step_size", 2048),
    ):
        if first is None:
            first = time.perf_counter()
        ids.append(int(resp.token))
        logprobs.append(resp.logprobs)
    end = time.perf_counter()
    out = {"ids": mx.array(ids, dtype=mx.int32)}
    if logprobs:
        out["logprobs"] = mx.stack(logprobs)
    mx.eval(out)
    mx.save_safetensors(out_path, out)
    print(
        json.dumps(
            {
                "load_s": load_s,
                "prompt_s": (first or end) - t1,
                "generation_s": end - (first or end),
                "steps": len(ids),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Leave without exit-time destructors, as the mlx-lm trace does (OpenBLAS thread joins).
    sys.stdout.flush()
    import os

    os._exit(0)
