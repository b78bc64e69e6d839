"""Independent reference computations for mlxb's GGUF importer (tests/gguf_import.rs).

Everything here comes from the `gguf` Python package (llama.cpp's own reader and numpy
dequantizers), the `regex` module and `sentencepiece`, never from mlxb's output:

  reference GGUF OUT_DIR [DIR] -- NAME...
                                         one pass over the file (gguf's reader is slow on big
                                         vocabularies): `vocab` below into OUT_DIR/vocab.json and
                                         `dequant` into OUT_DIR/tensors.safetensors
  dequant GGUF OUT.safetensors NAME...   tensors dequantized by gguf.quants.dequantize (f32, GGUF
                                         shape reversed like MLX), plus, where the importer must
                                         transform them, the expected output (`hf:` prefix: llama
                                         Q/K rows un-permuted, gemma norms minus one)
  blocks OUT_DIR                         random blocks of every supported type, their raw bytes
                                         and gguf's dequantization (`<TYPE>.bin`, `<TYPE>.f32`)
  vocab GGUF OUT.json [DIR]              the vocabulary as the importer must spell it, and token
                                         ids of test strings from a reference tokenizer: a plain
                                         BPE with llama.cpp's pre-tokenizer regexes (gpt2 vocab),
                                         or SentencePiece itself built from the GGUF (llama vocab);
                                         with DIR, also mlx-lm's encodings (with special tokens)
                                         and chat-prompt ids on the imported directory
  craft KIND OUT.gguf                    small invalid GGUFs (unsupported arch / tensor type)
"""

import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers: 12345 and 3.14159, year 2024!",
    "  leading spaces and    multiple   spaces  ",
    "tabs\tand\nnewlines\n\n\nend",
    "unicode: café, naïve, Zürich, 東京, Ελληνικά, 🙂👍",
    "code: def f(x):\n    return x**2  # square",
    "Monday, Tuesday, Wednesday,",
    "What is the capital of France?",
    "don't won't it's I'm you're they've we'll he'd",
    "<b>HTML</b> &amp; e-mail: someone@example.com",
]


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def dequant(r, out, names):
    from safetensors.numpy import save_file

    arch = field(r, "general.architecture")
    by_name = {t.name: t for t in r.tensors}
    tensors = {}
    for name in names:
        t = by_name[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        tensors[name] = w
        hf = w
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = field(r, "llama.attention.head_count")
            if name.split(".")[-2] == "attn_k":
                heads = field(r, "llama.attention.head_count_kv") or heads
            # llama.cpp permuted rows [h][2][j] → [h][j][2]; undo it (transformers' reverse_permute).
            dim = w.shape[0] // heads // 2
            hf = w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
        if arch == "gemma3" and name.endswith("norm.weight"):
            hf = w - np.float32(1.0)
        if hf is not w:
            tensors["hf:" + name] = np.ascontiguousarray(hf, dtype=np.float32)
    save_file(tensors, out)


def blocks(out_dir):
    rng = np.random.default_rng(1234)
    kinds = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16]
    for kind in kinds:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        n_blocks = 64
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        # Keep every f16/bf16 field finite: random bytes may spell inf/NaN, which no real file has.
        if kind in (T.F16, T.BF16):
            raw = raw.reshape(-1, 2)
            raw[:, 1] &= 0x3F  # small exponent, either sign bit cleared
            raw = raw.reshape(n_blocks, size)
        else:
            for off in f16_offsets(kind):
                raw[:, off + 1] &= 0x3F  # |x| < 2, finite
                raw[:, off + 1] |= rng.integers(0, 2, size=n_blocks, dtype=np.uint8) << 7
        ref = gguf.quants.dequantize(raw.reshape(-1), kind).astype(np.float32).reshape(-1)
        raw.tofile(f"{out_dir}/{kind.name}.bin")
        ref.tofile(f"{out_dir}/{kind.name}.f32")


def f16_offsets(kind):
    return {
        T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
        T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    }[kind]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def llama_cpp_split(text, regexes):
    """llama.cpp's unicode_regex_split: each regex cuts every piece into matches and gaps."""
    import regex

    pieces = [text]
    for rx in regexes:
        pat = regex.compile(rx)
        nxt = []
        for p in pieces:
            pos = 0
            for m in pat.finditer(p):
                if m.start() > pos:
                    nxt.append(p[pos:m.start()])
                if m.end() > m.start():
                    nxt.append(m.group())
                pos = m.end()
            if pos < len(p):
                nxt.append(p[pos:])
        pieces = nxt
    return pieces


GPT2_RX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 (single digits; contractions in either case).
QWEN2_RX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_REGEXES = {"smollm": [r"\p{N}", GPT2_RX], "default": [GPT2_RX], "gpt2": [GPT2_RX], "qwen2": [QWEN2_RX]}
# Pre-tokenizers whose Hugging Face tokenizer composes Unicode first.
NFC_PRE = {"qwen2"}


