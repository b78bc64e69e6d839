"""Builds a tiny random-weight model with mlx-lm's own classes and saves it with mlx-lm, plus a
small byte-level BPE tokenizer, so tests never need downloaded weights.

usage: python make_model.py OUT_DIR '{"model_type": "llama", ...config...}' [--dtype bf16|f32]
       [--quant-bits 4 --quant-group 64] [--seed 0]
"""
import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path
from mlx_lm.utils import quantize_model, save_config, save_model

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Monday, Tuesday, Wednesday, Thursday. "
    "What is the capital of France? Paris is the capital of France. def fibonacci(n): return n "
    "café naïve 東京 😀 1234567890 "
) * 20


def make_tokenizer(out: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(out / "tokenizer.json"))
    template = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    json.dump(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "chat_template": template,
        },
        open(out / "tokenizer_config.json", "w"),
    )
    return tok.get_vocab_size()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("config")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quant-bits", type=int)
    ap.add_argument("--quant-group", type=int, default=64)
    ap.add_argument(
        "--mixed-quant",
        action="store_true",
        help="with --quant-bits: per-layer bits as mlx_lm.convert's quant_predicate gives them "
        "(odd decoder layers at 8 bits, the rest at --quant-bits)",
    )
    ap.add_argument(
        "--kept-mix",
        action="store_true",
        help="with --quant-bits: the mix a GGUF import with --keep-quant gives (odd layers' "
        "v_proj/down_proj and the untied head dense, their other projections at 5 bits, even "
        "layers' o_proj at 8 bits, the rest at --quant-bits)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tokenizer", action="store_true", help="weights only (tiny vocabularies)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(a.config)
    if not a.no_tokenizer:
        n_tok = make_tokenizer(out, min(config["vocab_size"], 320))
        assert n_tok <= config["vocab_size"], (n_tok, config["vocab_size"])
    config.setdefault("eos_token_id", 2)
    # Top-level modules to leave out of the checkpoint (e.g. gemma3's lm_head, so that loading
    # ties the head to the embedding as real gemma3 checkpoints do).
    drop_modules = config.pop("_drop_modules", [])
    # Save the tensors as an unconverted Hugging Face checkpoint would have them, so that loading
    # goes through the model's `sanitize` (see to_hf_layout).
    hf_layout = config.pop("_hf_layout", False)

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(a.seed)
    model = module.Model(args)
    # Wider than the default init so greedy decoding does not collapse at once.
    params = tree_map(lambda p: mx.random.normal(p.shape) * 0.08 if p.ndim > 1 else p, model.parameters())
    # Norm weights: random around 1 so (1+w)-style and plain norms are both exercised.
    flat = dict(tree_flatten(params))
    for k, v in flat.items():
        if v.ndim == 1:
            flat[k] = 1.0 + 0.1 * mx.random.normal(v.shape)
    model.load_weights(list(flat.items()))
    for name in drop_modules:
        model.pop(name)
    dtype = {"bf16": mx.bfloat16, "f32": mx.float32, "f16": mx.float16}[a.dtype]
    # As mlx_lm.convert casts: floating parameters, except where the model's cast_predicate
    # keeps them (qwen3_5's A_log stays float32).
    cast = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    if a.quant_bits:
        predicate = None
        if a.mixed_quant:
            import re

            def predicate(path, module):
                if not hasattr(module, "to_quantized"):
                    return False
                m = re.search(r"layers\.(\d+)\.", path)
                if m and int(m.group(1)) % 2 == 1:
                    return {"group_size": a.quant_group, "bits": 8}
                return True

        if a.kept_mix:
            import re

            def predicate(path, module):
                if not hasattr(module, "to_quantized") or path == "lm_head":
                    return False
                m = re.search(r"layers\.(\d+)\.", path)
                odd = m is not None and int(m.group(1)) % 2 == 1
                if odd and path.endswith(("v_proj", "down_proj")):
                    return False
                if odd:
                    return {"group_size": a.quant_group, "bits": 5}
                if path.endswith("o_proj"):
                    return {"group_size": a.quant_group, "bits": 8}
                return True

        model, config = quantize_model(
            model, config, a.quant_group, a.quant_bits, quant_predicate=predicate
        )
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    if hf_layout:
        for f in out.glob("model*.safetensors"):
            w = to_hf_layout(config, mx.load(str(f)))
            mx.save_safetensors(str(f), w, metadata={"format": "mlx"})


def to_hf_layout(config, w):
    """The inverse of mlx-lm's sanitize for the families that have one: per-expert or fused
    expert tensors, HF conv layout and `w - 1` norms (qwen3_5), HF key prefixes, and the extra
    tensors sanitize drops (MTP / vision heads, KV projections of gemma4's KV-shared layers)."""
    mt = config["model_type"]
    out = {}
    for k, v in w.items():
        if mt == "qwen3_moe" and ".mlp.switch_mlp." in k:
            base, n = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{n}"] = v[e]
            continue
        if mt in ("qwen3_5", "qwen3_5_moe"):
            if "conv1d.weight" in k:
                v = v.moveaxis(2, 1)
            norms = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                     "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
            if v.ndim == 1 and any(k.endswith(s) for s in norms):
                v = v - 1.0
            k = k.replace("language_model.model.", "model.language_model.")
            k = k.replace("language_model.lm_head", "lm_head")
        out[k] = v
    for k in list(out):
        for sw, hf in ((".switch_mlp.", ".experts."), (".experts.switch_glu.", ".experts.")):
            if mt in ("qwen3_5_moe", "gemma4_text") and sw in k and k.endswith("gate_proj.weight"):
                base = k.split(sw)[0]
                up = out.pop(f"{base}{sw}up_proj.weight")
                out[f"{base}{hf}gate_up_proj"] = mx.concatenate([out.pop(k), up], axis=-2)
                out[f"{base}{hf}down_proj"] = out.pop(f"{base}{sw}down_proj.weight")
    if mt in ("qwen3_5", "qwen3_5_moe"):
        out["mtp.fc.weight"] = mx.zeros((4, 4))
        out["model.visual.patch_embed.weight"] = mx.zeros((4, 4))
    if mt == "gemma4_text" and config.get("num_kv_shared_layers", 0) > 0:
        last = config["num_hidden_layers"] - 1
        out[f"model.layers.{last}.self_attn.k_proj.weight"] = mx.zeros((4, 4))
        out[f"model.layers.{last}.self_attn.rotary_emb.inv_freq"] = mx.zeros((4,))
    return out


if __name__ == "__main__":
    main()
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
