"""mlx-lm side of `mlxb parity` (and the engine tests): runs mlx-lm 0.32.2's own generate_step
on given prompt token ids and saves every step's token id and full-vocab logprobs, plus
(optionally) the logits of a one-shot forward over the prompt and of blocks forwarded after it
on the same cache (as a speculative verify feeds its blocks).

usage: python mlx_lm_trace.py REQUEST.json OUT.safetensors
REQUEST: {"model": dir, "prompt_ids": [...], "max_tokens": n, "prefill_step_size": 2048,
          "sampler": {make_sampler kwargs}, "processors": {make_logits_processors kwargs},
          "seed": int|null, "prompt_logits": bool, "blocks": [[ids], ...] (with prompt_logits:
          each block's logits as block_logits_<i>), "max_kv_size": int|null,
          "kv_bits": int|null, "kv_group_size": 64, "quantized_kv_start": 5000}
Prints one JSON line with timings.
"""
import json
import os
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load_model


def main(request_path, out_path):
    req = json.load(open(request_path))
    t0 = time.perf_counter()
    model, _ = load_model(__import__("pathlib").Path(req["model"]))
    load_s = time.perf_counter() - t0
    prompt = mx.array(req["prompt_ids"])
    out = {}
    if req.get("prompt_logits"):
        cache = make_prompt_cache(model)
        out["prompt_logits"] = model(prompt[None], cache=cache)[0]
        mx.eval(out["prompt_logits"])
        for i, block in enumerate(req.get("blocks", [])):
            out[f"block_logits_{i}"] = model(mx.array(block)[None], cache=cache)[0]
            mx.eval(out[f"block_logits_{i}"])
    if req.get("seed") is not None:
        mx.random.seed(req["seed"])
    sampler = make_sampler(**req.get("sampler", {}))
    processors = make_logits_processors(**req.get("processors", {}))
    ids, logprobs = [], []
    t1 = time.perf_counter()
    first = None
    for tok, lp in generate_step(
        prompt,
        model,
        max_tokens=req.get("max_tokens", 32),
        sampler=sampler,
        logits_processors=processors,
        prefill_step_size=req.get("prefill_step_size", 2048),
        max_kv_size=req.get("max_kv_size"),
        kv_bits=req.get("kv_bits"),
        kv_group_size=req.get("kv_group_size", 64),
        quantized_kv_start=req.get("quantized_kv_start", 5000),
    ):
        if first is None:
            first = time.perf_counter()
        ids.append(int(tok))
        logprobs.append(lp)
    end = time.perf_counter()
    out["ids"] = mx.array(ids, dtype=mx.int32)
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
                "peak_memory_gb": mx.get_peak_memory() / 1e9,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
