"""Oracle side of tests/tokenizer_parity.rs.

`build DIR` trains tiny tokenizers with the `tokenizers` library (no downloads, no checked-in
data) and writes one model directory per fixture under DIR. `answer QUERIES.json` answers the
Rust test's queries with mlx-lm 0.32.2 / transformers: prompt ids through the real
`mlx_lm.generate.main()` (model loading and generation stubbed out), chat templates through
mlx-lm's TokenizerWrapper, EOS sets, encode/decode and mlx-lm's streaming detokenizers.
"""
import contextlib
import io
import json
import shutil
import os
import sys
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# ---------------------------------------------------------------------------------------------
# Fixtures


def corpus():
    """Small multilingual text: enough for a few hundred merges, while leaving most CJK and
    emoji characters unmerged so they split across byte-level tokens."""
    lines = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, world! How are you today? I'm fine, thanks.",
        "Machine learning models generate text one token at a time.",
        "Local inference on Apple silicon is fast and private.",
        "She said: \"don't stop\" -- and then she stopped, didn't she?",
        "Café, naïve, façade, crème brûlée, Ångström, São Paulo, Müller, Straße.",
        "El niño comió piñata; la señora habló español.",
        "日本語のテキストも少し含めます。東京は大きな都市です。",
        "中文文本：你好，世界！今天天气很好。",
        "한국어 문장도 조금 있습니다.",
        "Emoji: 😀 🎉 👍 🚀 — smiles and rockets.",
        "def main():\n    print('hello')\n    return 0\n",
        "    indented    text   with     runs of spaces\tand\ttabs\n\n",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2,718",
        "system user assistant model tool function call response",
        "The capital of France is Paris. The capital of Japan is Tokyo.",
        "What is the meaning of life? Forty-two, according to the book.",
    ]
    out = []
    for i in range(40):
        for j, line in enumerate(lines):
            if (i + j) % 3 != 0 or i < 3:
                out.append(line)
    return out


SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

