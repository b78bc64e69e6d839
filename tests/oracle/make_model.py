"""Builds a tiny random-weight model with mlx-lm's own classes and saves it with mlx-lm, plus a
small byte-level BPE tokenizer, so tests never need downloaded weights.

usage: python make_model.py OUT_DIR '{"model_type": "llama", ...config...}' [--dtype bf16|f32]
       [--quant-bits 4 --quant-group 64] [--seed 0]
"""
import argparse
import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
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
    model.set_dtype(dtype)
    if a.quant_bits:
        model, config = quantize_model(model, config, a.quant_group, a.quant_bits)
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")


if __name__ == "__main__":
    main()
