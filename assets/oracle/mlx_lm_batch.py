"""mlx-lm side of batched generation: runs mlx-lm 0.32.2's own `BatchGenerator` the way
`mlx_lm.generate.batch_generate` drives it and saves, per prompt, every generated token id and
its full-vocabulary logprobs (the stop token included, with why each sequence ended).

usage: python mlx_lm_batch.py REQUEST.json OUT.safetensors
REQUEST: {"model": dir, "prompts": [[ids], ...], "max_tokens": [n, ...],
          "stop_tokens": [ids], "sampler": {make_sampler kwargs}, "seed": int|null,
          "prefill_batch_size": 8, "completion_batch_size": 32, "prefill_step_size": 2048}
Prints one JSON line with timings (aggregate generated tokens per second).
"""
import json
import pathlib
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model


def main(request_path, out_path):
    req = json.load(open(request_path))
    model, _ = load_model(pathlib.Path(req["model"]))
    if req.get("seed") is not None:
        mx.random.seed(req["seed"])
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in req.get("stop_tokens", [])],
        sampler=make_sampler(**req.get("sampler", {})),
        prefill_batch_size=req.get("prefill_batch_size", 8),
        completion_batch_size=req.get("completion_batch_size", 32),
        prefill_step_size=req.get("prefill_step_size", 2048),
    )
    uids = gen.insert(req["prompts"], req["max_tokens"])
    ids = {u: [] for u in uids}
    rows = {u: [] for u in uids}
    finish = {}
    t0 = time.perf_counter()
    while responses := gen.next_generated():
        for r in responses:
            ids[r.uid].append(r.token)
            rows[r.uid].append(r.logprobs)
            if r.finish_reason is not None:
                finish[r.uid] = r.finish_reason
    elapsed = time.perf_counter() - t0
    gen.close()
    out = {}
    for i, u in enumerate(uids):
        out[f"ids_{i}"] = mx.array(ids[u], dtype=mx.int32)
        out[f"logprobs_{i}"] = mx.stack(rows[u])
        out[f"stopped_{i}"] = mx.array([finish[u] == "stop"])
    mx.save_safetensors(out_path, out)
    total = sum(len(v) for v in ids.values())
    print(json.dumps({"generated": total, "seconds": elapsed, "tps": total / elapsed}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