def bpe_encode(text, vocab, ranks, pre):
    enc = bytes_to_unicode()
    ids = []
    if pre in NFC_PRE:
        import unicodedata

        text = unicodedata.normalize("NFC", text)
    for piece in llama_cpp_split(text, PRE_REGEXES[pre]):
        word = [enc[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get((word[i], word[i + 1]), None), i) for i in range(len(word) - 1)]
            pairs = [p for p in pairs if p[0] is not None]
            if not pairs:
                break
            _, i = min(pairs)
            word = word[:i] + [word[i] + word[i + 1]] + word[i + 2:]
        ids.extend(vocab[w] for w in word)
    return ids


# Texts only a Qwen2 tokenizer is asked about: a decomposed accent (its NFC normalizer composes
# it first), digits, and the chat/tool markers it must keep whole.
QWEN2_TEXTS = [
    "cafe\u0301 or caf\u00e9? Ame\u0301lie",
    "x = 1234567890 + 3.14",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>{\"name\": \"f\"}</tool_call>",
]


def transformers_qwen2_ids(tokens, merges, types, texts):
    """transformers' own Qwen2Tokenizer (NFC, its split regex, byte-level BPE) built from the
    GGUF's vocabulary and merges, its control/user-defined tokens added as the GGUF marks them."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)},
                         merges=[tuple(m.split(" ")) for m in merges])
    tok.add_tokens([AddedToken(tokens[i], special=int(k) == 3, normalized=False)
                    for i, k in enumerate(types) if int(k) in (3, 4)])
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def spm_model(tokens, scores, types, unk_id):
    from sentencepiece import sentencepiece_model_pb2 as pb
    import sentencepiece as spm

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = unk_id
    m.trainer_spec.vocab_size = len(tokens)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    kinds = {1: pb.ModelProto.SentencePiece.NORMAL, 2: pb.ModelProto.SentencePiece.UNKNOWN,
             3: pb.ModelProto.SentencePiece.CONTROL, 4: pb.ModelProto.SentencePiece.USER_DEFINED,
             5: pb.ModelProto.SentencePiece.UNUSED, 6: pb.ModelProto.SentencePiece.BYTE}
    for i, (t, s, k) in enumerate(zip(tokens, scores, types)):
        p = m.pieces.add()
        p.piece = t
        p.score = float(s)
        p.type = pb.ModelProto.SentencePiece.UNKNOWN if i == unk_id else kinds.get(int(k), pb.ModelProto.SentencePiece.NORMAL)
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return sp


def vocab(r, out, model_dir=None):
    kind = field(r, "tokenizer.ggml.model")
    raw = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    result = {"kind": kind, "texts": TEXTS}
    if kind == "gpt2":
        tokens = raw
        vocab_ids = {t: i for i, t in enumerate(tokens)}
        ranks = {tuple(m.split(" ")): i for i, m in enumerate(field(r, "tokenizer.ggml.merges"))}
        pre = field(r, "tokenizer.ggml.pre") or "default"
        result["ids"] = [bpe_encode(t, vocab_ids, ranks, pre) for t in TEXTS]
        if pre == "qwen2":
            texts = TEXTS + QWEN2_TEXTS
            result["transformers_texts"] = texts
            result["transformers_ids"] = transformers_qwen2_ids(
                tokens, field(r, "tokenizer.ggml.merges"), types, texts)
    else:
        tokens = [t.replace(" ", "\u2581") for t in raw]
        sp = spm_model(tokens, field(r, "tokenizer.ggml.scores"), types, field(r, "tokenizer.ggml.unknown_token_id"))
        result["ids"] = [sp.encode(t) for t in TEXTS]
    result["tokens"] = tokens
    if model_dir is not None:
        from mlx_lm.utils import load_tokenizer

        tok = load_tokenizer(model_dir)
        result["mlx_lm_ids"] = [tok.encode(t) for t in TEXTS]
        result["mlx_lm_eos"] = sorted(tok.eos_token_ids)
        if tok.chat_template:
            msgs = [{"role": "user", "content": "What is the capital of France?"}]
            result["mlx_lm_chat_ids"] = tok.apply_chat_template(msgs, add_generation_prompt=True)
    with open(out, "w") as f:
        json.dump(result, f, ensure_ascii=False)


def craft(kind, out):
    arch = "mamba" if kind == "arch" else "llama"
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_token_merges(["a b"])
    if kind == "type":
        block, size = gguf.GGML_QUANT_SIZES[T.IQ2_XXS]
        data = np.zeros((256, 256 // block * size), dtype=np.uint8)
        w.add_tensor("token_embd.weight", data, raw_dtype=T.IQ2_XXS)
    else:
        w.add_tensor("token_embd.weight", np.zeros((256, 256), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "reference":
        split = args.index("--")
        head, names = args[:split], args[split + 1:]
        reader = gguf.GGUFReader(head[0])
        vocab(reader, f"{head[1]}/vocab.json", *head[2:])
        dequant(reader, f"{head[1]}/tensors.safetensors", names)
    else:
        {"dequant": lambda: dequant(gguf.GGUFReader(args[0]), args[1], args[2:]), "blocks": lambda: blocks(args[0]),
         "vocab": lambda: vocab(gguf.GGUFReader(args[0]), *args[1:]), "craft": lambda: craft(args[0], args[1])}[cmd]()
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