# Qwen3-style: namespace, reversed slicing, python string methods, enable_thinking.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama-3-style: strftime_now, trim, lstrip/trim_blocks on indented block tags.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|im_start|>system\\n\\n" }}
{{- "Year: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|im_end|>" }}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n\\n'+ message['content'] | trim + '<|im_end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n\\n' }}
{%- endif %}
"""

# Llama-3.2 (Meta): strftime_now, tools branches, `in` on messages, `is iterable`.
LLAMA32_TEMPLATE = """{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Block tags on their own indented lines: exercises trim_blocks + lstrip_blocks.
BLOCKS_TEMPLATE = """{% for message in messages %}
  {% if message.role == 'system' %}
    [SYS] {{ message.content }}
  {% else %}
    [{{ message.role | upper }}] {{ message.content }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}
"""

# Python-flavoured value rendering: None/True/False, lists, tojson, slicing, methods.
PYTHONIC_TEMPLATE = """{{ enable_thinking }}|{{ tools }}|{{ documents }}|{{ add_generation_prompt }}
{{ messages | length }}|{{ [1, 'a', none, true] }}|{{ {'k': 'v'} }}|{{ 7 // 2 }}|{{ 7 / 2 }}|{{ 2 ** 10 }}
{{ messages | tojson }}
{{ messages[-1] | tojson(indent=2) }}
{{ {'b': 1, 'a': [1.5, 'x"y', '<&>']} | tojson(sort_keys=true) }}
{% for m in messages %}{{ loop.index }}:{{ m.role | capitalize }}:{{ m.content.strip() }}|{{ m.content | trim }}|{{ m.content[:3] }}|{{ m.content.split() | join(',') }}|{{ m.content.replace(' ', '_') }}|{{ m.content.upper() }}
{% endfor %}{{ messages[0] }}|{% for k, v in messages[0].items() %}{{ k }}={{ v | length }};{% endfor %}{% for k in messages[0] %}{{ k }},{% endfor %}{{ messages[0].get('missing', 'dflt') }}|{{ 'content' in messages[0] }}
{{ undefined_thing }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ sep_token is defined }}|{{ 'x' ~ 1 }}|{{ (messages | selectattr('role', 'equalto', 'user') | list | length) }}
"""

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls %}{% if tc.function is defined %}{% set tc = tc.function %}{% endif %}
<tool_call>
{"name": "{{ tc.name }}", "arguments": {% if tc.arguments is string %}{{ tc.arguments }}{% else %}{{ tc.arguments | tojson }}{% endif %}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% elif not (loop.first and tools and message.role == 'system') %}<|im_start|>{{ message.role }}
{{ message.content }}{% for k, v in message.items() %}{% if k not in ['role', 'content'] %} [{{ k }}={{ v | tojson }}]{% endif %}{% endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

EXTRA_TEMPLATES = {
    "tpl_qwen3": QWEN3_TEMPLATE,
    "tpl_llama3": LLAMA3_TEMPLATE,
    "tpl_llama32": LLAMA32_TEMPLATE,
    "tpl_blocks": BLOCKS_TEMPLATE,
    "tpl_pythonic": PYTHONIC_TEMPLATE,
    "tpl_gemma": GEMMA_TEMPLATE,
    "tpl_tools": TOOLS_TEMPLATE,
}


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")


def byte_level_tokenizer(decoder_wrapped=False):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    data = json.loads(tok.to_str())
    if decoder_wrapped:
        # Same decoding, but a decoder mlx-lm does not recognise: NaiveStreamingDetokenizer.
        data["decoder"] = {"type": "Sequence", "decoders": [data["decoder"]]}
    return data


def spm_tokenizer():
    """A Llama-2 / Gemma style byte-fallback BPE: Prepend+Replace normalizer, no
    pre-tokenizer, the SPM decoder mlx-lm recognises, and a BOS-adding post-processor."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=380, special_tokens=specials, limit_alphabet=70, show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        name = f"<0x{b:02X}>"
        if name not in vocab:
            vocab[name] = len(vocab)
    data["model"]["byte_fallback"] = True
    data["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        ],
    }
    data["pre_tokenizer"] = None
    data["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    bos = vocab["<bos>"]
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<bos>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": "<bos>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<bos>", "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [bos], "tokens": ["<bos>"]}},
    }
    # Round-trip through the library so the file is exactly what it would save.
    return json.loads(Tokenizer.from_str(json.dumps(data)).to_str())


def build(root):
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)

    # smol: SmolLM2-like ChatML, ByteLevel BPE (BPEStreamingDetokenizer), GPT2Tokenizer class.
    d = root / "smol"
    d.mkdir()
    byte_level = byte_level_tokenizer()
    write_json(d / "tokenizer.json", byte_level)
    write_json(
        d / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "pad_token": "<|im_end|>",
            "chat_template": SMOL_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 8192,
            "tokenizer_class": "GPT2Tokenizer",
            "vocab_size": 420,
        },
    )
    write_json(d / "config.json", {"model_type": "llama", "eos_token_id": 2, "bos_token_id": 1})
    write_json(d / "generation_config.json", {"eos_token_id": [2, 0], "bos_token_id": 1})

    # gemma: SPM byte-fallback (SPMStreamingDetokenizer), Gemma template with raise_exception
    # and bos_token, templates given as a list of {name, template}, dict-form special tokens.
    d = root / "gemma"
    d.mkdir()
    spm = spm_tokenizer()
    write_json(d / "tokenizer.json", spm)
    added = lambda c: {
        "__type": "AddedToken",
        "content": c,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    write_json(
        d / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": added("<bos>"),
            "eos_token": added("<eos>"),
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "image_token": "<start_of_turn>",
            "chat_template": [
                {"name": "default", "template": GEMMA_TEMPLATE},
                {"name": "tool_use", "template": "TOOLS {{ messages }}"},
            ],
            "clean_up_tokenization_spaces": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    write_json(d / "config.json", {"model_type": "gemma", "eos_token_id": [1, 5]})

    # naive: ByteLevel behind a Sequence decoder (NaiveStreamingDetokenizer); the template
    # comes from chat_template.jinja, which beats tokenizer_config.json; the EOS token is not
    # in the vocabulary (transformers adds it); generation_config.json is corrupt (ignored).
    d = root / "naive"
    d.mkdir()
    write_json(d / "tokenizer.json", byte_level_tokenizer(decoder_wrapped=True))
    write_json(
        d / "tokenizer_config.json",
        {
            "bos_token": None,
            "eos_token": "</s>",
            "chat_template": "IGNORED {{ messages }}",
            "clean_up_tokenization_spaces": True,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    (d / "chat_template.jinja").write_text(QWEN3_TEMPLATE, encoding="utf-8")
    write_json(d / "config.json", {"model_type": "llama", "eos_token_id": [2, 7]})
    (d / "generation_config.json").write_text("{not json", encoding="utf-8")

    # plain: no chat template at all; special tokens only in special_tokens_map.json (legacy);
    # a post-processor that adds <|endoftext|> in front.
    d = root / "plain"
    d.mkdir()
    plain = json.loads(json.dumps(byte_level))
    eot = plain["model"]["vocab"]["<|endoftext|>"]
    plain["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [eot], "tokens": ["<|endoftext|>"]}
        },
    }
    write_json(d / "tokenizer.json", plain)
    write_json(
        d / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048},
    )
    write_json(
        d / "special_tokens_map.json",
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
    )
    write_json(d / "config.json", {"model_type": "llama", "eos_token_id": 3})
    write_json(d / "generation_config.json", {"eos_token_id": 0})

    # Template zoo: the smol tokenizer with other templates, to compare minijinja and Jinja2.
    for name, template in EXTRA_TEMPLATES.items():
        d = root / name
        d.mkdir()
        write_json(d / "tokenizer.json", byte_level)
        write_json(
            d / "tokenizer_config.json",
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": template,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
        )
        write_json(d / "config.json", {"model_type": "llama", "eos_token_id": 2})
    print("ok")


# ---------------------------------------------------------------------------------------------
# Answers

_LOADED = {}


def load(path):
    """What mlx_lm.utils.load does for the tokenizer, without the weights."""
    from mlx_lm import utils

    key = str(path)
    if key not in _LOADED:
        config = utils.load_config(Path(path))
        tokenizer = utils.load_tokenizer(
            Path(path), {"trust_remote_code": False}, eos_token_ids=config.get("eos_token_id", None)
        )
        _LOADED[key] = (tokenizer, config)
    return _LOADED[key]


def generate_cli_prompt(path, prompt, system, ignore):
    """Runs the real `mlx_lm.generate.main()` and captures the prompt ids it would generate
    from. Only model loading and generation itself are replaced."""
    import importlib

    # `mlx_lm.generate` the attribute is the function; the module is what main() lives in.
    g = importlib.import_module("mlx_lm.generate")

    captured = {}

    def fake_load(model_path, **kwargs):
        tokenizer, config = load(model_path)
        return None, tokenizer, config

    def fake_generate(model, tokenizer, prompt, **kwargs):
        captured["ids"] = list(prompt)
        return ""

    argv = ["mlx_lm.generate", "--model", str(path), f"--prompt={prompt}"]
    if system is not None:
        argv.append(f"--system-prompt={system}")
    if ignore:
        argv.append("--ignore-chat-template")
    old = (g.load, g.generate, sys.argv)
    g.load, g.generate, sys.argv = fake_load, fake_generate, argv
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            g.main()
    finally:
        g.load, g.generate, sys.argv = old
    return captured["ids"]


def stream(tokenizer, ids):
    detok = tokenizer.detokenizer
    segments = []
    for t in ids:
        detok.add_token(t)
        segments.append(detok.last_segment)
    detok.finalize()
    segments.append(detok.last_segment)
    return {"segments": segments, "kind": type(detok).__name__}


def answer(q):
    path = q["dir"]
    op = q["op"]
    try:
        if op == "prompt":
            return {"ids": generate_cli_prompt(path, q["prompt"], q.get("system"), q["ignore"])}
        tokenizer, _ = load(path)
        if op == "info":
            return {
                "eos": sorted(tokenizer.eos_token_ids),
                "has_chat_template": bool(tokenizer.has_chat_template),
                "eos_token_id": tokenizer.eos_token_id,
                "vocab_len": len(tokenizer),
                "detokenizer": type(tokenizer.detokenizer).__name__,
            }
        if op == "render":
            # Dicts built the way mlx-lm builds them: role first, then content.
            messages = [{"role": m["role"], "content": m["content"]} for m in q["messages"]]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=q["add_generation_prompt"]
            )
            return {"text": text}
        if op == "render_tools":
            # Messages as a server receives them (every key, in the client's order) and tools.
            text = tokenizer.apply_chat_template(
                q["messages"], tools=q["tools"], tokenize=False,
                add_generation_prompt=q["add_generation_prompt"],
            )
            return {"text": text}
        if op == "encode":
            return {"ids": tokenizer.encode(q["text"], add_special_tokens=q["add_special_tokens"])}
        if op == "decode":
            return {"text": tokenizer.decode(q["ids"])}
        if op == "stream":
            return stream(tokenizer, q["ids"])
        raise ValueError(f"unknown op {op}")
    except Exception as e:  # the Rust side checks that it fails too
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    cmd = sys.argv[1]
    if cmd == "build":
        build(sys.argv[2])
    elif cmd == "answer":
        queries = json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
        out = [answer(q) for q in queries]
        Path(sys.argv[3]).write_text(json.dumps(out), encoding="utf-8")
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
    # Leave without exit-time destructors: the OpenBLAS bundled with mlx-cpu can deadlock
    # joining its threads there (seen as a hung oracle process after its output was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
