"""An agent's tool loop against `mlxb serve`, driven by the official `openai` Python package.

usage: serve_tools.py BASE_URL MODEL

The model is offered a `get_weather` tool and asked a question that needs it; the reply is
read whole and streamed (which must agree: the same content and the same parsed calls), and
the conversation an agent sends back after running the tool (the assistant's call with its
JSON-text arguments, the tool's result) is answered. Prints one JSON object for
tests/gguf_import.rs.
"""

import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0, timeout=900)
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name"}},
                "required": ["city"],
            },
        },
    }
]
question = [{"role": "user", "content": "What is the weather in Paris right now?"}]
greedy = {"model": model, "temperature": 0, "tools": tools}


def call_dict(c):
    return {"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}


whole = client.chat.completions.create(messages=question, max_tokens=48, **greedy)
choice = whole.choices[0]

content, streamed, finish = "", {}, None
for chunk in client.chat.completions.create(
    messages=question, max_tokens=48, stream=True, **greedy
):
    if not chunk.choices:
        continue
    delta = chunk.choices[0].delta
    content += delta.content or ""
    for tc in delta.tool_calls or []:
        entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
        entry["name"] += tc.function.name or ""
        entry["arguments"] += tc.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish

# What an agent sends after running the tool.
followup = question + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
            }
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call_0",
        "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "sunny"}),
    },
]
answer = client.chat.completions.create(messages=followup, max_tokens=48, **greedy)

print(
    json.dumps(
        {
            "question": question,
            "followup": followup,
            "tools": tools,
            "whole": {
                "content": choice.message.content,
                "finish_reason": choice.finish_reason,
                "calls": [call_dict(c) for c in choice.message.tool_calls or []],
                "prompt_tokens": whole.usage.prompt_tokens,
            },
            "streamed": {
                "content": content,
                "finish_reason": finish,
                "calls": [streamed[i] for i in sorted(streamed)],
            },
            "answer": {
                "content": answer.choices[0].message.content,
                "finish_reason": answer.choices[0].finish_reason,
                "prompt_tokens": answer.usage.prompt_tokens,
            },
        }
    )
)
