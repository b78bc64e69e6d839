"""Independent re-computation of DSpark drafter forwards from the spec's equations
(../shared/reference/dspark-spec.md §1, §3), in numpy float64, for tests/dspark.rs.

The target's tapped layer outputs come from mlx-lm's own model (the drafter's inputs); the
drafter itself is written out here from the equations only:
  H      = rms(fc(concat_m h_L))                             context features (Eq. 2)
  K, V   = [k_proj(H); k_proj(x)], [v_proj(H); v_proj(x)]    KV injection (Eq. 3), q/k norm, RoPE
           at absolute positions; the block attends to all context rows and itself, no mask
  U_k    = lm_head(norm(h_k))                                 target head on the post-norm hidden
  markov z_k = U_k + W2 W1[x_{k-1}]                           (Eq. 5)
  rnn    [g, c, o] = joint([s; W1[x]; h]); s' = σ(g)s + (1-σ(g))tanh(c); z = U + W2 tanh(o)
  gated  z_k = U_k + W2(σ(gate([h; W1[x]])) ⊙ W1[x])
  conf   c_k = w [h_k; W1[x_{k-1}]] + b                       (logit, Eq. 7)
with x_{-1} = the anchor and x_k = argmax z_k.

usage: python dspark_ref.py REQUEST.json OUT.safetensors
REQUEST: {"target": dir, "drafter": dir, "prompt_ids": [...],
          "steps": [{"context": n}, ...]}   (step i: context rows 0..n, anchor prompt_ids[n] at n)
OUT: step{i}.{hidden,base_logits,logits,tokens,confidence}
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


def rms(x, w, eps):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rope(x, positions, theta):
    """Half-split (non-traditional) rotation of x [H, L, D] at absolute positions."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def taps_of(model, ids, layer_ids):
    """Raw outputs of the target's decoder layers (residual stream, before the final norm)."""
    h = model.model.embed_tokens(mx.array(ids)[None])
    out = {}
    for i, layer in enumerate(model.model.layers):
        h = layer(h, "causal", None)
        if i in layer_ids:
            out[i] = h
    return np.concatenate([f64(out[i][0]) for i in layer_ids], axis=-1)


class Drafter:
    def __init__(self, ddir, target):
        self.c = json.load(open(Path(ddir) / "dspark.json"))
        self.w = {k: f64(v) for k, v in mx.load(str(Path(ddir) / "model.safetensors")).items()}
        emb = f64(target.model.embed_tokens.weight)
        self.embed = emb
        self.head = f64(target.lm_head.weight) if hasattr(target, "lm_head") else emb

    def lin(self, name, x):
        y = x @ self.w[name + ".weight"].T
        b = self.w.get(name + ".bias")
        return y if b is None else y + b

    def attention(self, i, ctx, x, start):
        c, p = self.c, f"layers.{i}.self_attn"
        H, KV, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        eps, theta = c["rms_norm_eps"], c["rope_theta"]
        n_ctx, g = ctx.shape[0], x.shape[0]

        def heads(y, n):
            return y.reshape(y.shape[0], n, D).transpose(1, 0, 2)

        q = rope(rms(heads(self.lin(p + ".q_proj", x), H), self.w[p + ".q_norm.weight"], eps),
                 range(start, start + g), theta)
        kv_in = np.concatenate([ctx, x], axis=0)
        pos = list(range(n_ctx)) + list(range(start, start + g))
        k = rope(rms(heads(self.lin(p + ".k_proj", kv_in), KV), self.w[p + ".k_norm.weight"], eps),
                 pos, theta)
        v = heads(self.lin(p + ".v_proj", kv_in), KV)
        rep = H // KV
        k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
        s = q @ k.transpose(0, 2, 1) * D ** -0.5
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        return self.lin(p + ".o_proj", o.transpose(1, 0, 2).reshape(g, H * D))

    def block(self, ctx_taps, anchor, start):
        c = self.c
        eps, g = c["rms_norm_eps"], c["block_size"]
        ctx = rms(self.lin("fc", ctx_taps), self.w["hidden_norm.weight"], eps)
        ids = [anchor] + [c["mask_token_id"]] * (g - 1)
        h = self.embed[ids]
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}"
            h = h + self.attention(i, ctx, rms(h, self.w[p + ".input_layernorm.weight"], eps), start)
            x = rms(h, self.w[p + ".post_attention_layernorm.weight"], eps)
            gate, up = self.lin(p + ".mlp.gate_proj", x), self.lin(p + ".mlp.up_proj", x)
            h = h + self.lin(p + ".mlp.down_proj", gate * sigmoid(gate) * up)
        hn = rms(h, self.w["norm.weight"], eps)
        return hn, hn @ self.head.T

    def sample(self, hn, U, anchor):
        c = self.c
        kind, r = c["seq_head"], c["markov_rank"]
        w1 = self.w.get("markov_head.markov_w1.weight")
        prev, s = anchor, np.zeros(r)
        tokens, zs, confs = [], [], []
        for k in range(c["block_size"]):
            h = hn[k]
            e = w1[prev] if w1 is not None else None
            if kind == "markov":
                z = U[k] + self.lin("markov_head.markov_w2", e)
            elif kind == "rnn":
                gco = self.lin("markov_head.joint_proj", np.concatenate([s, e, h]))
                g_, c_, o_ = gco[:r], gco[r : 2 * r], gco[2 * r :]
                s = sigmoid(g_) * s + (1 - sigmoid(g_)) * np.tanh(c_)
                z = U[k] + self.lin("markov_head.markov_w2", np.tanh(o_))
            elif kind == "gated":
                gate = sigmoid(self.lin("markov_head.gate_proj", np.concatenate([h, e])))
                z = U[k] + self.lin("markov_head.markov_w2", gate * e)
            else:
                z = U[k]
            if c.get("confidence_head"):
                inp = np.concatenate([h, e]) if c.get("confidence_head_with_markov") else h
                confs.append(self.lin("confidence_head.proj", inp)[0])
            x = int(np.argmax(z))
            tokens.append(x)
            zs.append(z)
            prev = x
        return np.array(tokens), np.stack(zs), np.array(confs)


def main(req_path, out_path):
    req = json.load(open(req_path))
    target, _ = load_model(Path(req["target"]))
    d = Drafter(req["drafter"], target)
    ids = req["prompt_ids"]
    taps = taps_of(target, ids, d.c["target_layer_ids"])
    out = {}
    for i, step in enumerate(req["steps"]):
        n = step["context"]
        hn, U = d.block(taps[:n], ids[n], n)
        tokens, z, conf = d.sample(hn, U, ids[n])
        for name, a in [("hidden", hn), ("base_logits", U), ("logits", z), ("confidence", conf)]:
            out[f"step{i}.{name}"] = mx.array(a.astype(np.float32))
        out[f"step{i}.tokens"] = mx.array(tokens.astype(np.int32))
    mx.save_safetensors(out_path, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
