"""Drives `mlxb serve` with the official `openai` Python package (pinned in
scripts/requirements-oracle.txt) and prints what the client parsed, as one JSON object.

usage: serve_openai.py BASE_URL MODEL PROMPT MAX_TOKENS

The Rust test (tests/serve_openai.rs) compares the texts and ids with `mlxb generate`;
this script checks only what needs the client's own objects: streams concatenate to the
non-streamed text, `usage` and `logprobs` parse, a repeated prompt reports cached tokens.
"""

import json
import sys

import openai

base, model, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0, timeout=120)
messages = [{"role": "user", "content": prompt}]
greedy = {"model": model, "max_tokens": max_tokens, "temperature": 0}

models = [m.id for m in client.models.list().data]

chat = client.chat.completions.create(
    messages=messages, logprobs=True, top_logprobs=2, **greedy
)
chat_again = client.chat.completions.create(messages=messages, **greedy)
choice = chat.choices[0]
lp = choice.logprobs.content
assert len(lp) == chat.usage.completion_tokens or choice.finish_reason == "stop", (
    len(lp),
    chat.usage,
)
for entry in lp:
    assert len(entry.top_logprobs) == 2, entry
    assert entry.logprob == entry.top_logprobs[0].logprob, entry  # greedy: the best one

stream = client.chat.completions.create(
    messages=messages, stream=True, stream_options={"include_usage": True}, **greedy
)
pieces, stream_usage, stream_finish = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        stream_usage = chunk.usage
    for c in chunk.choices:
        pieces.append(c.delta.content or "")
        stream_finish = c.finish_reason or stream_finish

comp = client.completions.create(prompt=prompt, logprobs=1, **greedy)
comp_stream = client.completions.create(prompt=prompt, stream=True, **greedy)
comp_pieces = [c.choices[0].text for c in comp_stream if c.choices]

try:
    client.chat.completions.create(messages=messages, model="/etc/passwd", max_tokens=2)
    wrong_model = None
except openai.BadRequestError as e:
    wrong_model = {"status": e.status_code, "param": e.body.get("param")}

print(
    json.dumps(
        {
            "models": models,
            "chat_text": choice.message.content,
            "chat_finish": choice.finish_reason,
            "chat_usage": chat.usage.model_dump(),
            "chat_again_text": chat_again.choices[0].message.content,
            "chat_again_cached": chat_again.usage.prompt_tokens_details.cached_tokens,
            "chat_logprobs": [e.logprob for e in lp],
            "chat_stream_text": "".join(pieces),
            "chat_stream_finish": stream_finish,
            "chat_stream_usage": stream_usage.model_dump() if stream_usage else None,
            "comp_text": comp.choices[0].text,
            "comp_logprobs": comp.choices[0].logprobs.token_logprobs,
            "comp_usage": comp.usage.model_dump(),
            "comp_stream_text": "".join(comp_pieces),
            "wrong_model": wrong_model,
        }
    )
)
