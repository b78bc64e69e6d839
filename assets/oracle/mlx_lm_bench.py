"""mlx-lm side of `mlxb bench --baseline mlx-lm`: a persistent worker that loads the model once
and answers timing requests, one JSON object per line on stdin/stdout, so mlxb can interleave
its own repetitions with mlx-lm's in one invocation.

request:  {"op": "pp", "context": [...], "prompt": [...], "prefill_step_size": 2048}
          {"op": "tg", "prompt": [...], "n": 128}
          {"op": "verify", "context": [...], "block": [...], "prefill_step_size": 2048}
          {"op": "batch", "prompts": [[...], ...], "n": 128}   (BatchGenerator, its defaults)
reply:    {"seconds": float, "tokens": int}, plus "step_seconds" for verify (a one-token
          forward at the same depth; "seconds" is the whole block's forward); for batch, the
          clock starts once every sequence has its first token, as in mlxb's `tg x B`
"""
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load_model


def prefill(model, cache, tokens, step):
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i : i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def timed_forward(model, cache, tokens):
    """Seconds of one forward with every row's logits and the caches evaluated; the caches are
    trimmed back afterwards."""
    t0 = time.perf_counter()
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    seconds = time.perf_counter() - t0
    trim_prompt_cache(cache, len(tokens))
    return seconds


def timed_batch(model, prompts, n):
    """Aggregate decode of `prompts` together, `n` tokens each, no stop tokens."""
    gen = BatchGenerator(model, max_tokens=n)
    gen.insert(prompts, [n] * len(prompts))
    firsts, tokens, t0 = 0, 0, None
    while responses := gen.next_generated():
        if t0 is None:
            firsts += len(responses)
            if firsts >= len(prompts):
                t0 = time.perf_counter()
        else:
            tokens += len(responses)
    seconds = time.perf_counter() - t0
    gen.close()
    return {"seconds": seconds, "tokens": tokens}


def main(model_dir):
    model, _ = load_model(Path(model_dir))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "pp":
            cache = make_prompt_cache(model)
            step = req.get("prefill_step_size", 2048)
            prefill(model, cache, req["context"], step)
            t0 = time.perf_counter()
            prefill(model, cache, req["prompt"], step)
            out = {"seconds": time.perf_counter() - t0, "tokens": len(req["prompt"])}
        elif req["op"] == "verify":
            cache = make_prompt_cache(model)
            prefill(model, cache, req["context"], req.get("prefill_step_size", 2048))
            step = timed_forward(model, cache, req["block"][:1])
            block = timed_forward(model, cache, req["block"])
            out = {"seconds": block, "tokens": len(req["block"]), "step_seconds": step}
        elif req["op"] == "batch":
            out = timed_batch(model, req["prompts"], req["n"])
        else:
            n = 0
            t0 = None
            for _tok, _lp in generate_step(mx.array(req["prompt"]), model, max_tokens=req["n"]):
                if n == 0:
                    t0 = time.perf_counter()
                n += 1
            # Like mlx-lm's own generation_tps: the first token belongs to the prompt phase.
            out = {"seconds": time.perf_counter() - t0, "tokens": n - 1}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
