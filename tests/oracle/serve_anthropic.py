"""Drives `mlxb serve`'s `POST /v1/messages` with Anthropic's official Python client and
prints what the client parsed, as one JSON object (tests/serve_anthropic.rs compares it with
the chat route's output for the same prompt).

usage: serve_anthropic.py BASE_URL MODEL PROMPT MAX_TOKENS API_KEY
"""

import json
import sys

import anthropic

base, model, prompt, max_tokens, key = sys.argv[1:6]
max_tokens = int(max_tokens)
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)
messages = [{"role": "user", "content": prompt}]
# The Messages API has no sampling fields: the server's default (greedy) applies.
greedy = {"model": model, "max_tokens": max_tokens}

whole = client.messages.create(messages=messages, **greedy)
text = "".join(b.text for b in whole.content if b.type == "text")

with client.messages.stream(messages=messages, **greedy) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()

# A stop sequence taken from the reply itself.
stop = text[4:7] if len(text) > 8 else None
stopped = None
if stop:
    r = client.messages.create(messages=messages, stop_sequences=[stop], **greedy)
    stopped = {
        "text": "".join(b.text for b in r.content if b.type == "text"),
        "stop_reason": r.stop_reason,
        "stop_sequence": r.stop_sequence,
        "stop": stop,
    }

# An agent's second turn: tools, the assistant's tool_use and the tool_result.
tools = [
    {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
turn = client.messages.create(
    system="You are a weather assistant.",
    tools=tools,
    messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 C, sunny"}],
        },
    ],
    **greedy,
)

try:
    client.messages.create(messages=messages, tools=tools, tool_choice={"type": "any"}, **greedy)
    forced = None
except anthropic.BadRequestError as e:
    forced = {"status": e.status_code, "body": e.body}

print(
    json.dumps(
        {
            "text": text,
            "stop_reason": whole.stop_reason,
            "usage": [whole.usage.input_tokens, whole.usage.output_tokens],
            "id": whole.id,
            "role": whole.role,
            "streamed": streamed,
            "streamed_stop_reason": final.stop_reason,
            "streamed_usage": [final.usage.input_tokens, final.usage.output_tokens],
            "stopped": stopped,
            "tool_turn": {"stop_reason": turn.stop_reason, "types": [b.type for b in turn.content]},
            "forced": forced,
        }
    )
)
