"""An independent reference of DeepSpec's DSpark inference loop (dspark-spec.md §1, §3), written
from the spec's equations in numpy float64. It shares no code with mlxb's Rust module (nor with
tests/oracle/dspark_ref.py): the target runs in mlx-lm (recomputed from scratch every round,
no caches), the drafter in numpy.

Two commands:

  make TARGET OUT DTYPE SPEC_JSON
      Writes a random DeepSpec-format Qwen3 drafter for TARGET (config.json = a copy of the
      target's config plus DeepSpec's DSpark fields; model.safetensors with DeepSpec's
      unprefixed tensor names, frozen copies of the target's embedding and LM head) in DTYPE
      (f32 or bf16). SPEC_JSON: {"layers", "block_size", "markov_rank", "target_layer_ids",
      "mask_token_id", "seed", "fit": {"prompt_ids": [...], "max_tokens": n}}. With "fit", the
      Markov table W2 W1 is biased towards the bigrams of the target's greedy continuation of
      that prompt, so that drafts are sometimes accepted.

  run REQUEST OUT_DIR
      REQUEST: {"target", "drafter", "prompt_ids", "max_tokens", "eos": [...],
                "runs": [{"prune": "keep-first"|"deepspec"|"survival", "threshold": t}, ...]}
      Writes OUT_DIR/run{i}.jsonl, one JSON object per round in mlxb's `--spec-trace` schema.

The loop, greedy (T = 0):
  prefill: x_n = argmax target(prompt); draft context = the tapped rows of the prompt.
  round (anchor x_p at position p = len(committed) - 1):
    H      = hidden_norm(fc(concat_m h_L[0..p]))                     context features (Eq. 2)
    block  [x_p, MASK x (γ-1)] at positions p..p+γ-1, embedded with the drafter's embed_tokens
    layer  x += o(attn(in_norm(x))); x += mlp(post_norm(x)) with
           Q = rope(q_norm(q(x))) at p.., K = rope(k_norm(k([H; x]))) at (0..p, p..), V = v([H; x]),
           softmax(Q K^T / sqrt(hd)) V, no mask (non-causal)
    U_k    = lm_head(norm(x_k))
    z_k    = U_k + W2 W1[x_{k-1}], x_{-1} = x_p; x_k = argmax z_k                     (Eq. 5)
    c_k    = sigmoid(w [norm(x_k); W1[x_{k-1}]] + b)                                 (Eq. 7)
    prune  keep-first: first k >= 1 with c_k < t; deepspec: first k >= 0 with c_k < t;
           survival: first k with c_0 ... c_k < t; the proposal is x_0..x_{n-1}
    verify target argmax at rows p..p+n; accept the matching prefix a; next = the argmax at
           row p+a; an emitted EOS ends the generation.
The block is capped, as mlxb's executor caps it, at one less than the tokens still to emit (no
draft at all when that is 0).
"""
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model


def f64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rotate(x, positions, theta):
    """RoPE, half-split layout, on x [heads, L, hd] at the given absolute positions."""
    hd = x.shape[-1]
    freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * freq[None, :]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


# ----------------------------------------------------------------------------- target (mlx-lm)


class Target:
    def __init__(self, path):
        self.model, _ = load_model(Path(path))

    def run(self, ids, layer_ids):
        """Greedy picks for every row and the raw outputs of the tapped layers [L, m*d]."""
        x = mx.array(ids)[None]
        logits = self.model(x)
        h = self.model.model.embed_tokens(x)
        taps = {}
        for i, layer in enumerate(self.model.model.layers):
            h = layer(h, "causal", None)
            if i in layer_ids:
                taps[i] = h
        picks = [int(t) for t in np.argmax(f64(logits[0]), axis=-1)]
        return picks, np.concatenate([f64(taps[i][0]) for i in layer_ids], axis=-1)


# ----------------------------------------------------------------------------- drafter (numpy)


