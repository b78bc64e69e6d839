"""mlx-lm 0.32.2's tool-call parsing, for tests/tool_calls.rs.

`python tool_calls.py QUERIES OUT`: QUERIES is a JSON list of {"parser", "text", "tools"};
OUT gets, per query, either {"calls": [...]} -- each call as mlx-lm's server formats it
(`ToolCallFormatter._format`, with the random id left out unless the model gave one) -- or
{"error": ...} where mlx-lm's parser raises ValueError/JSONDecodeError (the server drops
the call), raises anything else or formatting fails (the server fails the request; mlxb drops
the call).

`python tool_calls.py infer QUERIES OUT`: per {"template", "vocab"}, the parser name that
`mlx_lm.tokenizer_utils._infer_tool_parser` picks (or null).

`python tool_calls.py render MODEL_DIR QUERIES OUT`: per {"messages", "tools"}, the prompt
transformers renders with the model's chat template (add_generation_prompt=True), after
mlx-lm's server has parsed each assistant call's JSON-text `arguments`.
"""

import importlib
import json
import os
import sys
from pathlib import Path


def formatted(parser, text, tools):
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    try:
        parsed = module.parse_tool_call(text, tools)
    except (ValueError, json.JSONDecodeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    except Exception as e:  # e.g. OverflowError: mlx-lm's server fails the request; mlxb drops the call
        return {"error": f"{type(e).__name__}: {e}", "uncaught": True}
    if not isinstance(parsed, list):
        parsed = [parsed]
    calls = []
    for tc in parsed:
        try:
            given_id = tc.pop("id", None)
            tc["arguments"] = json.dumps(tc["arguments"], ensure_ascii=False)
        except Exception as e:  # mlx-lm's server fails the request here
            return {"error": f"{type(e).__name__}: {e}"}
        call = {"function": tc, "type": "function"}
        if given_id:
            call["id"] = given_id
        calls.append(call)
    return {"calls": calls}


class FakeTokenizer:
    def __init__(self, template, vocab):
        self.chat_template = template
        self._vocab = {t: i for i, t in enumerate(vocab)}

    def get_vocab(self):
        return self._vocab


def main():
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    if sys.argv[1] == "render":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
        queries = json.loads(Path(sys.argv[3]).read_text(encoding="utf-8"))
        out = []
        for q in queries:
            for m in q["messages"]:
                for tc in m.get("tool_calls") or []:
                    args = tc.get("function", {}).get("arguments")
                    if isinstance(args, str) and args:
                        tc["function"]["arguments"] = json.loads(args)
            out.append(
                tokenizer.apply_chat_template(
                    q["messages"], tools=q["tools"], tokenize=False, add_generation_prompt=True
                )
            )
        Path(sys.argv[4]).write_text(json.dumps(out, ensure_ascii=False), encoding="utf-8")
        return
    if sys.argv[1] == "infer":
        queries = json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
        out = [_infer_tool_parser(FakeTokenizer(q["template"], q["vocab"])) for q in queries]
        Path(sys.argv[3]).write_text(json.dumps(out), encoding="utf-8")
        return
    queries = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    out = [formatted(q["parser"], q["text"], q.get("tools")) for q in queries]
    Path(sys.argv[2]).write_text(json.dumps(out, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
