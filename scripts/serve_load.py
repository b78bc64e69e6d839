#!/usr/bin/env python3
"""Bounded load / soak driver for `mlxb serve` on loopback.

Starts `mlxb serve --port 0 [SERVER ARGS]` itself (so it knows the pid for RSS), computes
the expected greedy text of every (prompt, endpoint) pair with one non-streamed request at a
time, then runs N concurrent clients for S seconds: a seeded mix of chat and completions,
streamed and not, all at temperature 0 with a fixed small prompt set. With --soak, some
streams are cancelled midway and some requests are malformed (each must get a 4xx).
/health is polled throughout. Prints one JSON report.

A stream is corrupted when its concatenated deltas differ from the expected text; a
non-streamed answer likewise. Usage:

  scripts/serve_load.py --clients 8 --duration 60 [--soak] [--mlxb target/release/mlxb] \
      [--max-tokens 32] [--seed 0] -- [mlxb serve args, e.g. --draft-kind ngram]

With --baseline mlx-lm it instead measures throughput side by side: mlxb's server, then
`mlx_lm server` on the same model directory (one at a time, so they never share the cores),
each under 1, 4, 8 and 32 concurrent clients (--clients-list) sending streamed chat
completions of the eight LOAD_PROMPTS back to back for --duration seconds. It prints a Markdown
table (or JSON with --json) of aggregate generated tokens/s, time to first token and
inter-token latency p50/p99, and the mlxb/mlx-lm throughput ratio; every answer is checked
against the same server's answer to the prompt alone.

  scripts/serve_load.py --baseline mlx-lm --model ~/.cache/mlxb/models/smollm2-135m-instruct \
      [--clients-list 1,4,8,32] [--duration 30] [--max-tokens 64] -- [mlxb serve args]

--arms measures several mlxb configurations in turn (each an extra set of `mlxb serve` flags,
separated by ';'; an empty one adds none), each row with its ratio to mlx-lm and to the first
arm, e.g. drafting against none: --arms ';--draft-kind ngram;--drafter default'.

With --multi-turn TURNS, each client instead holds new conversations of TURNS turns over a
system note of their own (about 650 tokens), each turn sent with the conversation so far, as
chat clients do; every answer is afterwards asked again alone and must match, and the table
also gives the prompt tokens each server reported as cached.
"""

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

import httpx

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors.",
    "Explain what a CPU does in one sentence.",
    "Say hello in Spanish.",
    "What is 2 + 2?",
]
LOAD_PROMPTS = PROMPTS + ["Name a planet in the solar system.", "Give me a synonym for happy."]
MALFORMED = [
    ("/v1/chat/completions", "{not json"),
    ("/v1/chat/completions", json.dumps({"messages": "hi"})),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -1})),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 10**9})),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "/etc/passwd"})),
    ("/v1/completions", json.dumps({"prompt": [10**9]})),
]


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def body_for(endpoint, prompt, max_tokens, stream):
    b = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    return b


def path_of(endpoint):
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def text_of(choice, endpoint, stream):
    if endpoint == "chat":
        part = choice.get("delta" if stream else "message") or {}
        return part.get("content") or ""
    return choice.get("text") or ""