class Drafter:
    def __init__(self, path):
        path = Path(path)
        self.c = json.load(open(path / "config.json"))
        assert self.c["architectures"][0] == "Qwen3DSparkModel", self.c["architectures"]
        assert self.c.get("markov_head_type", "vanilla") == "vanilla"
        self.w = {}
        for f in sorted(path.glob("*.safetensors")):
            self.w.update({k: f64(v) for k, v in mx.load(str(f)).items()})
        c = self.c
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.theta = c.get("rope_theta", 10000.0)
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads", self.heads)
        self.hd = c.get("head_dim") or c["hidden_size"] // self.heads
        self.gamma = c["block_size"]
        self.taps = c["target_layer_ids"]

    def linear(self, name, x):
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def split(self, y, n):
        return y.reshape(y.shape[0], n, self.hd).transpose(1, 0, 2)

    def attention(self, i, ctx, x, p):
        a = f"layers.{i}.self_attn"
        g = x.shape[0]
        q = self.split(self.linear(a + ".q_proj", x), self.heads)
        q = rotate(rmsnorm(q, self.w[a + ".q_norm.weight"], self.eps), range(p, p + g), self.theta)
        both = np.concatenate([ctx, x], axis=0)
        pos = list(range(ctx.shape[0])) + list(range(p, p + g))
        k = self.split(self.linear(a + ".k_proj", both), self.kv_heads)
        k = rotate(rmsnorm(k, self.w[a + ".k_norm.weight"], self.eps), pos, self.theta)
        v = self.split(self.linear(a + ".v_proj", both), self.kv_heads)
        group = self.heads // self.kv_heads
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(self.hd)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        return self.linear(a + ".o_proj", out.transpose(1, 0, 2).reshape(g, -1))

    def round(self, ctx_taps, anchor, p):
        """One draft round: γ tokens and their confidences c_k (sigmoid)."""
        ctx = rmsnorm(self.linear("fc", ctx_taps), self.w["hidden_norm.weight"], self.eps)
        ids = [anchor] + [self.c["mask_token_id"]] * (self.gamma - 1)
        x = self.w["embed_tokens.weight"][ids]
        for i in range(self.c["num_hidden_layers"]):
            l = f"layers.{i}"
            x = x + self.attention(i, ctx, rmsnorm(x, self.w[l + ".input_layernorm.weight"], self.eps), p)
            y = rmsnorm(x, self.w[l + ".post_attention_layernorm.weight"], self.eps)
            gate, up = self.linear(l + ".mlp.gate_proj", y), self.linear(l + ".mlp.up_proj", y)
            x = x + self.linear(l + ".mlp.down_proj", gate * sigmoid(gate) * up)
        h = rmsnorm(x, self.w["norm.weight"], self.eps)
        base = h @ self.w["lm_head.weight"].T
        w1 = self.w["markov_head.markov_w1.weight"]
        prev, tokens, conf = anchor, [], []
        for k in range(self.gamma):
            e = w1[prev]
            z = base[k] + self.linear("markov_head.markov_w2", e)
            inp = np.concatenate([h[k], e]) if self.c.get("confidence_head_with_markov", True) else h[k]
            conf.append(float(sigmoid(self.linear("confidence_head.proj", inp)[0])))
            prev = int(np.argmax(z))
            tokens.append(prev)
        return tokens, conf


def surviving(conf, threshold, mode):
    product = 1.0
    for k, c in enumerate(conf):
        product *= c
        score = product if mode == "survival" else c
        if k >= (1 if mode == "keep-first" else 0) and score < threshold:
            return k
    return len(conf)


def generate(target, drafter, prompt, max_tokens, eos, prune, threshold):
    picks, _ = target.run(prompt, drafter.taps)
    seq = list(prompt) + [picks[-1]]
    emitted, rounds = 1, []
    if seq[-1] in eos:
        return rounds
    while emitted < max_tokens:
        p = len(seq) - 1
        cap = min(drafter.gamma, max_tokens - emitted - 1)
        rec = {"prompt": 0, "round": len(rounds), "anchor_pos": p, "anchor": seq[p]}
        proposed = []
        if cap > 0:
            _, taps = target.run(seq[:p], drafter.taps) if p > 0 else (None, None)
            tokens, conf = drafter.round(taps, seq[p], p)
            n = min(surviving(conf, threshold, prune), cap)
            proposed = tokens[:n]
            rec.update(confidence=conf[:n], block_confidence=conf, prune=prune)
        rec["threshold"] = threshold if cap > 0 else None
        rec["proposed"] = proposed
        picks, _ = target.run(seq + proposed, drafter.taps)
        accepted, nxt, stop = 0, None, False
        for i in range(len(proposed) + 1):
            t = picks[p + i]
            emitted += 1
            if t in eos:
                nxt, stop = t, True
                break
            if i == len(proposed) or t != proposed[i]:
                nxt = t
                break
            accepted += 1
        seq += proposed[:accepted] + [nxt]
        rec.update(accepted=accepted, next=nxt)
        rounds.append(rec)
        if stop:
            break
    return rounds


