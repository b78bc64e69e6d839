"""Extra seed shapes for the fuzz corpora (imported by scripts/fuzz.sh's seed step).

The first seeds were one byte-level BPE tokenizer and one config.json per family; the fuzzer
then had to find every other tokenizer model, normalizer, pre-tokenizer, decoder and
post-processor, and every rope-scaling or nested-config form, a byte at a time, and still found
new edges in those after hours. These seeds hand it each shape that real model repositories
ship, built here by the `tokenizers` library itself (tiny vocabularies), so fuzzing starts
from every branch a real file takes and spends its time on the malformed variants.
"""

import json

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

TEXT = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France?",
    "Paris is the capital of France. def fibonacci(n): return n if n < 2 else n - 1",
    "café naïve 東京 😀 1234567890 Hello, world! ÀÉÎÕÜ\tTabs  and   spaces\n",
] * 8

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # what the trainers reserve ids 0-3 for


def _trained(model, trainer, **parts):
    tok = Tokenizer(model)
    for name, value in parts.items():
        setattr(tok, name, value)
    tok.train_from_iterator(TEXT, trainer)
    return tok


def tokenizers_by_shape():
    """(name, tokenizer.json bytes) for the tokenizer families real repositories ship beyond the
    byte-level and SentencePiece-style BPEs of the tokenizer-parity fixtures, which fuzz.sh
    seeds from too (tests/oracle/tokenizer.py, with their tokenizer_config.json forms and
    real chat templates)."""
    out = []
    # BERT WordPiece: its normalizer, pre-tokenizer, processor and decoder.
    tok = _trained(
        models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=20),
        trainers.WordPieceTrainer(
            vocab_size=150,
            special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"],
            show_progress=False,
        ),
        normalizer=normalizers.BertNormalizer(lowercase=True, strip_accents=True),
        pre_tokenizer=pre_tokenizers.BertPreTokenizer(),
        decoder=decoders.WordPiece(prefix="##"),
    )
    tok.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    out.append(("wordpiece", tok))
    # Unigram with Metaspace (T5, XLNet-style).
    tok = _trained(
        models.Unigram(),
        trainers.UnigramTrainer(
            vocab_size=90, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False
        ),
        normalizer=normalizers.Sequence(
            [normalizers.NFKC(), normalizers.Strip(), normalizers.Replace("  ", " ")]
        ),
        pre_tokenizer=pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
        decoder=decoders.Metaspace(replacement="▁", prepend_scheme="first"),
    )
    out.append(("unigram", tok))
    # WordLevel on whitespace, with lowercasing and accent stripping.
    tok = _trained(
        models.WordLevel(unk_token="<unk>"),
        trainers.WordLevelTrainer(vocab_size=80, special_tokens=SPECIALS, show_progress=False),
        normalizer=normalizers.Sequence(
            [normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()]
        ),
        pre_tokenizer=pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
        ),
    )
    out.append(("wordlevel", tok))
    # Byte-level BPE behind a GPT-4-style split regex and single digits (Llama 3, Qwen).
    tok = _trained(
        models.BPE(ignore_merges=True),
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|begin_of_text|>", "<|eot_id|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
        normalizer=normalizers.NFC(),
        pre_tokenizer=pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(
                    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                    behavior="isolated",
                ),
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        decoder=decoders.ByteLevel(),
    )
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                special_tokens=[("<|begin_of_text|>", 0)],
            ),
        ]
    )
    out.append(("split-bytelevel", tok))
    # BPE with an end-of-word suffix (CLIP, the original GPT) and RoBERTa's post-processor.
    tok = _trained(
        models.BPE(dropout=None, end_of_word_suffix="</w>"),
        trainers.BpeTrainer(
            vocab_size=150, special_tokens=SPECIALS, end_of_word_suffix="</w>", show_progress=False
        ),
        pre_tokenizer=pre_tokenizers.Sequence(
            [pre_tokenizers.Whitespace(), pre_tokenizers.UnicodeScripts()]
        ),
        decoder=decoders.BPEDecoder(suffix="</w>"),
    )
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 1))
    out.append(("bpe-suffix", tok))
    return [(name, tok.to_str().encode()) for name, tok in out]


def model_configs(base):
    """(name, config.json) variants: rope scalings, nested text configs, sliding layers."""
    heads = {"head_dim": 16}
    ropes = {
        "linear": {"type": "linear", "factor": 2.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "mrope": {"type": "mrope", "mrope_section": [2, 3, 3]},
    }
    out = []
    for name, scaling in ropes.items():
        out.append((f"llama-rope-{name}", dict(base, rope_scaling=scaling)))
        out.append((f"qwen2-rope-{name}", dict(base, model_type="qwen2", rope_scaling=scaling)))
    out.append(("llama-untied-traditional",
                dict(base, tie_word_embeddings=False, rope_traditional=True, attention_bias=True,
                     mlp_bias=True, max_position_embeddings=128)))
    out.append(("mistral-layer-types",
                dict(base, model_type="mistral", sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"])))
    out.append(("gemma4-shared-kv",
                dict(base, model_type="gemma4_text", global_head_dim=32, sliding_window=8,
                     num_hidden_layers=4, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                     vocab_size_per_layer_input=base["vocab_size"],
                     layer_types=["sliding_attention", "full_attention"] * 2,
                     final_logit_softcapping=30.0, **heads)))
    out.append(("qwen3-moe-sparse",
                dict(base, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[0],
                     norm_topk_prob=False, rope_theta=1e6,
                     max_position_embeddings=128, **heads)))
    out.append(("qwen3_5-nested",
                {"model_type": "qwen3_5",
                 "text_config": dict(base, model_type="qwen3_5_text", full_attention_interval=2,
                                     layer_types=["linear_attention", "full_attention"],
                                     linear_num_value_heads=4, linear_num_key_heads=2,
                                     linear_key_head_dim=16, linear_value_head_dim=16,
                                     linear_conv_kernel_dim=4,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                      "partial_rotary_factor": 0.25,
                                                      "mrope_section": [11, 11, 10]},
                                     **heads)}))
    out.append(("qwen3_5_moe-nested",
                {"model_type": "qwen3_5_moe",
                 "text_config": dict(base, layer_types=["linear_attention", "full_attention"],
                                     full_attention_interval=2, num_experts=4, num_experts_per_tok=1,
                                     moe_intermediate_size=32,
                                     shared_expert_intermediate_size=32, **heads)}))
    out.append(("llama-quant-mixed",
                dict(base, quantization={"group_size": 32, "bits": 8, "mode": "affine",
                                         "model.layers.0.self_attn.q_proj": False,
                                         "lm_head": {"group_size": 64, "bits": 6}},
                     quantization_config={"group_size": 32, "bits": 8})))
    return out


def as_json(value):
    return json.dumps(value).encode()
