"""Tiny random Gemma 4 assistant checkpoints, and an independent numpy reference of the
assistant's drafting steps, written from the spec's equations (gemma4-assistant-spec.md §3-§6)
and sharing nothing with mlxb's Rust provider.

usage:
  python gemma4_assistant.py make OUT_DIR '{"backbone_hidden_size": ..., "text_config": {...}}'
         [--seed N] [--num-assistant-tokens K]
      writes config.json, model.safetensors (HF tensor names, f32) and, with
      --num-assistant-tokens, generation_config.json.
  python gemma4_assistant.py step REQUEST.json OUT.safetensors
      REQUEST: {"target": DIR, "assistant": DIR, "prompt_ids": [...], "anchor": t, "steps": n}.
      The target (mlx-lm's own gemma4_text) prefills the prompt in one chunk; the reference
      then drafts `steps` tokens greedily from anchor t at position p = len(prompt), reading the
      donor layers' keys/values from mlx-lm's caches. Writes `tokens` [n] and `logits` [n, V].
"""
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

FULL, SLIDING = "full_attention", "sliding_attention"


def text_defaults(t):
    t = dict(t)
    t.setdefault("rms_norm_eps", 1e-6)
    t.setdefault(
        "rope_parameters",
        {
            FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
            SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "default"},
        },
    )
    return t


def head_shape(t, full):
    """(kv heads, head_dim) of a layer type."""
    d = t.get("global_head_dim") if full and t.get("global_head_dim") else t["head_dim"]
    kv = t["num_key_value_heads"]
    if full and t.get("attention_k_eq_v") and t.get("num_global_key_value_heads"):
        kv = t["num_global_key_value_heads"]
    return kv, d


def make(out, cfg, seed, num_assistant_tokens):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    t = text_defaults(cfg["text_config"])
    cfg = dict(cfg)
    cfg["text_config"] = t
    cfg.setdefault("model_type", "gemma4_assistant")
    cfg.setdefault("architectures", ["Gemma4AssistantForCausalLM"])
    cfg.setdefault("tie_word_embeddings", True)
    H, B, V, I = t["hidden_size"], cfg["backbone_hidden_size"], t["vocab_size"], t["intermediate_size"]
    nh = t["num_attention_heads"]

    def lin(o, i):
        return rng.normal(0, 1 / math.sqrt(i), (o, i)).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.normal(size=(n,))).astype(np.float32)

    w = {
        "model.embed_tokens.weight": rng.normal(0, 1, (V, H)).astype(np.float32),
        "model.norm.weight": norm(H),
        "pre_projection.weight": lin(H, 2 * B),
        "post_projection.weight": (4 * lin(B, H)),
    }
    for i, lt in enumerate(t["layer_types"]):
        _, d = head_shape(t, lt == FULL)
        p = f"model.layers.{i}"
        w[f"{p}.self_attn.q_proj.weight"] = lin(nh * d, H)
        w[f"{p}.self_attn.o_proj.weight"] = lin(H, nh * d)
        w[f"{p}.self_attn.q_norm.weight"] = norm(d)
        for n in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"]:
            w[f"{p}.{n}.weight"] = norm(H)
        w[f"{p}.mlp.gate_proj.weight"] = lin(I, H)
        w[f"{p}.mlp.up_proj.weight"] = lin(I, H)
        w[f"{p}.mlp.down_proj.weight"] = lin(H, I)
        w[f"{p}.layer_scalar"] = (1 + 0.1 * rng.normal(size=(1,))).astype(np.float32)
    if cfg.get("use_ordered_embeddings"):
        C = cfg["num_centroids"]
        w["masked_embedding.centroids.weight"] = lin(C, H)
        w["masked_embedding.token_ordering"] = rng.permutation(V).astype(np.int64)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    json.dump(cfg, open(out / "config.json", "w"), indent=1)
    if num_assistant_tokens:
        json.dump({"num_assistant_tokens": num_assistant_tokens}, open(out / "generation_config.json", "w"))


# ---- the reference step (numpy, float64) ----