def run(req_path, out_dir):
    req = json.load(open(req_path))
    target, drafter = Target(req["target"]), Drafter(req["drafter"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(req["runs"]):
        rounds = generate(target, drafter, req["prompt_ids"], req["max_tokens"], set(req["eos"]),
                          r["prune"], r["threshold"])
        with open(out / f"run{i}.jsonl", "w") as f:
            for rec in rounds:
                f.write(json.dumps(rec) + "\n")


# ----------------------------------------------------------------------------- make a drafter


def make(target_dir, out_dir, dtype, spec_json):
    spec = json.loads(spec_json)
    tdir, out = Path(target_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tc = json.load(open(tdir / "config.json"))
    tw = {}
    for f in sorted(tdir.glob("model*.safetensors")):
        tw.update({k: f64(v) for k, v in mx.load(str(f)).items()})
    embed = tw["model.embed_tokens.weight"]
    head = tw.get("lm_head.weight", embed)
    V, d = embed.shape
    L, r, gamma = spec["layers"], spec["markov_rank"], spec["block_size"]
    taps = spec["target_layer_ids"]
    H = tc["num_attention_heads"]
    KV = tc.get("num_key_value_heads", H)
    hd = tc.get("head_dim") or d // H
    inter = tc["intermediate_size"]
    rng = np.random.default_rng(spec.get("seed", 0))

    def normal(*shape, std):
        return rng.normal(0.0, std, size=shape)

    def norm_weight(n):
        return 1.0 + 0.1 * rng.normal(size=n)

    w = {
        "embed_tokens.weight": embed.copy(),
        "lm_head.weight": head.copy(),
        "fc.weight": normal(d, len(taps) * d, std=0.08),
        "hidden_norm.weight": norm_weight(d),
        "norm.weight": norm_weight(d),
        "markov_head.markov_w1.weight": normal(V, r, std=0.3),
        "markov_head.markov_w2.weight": normal(V, r, std=0.3),
        "confidence_head.proj.weight": normal(1, d + r, std=1.0 / np.sqrt(d + r)),
        "confidence_head.proj.bias": np.array([0.2]),
    }
    for i in range(L):
        l = f"layers.{i}"
        w.update({
            f"{l}.self_attn.q_proj.weight": normal(H * hd, d, std=0.08),
            f"{l}.self_attn.k_proj.weight": normal(KV * hd, d, std=0.08),
            f"{l}.self_attn.v_proj.weight": normal(KV * hd, d, std=0.08),
            f"{l}.self_attn.o_proj.weight": normal(d, H * hd, std=0.08),
            f"{l}.self_attn.q_norm.weight": norm_weight(hd),
            f"{l}.self_attn.k_norm.weight": norm_weight(hd),
            f"{l}.mlp.gate_proj.weight": normal(inter, d, std=0.08),
            f"{l}.mlp.up_proj.weight": normal(inter, d, std=0.08),
            f"{l}.mlp.down_proj.weight": normal(d, inter, std=0.08),
            f"{l}.input_layernorm.weight": norm_weight(d),
            f"{l}.post_attention_layernorm.weight": norm_weight(d),
        })
    fit = spec.get("fit")
    if fit:
        # Bias W2 W1 towards the target's greedy bigrams: W1[x] gets a code row, W2[next(x)]
        # the same code, scaled.
        target = Target(tdir)
        seq = list(fit["prompt_ids"])
        for _ in range(fit["max_tokens"]):
            picks, _ = target.run(seq, taps)
            seq.append(picks[-1])
        codes = {}
        for a, b in zip(seq[:-1], seq[1:]):
            if a not in codes:
                code = rng.normal(size=r)
                code /= np.linalg.norm(code)
                codes[a] = code
                w["markov_head.markov_w1.weight"][a] = 3.0 * code
                w["markov_head.markov_w2.weight"][b] += 4.0 * code
    c = dict(tc)
    c.update({
        "architectures": ["Qwen3DSparkModel"],
        "num_target_layers": tc["num_hidden_layers"],
        "num_hidden_layers": L,
        "block_size": gamma,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * L,
        "mask_token_id": spec["mask_token_id"],
        "target_layer_ids": taps,
        "num_anchors": 512,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "markov_rank": r,
        "markov_head_type": "vanilla",
        "torch_dtype": {"f32": "float32", "bf16": "bfloat16"}[dtype],
    })
    json.dump(c, open(out / "config.json", "w"), indent=2)
    dt = {"f32": mx.float32, "bf16": mx.bfloat16}[dtype]
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: mx.array(v.astype(np.float32)).astype(dt) for k, v in w.items()},
                        metadata={"format": "pt"})


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"make": make, "run": run}[cmd](*args)
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
