"""Oracle side of tests/sampling_parity.rs: mlx-lm's own samplers and logits processors
(make_sampler / make_logits_processors) run on fixed logits with fixed seeds; inputs and
results go to one safetensors file that the Rust test reads back.

Usage: sampling.py OUT.safetensors
"""
import os
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors, make_sampler

VOCAB = 640
ROWS = 8
STEPS = 32
SEED = 20240611

# Sampler cases: name -> make_sampler kwargs. Temperatures and min_p values are chosen so
# that computing 1/temp or log(min_p) from an f32 copy of the value would give different
# f32 bits (1.1, 0.85, 0.9): the Rust side must do that arithmetic in f64 like Python.
SAMPLERS = {
    "greedy": dict(temp=0.0),
    "temp": dict(temp=0.7),
    "temp_hot": dict(temp=1.1),
    "top_p": dict(temp=0.7, top_p=0.9),
    "top_k": dict(temp=0.7, top_k=20),
    "min_p": dict(temp=0.7, min_p=0.1),
    "min_p_keep": dict(temp=1.1, min_p=0.9, min_tokens_to_keep=5),
    "xtc": dict(temp=0.7, xtc_probability=0.5, xtc_threshold=0.03),
    "xtc_special": dict(
        temp=0.85, xtc_probability=0.7, xtc_threshold=0.02, xtc_special_tokens=[7, 13, 600]
    ),
    "all": dict(
        temp=0.85,
        top_p=0.95,
        min_p=0.05,
        min_tokens_to_keep=3,
        top_k=40,
        xtc_probability=0.6,
        xtc_threshold=0.04,
        xtc_special_tokens=[7, 31],
    ),
}

# Processor cases: name -> (make_logits_processors kwargs, token dtype of the history).
PROCESSORS = {
    "repetition": (dict(repetition_penalty=1.3, repetition_context_size=8), mx.int32),
    "repetition_wide": (dict(repetition_penalty=1.1), mx.int32),
    "presence": (dict(presence_penalty=0.7, presence_context_size=12), mx.int32),
    "frequency": (dict(frequency_penalty=0.45, frequency_context_size=16), mx.int32),
    "bias": (dict(logit_bias={5: 3.7, 17: -2.25, 600: 11.1, 42: -100.0}), mx.int32),
    "all": (
        dict(
            logit_bias={3: 1.5, 600: -0.3},
            repetition_penalty=1.15,
            repetition_context_size=10,
            presence_penalty=0.35,
            presence_context_size=6,
            frequency_penalty=0.2,
            frequency_context_size=30,
        ),
        mx.uint32,
    ),
}

# The generate-like pipeline: processors, logprobs, sampler, feed the token back.
PIPE_SAMPLER = SAMPLERS["all"]
PIPE_PROCESSORS = PROCESSORS["all"][0]


def make_logits():
    """Gaussian noise plus a few boosted tokens per row, so that every filter has work to do."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, VOCAB)) * 1.5
    for r in range(ROWS):
        x[r, (r * 7) % VOCAB] += 3.5
        x[r, (r * 13 + 5) % VOCAB] += 3.0
        x[r, (r * 31 + 2) % VOCAB] += 2.5
        x[r, 7] += 2.5  # an XTC special token near the top
    return mx.array(x.astype(np.float32))


def make_history():
    """A prompt with many repeats, then STEPS more ids: step i sees the first PROMPT+i."""
    prompt = [(i * 7) % 23 for i in range(30)] + [5, 17, 600, 5, 5]
    gen = [(i * 11 + 3) % 40 for i in range(STEPS)]
    return mx.array(prompt + gen, dtype=mx.int32), len(prompt)


def filters_of(sampler):
    """The `sampling_methods` list inside make_sampler's closure: mlx-lm's own filter chain."""
    cells = dict(zip(sampler.__code__.co_freevars, sampler.__closure__))
    return cells["sampling_methods"].cell_contents


def logprobs_of(logits):
    return logits - mx.logsumexp(logits, keepdims=True)


def main(out):
    res = {}
    logits_f32 = make_logits()
    history, prompt_len = make_history()
    res["logits"] = logits_f32
    res["history"] = history
    res["prompt_len"] = mx.array([prompt_len], dtype=mx.int32)

    for dt_name, dt in (("f32", mx.float32), ("bf16", mx.bfloat16)):
        logits = logits_f32.astype(dt)

        for name, kw in SAMPLERS.items():
            mx.random.seed(SEED)
            sampler = make_sampler(**kw)
            toks = []
            for i in range(STEPS):
                lp = logprobs_of(logits[i % ROWS : i % ROWS + 1])
                toks.append(sampler(lp))
            res[f"sample.{name}.{dt_name}"] = mx.concatenate(toks)

            # A batch: every row at once, as mlx-lm's BatchGenerator samples (one call on
            # [ROWS, VOCAB] logprobs), a few steps from one seed.
            mx.random.seed(SEED)
            sampler = make_sampler(**kw)
            rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            res[f"batch.{name}.{dt_name}"] = mx.concatenate([sampler(rows) for _ in range(4)])

            if kw["temp"] != 0:
                # The masked logprobs the categorical draw sees, from the same seed.
                mx.random.seed(SEED)
                methods = filters_of(make_sampler(**kw))
                outs = []
                for i in range(STEPS):
                    lp = logprobs_of(logits[i % ROWS : i % ROWS + 1])
                    for m in methods:
                        lp = m(lp)
                    outs.append(lp)
                res[f"filter.{name}.{dt_name}"] = mx.concatenate(outs)

        for name, (kw, tdt) in PROCESSORS.items():
            procs = make_logits_processors(**kw)
            outs = []
            for i in range(STEPS):
                toks = history[: prompt_len + i].astype(tdt)
                lg = logits[i % ROWS : i % ROWS + 1]
                for p in procs:
                    lg = p(toks, lg)
                outs.append(lg)
            res[f"proc.{name}.{dt_name}"] = mx.concatenate(outs)

        # Generate-like loop (generate.py _step): tokens grow with the sampled ids.
        mx.random.seed(SEED + 1)
        sampler = make_sampler(**PIPE_SAMPLER)
        procs = make_logits_processors(**PIPE_PROCESSORS)
        tokens = history[:prompt_len]
        ys = []
        for i in range(STEPS):
            lg = logits[i % ROWS : i % ROWS + 1]
            for p in procs:
                lg = p(tokens, lg)
            y = sampler(logprobs_of(lg))
            tokens = mx.concatenate([tokens, y])
            ys.append(y)
        res[f"pipe.{dt_name}"] = mx.concatenate(ys)

    mx.eval(res)
    mx.save_safetensors(out, res)


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