class Stats:
    def __init__(self):
        self.counts = {}
        self.ttft = []
        self.itl = []
        self.tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.corrupted = 0
        self.server_5xx = 0
        self.examples = []

    def count(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1

    def fail(self, key, detail):
        self.count(key)
        if len(self.examples) < 10:
            self.examples.append(f"{key}: {detail}"[:300])


async def read_stream(r, endpoint, st, sent, cancel_after=None):
    """Reads an SSE completion stream, recording TTFT and inter-token gaps in `st`. Returns
    (text, usage, saw [DONE], error event); text is None when it stopped after `cancel_after`
    text chunks on purpose."""
    text, last, chunks, usage, done, error = "", None, 0, None, False, None
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        v = json.loads(data)
        if "error" in v:
            error = v["error"]
            continue
        if v.get("usage"):
            usage = v["usage"]
        for c in v.get("choices", []):
            piece = text_of(c, endpoint, True)
            if piece:
                now = time.perf_counter()
                if last is None:
                    st.ttft.append(now - sent)
                else:
                    st.itl.append(now - last)
                last = now
                text += piece
                chunks += 1
        if cancel_after is not None and chunks >= cancel_after:
            return None, usage, False, None
    return text, usage, done, error


async def one_request(client, st, rng, expected, args, deadline):
    endpoint = rng.choice(["chat", "completions"])
    prompt = rng.choice(PROMPTS)
    stream = rng.random() < 0.6
    roll = rng.random()
    if args.soak and roll < 0.1:
        path, raw = rng.choice(MALFORMED)
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        if 400 <= r.status_code < 500 and "error" in r.json():
            st.count("malformed_rejected_4xx")
        else:
            st.server_5xx += r.status_code >= 500
            st.fail("malformed_not_rejected", f"{r.status_code} {r.text}")
        return
    cancel_after = rng.randint(1, 4) if (args.soak and stream and roll < 0.2) else None
    want = expected[(endpoint, prompt)]
    body = body_for(endpoint, prompt, args.max_tokens, stream)
    sent = time.perf_counter()
    if not stream:
        r = await client.post(path_of(endpoint), json=body)
        if r.status_code != 200:
            st.server_5xx += r.status_code >= 500
            st.fail(f"http_{r.status_code}", r.text)
            return
        v = r.json()
        if text_of(v["choices"][0], endpoint, False) != want:
            st.corrupted += 1
            st.fail("corrupted_whole", v["choices"][0])
            return
        st.tokens += v["usage"]["completion_tokens"]
        st.count("ok_whole")
        return
    async with client.stream("POST", path_of(endpoint), json=body) as r:
        if r.status_code != 200:
            await r.aread()
            st.server_5xx += r.status_code >= 500
            st.fail(f"http_{r.status_code}", r.text)
            return
        text, usage, done, error = await read_stream(r, endpoint, st, sent, cancel_after)
        if cancel_after is not None and not done and error is None and text is None:
            st.count("cancelled_midstream")
            return  # leaving the block closes the connection mid-stream
        if error is not None:
            st.server_5xx += 1
            st.fail("stream_error_event", error)
        elif not done:
            st.fail("stream_truncated", text)
        elif text != want:
            st.corrupted += 1
            st.fail("corrupted_stream", f"{text!r} != {want!r}")
        else:
            st.tokens += (usage or {}).get("completion_tokens", 0)
            st.count("ok_stream")


async def client_loop(i, client, st, expected, args, deadline):
    rng = random.Random(args.seed * 1000 + i)
    while time.monotonic() < deadline:
        try:
            await one_request(client, st, rng, expected, args, deadline)
        except (httpx.TimeoutException, httpx.TransportError) as e:
            st.fail(f"transport_{type(e).__name__}", str(e))


async def poll_health(client, pid, deadline, out):
    while time.monotonic() < deadline:
        t = time.perf_counter()
        try:
            r = await client.get("/health", timeout=10)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        out["polls"] += 1
        out["failures"] += not ok
        out["max_latency_s"] = max(out["max_latency_s"], time.perf_counter() - t)
        out["rss_peak_kib"] = max(out["rss_peak_kib"], rss_kib(pid) or 0)
        await asyncio.sleep(0.5)


async def run(args, url, pid):
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        expected = {}
        for endpoint in ["chat", "completions"]:
            for p in PROMPTS:
                r = await client.post(path_of(endpoint), json=body_for(endpoint, p, args.max_tokens, False))
                r.raise_for_status()
                expected[(endpoint, p)] = text_of(r.json()["choices"][0], endpoint, False)
        rss_before = rss_kib(pid)
        st = Stats()
        health = {"polls": 0, "failures": 0, "max_latency_s": 0.0, "rss_peak_kib": rss_before}
        start = time.monotonic()
        deadline = start + args.duration
        await asyncio.gather(
            poll_health(client, pid, deadline, health),
            *(client_loop(i, client, st, expected, args, deadline) for i in range(args.clients)),
        )
        elapsed = time.monotonic() - start
        await asyncio.sleep(1.0)
        metrics = (await client.get("/metrics")).text
        rss_after = rss_kib(pid)
    ms = lambda x: None if x is None else round(x * 1e3, 1)  # noqa: E731
    failed = {k: v for k, v in st.counts.items() if not (k.startswith("ok_") or k in ("cancelled_midstream", "malformed_rejected_4xx"))}
    return {
        "clients": args.clients,
        "duration_s": round(elapsed, 1),
        "soak": args.soak,
        "server_args": args.server_args,
        "max_tokens": args.max_tokens,
        "requests_ok": {k: v for k, v in st.counts.items() if k.startswith("ok_")},
        "requests_expected_outcome": {k: st.counts[k] for k in ("cancelled_midstream", "malformed_rejected_4xx") if k in st.counts},
        "requests_failed": failed,
        "server_5xx": st.server_5xx,
        "corrupted": st.corrupted,
        "generated_tokens": st.tokens,
        "throughput_tok_s": round(st.tokens / elapsed, 1),
        "ttft_ms_p50": ms(percentile(st.ttft, 50)),
        "ttft_ms_p99": ms(percentile(st.ttft, 99)),
        "itl_ms_p50": ms(percentile(st.itl, 50)),
        "itl_ms_p99": ms(percentile(st.itl, 99)),
        "health": {**health, "max_latency_s": round(health["max_latency_s"], 3)},
        "rss_kib_before": rss_before,
        "rss_kib_after": rss_after,
        "server_aborted_total": metric(metrics, "mlxb:request_aborted_total"),
        "server_failure_total": metric(metrics, "mlxb:request_failure_total"),
        "server_cached_prompt_tokens": metric(metrics, "mlxb:prompt_tokens_cached_total"),
        "server_spec_drafts": metric(metrics, "mlxb:spec_decode_num_drafts_total"),
        "server_spec_draft_tokens": metric(metrics, "mlxb:spec_decode_num_draft_tokens_total"),
        "server_spec_accepted_tokens": metric(metrics, "mlxb:spec_decode_num_accepted_tokens_total"),
        "server_block_widths": {w: metric(metrics, f'mlxb:spec_decode_block_width_total{{width="{w}"}}') for w in range(1, 9)},
        "examples": st.examples,
    }


COLORS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
QUESTIONS = [
    "How many marbles are in the red box?",
    "Which box holds the most marbles?",
    "Summarize the note in one sentence.",
    "Which colors does the note mention?",
    "How many boxes are there?",
    "Is any box empty?",
]


def conversation(k, turns):
    """Conversation k of the multi-turn load: a system note of its own (about 650 tokens) and
    `turns` questions about it."""
    facts = [f"Fact {j} of note {k}: the {COLORS[(j + k) % len(COLORS)]} box number {j} holds "
             f"{(j * 7 + k * 3) % 100} marbles." for j in range(30)]
    return " ".join(facts), [QUESTIONS[(k + t) % len(QUESTIONS)] for t in range(turns)]


def turn_messages(system, questions, replies, t):
    """The messages of turn t: the note, the earlier questions and replies, question t."""
    m = [{"role": "system", "content": system}]
    for q, a in zip(questions[:t], replies[:t]):
        m += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return m + [{"role": "user", "content": questions[t]}]


async def load_request(client, st, messages, want, max_tokens):
    """One streamed chat completion of `messages` (a prompt string: one user message); records
    TTFT, inter-token gaps, tokens and cached prompt tokens, checks the text against `want`
    (unless None) and returns it (None on failure)."""
    body = body_for("chat", "", max_tokens, True)
    body["messages"] = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    prompt = messages if isinstance(messages, str) else messages[-1]["content"]
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            st.fail(f"http_{r.status_code}", r.text)
            return None
        text, usage, _, error = await read_stream(r, "chat", st, sent)
    if error is not None:
        st.fail("stream_error_event", error)
        return None
    if want is not None and text != want:
        st.corrupted += 1
        st.fail("corrupted_stream", f"{prompt!r}: {text!r} != {want!r}")
    usage = usage or {}
    st.tokens += usage.get("completion_tokens", 0)
    st.prompt_tokens += usage.get("prompt_tokens", 0)
    st.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    st.count("ok_stream")
    return text


async def answer_alone(client, messages, max_tokens):
    r = await client.post("/v1/chat/completions",
                          json={**body_for("chat", "", max_tokens, False), "messages": messages})
    r.raise_for_status()
    return text_of(r.json()["choices"][0], "chat", False)


async def load_level(url, clients, duration, max_tokens, turns=0):
    """`clients` concurrent clients for `duration` seconds; client i starts at prompt i. With
    `turns`, each client holds multi-turn conversations instead, each one new (its own note),
    each turn sent with the conversation so far; every answer is then asked again alone and
    compared."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        expected = {}
        if not turns:
            for p in LOAD_PROMPTS:
                expected[p] = await answer_alone(client, [{"role": "user", "content": p}], max_tokens)
        st = Stats()
        start = time.monotonic()
        deadline = start + duration
        answered = []

        async def send(messages, want):
            try:
                return await load_request(client, st, messages, want, max_tokens)
            except (httpx.TimeoutException, httpx.TransportError) as e:
                st.fail(f"transport_{type(e).__name__}", str(e))
                await asyncio.sleep(0.1)
                return None

        async def loop(i):
            k = i
            while time.monotonic() < deadline:
                if turns:
                    # Conversations never repeat, across levels either.
                    system, questions = conversation(1000 * clients + k, turns)
                    replies = []
                    for t in range(turns):
                        if time.monotonic() >= deadline:
                            break
                        msgs = turn_messages(system, questions, replies, t)
                        text = await send(msgs, None)
                        if text is None:
                            break
                        answered.append((msgs, text))
                        replies.append(text)
                    k += clients
                else:
                    prompt = LOAD_PROMPTS[k % len(LOAD_PROMPTS)]
                    await send(prompt, expected[prompt])
                    k += 1

        await asyncio.gather(*(loop(i) for i in range(clients)))
        elapsed = time.monotonic() - start
        for msgs, text in answered:
            alone = await answer_alone(client, msgs, max_tokens)
            if alone != text:
                st.corrupted += 1
                st.fail("differs_from_alone", f"{msgs[-1]['content']!r}: {text!r} != {alone!r}")
    ms = lambda x: None if x is None else round(x * 1e3, 1)  # noqa: E731
    return {
        "clients": clients,
        "requests": sum(v for k, v in st.counts.items() if k.startswith("ok_")),
        "corrupted": st.corrupted,
        "failed": {k: v for k, v in st.counts.items() if not k.startswith("ok_")},
        "tok_s": round(st.tokens / elapsed, 1),
        "ttft_ms_p50": ms(percentile(st.ttft, 50)),
        "ttft_ms_p99": ms(percentile(st.ttft, 99)),
        "itl_ms_p50": ms(percentile(st.itl, 50)),
        "itl_ms_p99": ms(percentile(st.itl, 99)),
        "prompt_tokens": st.prompt_tokens,
        "cached_tokens": st.cached_tokens,
        "examples": st.examples,
    }


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_mlx_lm(model):
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if server.poll() is not None:
            sys.exit(f"mlx_lm server exited ({server.returncode}): {' '.join(cmd)}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    sys.exit("mlx_lm server did not come up within 300 s")


def start_mlxb(args, arm=()):
    cmd = [args.mlxb, "serve", "--host", "127.0.0.1", "--port", "0"]
    if args.model:
        cmd += ["--model", args.model]
    server = subprocess.Popen([*cmd, *args.server_args, *arm], stdout=subprocess.PIPE, text=True)
    for line in server.stdout:
        if line.strip().startswith("url"):
            return server, line.split()[1]
    sys.exit(f"mlxb serve exited without printing its URL: {cmd}")


def stop(server):
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def compare(args):
    levels = [int(c) for c in args.clients_list.split(",")]
    arms = [a.split() for a in args.arms.split(";")] if args.arms else [[]]
    labels = [" ".join(a) or "no drafter" for a in arms]
    labels = [f"{l} ({i + 1})" if labels.count(l) > 1 else l for i, l in enumerate(labels)]
    result = {"model": args.model, "max_tokens": args.max_tokens, "duration_s": args.duration,
              "multi_turn": args.multi_turn, "server_args": args.server_args,
              "arms": labels, "mlxb": {}, "mlx-lm": []}
    runs = [(label, lambda a=arm: start_mlxb(args, a)) for label, arm in zip(labels, arms)]
    runs.append(("mlx-lm", lambda: start_mlx_lm(args.model)))
    for name, start in runs:
        server, url = start()
        rows = []
        try:
            for c in levels:
                print(f"serve_load: {name}, {c} clients ...", file=sys.stderr, flush=True)
                rows.append(asyncio.run(
                    load_level(url, c, args.duration, args.max_tokens, args.multi_turn)))
        finally:
            stop(server)
        if name == "mlx-lm":
            result["mlx-lm"] = rows
        else:
            result["mlxb"][name] = rows
    if args.json:
        print(json.dumps(result, indent=1))
        return
    first = labels[0]
    print(f"| mlxb serve | clients | mlxb tok/s | mlx-lm tok/s | ratio | vs {first} | mlxb TTFT p50/p99 ms | mlx-lm TTFT p50/p99 ms | mlxb ITL p50/p99 ms | mlx-lm ITL p50/p99 ms | answers intact (mlxb / mlx-lm) | prompt tokens cached (mlxb / mlx-lm) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cached = lambda r: f"{r['cached_tokens']}/{r['prompt_tokens']}"  # noqa: E731
    intact = lambda r: f"{r['requests'] - r['corrupted']}/{r['requests']}"  # noqa: E731
    for label in labels:
        for ours, theirs, plain in zip(result["mlxb"][label], result["mlx-lm"], result["mlxb"][first]):
            ratio = ours["tok_s"] / theirs["tok_s"] if theirs["tok_s"] else float("nan")
            own = ours["tok_s"] / plain["tok_s"] if plain["tok_s"] else float("nan")
            print(f"| {label} | {ours['clients']} | {ours['tok_s']} | {theirs['tok_s']} | {ratio:.2f}x | {own:.2f}x "
                  f"| {ours['ttft_ms_p50']}/{ours['ttft_ms_p99']} | {theirs['ttft_ms_p50']}/{theirs['ttft_ms_p99']} "
                  f"| {ours['itl_ms_p50']}/{ours['itl_ms_p99']} | {theirs['itl_ms_p50']}/{theirs['itl_ms_p99']} "
                  f"| {intact(ours)} / {intact(theirs)} | {cached(ours)} / {cached(theirs)} |")
    for name, rows in [*result["mlxb"].items(), ("mlx-lm", result["mlx-lm"])]:
        for r in rows:
            for e in r["examples"]:
                print(f"{name} @ {r['clients']} clients: {e}", file=sys.stderr)


def metric(text, name):
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--soak", action="store_true", help="mid-stream cancellations and malformed requests")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mlxb", default="target/release/mlxb")
    ap.add_argument("--baseline", choices=["mlx-lm"], help="measure throughput beside mlx_lm server")
    ap.add_argument("--model", help="model directory (--baseline: both servers load it)")
    ap.add_argument("--clients-list", default="1,4,8,32", help="--baseline: client counts")
    ap.add_argument("--json", action="store_true", help="--baseline: JSON instead of a table")
    ap.add_argument("--arms", help="--baseline: mlxb configurations to measure in turn, as extra "
                                   "`mlxb serve` flags separated by ';' (an empty one = no extra "
                                   "flags), e.g. ';--draft-kind ngram'; each row also gives its "
                                   "ratio to the first")
    ap.add_argument("--multi-turn", type=int, default=0, metavar="TURNS",
                    help="--baseline: each client holds conversations of TURNS turns over a note of "
                         "its own (prompt reuse under load) instead of one-shot prompts")
    ap.add_argument("server_args", nargs="*", help="extra `mlxb serve` flags (after --)")
    args = ap.parse_args()
    if args.baseline:
        if not args.model:
            ap.error("--baseline needs --model DIR (both servers load the same directory)")
        if args.max_tokens == 32 and "--max-tokens" not in sys.argv:
            args.max_tokens = 64
        return compare(args)
    if not (1 <= args.clients <= 1024 and 0 < args.duration <= 3600):
        ap.error("--clients must be 1..1024 and --duration 0..3600 s")
    cmd = [args.mlxb, "serve", "--host", "127.0.0.1", "--port", "0", *args.server_args]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        url = None
        for line in server.stdout:
            if line.strip().startswith("url"):
                url = line.split()[1]
                break
        if url is None:
            sys.exit(f"mlxb serve exited without printing its URL: {cmd}")
        report = asyncio.run(run(args, url, server.pid))
        print(json.dumps(report, indent=1))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