def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (w if w is not None else 1.0)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def rope(x, pos, d, params):
    """NeoX rotation of x [heads, d] at `pos`: pairs (j, j + d/2) with inverse frequency
    theta^(-2j/d), rotated only for j < partial_rotary_factor * d / 2 ("proportional"); the
    default type rotates every pair."""
    theta = params.get("rope_theta", 1e4)
    half = d // 2
    rotated = half
    if params.get("rope_type") == "proportional":
        rotated = int(params.get("partial_rotary_factor", 1.0) * d) // 2
    inv = np.array([theta ** (-2 * j / d) if j < rotated else 0.0 for j in range(half)])
    ang = pos * inv
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[:, :half], x[:, half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def step_ref(A, cfg, emb, hidden, pos, donors):
    t = cfg["text_config"]
    eps = t["rms_norm_eps"]
    nh = t["num_attention_heads"]
    x = A["pre_projection.weight"] @ np.concatenate([emb, hidden])
    for i, lt in enumerate(t["layer_types"]):
        p = f"model.layers.{i}"
        kvh, d = head_shape(t, lt == FULL)
        K, Vv = donors[lt]  # [kvh, n, d]
        n = rms(x, A[f"{p}.input_layernorm.weight"], eps)
        q = (A[f"{p}.self_attn.q_proj.weight"] @ n).reshape(nh, d)
        q = rms(q, A[f"{p}.self_attn.q_norm.weight"], eps)
        q = rope(q, pos, d, t["rope_parameters"][lt])
        outs = []
        for h in range(nh):
            g = h // (nh // kvh)
            s = K[g] @ q[h]  # scale 1.0
            a = np.exp(s - s.max())
            a /= a.sum()
            outs.append(a @ Vv[g])
        o = A[f"{p}.self_attn.o_proj.weight"] @ np.concatenate(outs)
        x = x + rms(o, A[f"{p}.post_attention_layernorm.weight"], eps)
        m = rms(x, A[f"{p}.pre_feedforward_layernorm.weight"], eps)
        ff = A[f"{p}.mlp.down_proj.weight"] @ (
            gelu_tanh(A[f"{p}.mlp.gate_proj.weight"] @ m) * (A[f"{p}.mlp.up_proj.weight"] @ m))
        x = x + rms(ff, A[f"{p}.post_feedforward_layernorm.weight"], eps)
        x = x * A[f"{p}.layer_scalar"][0]
    hn = rms(x, A["model.norm.weight"], eps)
    E = A["model.embed_tokens.weight"]
    if cfg.get("use_ordered_embeddings"):
        C, k = cfg["num_centroids"], cfg["centroid_intermediate_top_k"]
        c = A["masked_embedding.centroids.weight"] @ hn
        top = np.argsort(-c)[:k]
        ids = A["masked_embedding.token_ordering"].reshape(C, -1)[top].reshape(-1)
        sel = E[ids] @ hn
        logits = np.full(E.shape[0], sel.min() - 1.0)
        logits[ids] = sel
    else:
        logits = E @ hn
    return logits, A["post_projection.weight"] @ hn


def step(req_path, out_path):
    import mlx.core as mx
    from mlx_lm.utils import load
    from safetensors.numpy import load_file, save_file

    req = json.load(open(req_path))
    model, _ = load(req["target"])
    tcfg = json.load(open(Path(req["target"]) / "config.json"))
    cfg = json.load(open(Path(req["assistant"]) / "config.json"))
    cfg["text_config"] = text_defaults(cfg["text_config"])
    A = {k: v.astype(np.float64) if v.dtype != np.int64 else v
         for k, v in load_file(str(Path(req["assistant"]) / "model.safetensors")).items()}
    prompt = req["prompt_ids"]
    p = len(prompt)
    cache = model.make_cache()
    h = model.model(mx.array([prompt]), cache=cache)
    mx.eval(h)
    hidden = np.array(h[0, p - 1].astype(mx.float32), dtype=np.float64)
    E = np.array(model.model.embed_tokens.weight.astype(mx.float32), dtype=np.float64)
    B = tcfg["hidden_size"]
    # Donors: the last layer of each type that owns a cache.
    types = model.args.layer_types[: len(cache)]
    donors = {}
    W = cfg["text_config"]["sliding_window"]
    for lt in (FULL, SLIDING):
        idx = max(i for i, x in enumerate(types) if x == lt)
        c = cache[idx]  # one prefill chunk: every key is still there, in position order
        k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        k = np.array(k[0].astype(mx.float32), dtype=np.float64)
        v = np.array(v[0].astype(mx.float32), dtype=np.float64)
        assert k.shape[1] == p, (lt, k.shape)
        if lt == SLIDING:
            k, v = k[:, -W:], v[:, -W:]
        donors[lt] = (k, v)
    tok = req["anchor"]
    tokens, logits = [], []
    for _ in range(req["steps"]):
        emb = E[tok] * math.sqrt(B)
        lg, hidden = step_ref(A, cfg, emb, hidden, p, donors)
        tok = int(np.argmax(lg))
        tokens.append(tok)
        logits.append(lg)
    save_file({"tokens": np.array(tokens, dtype=np.int32),
               "logits": np.stack(logits).astype(np.float32)}, out_path)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        args = sys.argv[2:]
        seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 0
        nat = int(args[args.index("--num-assistant-tokens") + 1]) if "--num-assistant-tokens" in args else None
        make(args[0], json.loads(args[1]), seed, nat)
    elif cmd == "step":
        step(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd}")
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
